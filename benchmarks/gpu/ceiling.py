"""The transport's ceiling in the same run: a raw Mooncake read of the same bytes between two
processes, memory on the same device as the engines' KV caches.

One process registers a buffer and serves it; the other reads ``nbytes`` of it as plain 1 MiB
descriptors (bench_transfer's ceiling read), with the read wait the connector uses by default for
the protocol, ``repeats`` times. No planner, side channel or fix-up: only Mooncake.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any

from .checks import descriptors


def _allocate(nbytes: int, device: str):
    import torch

    if device == "cuda":
        torch.cuda.set_device(0)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def _transport(protocol: str, device_name: str, device: str):
    from vllm_ascend_mooncake.datapath.mooncake import MooncakeTransport

    return MooncakeTransport(
        "127.0.0.1", protocol, device_name, device_type="cuda" if device == "cuda" else "cpu"
    )


def _register(transport, tensor) -> None:
    from vllm_ascend_mooncake.datapath.registration import kv_memory_ranges

    transport.register(kv_memory_ranges([tensor]))


def _serve(conn, nbytes: int, device: str, protocol: str, device_name: str) -> None:
    try:
        tensor = _allocate(nbytes, device)
        tensor.fill_(7)
        transport = _transport(protocol, device_name, device)
        _register(transport, tensor)
        conn.send(("ok", (transport.session, tensor.data_ptr())))
        conn.recv()  # until the reader is done
        transport.close()
        conn.send(("ok", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _read(
    conn,
    session: str,
    remote: int,
    nbytes: int,
    repeats: int,
    device: str,
    protocol: str,
    device_name: str,
) -> None:
    try:
        tensor = _allocate(nbytes, device)
        transport = _transport(protocol, device_name, device)
        _register(transport, tensor)
        local_addrs, remote_addrs, lengths = descriptors(tensor.data_ptr(), remote, nbytes)
        transport.read(session, local_addrs, remote_addrs, lengths)  # warm-up: connects
        seconds = []
        for _ in range(repeats):
            if device == "cuda":
                import torch

                torch.cuda.synchronize()
            started = time.perf_counter()
            transport.read(session, local_addrs, remote_addrs, lengths)
            seconds.append(time.perf_counter() - started)
        landed = int((tensor == 7).sum().item())
        transport.close()
        conn.send(("ok", {"seconds": seconds, "bytes_checked": landed == nbytes}))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _receive(conn, process, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"ceiling process {process.pid} did not answer in {timeout_s:.0f} s")
    status, value = conn.recv()
    if status != "ok":
        raise RuntimeError(f"ceiling process {process.pid} failed:\n{value}")
    return value


def measure_ceiling(
    nbytes: int,
    *,
    device: str,
    protocol: str,
    device_name: str = "",
    repeats: int = 10,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Read ``nbytes`` between two fresh processes ``repeats`` times; the seconds of each read,
    and whether every byte landed."""
    ctx = mp.get_context("spawn")
    serve_conn, serve_child = ctx.Pipe()
    read_conn, read_child = ctx.Pipe()
    server = ctx.Process(
        target=_serve, args=(serve_child, nbytes, device, protocol, device_name), daemon=True
    )
    reader = None
    deadline = time.monotonic() + timeout_s
    server.start()
    try:
        session, remote = _receive(serve_conn, server, timeout_s)
        reader = ctx.Process(
            target=_read,
            args=(read_child, session, remote, nbytes, repeats, device, protocol, device_name),
            daemon=True,
        )
        reader.start()
        result = _receive(read_conn, reader, max(1.0, deadline - time.monotonic()))
        serve_conn.send("done")
        _receive(serve_conn, server, 30)
        return {"bytes": nbytes, "repeats": repeats, **result}
    finally:
        for process in (reader, server):
            if process is not None:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=10)
