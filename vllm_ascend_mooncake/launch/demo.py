"""One command, a whole P/D deployment: tiny model, prefill TP 2 -> decode TP 1, proxy, requests.

    python -m vllm_ascend_mooncake.launch.demo [--prefill-tp 2] [--decode-tp 1] [--model DIR]
                                               [--prompt TEXT] [--keep-running]

Without ``--model`` a tiny random Llama (8 query heads, 2 KV heads, so TP 2 -> 1 merges heads from
two prefill ranks) is built locally. The demo sends the prompt twice (the second time the proxy
overlaps the prefill and decode legs), prints each answer with its latency and the KV-transfer
statistics the decode instance logged, then stops everything.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.request

from .deployment import DeploymentSpec, LocalDeployment
from .tiny_model import TinyModelSpec, build_tiny_model

DEFAULT_PROMPT = (
    "Prefill and decode run on different instances: the decode instance pulls the prompt's "
    "KV cache over Mooncake and continues the text"
)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the servers like Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--model", help="model directory (default: a locally built tiny model)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--keep-running", action="store_true", help="serve until Ctrl-C")
    parser.add_argument("--log-dir", help="where the instances write their logs")
    args = parser.parse_args(argv)

    model = args.model or str(build_tiny_model(TinyModelSpec(num_kv_heads=2)))
    spec = DeploymentSpec(
        model=model, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, log_dir=args.log_dir
    )
    deployment = LocalDeployment(spec)
    print(f"[demo] model {model}")
    print(
        f"[demo] starting prefill (TP {spec.prefill_tp}) and decode (TP {spec.decode_tp}); "
        f"logs in {deployment.log_dir}",
        flush=True,
    )
    try:
        seconds = deployment.start()
        print(f"[demo] ready after {seconds:.0f} s; proxy at {deployment.proxy_url}", flush=True)
        models = json.loads(urllib.request.urlopen(f"{deployment.proxy_url}/v1/models").read())
        served = models["data"][0]["id"]
        body = {
            "model": served,
            "prompt": args.prompt,
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }
        print(f"[demo] prompt: {args.prompt!r}")
        # The proxy learns the prefill's address from the first answer; from the second request
        # on it sends the prefill and decode legs at once. A new cache_salt keeps the decode
        # from reusing the first request's prompt blocks, so it pulls again.
        for label, salt in (
            ("first, legs in turn", "demo-1"),
            ("second, legs overlapped", "demo-2"),
        ):
            request = urllib.request.Request(
                f"{deployment.proxy_url}/v1/completions",
                data=json.dumps({**body, "cache_salt": salt}).encode(),
                headers={"Content-Type": "application/json"},
            )
            started = time.monotonic()
            with urllib.request.urlopen(request, timeout=600) as response:
                answer = json.loads(response.read())
            elapsed = time.monotonic() - started
            print(f"[demo] answer ({label}, {elapsed:.2f} s): {answer['choices'][0]['text']!r}")
        if not args.model:
            print("[demo] (the tiny model has random weights: its text is noise by design)")
        time.sleep(2.5)  # the decode instance logs transfer metrics every second
        metrics = deployment.transfer_metrics()
        print(f"[demo] KV transfer: {metrics or 'no metrics logged (see decode.log)'}")
        totals = deployment.transfer_totals()
        expected = 2 * spec.decode_tp  # each request, on every decode rank
        print(
            f"[demo] pulls: {totals['successful']} successful (expected {expected}: 2 requests x "
            f"{spec.decode_tp} decode rank(s)), {totals['failed']} failed"
        )
        if totals["successful"] != expected or totals["failed"]:
            print("[demo] error: not every KV pull succeeded (see decode.log)", file=sys.stderr)
            return 1
        if args.keep_running:
            print(f"[demo] serving at {deployment.proxy_url}; Ctrl-C stops everything", flush=True)
            while True:
                time.sleep(3600)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        print("[demo] stopping", flush=True)
        deployment.stop()


if __name__ == "__main__":
    sys.exit(main())
