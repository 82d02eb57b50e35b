"""What the scheduler orders its workers to do each step: pulls (decode), holds (prefill) and
the rest, carried in the step metadata (``connector.facade.StepMetadata``).

The orders are the data path's input, so they live here and the connector imports them; the data
path never imports the connector."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PullOrder:
    """Pull ``remote_block_ids`` (their suffix, when decode already caches a prefix) of a
    prefill instance into this decode instance's ``local_block_ids``.

    ``transfer_id`` is the id prefill holds the KV under (its request id, or the proxy's transfer
    id when the legs overlap): both sides derive the replica choice from it and prefill tracks
    reads under it. ``remote_block_ids`` is None when prefill had not answered yet: its read
    lease then carries them, and ``num_prompt_tokens`` lets prefill check the prompts match.
    ``remote_port`` is the side channel of prefill TP rank 0; rank ``r`` listens on
    ``remote_port + r``.

    A model with several KV cache groups (vLLM's hybrid manager: sliding-window beside full
    attention) lists each side's blocks group after group, with the groups' sizes
    (``*_group_sizes``, :func:`~..core.groups.split_groups`); no sizes: one group.
    """

    request_id: str
    transfer_id: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...] | None
    remote_host: str
    remote_port: int
    remote_engine_id: str | None = None
    num_prompt_tokens: int = -1
    #: the prefill instance's TP size (its params say); None: the configured ``prefill.tp_size``
    remote_tp_size: int | None = None
    #: wall-clock times vLLM received the request and admitted it for loading (timeline only)
    arrived_at: float = field(default=0.0, compare=False)
    admitted_at: float = field(default=0.0, compare=False)
    local_group_sizes: tuple[int, ...] = ()
    remote_group_sizes: tuple[int, ...] = ()

    @property
    def release_only(self) -> bool:
        """No local blocks: vLLM loads nothing and does not wait for a report; the pull only
        tells prefill to free its hold (an abort before scheduling, a request skipping
        external KV)."""
        return not self.local_block_ids

    @property
    def early(self) -> bool:
        """Admitted before prefill answered (overlapped legs): the lease names the blocks."""
        return self.remote_block_ids is None


@dataclass(frozen=True)
class HoldOrder:
    """Keep a finished prefill request's prompt blocks until its readers are done."""

    request_id: str  # vLLM's id, reported back when the blocks may be freed
    transfer_id: str  # what decode claims and reports reads under
    block_ids: tuple[int, ...]
    num_prompt_tokens: int
    #: the KV cache groups' sizes in ``block_ids``, group after group (none: one group)
    group_sizes: tuple[int, ...] = ()
    #: wall-clock time vLLM finished the request (scheduler process), for the hold-delay metric
    finished_at: float = field(default=0.0, compare=False)
    #: wall-clock times vLLM received it and its scheduler first saw it (timeline only)
    arrived_at: float = field(default=0.0, compare=False)
    scheduled_at: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class PairingOrder:
    """Handshake with every TP rank of prefill engine ``engine_id`` (side channel of rank ``r``
    at ``remote_port + r``) and report whether this decode can read it, before the first pull
    from it: a prefill that cannot be read then costs a request nothing (it is computed here)
    instead of failing it."""

    engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int


@dataclass
class StepOrders:
    """What the scheduler asks the workers to do this step (carried by the step metadata)."""

    pulls: list[PullOrder] = field(default_factory=list)
    holds: list[HoldOrder] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)  # transfer ids prefill will never hand off
    # requests that finished (aborted) while their KV was loading: stop waiting for prefill
    cancels: list[str] = field(default_factory=list)
    # decode: prefill engines to pair with before the first pull from each
    pairings: list[PairingOrder] = field(default_factory=list)
    idle: bool = False  # the step runs no tokens: workers may wait a little for transfers
