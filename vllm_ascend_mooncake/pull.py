"""The unit of work between the decode scheduler, its workers and their receivers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PullRequest:
    """Pull ``remote_block_ids`` (their suffix, when decode already caches a prefix) of a
    prefill instance into this decode instance's ``local_block_ids``.

    ``transfer_id`` is the prefill's request id: both sides derive the replica choice from it and
    prefill tracks reads under it. ``remote_port`` is the side channel of prefill TP rank 0; rank
    ``r`` listens on ``remote_port + r``.
    """

    request_id: str
    transfer_id: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    remote_host: str
    remote_port: int
    remote_engine_id: str | None = None
