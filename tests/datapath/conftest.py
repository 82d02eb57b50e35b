"""Fixtures shared by the decode receiver's tests (:mod:`receiver_cluster` builds the cluster)."""

from __future__ import annotations

import pytest
from receiver_cluster import (
    Cluster,
    QueuedFixupMemory,
)


@pytest.fixture
def cluster():
    made = []

    def make(*args, **kw) -> Cluster:
        made.append(Cluster(*args, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def queued_fixups(monkeypatch):
    """The receiver's fix-ups queue on a :class:`QueuedFixupMemory` instead of running."""
    from vllm_ascend_mooncake.datapath import copy_overlap as copy_module
    from vllm_ascend_mooncake.datapath import receiver as receiver_module

    def queueing(run_now):
        def queue(memory, fixups):
            if isinstance(memory, QueuedFixupMemory):
                memory.queued.append(lambda: run_now(memory, fixups))
            else:
                run_now(memory, fixups)

        return queue

    for module, name in ((copy_module, "apply_row_copies"), (receiver_module, "apply_swaps")):
        monkeypatch.setattr(module, name, queueing(getattr(module, name)))
