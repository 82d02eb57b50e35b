"""Why a pull failed, as a kind an operator can count and a test can assert.

Every failure the receiver reports carries one :class:`FailureKind`: raised as a
:class:`PullError` where the receiver itself decides, or derived by :func:`kind_of` from the
transport's and the side channel's own exceptions. Decode's ``/metrics`` counts failed pulls by
kind (``vllm:mooncake_hetero_failed_pulls_total{kind=...}``).
"""

from __future__ import annotations

from enum import Enum

from ..core.layout import LayoutError
from ..core.topology import TopologyError
from .compat import IncompatiblePeerError
from .side_channel import PeerRefused, SideChannelError
from .transport import TransferError, UnsettledTransfer


class FailureKind(str, Enum):
    """What went wrong, from the decode worker's point of view."""

    #: prefill's grant names other blocks or another prompt length than the request
    GRANT_MISMATCH = "grant_mismatch"
    #: the prefill worker runs another TP size than the request's params name
    TP_MISMATCH = "tp_mismatch"
    #: the prefill worker's model, cache geometry or TP size cannot pair with this decode worker
    INCOMPATIBLE_PEER = "incompatible_peer"
    #: the request needs a staging area and none is configured or none became free
    NO_STAGING = "no_staging"
    #: prefill answered with a message that is not an answer to the question
    BAD_REPLY = "bad_reply"
    #: prefill refused the read (unknown or released transfer, another reader, restarted)
    REFUSED = "refused"
    #: prefill had not registered the request when the claim's wait ran out
    NOT_READY = "not_ready"
    #: the reads took longer than prefill's lease: the blocks may have been reused
    LEASE_OUTLASTED = "lease_outlasted"
    #: vLLM finished the request before prefill granted it (not a transfer failure)
    CANCELLED = "cancelled"
    #: the router freed prefill's hold because the client left, racing the abort of the
    #: request on its way to decode (not a transfer failure; the blocks are still not loaded)
    CLIENT_LEFT = "client_left"
    #: prefill did not answer, its side channel failed, or its circuit is open
    PEER_UNAVAILABLE = "peer_unavailable"
    #: the transport failed the read (after its retries)
    TRANSFER = "transfer"
    #: a read never settled: its bytes may still land (the pull is never reported)
    UNSETTLED = "unsettled"
    #: ``verify_reads`` found bytes that differ from prefill's
    INTEGRITY = "integrity"
    #: the local copies and permutations after the reads failed
    FIXUP = "fixup"
    #: the decode worker is shutting down or its KV cache is asleep
    UNAVAILABLE_HERE = "unavailable_here"
    #: anything else (a bug: its log line has the traceback)
    INTERNAL = "internal"


class PullError(RuntimeError):
    """A pull failed for a reason of ``kind``; the message tells the operator what to change."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class PullCancelled(PullError):
    """The request finished in vLLM before prefill granted its read; nothing was read."""

    def __init__(self, message: str) -> None:
        super().__init__(FailureKind.CANCELLED, message)


def as_pull_error(exc: BaseException) -> PullError:
    """``exc`` as a :class:`PullError` of its kind (its message unchanged)."""
    return exc if isinstance(exc, PullError) else PullError(kind_of(exc), str(exc))


def kind_of(exc: BaseException) -> FailureKind:
    """The kind of failure ``exc`` is, whoever raised it."""
    if isinstance(exc, PullError):
        return exc.kind
    if isinstance(exc, UnsettledTransfer):
        return FailureKind.UNSETTLED
    if isinstance(exc, TransferError):
        return FailureKind.TRANSFER
    if isinstance(exc, PeerRefused):
        return FailureKind.REFUSED
    if isinstance(exc, SideChannelError):
        return FailureKind.PEER_UNAVAILABLE
    if isinstance(exc, (IncompatiblePeerError, TopologyError, LayoutError)):
        return FailureKind.INCOMPATIBLE_PEER
    return FailureKind.INTERNAL
