"""Transfer benchmark: our pulls vs the transport's ceiling, real Mooncake (TCP) between processes.

Request shape (default): 32 layers, 8 KV heads, head_dim 128, bf16, 4,096 tokens, block size 128.
For each prefill->decode TP pair and layout, separate prefill and decode worker processes hold the
KV cache as the engines lay it out; a decode rank pulls one request and the time from its first
read to KV ready (fix-up included) is compared with the transport's ceiling measured in the same
run: the same bytes, from the same prefill ranks, read as plain 1 MiB descriptors.

``--verify-cost`` runs every case twice, plain and with ``verify_reads`` (each batch's landed
bytes checked against prefill's checksum), and prints what the check costs.

``--prefill-block-size N`` gives prefill blocks of ``N`` tokens (one of N and ``--block-size``
must divide the other): the request then moves token by token, head-major blocks in vLLM CPU's
vec packing cut through decode's staging buffer, against the same ceiling.

Each timed read also counts the CPU seconds every worker process spent in it (user and system,
all threads, from ``/proc``): ``cores`` is that over the wall time. Over TCP loopback the kernel
copies every byte twice, so a read can keep the machine's cores busy by itself; where the
ceiling already does, whatever CPU work a pull adds (a fix-up, row copies out of staging) adds
wall time on top, and ``CPU-bound ratio`` (ceiling's CPU seconds over ours) is the best ratio
that machine allows.

    python -m benchmarks.micro.bench_transfer [--json results.json] [--repeats 3]
"""

from __future__ import annotations

import os
import statistics
import sys
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.common import (
    add_json_arg,
    add_repeats_arg,
    add_request_shape_args,
    make_parser,
    write_json,
)
from benchmarks.e2e.cpu_usage import parse_cpu_seconds
from vam_testing.datapath_cases import CaseSpec, RequestSpec
from vam_testing.datapath_harness import WorkerProcess
from vllm_ascend_mooncake.core.topology import request_seed
from vllm_ascend_mooncake.launch.ports import free_port_range

