"""Row copies out of staging, overlapped with the next read.

A request read through staging lands batch by batch; each batch's row copies move its bytes out
of the staging area into KV blocks. Run in line, copies and reads alternate and the transport's
pipeline drains at every batch. Here a landed batch's copies run on a copy thread while the
next batch is read, wherever that read lands clear of the bytes the copies read or write (the
planner puts consecutive batches in the two halves of the area,
:func:`..core.staging.stage_batches`; :func:`..core.staging.copies_must_finish_first` decides).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ..core.plan_types import TransferBatch
from ..core.relayout import LocalMemory, apply_row_copies
from ..core.staging import copies_must_finish_first


class CopyOverlap:
    """Reads a peer's batches, running each one's row copies while the next one is read."""

    def __init__(self, memory: LocalMemory, threads: int) -> None:
        self._memory = memory
        # one copy at a time per reading thread: a pool as large as the receiver's never queues
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vam-copy")

    def read_all(
        self, batches: Sequence[TransferBatch], read: Callable[[TransferBatch], None]
    ) -> None:
        """``read`` each batch in order; every batch's copies have run when this returns or
        raises (the caller may then reuse or release the staging area)."""
        landed: TransferBatch | None = None  # the batch whose copies may still run
        copying: Future[None] | None = None
        try:
            for batch in batches:
                if copying is not None and copies_must_finish_first(landed, batch):
                    copying.result()
                    copying = None
                read(batch)
                if copying is not None:
                    copying.result()
                    copying = None
                if batch.after_landing:
                    landed, copying = batch, self._pool.submit(self._copy, batch)
            if copying is not None:
                copying.result()
                copying = None
        finally:
            if copying is not None:  # the read failed: its copies still read the staging area
                wait([copying])

    def _copy(self, batch: TransferBatch) -> None:
        apply_row_copies(self._memory, batch.after_landing)
        # on a device, the copies this thread queued must run before the area is read again
        self._memory.fence()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
