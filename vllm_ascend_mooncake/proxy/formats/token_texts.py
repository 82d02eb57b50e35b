"""Which tokens a decode prompt may end with: those that decode to whole characters.

vLLM primes each request's detokenizer with its prompt (``tokenizers``' ``DecodeStream(ids=...)``).
When the prompt ends with a token that is only part of a character (a byte of a multi-byte UTF-8
sequence, which decodes alone to U+FFFD), the stream's first output is the text of the *whole
prompt* followed by the new token's (measured with vLLM 0.30-0.32 and tokenizers 0.23: every one
of the 128 such tokens of the test tokenizer, no other). A continued request's decode prompt ends
with prefill's token, so a token like that would put the prompt into the client's answer: such a
request keeps decode's first token instead. Whether a token is whole is a property of the
vocabulary, asked once per model and token of an instance's ``/detokenize`` and remembered,
unless prefill's own text of the token already shows it (:func:`text_shows_whole`): that question
is an HTTP round trip on the way to the client's first token (issue #46: 2.8-6.8 ms on the 2-core
VM, on 15 of 27 continued requests of a 256-token run whose first tokens were mostly new).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import httpx

logger = logging.getLogger(__name__)

REPLACEMENT_CHARACTER = "\ufffd"
#: Tokens remembered per proxy (a vocabulary is bounded; several models share the cache).
MAX_REMEMBERED = 1 << 20


def text_shows_whole(token_text: str, token_count: int, client_body: Mapping[str, Any]) -> bool:
    """Whether prefill's text of its one token (as its answer gave it) shows that the token
    decodes to whole characters alone, so that no instance need be asked. vLLM's detokenizer,
    primed with the prompt, holds back a token that ends inside a character (its text is then
    empty, or carries U+FFFD); a prompt given as text (a completion's string, chat messages)
    ends on a whole character, so a token whose text is non-empty and free of U+FFFD is whole
    alone too. Checked with the test tokenizer's ``DecodeStream`` (all 512 tokens after each of
    60 random text prompts, multi-byte characters among them: no token it calls whole is
    partial alone). A prompt of token ids may end inside a character, and a text of several
    tokens says nothing of the last one alone: those are asked."""
    prompt_is_text = isinstance(client_body.get("prompt"), str) or "messages" in client_body
    return (
        prompt_is_text
        and token_count == 1
        and token_text != ""
        and REPLACEMENT_CHARACTER not in token_text
    )


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
