"""Mooncake reads between two real processes over TCP, with both ways of waiting.

``poll`` (our default on TCP) submits one asynchronous batch per descriptor and sleeps between
status checks; ``sync`` is Mooncake's own ``batch_transfer_sync_read``, which spins. Both must move
exactly the requested bytes, and a read of memory the peer never registered must fail with a
TransferError naming the peer rather than return garbage.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from vllm_ascend_mooncake.datapath.mooncake import MooncakeTransport
from vllm_ascend_mooncake.datapath.transport import (
    MemoryRange,
    TransferError,
    TransportSetupError,
)

SOURCE_BYTES = 4 << 20


def _serve(conn) -> None:
    """Register a patterned buffer, publish where it is, and keep it alive until told to stop."""
    source = np.random.default_rng(7).integers(0, 256, SOURCE_BYTES, dtype=np.uint8)
    engine = MooncakeTransport("127.0.0.1", "tcp")
    engine.register([MemoryRange(source.ctypes.data, source.nbytes)])
    conn.send((engine.session, source.ctypes.data))
    conn.recv()
    engine.close()


@pytest.fixture(scope="module")
def peer():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve, args=(child,), daemon=True)
    process.start()
    assert parent.poll(120), "the serving process did not start its transfer engine"
    session, base = parent.recv()
    yield session, base
    parent.send("stop")
    process.join(timeout=30)


def _expected() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, SOURCE_BYTES, dtype=np.uint8)


@pytest.mark.parametrize("read_wait", ["poll", "sync"])
def test_scattered_reads_land_exactly(peer, read_wait) -> None:
    session, base = peer
    engine = MooncakeTransport("127.0.0.1", "tcp", read_wait=read_wait)
    assert engine.read_wait == read_wait
    dest = np.zeros(SOURCE_BYTES, dtype=np.uint8)
    engine.register([MemoryRange(dest.ctypes.data, dest.nbytes)])
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 16 << 10, 300)  # ~2.4 MB: fits the destination
    remote_offsets = [int(rng.integers(0, SOURCE_BYTES - n)) for n in lengths]
    assert int(np.sum(lengths)) < SOURCE_BYTES - (64 << 10)
    local_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    engine.read(
        session,
        [dest.ctypes.data + o for o in local_offsets],
        [base + o for o in remote_offsets],
        [int(n) for n in lengths],
    )
    source = _expected()
    for lo, ro, n in zip(local_offsets, remote_offsets, lengths, strict=True):
        assert np.array_equal(dest[lo : lo + n], source[ro : ro + n])
    end = int(np.sum(lengths))
    assert not dest[end:].any(), "bytes landed past the last descriptor"
    engine.close()


@pytest.mark.parametrize("read_wait", ["poll", "sync"])
def test_unregistered_remote_memory_is_a_transfer_error(peer, read_wait) -> None:
    session, base = peer
    engine = MooncakeTransport("127.0.0.1", "tcp", read_wait=read_wait)
    dest = np.zeros(1 << 16, dtype=np.uint8)
    engine.register([MemoryRange(dest.ctypes.data, dest.nbytes)])
    beyond = base + SOURCE_BYTES + (1 << 20)
    with pytest.raises(TransferError, match=session.replace(".", r"\.")):
        engine.read(
            session, [dest.ctypes.data, dest.ctypes.data + 4096], [base, beyond], [4096, 4096]
        )
    engine.close()


def test_unknown_read_wait_is_refused() -> None:
    with pytest.raises(TransportSetupError, match=r"read_wait must be one of .*, not 'spin'"):
        MooncakeTransport("127.0.0.1", "tcp", read_wait="spin")
