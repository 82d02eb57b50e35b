"""Turn the timed lines of a streamed ``/v1/completions`` answer into TTFT and inter-token gaps.

The parser is fed each server-sent-event line with the time it arrived, so it is pure and can be
tested without a server. A chunk counts as *content* when it carries generated tokens: with
``return_token_ids`` every vLLM chunk lists them, which also counts tokens whose text the
detokenizer holds back (an incomplete UTF-8 sequence arrives as an empty string). Inter-token
latency is the gap between consecutive content chunks, as ``vllm bench serve`` measures it.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

_DATA_PREFIX = "data:"
_DONE_MARKER = "[DONE]"


@dataclass
class StreamTiming:
    """What one streamed request looked like from the client."""

    sent_at_s: float
    content_chunk_times_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    done: bool = False
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """Seconds from sending the request to the first chunk with a generated token."""
        if not self.content_chunk_times_s:
            return None
        return self.content_chunk_times_s[0] - self.sent_at_s

    @property
    def inter_token_gaps_s(self) -> list[float]:
        """Seconds between consecutive content chunks (one per decode step in vLLM)."""
        times = self.content_chunk_times_s
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    @property
    def e2e_s(self) -> float | None:
        """Seconds from sending the request to its last content chunk."""
        if not self.content_chunk_times_s:
            return None
        return self.content_chunk_times_s[-1] - self.sent_at_s

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per output token after the first: (e2e - TTFT) / (tokens - 1).

        Unlike the inter-chunk gaps it does not depend on how chunks were grouped on the way
        (a starved proxy that forwards several events in one read makes gaps of ~0 and one
        long one), so it is the steadier measure of decode speed.
        """
        if self.ttft_s is None or self.e2e_s is None or len(self.token_ids) < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (len(self.token_ids) - 1)

    @property
    def succeeded(self) -> bool:
        """The stream ended with ``[DONE]``, reported no error and produced tokens."""
        return self.done and self.error is None and bool(self.content_chunk_times_s)


class SseTimingParser:
    """Accumulates a :class:`StreamTiming` from ``(line, arrival time)`` pairs."""

    def __init__(self, sent_at_s: float) -> None:
        self.timing = StreamTiming(sent_at_s=sent_at_s)

    def feed_line(self, line: str, arrived_at_s: float) -> None:
        """Account for one line of the event stream (blank lines and comments are ignored)."""
        line = line.strip()
        if not line.startswith(_DATA_PREFIX):
            return
        payload = line[len(_DATA_PREFIX) :].strip()
        if payload == _DONE_MARKER:
            self.timing.done = True
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            self.timing.error = f"unparseable event: {payload[:200]}"
            return
        if not isinstance(chunk, dict):
            self.timing.error = f"event is not a JSON object: {payload[:200]}"
            return
        if "error" in chunk:
            self.timing.error = json.dumps(chunk["error"])[:500]
            return
        new_token_ids, new_text = _generated_tokens(chunk)
        self.timing.text += new_text
        if new_token_ids:
            self.timing.token_ids.extend(new_token_ids)
            self.timing.content_chunk_times_s.append(arrived_at_s)
        elif new_text:
            # Without return_token_ids a chunk with text still marks one decode step.
            self.timing.content_chunk_times_s.append(arrived_at_s)


def _generated_tokens(chunk: dict[str, Any]) -> tuple[list[int], str]:
    """Generated token ids and text of one completion chunk (first choice only)."""
    choices = chunk.get("choices") or []
    if not choices:
        return [], ""
    choice = choices[0]
    token_ids = choice.get("token_ids") or []
    return [int(token) for token in token_ids], choice.get("text") or ""
