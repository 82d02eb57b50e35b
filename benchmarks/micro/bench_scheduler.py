"""Scheduler-side cost with many requests in flight (target: <= 1 ms per step).

Real vLLM ``Request`` and ``KVCacheBlocks`` objects go through the connector's scheduler side: 1,000
decode requests arrive with prefill params (matched tokens, allocation, pull orders), 1,000 prefill
requests finish and are held. Reported: the per-step cost of ``build_connector_meta`` (including
pickling the step metadata, as vLLM ships it to the workers) in a steady step and in a burst step
where all 1,000 requests are new, and the per-request cost of the bookkeeping calls.

    python -m benchmarks.micro.bench_scheduler [--requests 1000] [--json out.json]
"""

from __future__ import annotations

import pickle
import statistics
import sys
import time

from vllm.v1.request import Request, RequestStatus

from benchmarks.common import add_json_arg, make_parser, write_json
from vam_testing.scheduler_fakes import (
    connector_scheduler,
    kv_blocks,
    vllm_request,
)
from vllm_ascend_mooncake.connector.facade import StepMetadata
from vllm_ascend_mooncake.connector.scheduler import ConnectorScheduler

BLOCK = 128
PROMPT_TOKENS = 4096


def scheduler(role: str) -> ConnectorScheduler:
    """TP 4 -> 1, 8 KV heads."""
    return connector_scheduler(role, prefill_tp=4, num_kv_heads=8, block_size=BLOCK)


def request(request_id: str, params: dict) -> Request:
    return vllm_request(request_id, PROMPT_TOKENS, params, max_tokens=16)


def step_cost(sched: ConnectorScheduler) -> float:
    started = time.perf_counter()
    pickle.dumps(StepMetadata(sched.build_step_orders()))
    return time.perf_counter() - started


def main() -> int:
    parser = make_parser("benchmarks.micro.bench_scheduler", __doc__)
    parser.add_argument("--requests", type=int, default=1000, help="requests in flight")
    add_json_arg(parser)
    args = parser.parse_args()
    n = args.requests
    per_req = PROMPT_TOKENS // BLOCK

    prefill = scheduler("kv_producer")
    prefill_requests = []
    for i in range(n):
        req = request(f"p-{i}", {"do_remote_decode": True})
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        prefill_requests.append(req)
    # block 0 is vLLM's null block (never a prompt's): ids start at 1
    block_ids = [list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for i in range(n)]
    started = time.perf_counter()
    finished = [
        prefill.request_finished(r, (ids,))[1]
        for r, ids in zip(prefill_requests, block_ids, strict=True)
    ]
    prefill_us = (time.perf_counter() - started) / n * 1e6
    prefill_burst_ms = step_cost(prefill) * 1e3

    decode = scheduler("kv_consumer")
    requests = [request(f"d-{i}", dict(params)) for i, params in enumerate(finished)]
    allocations = [kv_blocks(ids) for ids in block_ids]
    started = time.perf_counter()
    for req, blocks in zip(requests, allocations, strict=True):
        count, _ = decode.get_num_new_matched_tokens(req, 0)
        decode.update_state_after_alloc(req, blocks, count)
    decode_us = (time.perf_counter() - started) / n * 1e6
    burst_ms = step_cost(decode) * 1e3

    # Steady state: with 1,000 requests in flight, a handful (8) arrive per step.
    steady = []
    for step in range(50):
        for req, blocks in list(zip(requests, allocations, strict=True))[
            step * 8 % n : step * 8 % n + 8
        ]:
            req.kv_transfer_params["do_remote_prefill"] = True
            count, _ = decode.get_num_new_matched_tokens(req, 0)
            decode.update_state_after_alloc(req, blocks, count)
        steady.append(step_cost(decode))
    idle = min(step_cost(decode) for _ in range(50))

    results = {
        "requests_in_flight": n,
        "prefill_request_finished_us_per_request": round(prefill_us, 2),
        "decode_match_and_alloc_us_per_request": round(decode_us, 2),
        "build_connector_meta_ms_burst_all_new": round(burst_ms, 3),
        "build_connector_meta_ms_prefill_burst": round(prefill_burst_ms, 3),
        "build_connector_meta_ms_steady_8_new_median": round(statistics.median(steady) * 1e3, 3),
        "build_connector_meta_ms_idle": round(idle * 1e3, 3),
        "target_ms_per_step": 1.0,
    }
    for key, value in results.items():
        print(f"{key:48} {value}")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
