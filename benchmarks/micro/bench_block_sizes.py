"""Different block sizes on prefill and decode: what a request costs next to equal block sizes.

Realistic request by default (32 layers, 8 KV heads, head_dim 128, bf16, 4,096 tokens); decode's
block size is ``--block-size`` (128) and prefill's half and double it. Three layouts: vllm-ascend's
separate token-major K and V tensors, and vLLM CPU's fused head-major view packed by the vec and
the amx kernels (cut by token through a 64 MiB staging buffer). Two block tables: one contiguous
run, and runs of 4 blocks scattered. For each TP pair it reports decode rank 0's descriptors and
bytes read, against the equal-size plan of the same request (the ratio), and the local work the
mixed plan adds (row copies out of staging and swaps, run on real memory) against a plain copy
of the same bytes measured in the same run.

    python -m benchmarks.micro.bench_block_sizes [--json results.json]
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

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
from vllm_ascend_mooncake.core.packing import chunk_packing
from vllm_ascend_mooncake.core.plan import PlanOptions, RequestPlan, StagingArea, plan_request
from vllm_ascend_mooncake.core.relayout import LocalMemory, apply_row_copies, apply_swaps
from vllm_ascend_mooncake.core.topology import TransferTopology

ELEMENT = 2  # bf16
STAGING_BYTES = 64 << 20
LAYOUTS = ("token_major_split_kv", "cpu_vec_head_major", "cpu_amx_head_major")


@dataclass
class Row:
    layout: str
    prefill_block: int
    decode_block: int
    prefill_tp: int
    decode_tp: int
    table: str
    descriptors: int
    equal_size_descriptors: int
    mib_read: float
    local_mib: float
    plan_ms: float
    local_gbps: float | None = None
    memcpy_gbps: float | None = None
    local_vs_memcpy: float | None = None


def layouts_for(kind: str, layers: int, heads: int, block: int, head_dim: int, blocks: int):
    if kind == "token_major_split_kv":
        return kv_layouts(False, layers, heads, block, head_dim, blocks, element=ELEMENT)
    packing = chunk_packing(f"CPU_ATTN/{kind.split('_')[1]}", "auto", head_dim, ELEMENT)
    return kv_layouts(
        True, layers, heads, block, head_dim, blocks, element=ELEMENT, packing=packing
    )


def block_ids(count: int, pool: int, table: str, rng: np.random.Generator) -> list[int]:
    if table == "contiguous":
        return list(range(count))
    runs = [list(range(i, min(i + 4, pool))) for i in range(0, pool, 4)]
    rng.shuffle(runs)
    return [b for run in runs for b in run][:count]


def local_work_bytes(plan: RequestPlan) -> int:
    copies = sum(c.num_bytes for p in plan.peers for b in p.batches for c in b.after_landing)
    return copies + sum(len(s.addrs) * s.span for s in plan.fixups)


def main() -> int:
    args = request_rows_args("benchmarks.micro.bench_block_sizes", __doc__)
    rng = np.random.default_rng(0)
    bd = args.block_size
    rows: list[Row] = []
    staging = torch.empty(STAGING_BYTES, dtype=torch.uint8)
    for kind in LAYOUTS:
        for bp in (bd // 2, 2 * bd):
            for prefill_tp, decode_tp in ((1, 1), (2, 1), (1, 2)):
                for table in ("contiguous", "fragmented"):
                    rows.append(measure(args, kind, bp, prefill_tp, decode_tp, table, staging, rng))
                    print_row(rows[-1])
    if args.json:
        write_json(args.json, [asdict(r) for r in rows])
    return 0


def measure(args, kind, bp, prefill_tp, decode_tp, table, staging, rng) -> Row:
    bd = args.block_size
    topo = TransferTopology(args.kv_heads, prefill_tp, decode_tp)
    prefill_blocks, decode_blocks = -(-args.tokens // bp), -(-args.tokens // bd)
    local_pool = 2 * decode_blocks  # each side's cache holds twice the request's blocks

    def tables(prefill_block: int):
        pool = 2 * -(-args.tokens // prefill_block)
        remote_layouts = layouts_for(
            kind, args.layers, topo.prefill_heads_per_rank, prefill_block, args.head_dim, pool
        )
        return {p: place_regions(remote_layouts, (p + 1) << 40) for p in range(prefill_tp)}

    local_layouts = layouts_for(
        kind, args.layers, topo.decode_heads_per_rank, bd, args.head_dim, local_pool
    )
    local_bytes = sum(layout.span_bytes for layout in local_layouts)
    memory_tensor = torch.empty(local_bytes, dtype=torch.uint8)
    local = place_regions(local_layouts, memory_tensor.data_ptr())
    remote = tables(bp)
    remote_ids = block_ids(prefill_blocks, 2 * prefill_blocks, table, rng)
    local_ids = block_ids(decode_blocks, local_pool, table, rng)
    options = PlanOptions(staging=StagingArea(staging.data_ptr(), staging.numel()))

    def plan() -> RequestPlan:
        return plan_request(
            topo, 0, 0, local, remote, local_ids, remote_ids, options, num_tokens=args.tokens
        )

    plan_s = best_of(plan, args.repeats)
    mixed = plan()
    equal_remote_ids = block_ids(decode_blocks, 2 * decode_blocks, table, rng)
    equal = plan_request(
        topo, 0, 0, local, tables(bd), local_ids, equal_remote_ids, options, num_tokens=args.tokens
    )
    work = local_work_bytes(mixed)
    row = Row(
        kind,
        bp,
        bd,
        prefill_tp,
        decode_tp,
        table,
        mixed.num_descriptors,
        equal.num_descriptors,
        mixed.num_bytes / 2**20,
        work / 2**20,
        plan_s * 1e3,
    )
    if work:
        memory = LocalMemory([memory_tensor, staging])

        def local_work() -> None:
            for peer in mixed.peers:
                for batch in peer.batches:
                    apply_row_copies(memory, batch.after_landing)
            apply_swaps(memory, mixed.fixups)

        work_s = best_of(local_work, args.repeats)
        measured = against_memcpy(work, work_s, args.repeats)
        row.local_gbps, row.memcpy_gbps, row.local_vs_memcpy = measured
    return row


def print_row(row: Row) -> None:
    def show(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    print(
        f"{row.layout:21} Bp{row.prefill_block:<4}->Bd{row.decode_block:<4} "
        f"Tp{row.prefill_tp}->Td{row.decode_tp} {row.table:10} desc={row.descriptors:6d} "
        f"(equal sizes {row.equal_size_descriptors:6d}) read={row.mib_read:6.1f}MiB "
        f"plan={row.plan_ms:7.2f}ms local={row.local_mib:6.1f}MiB "
        f"local={show(row.local_gbps)}GB/s memcpy={show(row.memcpy_gbps)}GB/s "
        f"ratio={show(row.local_vs_memcpy)}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
