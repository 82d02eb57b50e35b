"""How many tokens an instance's model holds (vLLM's ``max_model_len``), from its ``/v1/models``.

A continued request's decode prompt is the prompt followed by prefill's token. vLLM refuses a
prompt that fills the whole context (a prompt of ``max_model_len`` tokens: "plus the number of
requested output tokens (at least 1) is longer than the maximum model length") and clamps an
answer's ``max_tokens`` to what the context leaves. So a prompt of ``max_model_len - 1`` tokens
has an answer of exactly one token colocated, which prefill already sampled, and a continued
decode leg would fail. vLLM's model cards carry ``max_model_len``; the proxy asks each instance
once and remembers it.
"""

from __future__ import annotations

import logging
import time

import httpx

logger = logging.getLogger(__name__)

#: How long an instance that could not say is not asked again.
RETRY_AFTER_S = 30.0


class ModelLimits:
    """Remembers each instance's ``max_model_len``."""

    def __init__(self, client: httpx.AsyncClient, timeout_s: float = 10.0) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._known: dict[str, int] = {}
        #: instances that could not say, and when to ask them again
        self._unknown_until: dict[str, float] = {}

    async def max_model_len(
        self, base_url: str, headers: dict[str, str] | None = None
    ) -> int | None:
        """The context length of the model the instance at ``base_url`` serves (the smallest
        of its model cards'); None when it cannot say (then nothing is decided by it).
        ``headers``: the client's that the instance may need (``Authorization`` for vLLM's
        ``--api-key``, which guards ``/v1/models``)."""
        known = self._known.get(base_url)
        if known is not None:
            return known
        if time.monotonic() < self._unknown_until.get(base_url, 0.0):
            return None
        try:
            response = await self._client.get(
                f"{base_url}/v1/models", headers=headers, timeout=self._timeout_s
            )
            cards = response.json()["data"] if response.is_success else []
            lengths = [
                card["max_model_len"]
                for card in cards
                if isinstance(card.get("max_model_len"), int)
                and not isinstance(card["max_model_len"], bool)
            ]
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as error:
            logger.warning("cannot read max_model_len of %s: %r", base_url, error)
            lengths = []
        if not lengths:
            self._unknown_until[base_url] = time.monotonic() + RETRY_AFTER_S
            return None
        self._known[base_url] = min(lengths)
        return self._known[base_url]
