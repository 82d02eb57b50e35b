"""A client's request fields the proxy decides on, read the way vLLM reads them: its boolean
flags, and the answer's token limit (:func:`token_limit`).

vLLM's request models are pydantic models in lax mode: a boolean field takes ``true``/``false``,
the numbers 0 and 1, and the strings ``"1" "on" "t" "true" "y" "yes"`` / ``"0" "off" "f"
"false" "n" "no"`` in any case, so ``"stream": "true"`` streams there and
``"return_token_ids": "false"`` returns none. The proxy decides from the same flags (stream or
not, token ids, usage), so it reads every one of them with :func:`json_bool`; a value pydantic
refuses (vLLM answers 400) reads as None, neither true nor false.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def json_bool(value: Any) -> bool | None:
    """``value`` as pydantic's lax ``bool`` takes it; None when absent or refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return {0: False, 1: True}.get(value)  # 1.0 == 1; 2, 0.5 and NaN are refused
    if isinstance(value, str):
        lowered = value.lower()  # pydantic strips nothing: " true" is refused
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    return None


def is_true(value: Any) -> bool:
    """Whether vLLM takes ``value`` as true (absent, false and refused values are not)."""
    return json_bool(value) is True


def is_false(value: Any) -> bool:
    """Whether vLLM takes ``value`` as false (absent and refused values are not)."""
    return json_bool(value) is False


def is_flag(value: Any) -> bool:
    """Whether vLLM takes ``value`` as a boolean at all."""
    return json_bool(value) is not None


def token_limit(body: Mapping[str, Any]) -> int | None:
    """The answer's token limit the client set (chat's ``max_completion_tokens`` first, as vLLM
    reads it), or None."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
