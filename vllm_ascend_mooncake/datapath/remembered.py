"""Prefill side: what is remembered about transfers this rank does not hold, for a bounded time.

Two memories, each an entry per transfer id, forgotten a fixed time (``remember_s``) after it
was added:

* :class:`EarlyNotices`: read-done notices for a transfer this rank does not hold yet (decode
  can be faster than prefill's next step), taken when the hold comes; at most ``limit`` of
  them, so a flood of notices for made-up ids cannot grow memory (the rest are ignored);
* :class:`ReleasedIds`: transfers released or dropped, with why, so a late claim is refused and
  told why, and a stale hold cannot resurrect one.

Entries are kept in the order they were added, which is their order of expiry: expiring looks at
the oldest ones only, not at every remembered id each step. Neither locks:
:class:`~.sender.SendTracker`'s lock guards them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

from ..log import get_logger

logger = get_logger(__name__)

_Entry = TypeVar("_Entry", bound=tuple)


class _Expiring(Generic[_Entry]):
    """Entries by transfer id, each a tuple whose second item is when it is forgotten, kept in
    the order they were added (their order of expiry)."""

    def __init__(self, remember_s: float, entries: OrderedDict[str, _Entry] | None = None) -> None:
        self.remember_s = remember_s
        #: transfer id -> entry; ``entries`` lets a test watch which ones expiring looks at
        self._entries: OrderedDict[str, _Entry] = OrderedDict() if entries is None else entries

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def forget(self, transfer_id: str) -> None:
        self._entries.pop(transfer_id, None)

    def expire(self, now: float) -> None:
        """Forget the entries whose time is up: the oldest ones, up to the first that is not."""
        entries = self._entries
        while entries and next(iter(entries.values()))[1] <= now:  # (..., forget after, ...)
            entries.popitem(last=False)


class EarlyNotices(_Expiring[tuple[set[int], float, int]]):
    """Read-done notices for transfers not held yet: the decode ranks that sent one, and their
    decode TP (-1: the configured one), per transfer id."""

    def __init__(self, remember_s: float, limit: int) -> None:
        super().__init__(remember_s)
        self.limit = limit
        #: notices ignored because ``limit`` others were remembered already
        self.num_ignored = 0

    def note(self, transfer_id: str, decode_rank: int, decode_tp: int, now: float) -> bool:
        """Remember ``decode_rank``'s notice (or ignore it, past the limit); False when a decode
        instance of another TP sent the first notice for it (the first one is kept)."""
        if transfer_id not in self._entries and len(self._entries) >= self.limit:
            self.num_ignored += 1
            if self.num_ignored % 1000 == 1:
                logger.warning(
                    "%d read-done notices for requests this rank never held were ignored (more "
                    "than %d pending): a misbehaving or hostile peer?",
                    self.num_ignored,
                    self.limit,
                )
            return True
        forget = now + self.remember_s
        ranks, _, first_tp = self._entries.setdefault(transfer_id, (set(), forget, decode_tp))
        if first_tp != decode_tp:
            return False
        ranks.add(decode_rank)
        return True

    def take(self, transfer_id: str) -> tuple[set[int], int]:
        """The decode ranks done with ``transfer_id`` before it was held and their decode TP
        (none and -1 if no notice came), forgetting them."""
        ranks, _, decode_tp = self._entries.pop(transfer_id, (set(), 0.0, -1))
        return ranks, decode_tp


class ReleasedIds(_Expiring[tuple[str, float, str]]):
    """Transfers released or dropped: the vLLM request id each was held for ("" for one dropped
    before it was held) and why it went, what a late claim is told."""

    def release(self, transfer_id: str, request_id: str, why: str, now: float) -> None:
        """Remember ``transfer_id`` as released now (moved to the end if it was remembered:
        the order stays expiry order)."""
        self._entries.pop(transfer_id, None)
        self._entries[transfer_id] = (request_id, now + self.remember_s, why)

    def drop(self, transfer_id: str, why: str, now: float) -> None:
        """Remember ``transfer_id`` as dropped before it was held, unless it is remembered
        already (it then keeps its place and its reason)."""
        self._entries.setdefault(transfer_id, ("", now + self.remember_s, why))

    def owner(self, transfer_id: str) -> str | None:
        """The vLLM request id ``transfer_id`` was released for ("": dropped before it was
        held); None if it is not remembered."""
        entry = self._entries.get(transfer_id)
        return None if entry is None else entry[0]

    def why(self, transfer_id: str) -> str | None:
        """Why ``transfer_id`` went; None if it is not remembered."""
        entry = self._entries.get(transfer_id)
        return None if entry is None else entry[2]
