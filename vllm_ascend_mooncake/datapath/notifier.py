"""Read-done notices, delivered off the read path.

Decode tells every prefill rank it read (successfully or not) that it is done, so the prefill can
free the request's blocks. Waiting for that exchange on the read path would add a round trip to
every request and, when the peer is slow to answer, hold up the next reads queued for it; losing
the notice would strand the prefill's blocks until their release deadline. So notices go out on
their own threads, in order per peer, and are sent again while the peer does not answer. A peer
that answers with an error (it restarted, or no longer knows the request) is not asked again.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from ..log import get_logger
from .lanes import FifoLane
from .side_channel import PeerRefused, SideChannelClient
from .wire import ReadDone

logger = get_logger(__name__)


class ReadDoneNotifier:
    """Sends :class:`ReadDone` messages to prefill side channels, retrying silent peers."""

    def __init__(
        self,
        client: SideChannelClient,
        threads: int = 2,
        attempts: int = 4,
        backoff_s: float = 1.0,
        per_turn: int = 4,
    ) -> None:
        self._client = client
        self._attempts = max(1, attempts)
        self._backoff_s = backoff_s
        self._per_turn = per_turn
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vam-notify")
        self._lanes: dict[tuple[str, int], FifoLane] = {}

    def send(self, host: str, port: int, prefill_rank: int, message: ReadDone) -> None:
        """Queue ``message`` for the side channel at ``host:port``; returns at once."""
        key = (host, port)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes.setdefault(key, FifoLane(self._pool, self._deliver, self._per_turn))
        lane.push((host, port, prefill_rank, message))

    def _deliver(self, host: str, port: int, prefill_rank: int, message: ReadDone) -> None:
        error: Exception | None = None
        for attempt in range(1, self._attempts + 1):
            try:
                self._client.request(host, port, message)
            except PeerRefused as exc:
                error = exc
                break
            except Exception as exc:
                error = exc
                if attempt < self._attempts:
                    time.sleep(self._backoff_s * attempt)
                continue
            if attempt > 1:
                logger.info(
                    "told prefill rank %d (%s:%d) that request %s was read, at attempt %d",
                    prefill_rank,
                    host,
                    port,
                    message.request_id,
                    attempt,
                )
            return
        logger.warning(
            "could not tell prefill rank %d (%s:%d) that request %s was read (%s); it will "
            "release the blocks at its deadline",
            prefill_rank,
            host,
            port,
            message.request_id,
            error,
        )

    def shutdown(self) -> None:
        """Stop; notices not yet delivered are dropped (the prefill frees at its deadline)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
