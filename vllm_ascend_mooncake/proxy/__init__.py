"""The P/D proxy: one OpenAI-compatible endpoint in front of vLLM prefill and decode instances.

It runs without vLLM (it only speaks HTTP); install it with the ``proxy`` extra and start it
with ``vam-proxy`` (see ``docs/proxy.md``).
"""

from .app import create_app

__all__ = ["create_app"]
