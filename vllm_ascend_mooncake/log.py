"""Loggers: vLLM's logger (its format, its VLLM_LOGGING_LEVEL) when vLLM is importable.

The pure planning core and the data-path tests run without vLLM too, so this falls back to the
standard library's logging.
"""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    """A logger under vLLM's ``vllm`` namespace, so vLLM's handlers, format and
    ``VLLM_LOGGING_LEVEL`` apply (vLLM configures only that namespace)."""
    try:
        from vllm.logger import init_logger
    except ImportError:
        return logging.getLogger(name)
    return init_logger(f"vllm.plugins.{name}")
