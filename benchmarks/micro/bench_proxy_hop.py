"""What the proxy's hop costs a streamed request's first token, without any engine.

Two fake vLLM instances (``tests/proxy/fake_vllm.py``, answering as the tiny engine and as our
connector's prefill, each in a process of its own) and ``vam-proxy`` as deployed (its own
process, ``--log-level info``). One client sends streamed completions one at a time, alternating
between the proxy (the default route: prefill's token first, decode continuing) and the fake
prefill directly (one hop, the colocated analogue), and times the first chunk with a choice.
The difference of the medians is the proxy's hop, both ways, with everything it does on the
way (its prefill leg, reading prefill's stream, the checks, writing the client's first chunk).

    PYTHONPATH=. python -m benchmarks.micro.bench_proxy_hop [--requests 300] [--baseline-tree DIR]

``--baseline-tree DIR`` runs a second proxy from another checkout (e.g. the main branch's) whose
requests are interleaved with this tree's, so the two are compared under the same load. Each
proxy's ``request timeline`` lines (``VAM_TIMELINE_LOG=1``) are joined with the client's send and
first-chunk times: the median ms after the client sent per stamp, and the median step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from vllm_ascend_mooncake.timeline import parse_timeline_line

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Hello there, " * 40


def _serve_fake(name: str, port: int) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "proxy"))
    from fake_vllm import FakeVllm
    from loopback_server import serve_on_loopback

    fake = FakeVllm(name)
    fake.generates = True
    fake.hands_off_like_the_connector = True
    with serve_on_loopback(fake.app(), port):
        signal.sigwait({signal.SIGTERM})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not start")


def first_chunk_ms(
    client: httpx.Client, url: str, body: dict, stamps: dict[str, tuple[float, float]] | None = None
) -> float:
    """Milliseconds to the first event with a choice (as vLLM's client counts TTFT);
    ``stamps`` gets the request's id -> (wall clock sent, first chunk)."""
    request_id = f"hop-{time.time_ns()}"
    sent = time.time()
    started = time.perf_counter()
    headers = {"X-Request-Id": request_id}
    with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        first = None
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                first = 1e3 * (time.perf_counter() - started)
        assert first is not None
        if stamps is not None:
            stamps[request_id] = (sent, sent + first / 1e3)
        return first


def _start_proxy(
    tree: Path, port: int, prefill: str, decode: str, log_path: Path, extra: list[str]
) -> subprocess.Popen[bytes]:
    """``vam-proxy`` of the source tree ``tree``, as deployed (``--log-level info``)."""
    command = [sys.executable, "-m", "vllm_ascend_mooncake.proxy", "--prefill", prefill]
    command += ["--decode", decode, "--port", str(port), *extra]
    env = {**os.environ, "PYTHONPATH": str(tree), "VAM_TIMELINE_LOG": "1"}
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="per target")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="also a proxy from this source tree (another checkout), its requests interleaved",
    )
    parser.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="an argument for this tree's proxy only (repeat), e.g. --proxy-arg=--no-access-log",
    )
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    trees = {"proxy": ROOT}
    if args.baseline_tree is not None:
        trees["baseline"] = args.baseline_tree.resolve()
    ports = {name: _free_port() for name in ("prefill", "decode", *trees)}
    fakes = [ctx.Process(target=_serve_fake, args=(n, ports[n])) for n in ("prefill", "decode")]
    for fake in fakes:
        fake.start()
    prefill, decode = (f"http://127.0.0.1:{ports[n]}" for n in ("prefill", "decode"))
    urls = {"direct": prefill} | {name: f"http://127.0.0.1:{ports[name]}" for name in trees}
    logs = {name: args.log_dir / f"bench_proxy_hop_{name}.log" for name in trees}
    servers = [
        _start_proxy(
            tree, ports[name], prefill, decode, logs[name], args.proxy_arg if tree == ROOT else []
        )
        for name, tree in trees.items()
    ]
    stamps: dict[str, dict[str, tuple[float, float]]] = {name: {} for name in trees}
    try:
        for url in (decode, *urls.values()):
            _wait_ready(url)
        body = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "stream": True,
        }
        times: dict[str, list[float]] = {name: [] for name in urls}
        with httpx.Client(timeout=30) as client:
            for _ in range(5):  # warm-up: the proxy learns prefill's address, caches fill
                for url in urls.values():
                    first_chunk_ms(client, url, body)
            for _ in range(args.requests):
                for name, url in urls.items():
                    times[name].append(first_chunk_ms(client, url, body, stamps.get(name)))
        for name, values in times.items():
            q = statistics.quantiles(values, n=4)
            print(
                f"{name:8} first chunk p50 {statistics.median(values):6.2f} ms "
                f"(p25 {q[0]:.2f}, p75 {q[2]:.2f}), {len(values)} requests"
            )
        for name in trees:
            hop = statistics.median(times[name]) - statistics.median(times["direct"])
            print(f"{name}'s hop (difference of the medians): {hop:.2f} ms")
    finally:
        for server in servers:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=30)
        for fake in fakes:
            fake.terminate()
            fake.join(timeout=10)
    for name in trees:
        print(f"{name}:")
        _print_stamps(stamps[name], logs[name])


def _print_stamps(client_stamps: dict[str, tuple[float, float]], log: Path) -> None:
    """Per proxy timeline stamp (the proxy's log), ms after the client sent (median) and the
    median step from the stamp before it (per request)."""
    records: list[dict[str, float]] = []
    for line in log.read_text().splitlines():
        record = parse_timeline_line(line)
        if record is None:
            continue
        request_id = record["transfer"].rsplit("-", 1)[0]
        if request_id in client_stamps:
            sent, first = client_stamps[request_id]
            stamps = {**record["stamps"], "client.first_chunk": first}
            records.append({name: 1e3 * (at - sent) for name, at in stamps.items()})
    names = sorted(
        {name for record in records for name in record},
        key=lambda name: statistics.median(r[name] for r in records if name in r),
    )
    print("per stamp: ms after the client sent (median); median step from the stamp before")
    previous = None
    for name in names:
        offsets = [r[name] for r in records if name in r]
        steps = [r[name] - r[previous] for r in records if name in r and previous in r]
        step = statistics.median(steps) if steps else statistics.median(offsets)
        print(f"  {name:24} {statistics.median(offsets):7.2f}  step {step:6.2f}  n {len(offsets)}")
        previous = name


if __name__ == "__main__":
    main()
