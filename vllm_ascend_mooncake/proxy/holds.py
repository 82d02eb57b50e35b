"""Keep prefill's hold on a request's KV while its decode request may still be queued.

Prefill frees the blocks of a transfer that no decode worker claimed within its
``release_timeout_s``. A decode request that waits in decode's vLLM queue (``--max-num-seqs``
reached) has not claimed yet, and vLLM's scheduler tells the connector nothing about waiting
requests (it looks at one only when it can run it), so under overload the claim comes after the
release: a failed pull (HTTP 500) or a recompute. The proxy knows the transfer is still wanted:
from prefill's answer until prefill says the transfer was read (or released), it sends every
prefill worker holding it a ``KeepHold`` at half the hold's remaining time. Prefill bounds every
hold (``MAX_HOLD_TIMEOUTS`` release timeouts in all), so a decode that vanished, or a proxy that
renews for ever, still frees prefill's memory.

Renewals go over the connector's side channel (ZMQ, signed with ``VAM_SIDE_CHANNEL_SECRET`` when
it is set) from a few threads of their own, so a frozen prefill delays no request: a worker that
does not answer in time is not asked again for that transfer.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..connector.keys import SECRET_ENV
from ..datapath.side_channel import SideChannelClient, SideChannelError
from ..datapath.wire import ClaimReply, KeepHold
from .payloads import prefill_address

logger = logging.getLogger(__name__)

#: How long one renewal may take before that worker is left alone for this transfer.
RENEW_TIMEOUT_S = 2.0
#: Pause before asking again a worker that does not hold the transfer yet (it registers a hold
#: one engine step after answering), and how many times it is asked so.
PENDING_PAUSE_S = 0.5
MAX_PENDING_ANSWERS = 20
#: The shortest pause between two renewals of one worker's hold.
MIN_RENEW_PAUSE_S = 0.5


class HoldKeeper:
    """Renews prefill holds for the transfers handed to decode and not read yet."""

    def __init__(
        self,
        threads: int = 4,
        timeout_s: float = RENEW_TIMEOUT_S,
        on_renewal: Callable[[], None] | None = None,
    ) -> None:
        self._on_renewal = on_renewal
        secret = os.environ.get(SECRET_ENV, "")
        self._client = SideChannelClient(timeout_s, secret=secret.encode() if secret else None)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vam-keep-hold")
        self._tasks: set[asyncio.Task] = set()
        #: renewals prefill answered "held" (for the metrics and the tests)
        self.renewals = 0

    def keep(self, kv_transfer_params: dict[str, Any] | None) -> asyncio.Task | None:
        """Start renewing the transfer ``kv_transfer_params`` (a prefill's answer) names, on
        every worker of its prefill; the task, which the caller cancels once the request has
        ended (None: the params name no transfer)."""
        address = prefill_address(kv_transfer_params)
        transfer_id = (kv_transfer_params or {}).get("remote_request_id")
        if address is None or not isinstance(transfer_id, str):
            return None
        workers = [
            (address["remote_host"], address["remote_port"] + rank)
            for rank in range(address["remote_tp_size"])
        ]
        task = asyncio.create_task(self._keep_all(transfer_id, workers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _keep_all(self, transfer_id: str, workers: list[tuple[str, int]]) -> None:
        await asyncio.gather(*(self._keep_one(transfer_id, host, port) for host, port in workers))

    async def _keep_one(self, transfer_id: str, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        pending = 0
        # A decode that is not queued has read the transfer by then: one "refused" ends it.
        await asyncio.sleep(MIN_RENEW_PAUSE_S)
        while True:
            try:
                reply = await loop.run_in_executor(
                    self._pool, self._client.request, host, port, KeepHold(transfer_id)
                )
            except SideChannelError as exc:
                logger.info("not renewing transfer %s on %s:%d: %s", transfer_id, host, port, exc)
                return
            if not isinstance(reply, ClaimReply) or reply.status == "refused":
                return  # read, released, or held as long as any transfer is
            if reply.status == "held":
                self.renewals += 1
                if self._on_renewal is not None:
                    self._on_renewal()
                pause = max(MIN_RENEW_PAUSE_S, reply.lease_s / 2)
            else:
                pending += 1
                if pending > MAX_PENDING_ANSWERS:
                    return
                pause = PENDING_PAUSE_S
            await asyncio.sleep(pause)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
