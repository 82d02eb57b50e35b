"""Where each prefill instance's data-parallel engines serve their KV, and which gets a request.

A prefill instance started with ``--data-parallel-size N`` fronts N engines with one API server.
Each engine holds what it computes on its own side channel (base port + rank * TP) under its own
engine id (vLLM appends ``_dp<rank>``), and the API server picks the engine for each request
unless the request names one with the ``X-data-parallel-rank`` header.

Overlapped legs tell decode where to read before prefill has answered, so the proxy cannot let
the API server pick: it picks the engine itself (the one with the fewest of this proxy's prefill
legs in flight, then the one picked least), pins the prefill leg to it and gives decode that
engine's address. Each answer says which engine served it (``remote_dp_rank`` of
``remote_dp_size``); an engine whose address is not known yet gets serial legs, pinned to it, so
its first answer teaches the address. Instances that do not report a DP size (DP 1, other
connectors) are never pinned: they behave exactly as before.

No I/O here; the proxy's request path calls it from one event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..handoff import PROMPT_PREFIX_KEY, prefill_address

logger = logging.getLogger(__name__)

#: The request header vLLM's OpenAI server reads the engine index from.
DP_RANK_HEADER = "X-data-parallel-rank"

#: More engines than any API server fronts; a larger reported size is ignored as malformed.
MAX_DP_SIZE = 1024


@dataclass(frozen=True)
class RankChoice:
    """The engine a prefill leg goes to, and where decode can read what it computes."""

    #: the engine index to pin with :data:`DP_RANK_HEADER`; None: let the instance pick
    dp_rank: int | None
    #: that engine's address (the keys of :data:`..handoff.PREFILL_ADDRESS_KEYS`); None: not
    #: known yet, so the legs go serial
    address: dict[str, Any] | None

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` plus the pin, when there is one."""
        if self.dp_rank is None:
            return headers
        return {**headers, DP_RANK_HEADER: str(self.dp_rank)}


_UNPINNED = RankChoice(None, None)


@dataclass
class _Instance:
    dp_size: int
    addresses: dict[int, dict[str, Any]] = field(default_factory=dict)
    in_flight: dict[int, int] = field(default_factory=dict)
    picked: dict[int, int] = field(default_factory=dict)
    #: whether its vLLM takes chat prompts as forwarded token ids (``remote_chat_prompt_ids``)
    chat_prompt_ids: bool = False
    #: whether it computes prompts but their last token (a hybrid model, ``PROMPT_PREFIX_KEY``)
    prompt_prefix: bool = False


def reported_rank(kv_transfer_params: dict[str, Any]) -> tuple[int, int] | None:
    """The ``(rank, size)`` a prefill answer reports; None when absent or malformed."""
    rank, size = kv_transfer_params.get("remote_dp_rank"), kv_transfer_params.get("remote_dp_size")
    if type(rank) is not int or type(size) is not int:  # bool is an int, but never a rank
        return None
    if not 0 <= rank < size <= MAX_DP_SIZE:
        return None
    return rank, size


