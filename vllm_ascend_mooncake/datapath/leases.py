"""Decode side: obtain and renew the read lease of each prefill rank a pull reads.

A lease is prefill's promise to keep a transfer's blocks for ``lease_s``: decode reads only under
one, and only the blocks the grant names (:func:`agreed_blocks`). The claims themselves wait
for their grants on :mod:`.claims`' one thread; this module turns the answers into grants or
typed failures (:mod:`.failures`), and claims again from a prefill that restarted while an early
pull (admitted before prefill finished) waited for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from ..core.layout import Region
from ..core.topology import TransferTopology
from ..log import get_logger
from .claims import ClaimAnswer, ClaimExchange
from .failures import FailureKind, PullError
from .orders import PullOrder
from .peers import PeerDirectory, PrefillPeer
from .side_channel import PeerRefused, SideChannelError
from .wire import ClaimRead, ClaimReply

logger = get_logger(__name__)

#: How a claim that was not granted fails, by the status prefill answered (others: refused).
_REFUSAL_KINDS = {"pending": FailureKind.NOT_READY, "dropped": FailureKind.CLIENT_LEFT}


@dataclass
class LeasedPeer:
    """A prefill rank a pull reads, and the read lease it granted."""

    rank: int
    host: str
    port: int
    transport_session: str
    incarnation: str
    claimed_at: float = 0.0
    lease_s: float = 0.0


@dataclass(frozen=True)
class LeaseTerms:
    """How long claims wait and how often they ask (the receiver's options)."""

    claim_wait_s: float  # for a pull whose prefill finished (serial legs)
    prefill_wait_s: float  # for a pull admitted before prefill finished
    claim_park_s: float  # how long prefill may hold one "pending" answer


#: A request's prefill blocks: the ids, group after group, and the KV cache groups' sizes.
HeldBlocks = tuple[tuple[int, ...], tuple[int, ...]]


def agreed_blocks(
    pull: PullOrder, rank: int, so_far: HeldBlocks | None, granted: ClaimReply
) -> HeldBlocks:
    """The prefill block ids (and groups' sizes) a grant names, checked against the prompt and
    against what is already known: the request's params (serial legs) or the other ranks'
    grants (overlapped).

    A decode reads only blocks that prefill holds for this transfer: params naming other blocks
    (a client's own, or a stale or forged hand-off) are refused, not read."""
    blocks = (tuple(granted.block_ids), tuple(granted.group_sizes))
    block_ids = blocks[0]
    if granted.num_prompt_tokens != pull.num_prompt_tokens or not block_ids:
        raise PullError(
            FailureKind.GRANT_MISMATCH,
            f"prefill computed {granted.num_prompt_tokens} prompt tokens in {len(block_ids)} "
            f"blocks, the decode request has {pull.num_prompt_tokens} tokens",
        )
    if so_far is not None and blocks != so_far:
        named_by = "another prefill rank" if pull.early else "the request's kv_transfer_params"
        raise PullError(
            FailureKind.GRANT_MISMATCH,
            f"prefill rank {rank} holds {pull.transfer_id} in blocks {list(block_ids)[:8]}... "
            f"(groups of {list(blocks[1])}), {named_by} in {list(so_far[0])[:8]}... (groups "
            f"of {list(so_far[1])}): refusing to read blocks prefill does not hold for this "
            f"transfer",
        )
    return blocks


def check_same_tp(prefill: PrefillPeer, topology: TransferTopology) -> None:
    """The prefill worker runs the TP size the request's params name (which chose the ranks)."""
    if prefill.topology.prefill_tp != topology.prefill_tp:
        raise PullError(
            FailureKind.TP_MISMATCH,
            f"prefill engine {prefill.engine_id} runs TP {prefill.topology.prefill_tp}, but the "
            f"request's kv_transfer_params name TP {topology.prefill_tp}",
        )


def _settle(target: Future, source: Future) -> None:
    """Give ``target`` the outcome of the finished ``source``."""
    exc = source.exception()
    if exc is None:
        target.set_result(source.result())
    else:
        target.set_exception(exc)


class Leases:
    """Claims read leases for one decode worker's pulls; no thread waits for a grant."""

    def __init__(
        self,
        exchange: ClaimExchange,
        peers: PeerDirectory,
        terms: LeaseTerms,
        decode_rank: int,
        decode_tp: int,
        still_wanted: Callable[[PullOrder], None],
        run_off_thread: Callable[..., None],
    ) -> None:
        """``still_wanted(pull)`` raises once vLLM no longer wants the pull;
        ``run_off_thread(pull, task, *args)`` runs ``task`` on a planning thread (or fails the
        pull): looking a restarted peer up may fetch its metadata, never on the claims thread."""
        self._exchange = exchange
        self._peers = peers
        self._terms = terms
        self._rank = decode_rank
        self._decode_tp = decode_tp
        self._still_wanted = still_wanted
        self._run_off_thread = run_off_thread

    def first_claim(
        self,
        pull: PullOrder,
        peer: LeasedPeer,
        remote_tables: dict[int, Sequence[Region]],
        topology: TransferTopology,
    ) -> Future[ClaimReply]:
        """The first claim; an early pull whose cached peer restarted claims again from the new
        one (the transfer id is unique, so the new incarnation is the one computing it)."""
        granted: Future[ClaimReply] = Future()

        def answered(claim: Future[ClaimReply]) -> None:
            if pull.early and isinstance(claim.exception(), PeerRefused):
                self._run_off_thread(
                    pull, self._claim_restarted, pull, peer, remote_tables, topology, claim, granted
                )
            else:
                _settle(granted, claim)

        self.claim(pull, peer).add_done_callback(answered)
        return granted

    def claim(self, pull: PullOrder, peer: LeasedPeer) -> Future[ClaimReply]:
        """Obtain (or renew) the peer's read lease: the future fails if the peer refuses, stays
        silent, or never registers the request within the claim's wait."""
        terms = self._terms
        wait_s = terms.prefill_wait_s if pull.early else terms.claim_wait_s
        message = ClaimRead(
            pull.transfer_id,
            self._rank,
            peer.incarnation,
            pull.num_prompt_tokens,
            wait_s=terms.claim_park_s,
            decode_tp=self._decode_tp,
            reader=self._peers.local.incarnation,
        )
        granted: Future[ClaimReply] = Future()

        def answered(claim: Future[ClaimAnswer]) -> None:
            try:
                answer = claim.result()
            except SideChannelError as exc:  # refused the message, or silent every attempt
                self._peers.invalidate(peer.host, peer.port)
                granted.set_exception(exc)
                return
            except Exception as exc:  # cancelled
                granted.set_exception(exc)
                return
            reply = answer.reply
            if not isinstance(reply, ClaimReply):
                granted.set_exception(
                    PullError(
                        FailureKind.BAD_REPLY,
                        f"{peer.host}:{peer.port} answered a claim with {reply!r}",
                    )
                )
            elif reply.status != "granted":
                kind = _REFUSAL_KINDS.get(reply.status, FailureKind.REFUSED)
                granted.set_exception(
                    PullError(
                        kind,
                        f"prefill rank {peer.rank} refused the read of {pull.transfer_id}: "
                        f"{reply.reason}",
                    )
                )
            else:
                peer.claimed_at, peer.lease_s = answer.sent_at, reply.lease_s
                granted.set_result(reply)

        self._exchange.claim(
            peer.host,
            peer.port,
            message,
            time.monotonic() + wait_s,
            lambda: self._still_wanted(pull),
        ).add_done_callback(answered)
        return granted

    def _claim_restarted(
        self,
        pull: PullOrder,
        peer: LeasedPeer,
        remote_tables: dict[int, Sequence[Region]],
        topology: TransferTopology,
        refused: Future[ClaimReply],
        granted: Future[ClaimReply],
    ) -> None:
        try:
            prefill = self._peers.get(peer.host, peer.port)  # invalidated by the refusal
            if prefill.incarnation == peer.incarnation:
                _settle(granted, refused)
                return
            check_same_tp(prefill, topology)
        except Exception as exc:
            granted.set_exception(exc)
            return
        logger.info(
            "prefill %s:%d restarted (incarnation %s); claiming %s from the new one",
            peer.host,
            peer.port,
            prefill.incarnation,
            pull.transfer_id,
        )
        peer.transport_session = prefill.transport_session
        peer.incarnation = prefill.incarnation
        remote_tables[peer.rank] = prefill.regions
        self.claim(pull, peer).add_done_callback(lambda claim: _settle(granted, claim))
