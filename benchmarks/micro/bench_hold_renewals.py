"""What the proxy's hold renewals cost: one ``KeepHold`` per kept transfer and prefill worker.

Real prefill side channels (``PrefillSender`` on loopback, one per TP rank, each holding every
transfer) and the proxy's ``HoldKeeper`` on its own event loop thread. ``--transfers`` transfers
are kept on ``--tp`` workers with a short release timeout (so renewals come every third of it)
for ``--seconds``; reported: renewals answered, the proxy's CPU per renewal (its event loop
thread), the rest of the process's CPU per renewal (the prefill side channels' threads and ZMQ's
I/O threads), and what that means at the default release timeout (a renewal per transfer and
worker every ``release_timeout_s / 3``). Renewals are not batched: each is one exchange of one
transfer id with one worker (issue #43 item g measured it instead).

    python -m benchmarks.micro.bench_hold_renewals [--transfers 500] [--tp 4] [--json out.json]
"""

from __future__ import annotations

import asyncio
import threading
import time

from benchmarks.common import add_json_arg, make_parser, write_json
from vam_testing.datapath_cases import worker_metadata
from vllm_ascend_mooncake.connector.config import ConnectorConfig
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.prefill_service import PrefillSender
from vllm_ascend_mooncake.datapath.sender import SendTracker
from vllm_ascend_mooncake.launch.ports import free_port_range
from vllm_ascend_mooncake.options import default_of
from vllm_ascend_mooncake.proxy import holds
from vllm_ascend_mooncake.proxy.holds import HoldKeeper

DEFAULT_RELEASE_TIMEOUT_S = default_of(ConnectorConfig, "release_timeout_s")

HOST = "127.0.0.1"


def prefill_workers(tp: int, transfers: int, release_timeout_s: float) -> tuple[int, list]:
    port = free_port_range(tp)
    senders = []
    for rank in range(tp):
        tracker = SendTracker(TransferTopology(4, tp, 1), rank, release_timeout_s)
        metadata = worker_metadata(
            engine_id="prefill", tp_rank=rank, tp_size=tp, transport_session="s"
        )
        senders.append(PrefillSender(metadata, tracker, HOST, port + rank))
        for index in range(transfers):
            tracker.hold(f"t{index}")
    return port, senders


def main() -> int:
    parser = make_parser("benchmarks.micro.bench_hold_renewals", __doc__)
    parser.add_argument("--transfers", type=int, default=500, help="kept transfers")
    parser.add_argument("--tp", type=int, default=4, help="prefill TP size (workers)")
    parser.add_argument("--release-timeout-s", type=float, default=1.5, help="prefill's")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long to keep them")
    add_json_arg(parser)
    args = parser.parse_args()
    holds.MIN_RENEW_PAUSE_S = 0.0
    port, senders = prefill_workers(args.tp, args.transfers, args.release_timeout_s)
    measured: dict = {}

    async def keep() -> None:
        keeper = HoldKeeper()
        cpu, wall = time.thread_time(), time.perf_counter()
        for index in range(args.transfers):
            keeper.keep(
                {
                    "remote_request_id": f"t{index}",
                    "remote_engine_id": "prefill",
                    "remote_host": HOST,
                    "remote_port": port,
                    "remote_tp_size": args.tp,
                }
            )
        await asyncio.sleep(args.seconds)
        measured["proxy_cpu_s"] = time.thread_time() - cpu
        measured["wall_s"] = time.perf_counter() - wall
        measured["renewals"] = keeper.renewals
        await keeper.close()

    process_cpu = time.process_time()
    loop_thread = threading.Thread(target=asyncio.run, args=(keep(),))
    loop_thread.start()
    loop_thread.join()
    other_cpu_s = time.process_time() - process_cpu - measured["proxy_cpu_s"]
    for sender in senders:
        sender.close()
    renewals = measured["renewals"]
    proxy_us = 1e6 * measured["proxy_cpu_s"] / renewals
    other_us = 1e6 * other_cpu_s / renewals
    # at the default release timeout: a renewal per transfer and worker every third of it
    per_kept_transfer_per_s = args.tp / (DEFAULT_RELEASE_TIMEOUT_S / 3)
    results = {
        "transfers": args.transfers,
        "tp": args.tp,
        "release_timeout_s": args.release_timeout_s,
        "renewals": renewals,
        "renewals_per_s": renewals / measured["wall_s"],
        "proxy_cpu_us_per_renewal": proxy_us,
        "prefill_side_cpu_us_per_renewal": other_us,
        "default_release_timeout_s": DEFAULT_RELEASE_TIMEOUT_S,
        "proxy_cpu_share_per_1000_kept_transfers": 1000 * per_kept_transfer_per_s * proxy_us / 1e6,
    }
    for key, value in results.items():
        print(f"{key:45} {value:.4g}" if isinstance(value, float) else f"{key:45} {value}")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