class PrefillRanks:
    """Per prefill base URL: its engines' addresses, learned from answers, and their load."""

    def __init__(self) -> None:
        self._instances: dict[str, _Instance] = {}
        #: called with an instance's URL when the engine ids known for it change (learned or
        #: forgotten); the pairing watch re-judges the instance then
        self.on_engines_changed: Callable[[str], None] | None = None

    def _engines_changed(self, url: str, before: frozenset[str]) -> None:
        if self.on_engines_changed is not None and self.engine_ids(url) != before:
            self.on_engines_changed(url)

    def learn(self, url: str, kv_transfer_params: dict[str, Any] | None) -> None:
        """Remember where the engine that produced these params serves its KV.

        An answer without an address makes the proxy forget the whole instance (it went serial
        or was replaced by something that does not hand off): the next requests go serial.
        """
        before = self.engine_ids(url)
        try:
            self._learn(url, kv_transfer_params)
        finally:
            self._engines_changed(url, before)

    def _learn(self, url: str, kv_transfer_params: dict[str, Any] | None) -> None:
        address = prefill_address(kv_transfer_params)
        if address is None:
            self._instances.pop(url, None)
            return
        assert kv_transfer_params is not None
        rank, size = reported_rank(kv_transfer_params) or (0, 1)
        instance = self._instances.get(url)
        if instance is None or instance.dp_size != size:
            if instance is not None:
                logger.info("prefill %s now fronts %d data-parallel engines", url, size)
            instance = self._instances[url] = _Instance(size)
        instance.chat_prompt_ids = kv_transfer_params.get("remote_chat_prompt_ids") is True
        instance.prompt_prefix = kv_transfer_params.get(PROMPT_PREFIX_KEY) is True
        if instance.addresses.get(rank) != address:
            engine = f" (data-parallel engine {rank} of {size})" if size > 1 else ""
            logger.info("prefill %s%s serves its KV cache from %s", url, engine, address)
            instance.addresses[rank] = address

    def prompt_prefix(self, url: str) -> bool:
        """Whether the instance's last answer said it computes prompts but their last token
        (streamed answers carry no params: the proxy asks what it learned)."""
        instance = self._instances.get(url)
        return instance is not None and instance.prompt_prefix

    def forget(self, url: str) -> None:
        """The instance stopped answering: its addresses may be stale once it is back."""
        before = self.engine_ids(url)
        self._instances.pop(url, None)
        self._engines_changed(url, before)

    def choose(self, url: str) -> RankChoice:
        """The engine the next prefill leg to ``url`` should go to (nothing is counted yet).

        Unknown instances and DP 1 are not pinned; the address is the one last learned.
        """
        instance = self._instances.get(url)
        if instance is None:
            return _UNPINNED
        if instance.dp_size == 1:
            return RankChoice(None, instance.addresses.get(0))
        rank = min(
            range(instance.dp_size),
            key=lambda r: (instance.in_flight.get(r, 0), instance.picked.get(r, 0), r),
        )
        return RankChoice(rank, instance.addresses.get(rank))

    def started(self, url: str, choice: RankChoice) -> None:
        """A prefill leg went to ``choice``'s engine; pair with :meth:`finished`."""
        instance = self._instances.get(url)
        if instance is None or choice.dp_rank is None:
            return
        instance.in_flight[choice.dp_rank] = instance.in_flight.get(choice.dp_rank, 0) + 1
        instance.picked[choice.dp_rank] = instance.picked.get(choice.dp_rank, 0) + 1

    def finished(self, url: str, choice: RankChoice) -> None:
        """The prefill leg :meth:`started` counted is over (answered, failed or cancelled)."""
        instance = self._instances.get(url)
        if instance is None or choice.dp_rank is None:
            return
        count = instance.in_flight.get(choice.dp_rank, 0)
        if count > 0:
            instance.in_flight[choice.dp_rank] = count - 1

    def chat_prompt_ids(self, url: str) -> bool:
        """Whether ``url``'s vLLM takes chat prompts as forwarded token ids, as its last answer
        said (False when none did)."""
        instance = self._instances.get(url)
        return instance is not None and instance.chat_prompt_ids

    def engine_ids(self, url: str) -> frozenset[str]:
        """The engine ids (``remote_engine_id``) ``url``'s answers reported last, one per known
        engine; empty when none is known."""
        instance = self._instances.get(url)
        if instance is None:
            return frozenset()
        return frozenset(address["remote_engine_id"] for address in instance.addresses.values())

    def engines(self, url: str) -> dict[int, dict[str, Any]]:
        """The addresses known for ``url``'s engines, by rank (a copy, for reports and tests)."""
        instance = self._instances.get(url)
        return {} if instance is None else dict(instance.addresses)
