"""Prefill side: the side-channel service that decode workers and routers talk to.

This module is the messaging only; every hold, lease and release it reports or changes is
:class:`~.sender.SendTracker`'s state. A hand-off's messages in time, who sends each, which
method answers it and the thread it runs on:

============  ============  ==============================  ==============================
message       from          answered by                     runs on
============  ============  ==============================  ==============================
(hold)        vLLM's step   ``SendTracker.hold``,           vLLM's worker thread
                            ``drop``
GetMetadata   decode        the worker's metadata           the side channel's thread
ClaimRead     decode        ``SendTracker.claim``           the side channel's thread; a
                                                            pending one is parked there
VerifyRead    decode        ``_verify``                     the side channel's worker pool
KeepHold      router        ``SendTracker.keep``            the side channel's thread
DropHold      router        ``SendTracker.drop_unread``     the side channel's thread
ReadDone      decode        ``SendTracker.read_done``       the side channel's thread
(finished)    vLLM's step   ``SendTracker.take_finished``   vLLM's worker thread
============  ============  ==============================  ==============================

Each tracker method takes the tracker's one lock briefly. A claim for a request prefill has not
registered yet is parked (held open, at most :data:`MAX_CLAIM_PARK_S`) and answered the moment a
hold or drop wakes the server (``SendTracker.on_change``). A checksum takes seconds, so
``VerifyRead`` is answered off the side channel's thread. Messages addressed to an earlier
incarnation of this worker are refused: its KV is gone.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..core.relayout import LocalMemory
from ..log import get_logger
from . import verify
from .side_channel import Deferred, Park, SideChannelServer
from .wire import (
    Ack,
    ClaimRead,
    DropHold,
    ErrorReply,
    GetMetadata,
    KeepHold,
    Message,
    ReadDone,
    VerifyRead,
    WorkerMetadata,
)

if TYPE_CHECKING:  # the tracker's module re-exports this one's service
    from .sender import SendTracker

logger = get_logger(__name__)

#: The longest a pending claim is held open before it is answered "pending" anyway.
MAX_CLAIM_PARK_S = 5.0


class PrefillSender:
    """A prefill worker's side-channel service: metadata, read leases, read-done bookkeeping."""

    def __init__(
        self,
        metadata: WorkerMetadata,
        tracker: SendTracker,
        host: str,
        port: int,
        secret: bytes | None = None,
        memory: LocalMemory | None = None,
    ) -> None:
        self.metadata = metadata
        self.tracker = tracker
        #: the registered KV memory, which integrity checks read (None: they are refused)
        self._memory = memory
        self._server = SideChannelServer(
            host, port, self._handle, name=f"vam-sender-{port}", secret=secret
        )
        tracker.on_change = self._server.wake

    def _stale(self, incarnation: str) -> ErrorReply | None:
        if incarnation == self.metadata.incarnation:
            return None
        return ErrorReply(
            f"addressed to incarnation {incarnation} but this worker is "
            f"{self.metadata.incarnation} (it restarted; its KV is gone)"
        )

    def _handle(self, message: Message) -> Message | Park | Deferred:
        if isinstance(message, GetMetadata):
            return self.metadata
        if isinstance(message, ClaimRead):
            stale = self._stale(message.incarnation)
            if stale is not None:
                return stale
            reply = self.tracker.claim(
                message.request_id,
                message.decode_rank,
                message.num_prompt_tokens,
                message.decode_tp,
                message.reader,
            )
            if reply.status == "pending" and message.wait_s > 0:
                # Answer when prefill registers the request (a hold wakes the server), not later.
                wait_s = min(message.wait_s, MAX_CLAIM_PARK_S)
                return Park(time.monotonic() + wait_s, reply, key=message.request_id)
            return reply
        if isinstance(message, KeepHold):
            return self.tracker.keep(message.request_id)
        if isinstance(message, DropHold):
            return self.tracker.drop_unread(message.request_id)
        if isinstance(message, VerifyRead):
            # A checksum of a batch's GBs takes seconds: off this thread, or every claim and
            # read-done notice to this worker would wait behind it (issue #43 item a).
            return Deferred(lambda: self._verify(message))
        if isinstance(message, ReadDone):
            stale = self._stale(message.incarnation)
            if stale is not None:
                return stale
            if not message.success:
                # a claim that raced its client's leaving: nothing wrong with either side
                raced = self.tracker.dropped(message.request_id)
                logger.log(
                    logging.INFO if raced else logging.WARNING,
                    "decode rank %d failed to read request %s: %s",
                    message.decode_rank,
                    message.request_id,
                    message.reason,
                )
            if not self.tracker.read_done(
                message.request_id,
                message.decode_rank,
                message.success,
                message.reader,
                message.decode_tp,
            ):
                logger.warning(
                    "ignored a read-done notice for request %s, decode rank %d (TP %d), from a "
                    "reader the lease was not granted to or of another decode TP",
                    message.request_id,
                    message.decode_rank,
                    message.decode_tp,
                )
                return ErrorReply(
                    "this read lease was granted to another reader, or another decode TP reads it"
                )
            return Ack()
        return ErrorReply(f"unexpected {type(message).__name__} on a prefill side channel")

    def _verify(self, message: VerifyRead) -> Message:
        """The checksum ``message`` asks for (on the server's worker pool): the lease is looked
        up when the work starts, not when the question arrived."""
        blocks = self.tracker.leased_blocks(message.request_id, message.decode_rank, message.reader)
        reply = verify.answer(message, self._memory, self.metadata.to_regions(), blocks)
        return ErrorReply(reply) if isinstance(reply, str) else reply

    def suspend(self, reason: str) -> None:
        """vLLM's sleep mode: refuse claims and end every hold, waiting at most one release
        timeout for reads under way (see :meth:`.sender.SendTracker.suspend`)."""
        self.tracker.suspend(reason, self.tracker.lease_s)

    def resume(self) -> None:
        self.tracker.resume()

    def close(self) -> None:
        self._server.close()
