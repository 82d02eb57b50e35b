"""How a read waits for Mooncake: our polled wait against Mooncake's spinning sync wait.

Real Mooncake over TCP between processes. One process registers a source buffer; ``--readers``
processes read from it at the same time (2 readers is a TP 2 decode reading one prefill rank), each
with ``poll`` (one asynchronous batch per descriptor, sleeping between status checks) and with
``sync`` (``batch_transfer_sync_read``, which spins until the batch is done), alternating, in the
same run. Reported per shape: median wall time of one read, the CPU the reading thread burned, and
the ratios poll/sync. Every read's bytes are checked.

    python -m benchmarks.micro.bench_read_wait [--readers 2] [--repeats 15] [--json out.json]
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time

import numpy as np

from benchmarks.common import add_json_arg, add_repeats_arg, make_parser, write_json

SOURCE_BYTES = 64 << 20
SHAPES = ((64, 64 << 10), (1000, 4 << 10), (32, 1 << 20))


def _serve(conn) -> None:
    from vllm_ascend_mooncake.datapath.mooncake import MooncakeTransport
    from vllm_ascend_mooncake.datapath.transport import MemoryRange

    source = np.random.default_rng(3).integers(0, 256, SOURCE_BYTES, dtype=np.uint8)
    engine = MooncakeTransport("127.0.0.1", "tcp")
    engine.register([MemoryRange(source.ctypes.data, source.nbytes)])
    conn.send((engine.session, source.ctypes.data))
    conn.recv()


def _read(conn, session: str, base: int, repeats: int, start_at: float) -> None:
    from vllm_ascend_mooncake.datapath.mooncake import MooncakeTransport
    from vllm_ascend_mooncake.datapath.transport import MemoryRange

    source = np.random.default_rng(3).integers(0, 256, SOURCE_BYTES, dtype=np.uint8)
    engines = {w: MooncakeTransport("127.0.0.1", "tcp", read_wait=w) for w in ("poll", "sync")}
    dest = np.zeros(max(n * size for n, size in SHAPES), dtype=np.uint8)
    for engine in engines.values():
        engine.register([MemoryRange(dest.ctypes.data, dest.nbytes)])
    results: dict[str, dict[str, list[float]]] = {}
    time.sleep(max(0.0, start_at - time.time()))  # readers start together
    for n, size in SHAPES:
        offsets = [(k * 7919) % (SOURCE_BYTES // size) * size for k in range(n)]
        local = [dest.ctypes.data + k * size for k in range(n)]
        remote = [base + o for o in offsets]
        for _ in range(repeats):
            for wait, engine in engines.items():
                dest[: n * size] = 0
                cpu, wall = time.thread_time(), time.perf_counter()
                engine.read(session, local, remote, [size] * n)
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                for k, o in enumerate(offsets):
                    if not np.array_equal(dest[k * size : (k + 1) * size], source[o : o + size]):
                        raise RuntimeError(f"{wait} read of {n}x{size} landed wrong bytes")
                entry = results.setdefault(f"{n}x{size // 1024}KiB", {})
                entry.setdefault(f"{wait}_wall", []).append(wall)
                entry.setdefault(f"{wait}_cpu", []).append(cpu)
    conn.send(results)


def main() -> int:
    parser = make_parser("benchmarks.micro.bench_read_wait", __doc__)
    parser.add_argument("--readers", type=int, default=2, help="reader processes at once")
    add_repeats_arg(parser, 15, "median of")
    add_json_arg(parser)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    server_conn, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(child,), daemon=True)
    server.start()
    session, base = server_conn.recv()
    start_at = time.time() + 15
    readers = []
    for _ in range(args.readers):
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_read, args=(child, session, base, args.repeats, start_at))
        process.start()
        readers.append((process, parent))
    per_reader = [conn.recv() for _, conn in readers]
    for process, _ in readers:
        process.join()
    server_conn.send("stop")
    print(
        f"{args.readers} reader process(es) at once, median of {args.repeats} reads each; "
        f"Mooncake TCP over loopback"
    )
    print(
        f"{'shape':>14} {'poll ms':>8} {'sync ms':>8} {'wall poll/sync':>15} "
        f"{'poll cpu ms':>12} {'sync cpu ms':>12} {'cpu poll/sync':>14}"
    )
    rows = []
    for shape in per_reader[0]:
        med = {
            key: statistics.median(v for r in per_reader for v in r[shape][key])
            for key in ("poll_wall", "sync_wall", "poll_cpu", "sync_cpu")
        }
        row = {
            "shape": shape,
            "readers": args.readers,
            **med,
            "wall_ratio": med["poll_wall"] / med["sync_wall"],
            "cpu_ratio": med["poll_cpu"] / med["sync_cpu"] if med["sync_cpu"] else None,
        }
        rows.append(row)
        cpu_ratio = f"{row['cpu_ratio']:14.2f}" if row["cpu_ratio"] is not None else f"{'-':>14}"
        print(
            f"{shape:>14} {med['poll_wall'] * 1e3:8.1f} {med['sync_wall'] * 1e3:8.1f} "
            f"{row['wall_ratio']:15.2f} {med['poll_cpu'] * 1e3:12.1f} "
            f"{med['sync_cpu'] * 1e3:12.1f} {cpu_ratio}"
        )
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