TARGETS = {"homogeneous": 0.95, "heterogeneous": 0.85}


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds the processes ``pids`` used so far (all their threads)."""
    total = 0.0
    for pid in pids:
        try:
            total += parse_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
    return total


@dataclass
class Result:
    layout: str
    prefill_tp: int
    decode_tp: int
    table: str
    prefill_block_size: int
    decode_block_size: int
    mib_per_decode_rank: float
    descriptors: int
    ours_s: float
    fixup_s: float
    ceiling_s: float
    ratio: float
    target: float
    meets_target: bool
    verify_reads: bool = False
    #: CPU seconds all worker processes spent in our pull and in the ceiling's read
    ours_cpu_s: float = 0.0
    ceiling_cpu_s: float = 0.0
    cores: float = os.cpu_count() or 1

    @property
    def cpu_bound_ratio(self) -> float:
        """ceiling CPU / our CPU: where the ceiling keeps every core busy, our best ratio."""
        return self.ceiling_cpu_s / self.ours_cpu_s if self.ours_cpu_s else float("nan")


def layout_label(layout: str) -> str:
    return {"vllm_head_major": "head-major (LBHNC)", "split_kv": "token-major K/V"}[layout]


def block_tables(
    tokens: int, prefill_block_size: int, decode_block_size: int, table: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The request's prefill and decode block ids: prefill's contiguous, decode's contiguous or
    fragmented (runs of 4 blocks with gaps of 4)."""
    remote_blocks = -(-tokens // prefill_block_size)
    blocks = -(-tokens // decode_block_size)
    local_ids = (
        tuple(range(blocks))
        if table == "contiguous"
        else tuple(b for i in range(0, blocks, 4) for b in range(i * 2, i * 2 + 4))[:blocks]
    )
    return local_ids, tuple(range(remote_blocks))


def run_case(workers, case: CaseSpec, repeats: int, table: str, tokens: int) -> Result:
    prefill, decode = workers
    pids = [worker.process.pid for worker in prefill + decode]
    local_ids, remote_ids = block_tables(
        tokens, case.prefill_tokens_per_block, case.block_size, table
    )
    for rank in range(case.prefill_tp):
        prefill[rank].call("setup_prefill", case, rank, timeout_s=600)
    for rank in range(case.decode_tp):
        decode[rank].call("setup_decode", case, rank, timeout_s=600)
    try:
        ours, fixups, ceiling, descriptors, per_rank_bytes = [], [], [], 0, 0
        ours_cpu, ceiling_cpu = [], []
        for _ in range(repeats):
            request = RequestSpec(
                request_id=uuid.uuid4().hex,
                transfer_id=uuid.uuid4().hex,
                local_block_ids=local_ids,
                remote_block_ids=remote_ids,
                prompt_tokens=tokens if case.mixed_block_sizes else None,
            )
            for rank in range(case.prefill_tp):
                prefill[rank].call("hold", [request])
            cpu_before = cpu_seconds(pids)
            for rank in range(case.decode_tp):
                decode[rank].send("pull", [request], 600.0)
            outcomes = [decode[rank].receive(900) for rank in range(case.decode_tp)]
            ours_cpu.append(cpu_seconds(pids) - cpu_before)
            for outcome in outcomes:
                if outcome.failed:
                    raise RuntimeError(f"pull failed: {outcome.failed}")
            for rank in range(case.prefill_tp):
                prefill[rank].call("collect_finished", [request.transfer_id], 60.0)
            ours.append(max(o.ready_seconds for o in outcomes))
            fixups.append(max(o.fixup_seconds for o in outcomes))
            descriptors = outcomes[0].descriptors
            per_rank_bytes = outcomes[0].bytes_moved
            topology = case.topology()
            for rank in range(case.decode_tp):
                pulls = topology.pulls_for(rank, request_seed(request.transfer_id))
                share = {p.prefill_rank: outcomes[rank].bytes_moved // len(pulls) for p in pulls}
                if rank == 0:
                    cpu_before = cpu_seconds(pids)
                decode[rank].send("ceiling_read", share)
            ceiling.append(max(decode[rank].receive(900) for rank in range(case.decode_tp)))
            ceiling_cpu.append(cpu_seconds(pids) - cpu_before)
    finally:
        for rank in range(case.prefill_tp):
            prefill[rank].call("teardown")
        for rank in range(case.decode_tp):
            decode[rank].call("teardown")
    ours_s, ceiling_s = statistics.median(ours), statistics.median(ceiling)
    kind = "homogeneous" if case.prefill_tp == case.decode_tp else "heterogeneous"
    ratio = ceiling_s / ours_s
    return Result(
        layout=layout_label(case.layout),
        prefill_tp=case.prefill_tp,
        decode_tp=case.decode_tp,
        table=table,
        prefill_block_size=case.prefill_tokens_per_block,
        decode_block_size=case.block_size,
        mib_per_decode_rank=per_rank_bytes / 2**20,
        descriptors=descriptors,
        ours_s=ours_s,
        fixup_s=statistics.median(fixups),
        ceiling_s=ceiling_s,
        ratio=ratio,
        target=TARGETS[kind],
        meets_target=ratio >= TARGETS[kind],
        verify_reads=case.verify_reads,
        ours_cpu_s=statistics.median(ours_cpu),
        ceiling_cpu_s=statistics.median(ceiling_cpu),
    )


def main() -> int:
    parser = make_parser("benchmarks.micro.bench_transfer", __doc__)
    add_request_shape_args(parser)
    add_repeats_arg(parser, 3, "median of")
    parser.add_argument("--pairs", default="1-1,2-1,4-1,1-2", help="prefill-decode TP pairs")
    parser.add_argument("--layouts", default="vllm_head_major,split_kv", help="KV cache layouts")
    parser.add_argument("--table", choices=("contiguous", "fragmented"), default="contiguous")
    parser.add_argument(
        "--prefill-block-size",
        type=int,
        default=None,
        help="prefill's tokens per block (default: --block-size); one must divide the other",
    )
    parser.add_argument("--no-coalesce", action="store_true", help="disable run-level coalescing")
    parser.add_argument(
        "--read-wait",
        choices=("poll", "sync"),
        default="poll",
        help="how decode's reads (ours and the ceiling's) wait for Mooncake",
    )
    parser.add_argument(
        "--block-reads-from-kib",
        type=int,
        default=256,
        help="head-major merges read per block from this prefill block size (the TCP default)",
    )
    parser.add_argument(
        "--max-descriptor-kib",
        type=int,
        default=1024,
        help="split descriptors above this size (0: never)",
    )
    parser.add_argument(
        "--verify-cost",
        action="store_true",
        help="run every case plain and with verify_reads, and report what the check costs",
    )
    add_json_arg(parser)
    args = parser.parse_args()

    pairs = [tuple(int(x) for x in pair.split("-")) for pair in args.pairs.split(",")]
    prefill_block = args.prefill_block_size or args.block_size
    mixed = prefill_block != args.block_size
    if prefill_block % args.block_size and args.block_size % prefill_block:
        parser.error(f"block sizes {prefill_block} and {args.block_size}: neither divides")
    local_ids, remote_ids = block_tables(args.tokens, prefill_block, args.block_size, args.table)
    spread = 1 if args.table == "contiguous" else 2  # pool sizes as with equal block sizes
    prefill_pool, decode_pool = spread * (len(remote_ids) + 2), spread * (len(local_ids) + 2)
    blocks = f"prefill {prefill_block} -> decode {args.block_size}" if mixed else args.block_size
    print(
        f"request: {args.layers} layers, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
        f"bf16, {args.tokens} tokens, block {blocks} ({args.table} block table); "
        f"Mooncake TCP over loopback, reads wait by {args.read_wait}; median of {args.repeats}",
        flush=True,
    )
    workers = (
        [WorkerProcess() for _ in range(max(p for p, _ in pairs))],
        [WorkerProcess(read_wait=args.read_wait) for _ in range(max(d for _, d in pairs))],
    )
    results = []
    try:
        for layout in args.layouts.split(","):
            for prefill_tp, decode_tp in pairs:
                full = args.layers * args.tokens * args.kv_heads * 2 * args.head_dim * 2
                case = CaseSpec(
                    name=f"bench-{layout}-{prefill_tp}-{decode_tp}",
                    heads=args.kv_heads,
                    prefill_tp=prefill_tp,
                    decode_tp=decode_tp,
                    layout=layout,
                    num_layers=args.layers,
                    block_size=args.block_size,
                    prefill_block_size=prefill_block,
                    # head-major blocks of different sizes are cut by token: vLLM CPU's packing
                    cpu_packing="vec" if mixed and layout == "vllm_head_major" else None,
                    head_size=args.head_dim,
                    element_size=2,
                    prefill_blocks=prefill_pool,
                    decode_blocks=decode_pool,
                    base_port=free_port_range(prefill_tp),
                    release_timeout_s=600,
                    coalesce_runs=not args.no_coalesce,
                    block_reads_from_bytes=args.block_reads_from_kib * 1024,
                    max_descriptor_bytes=args.max_descriptor_kib << 10,
                    staging_bytes=64 << 20,
                    verify=False,
                    ceiling_bytes=full + (64 << 20),  # staged slices read whole blocks
                )
                plain = None
                for verify_reads in (False, True) if args.verify_cost else (False,):
                    case = replace(case, verify_reads=verify_reads)
                    result = run_case(workers, case, args.repeats, args.table, args.tokens)
                    results.append(result)
                    cost = (
                        f", verify_reads costs {result.ours_s / plain.ours_s:.2f}x"
                        if plain is not None
                        else ""
                    )
                    plain = plain or result
                    print(
                        f"{result.layout:20} Tp{prefill_tp}->Td{decode_tp}"
                        f"{' verified' if verify_reads else ''}: "
                        f"{result.mib_per_decode_rank:7.1f} MiB/rank, "
                        f"{result.descriptors:5d} desc, ours {result.ours_s * 1e3:7.1f} ms "
                        f"(fix-up {result.fixup_s * 1e3:5.1f}), "
                        f"ceiling {result.ceiling_s * 1e3:7.1f} ms,"
                        f" ratio {result.ratio:.2f} (target {result.target:.2f}"
                        f"{'' if result.meets_target else ', MISSED'}){cost}; CPU ours "
                        f"{result.ours_cpu_s * 1e3:.0f} ms "
                        f"({result.ours_cpu_s / result.ours_s:.2f} cores), ceiling "
                        f"{result.ceiling_cpu_s * 1e3:.0f} ms "
                        f"({result.ceiling_cpu_s / result.ceiling_s:.2f} cores), CPU-bound "
                        f"ratio {result.cpu_bound_ratio:.2f}",
                        flush=True,
                    )
    finally:
        for worker in workers[0] + workers[1]:
            worker.close()
    if args.json:
        write_json(
            args.json, [{**asdict(r), "cpu_bound_ratio": r.cpu_bound_ratio} for r in results]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
