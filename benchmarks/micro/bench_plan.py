"""Planner micro-benchmark: descriptors per request, planning time, fix-up speed vs memcpy.

Realistic request by default: 32 layers, 8 KV heads, head_dim 128, bf16, 4,096 tokens, block 128.
Two layouts: vLLM's fused head-major view (one region per layer, K|V in the content axis) and
vllm-ascend's separate token-major K and V tensors (two regions per layer). Two block tables: one
contiguous run, and fragmented runs of 4 blocks. For each TP pair it reports what decode rank 0
issues with and without run-level coalescing, and times the fix-up on real torch memory against a
plain copy of the same number of bytes, measured in the same run.

    python -m benchmarks.micro.bench_plan [--json results.json]
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import torch

from benchmarks.common import (
    against_memcpy,
    best_of,
    kv_layouts,
    place_regions,
    request_rows_args,
    write_json,
)
from vllm_ascend_mooncake.core.plan import PlanOptions, StagingArea, plan_request
from vllm_ascend_mooncake.core.relayout import LocalMemory, apply_swaps
from vllm_ascend_mooncake.core.topology import TransferTopology


@dataclass
class Row:
    layout: str
    prefill_tp: int
    decode_tp: int
    table: str
    coalesce_runs: bool
    descriptors: int
    mib_read: float
    fixup_mib: float
    plan_ms: float
    fixup_gbps: float | None = None
    memcpy_gbps: float | None = None
    fixup_vs_memcpy: float | None = None


def block_tables(num_blocks: int, kind: str, rng: np.random.Generator):
    if kind == "contiguous":
        return list(range(num_blocks)), list(range(num_blocks))
    runs = [list(range(i, i + 4)) for i in range(0, 2 * num_blocks, 8)][: num_blocks // 4]
    rng.shuffle(runs)
    remote = [b for run in runs for b in run]
    local_runs = [list(range(i, i + 4)) for i in range(0, 2 * num_blocks, 8)][: num_blocks // 4]
    rng.shuffle(local_runs)
    return [b for run in local_runs for b in run], remote


def main() -> int:
    args = request_rows_args("benchmarks.micro.bench_plan", __doc__)

    num_blocks = args.tokens // args.block_size
    pool_blocks = 2 * num_blocks
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    torch.set_num_threads(torch.get_num_threads())

    for kind in ("head_major_fused", "token_major_split_kv"):
        for prefill_tp, decode_tp in ((4, 1), (1, 1), (1, 4)):
            topo = TransferTopology(args.kv_heads, prefill_tp, decode_tp)
            remote_heads = topo.prefill_heads_per_rank
            local_heads = topo.decode_heads_per_rank
            head_major = kind == "head_major_fused"
            local_layouts = kv_layouts(
                head_major, args.layers, local_heads, args.block_size, args.head_dim, pool_blocks
            )
            remote_layouts = kv_layouts(
                head_major, args.layers, remote_heads, args.block_size, args.head_dim, pool_blocks
            )
            remote = {p: place_regions(remote_layouts, (p + 1) << 40) for p in range(prefill_tp)}
            for table in ("contiguous", "fragmented"):
                local_ids, remote_ids = block_tables(num_blocks, table, rng)
                for coalesce in (True, False):
                    options = PlanOptions(
                        coalesce_runs=coalesce, staging=StagingArea(1 << 50, 64 << 20)
                    )
                    local = place_regions(local_layouts, 1 << 44)
                    plan_s = best_of(
                        partial(
                            plan_request, topo, 0, 0, local, remote, local_ids, remote_ids, options
                        ),
                        args.repeats,
                    )
                    plan = plan_request(topo, 0, 0, local, remote, local_ids, remote_ids, options)
                    fix_bytes = sum(len(s.addrs) * s.span for s in plan.fixups)
                    row = Row(
                        kind,
                        prefill_tp,
                        decode_tp,
                        table,
                        coalesce,
                        plan.num_descriptors,
                        plan.num_bytes / 2**20,
                        fix_bytes / 2**20,
                        plan_s * 1e3,
                    )
                    if fix_bytes:
                        measure_fixup(
                            row,
                            topo,
                            local_layouts,
                            remote,
                            local_ids,
                            remote_ids,
                            options,
                            fix_bytes,
                            args.repeats,
                        )
                    rows.append(row)
                    print_row(row)
    if args.json:
        write_json(args.json, [asdict(r) for r in rows])
    return 0


def measure_fixup(
    row, topo, local_layouts, remote, local_ids, remote_ids, options, fix_bytes, repeats
) -> None:
    """Run the plan's fix-ups on real memory; compare with a copy of the same bytes."""
    total = sum(layout.span_bytes for layout in local_layouts)
    memory_tensor = torch.randint(0, 256, (total,), dtype=torch.uint8)
    local = place_regions(local_layouts, memory_tensor.data_ptr())
    plan = plan_request(topo, 0, 0, local, remote, local_ids, remote_ids, options)
    memory = LocalMemory([memory_tensor])
    fix_s = best_of(lambda: apply_swaps(memory, plan.fixups), repeats)
    row.fixup_gbps, row.memcpy_gbps, row.fixup_vs_memcpy = against_memcpy(fix_bytes, fix_s, repeats)


def print_row(row: Row) -> None:
    ratio = f"{row.fixup_vs_memcpy:.2f}" if row.fixup_vs_memcpy is not None else "-"
    fix = f"{row.fixup_gbps:.2f}" if row.fixup_gbps is not None else "-"
    mem = f"{row.memcpy_gbps:.2f}" if row.memcpy_gbps is not None else "-"
    print(
        f"{row.layout:22} Tp{row.prefill_tp}->Td{row.decode_tp} {row.table:10} "
        f"runs={'on ' if row.coalesce_runs else 'off'} desc={row.descriptors:6d} "
        f"read={row.mib_read:7.1f}MiB plan={row.plan_ms:7.2f}ms fixup={row.fixup_mib:6.1f}MiB "
        f"fix={fix}GB/s memcpy={mem}GB/s ratio={ratio}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
