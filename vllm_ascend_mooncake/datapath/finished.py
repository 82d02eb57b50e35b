"""Prefill side: the requests vLLM may free the blocks of, and how many went by timeout.

vLLM's worker thread takes the requests released since its last step
(:meth:`FinishedRequests.take`); each is reported exactly once. Adding one wakes whoever waits
on the tracker's condition (an idle step waiting for news). It does not lock:
:class:`~.sender.SendTracker`'s lock guards it, and its condition is on that lock.
"""

from __future__ import annotations

import threading


class FinishedRequests:
    """vLLM request ids released since vLLM last took them, and the count of timeouts."""

    def __init__(self, news: threading.Condition) -> None:
        self._news = news  # notified (its lock held by the caller) when a request is added
        self._ids: set[str] = set()
        #: releases by timeout in all
        self.num_expired = 0
        self._expired_reported = 0

    def __bool__(self) -> bool:
        return bool(self._ids)

    def add(self, request_id: str, expired: bool = False) -> None:
        """``request_id``'s blocks may be freed (``expired``: its release timeout passed)."""
        self._ids.add(request_id)
        if expired:
            self.num_expired += 1
        self._news.notify_all()

    def take(self) -> set[str]:
        """The requests added since the last call."""
        taken, self._ids = self._ids, set()
        return taken

    def take_expired_count(self) -> int:
        """Releases by timeout since the last call (for stats)."""
        count = self.num_expired - self._expired_reported
        self._expired_reported = self.num_expired
        return count
