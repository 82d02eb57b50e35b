"""Which tokens a decode prompt may end with: those that decode to whole characters.

vLLM primes each request's detokenizer with its prompt (``tokenizers``' ``DecodeStream(ids=...)``).
When the prompt ends with a token that is only part of a character (a byte of a multi-byte UTF-8
sequence, which decodes alone to U+FFFD), the stream's first output is the text of the *whole
prompt* followed by the new token's (measured with vLLM 0.30-0.32 and tokenizers 0.23: every one
of the 128 such tokens of the test tokenizer, no other). A continued request's decode prompt ends
with prefill's token, so a token like that would put the prompt into the client's answer: such a
request keeps decode's first token instead. Whether a token is whole is a property of the
vocabulary, asked once per model and token of an instance's ``/detokenize`` and remembered.
"""

from __future__ import annotations

import logging

import httpx

logger = logging.getLogger(__name__)

REPLACEMENT_CHARACTER = "\ufffd"
#: Tokens remembered per proxy (a vocabulary is bounded; several models share the cache).
MAX_REMEMBERED = 1 << 20


class TokenTexts:
    """Remembers, per model and token id, whether the token decodes to whole characters."""

    def __init__(self, client: httpx.AsyncClient, timeout_s: float = 10.0) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._whole: dict[tuple[str, int], bool] = {}

    async def whole_characters(self, base_url: str, model: str | None, token_id: int) -> bool:
        """Whether ``token_id`` decodes to whole characters; False when the instance at
        ``base_url`` cannot say (the request then keeps decode's first token)."""
        key = (model or "", token_id)
        known = self._whole.get(key)
        if known is not None:
            return known
        body: dict = {"tokens": [token_id]}
        if model:
            body["model"] = model
        try:
            response = await self._client.post(
                f"{base_url}/detokenize", json=body, timeout=self._timeout_s
            )
            text = response.json()["prompt"] if response.is_success else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            logger.warning("cannot detokenize token %d on %s: %r", token_id, base_url, error)
            return False
        if not isinstance(text, str):
            status = response.status_code
            logger.warning("cannot detokenize token %d on %s: HTTP %d", token_id, base_url, status)
            return False
        whole = REPLACEMENT_CHARACTER not in text
        if len(self._whole) < MAX_REMEMBERED:
            self._whole[key] = whole
        return whole
