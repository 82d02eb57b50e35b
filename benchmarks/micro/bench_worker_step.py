"""Worker-side cost per engine step with many requests in flight, prefill and decode.

Each engine step the connector's worker asks the data path what ended (``get_finished``):
prefill's :class:`~vllm_ascend_mooncake.datapath.sender.SendTracker` (expire overdue holds and
remembered ids, take the finished) and decode's
:class:`~vllm_ascend_mooncake.datapath.pull_reports.PullReports` (take the pulls that ended).
With ``--requests`` held (prefill) or in flight (decode), a steady step in which a few (8) end
is timed, and an idle step; a step must not cost more because more requests are in flight.
Also the per-request cost of a hold, a claim and a read-done notice (prefill), and of admitting
and finishing a pull (decode). The product's classes, no sockets: what a step costs the engine.

    python -m benchmarks.micro.bench_worker_step [--requests 10000] [--json out.json]
"""

from __future__ import annotations

import statistics
import sys
import time

from benchmarks.common import add_json_arg, make_parser, write_json
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.orders import PullOrder
from vllm_ascend_mooncake.datapath.pull_reports import PullReports
from vllm_ascend_mooncake.datapath.sender import SendTracker

BLOCKS_PER_REQUEST = 32
ENDING_PER_STEP = 8
STEPS = 200


def _per_request_us(started: float, n: int) -> float:
    return round((time.perf_counter() - started) / n * 1e6, 2)


def prefill_costs(n: int) -> dict[str, float]:
    """A TP-1 prefill rank read by one TP-1 decode rank."""
    tracker = SendTracker(TransferTopology(8, 1, 1), 0, release_timeout_s=3600.0)
    ids = [f"t-{i}" for i in range(n + ENDING_PER_STEP * STEPS)]
    blocks = tuple(range(1, BLOCKS_PER_REQUEST + 1))
    started = time.perf_counter()
    for transfer_id in ids:
        tracker.hold(transfer_id, block_ids=blocks, num_prompt_tokens=4096)
    hold_us = _per_request_us(started, len(ids))
    started = time.perf_counter()
    for transfer_id in ids:
        tracker.claim(transfer_id, 0, 4096, 1, "decode-0")
    claim_us = _per_request_us(started, len(ids))
    tracker.take_finished()
    steady = []
    for step in range(STEPS):  # n stay held; a few are read and freed per step
        for transfer_id in ids[n + step * ENDING_PER_STEP : n + (step + 1) * ENDING_PER_STEP]:
            tracker.read_done(transfer_id, 0, True, "decode-0", 1)
        started = time.perf_counter()
        freed = tracker.take_finished()
        steady.append(time.perf_counter() - started)
        assert len(freed) == ENDING_PER_STEP, freed
    assert tracker.num_held == n
    idle = []
    for _ in range(STEPS):
        started = time.perf_counter()
        tracker.take_finished()
        idle.append(time.perf_counter() - started)
    return {
        "prefill_hold_us_per_request": hold_us,
        "prefill_claim_us_per_request": claim_us,
        "prefill_step_ms_steady_8_freed_median": round(statistics.median(steady) * 1e3, 4),
        "prefill_step_ms_idle_median": round(statistics.median(idle) * 1e3, 4),
    }


def _pull(i: int) -> PullOrder:
    return PullOrder(
        f"r-{i}", f"t-{i}", tuple(range(1, BLOCKS_PER_REQUEST + 1)), None, "127.0.0.1", 1
    )


def decode_costs(n: int) -> dict[str, float]:
    reports = PullReports()
    pulls = [_pull(i) for i in range(n + ENDING_PER_STEP * STEPS)]
    started = time.perf_counter()
    for pull in pulls:
        reports.admit(pull)
    admit_us = _per_request_us(started, len(pulls))
    steady = []
    for step in range(STEPS):  # n stay in flight; a few land per step
        for pull in pulls[n + step * ENDING_PER_STEP : n + (step + 1) * ENDING_PER_STEP]:
            reports.finish(pull, None)
        started = time.perf_counter()
        done, failed = reports.take_finished()
        steady.append(time.perf_counter() - started)
        assert len(done) == ENDING_PER_STEP and not failed
    idle = []
    for _ in range(STEPS):
        started = time.perf_counter()
        reports.take_finished()
        idle.append(time.perf_counter() - started)
    return {
        "decode_admit_us_per_request": admit_us,
        "decode_step_ms_steady_8_landed_median": round(statistics.median(steady) * 1e3, 4),
        "decode_step_ms_idle_median": round(statistics.median(idle) * 1e3, 4),
    }


def main() -> int:
    parser = make_parser("benchmarks.micro.bench_worker_step", __doc__)
    parser.add_argument("--requests", type=int, default=10_000, help="requests in flight")
    add_json_arg(parser)
    args = parser.parse_args()
    results = {"requests_in_flight": args.requests}
    results |= prefill_costs(args.requests)
    results |= decode_costs(args.requests)
    for key, value in results.items():
        print(f"{key:44} {value}")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
