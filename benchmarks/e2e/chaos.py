"""Chaos under load: mixed requests through the proxy while prefills die, stall and the link slows.

Two prefill instances and one decode (TP 1 each, float32 tiny model) behind one ``vam-proxy``.
Closed-loop clients send requests drawn from a seeded mix: prompt lengths, ``max_tokens``,
streamed or not, ``n`` 1 or 2, and clients that hang up after the first chunk. Meanwhile, in
order: prefill B is killed (SIGKILL) and restarted on its ports; once it is back, prefill A is
frozen (SIGSTOP) for ``freeze_s`` and thawed; then, when the instances run in network namespaces
(:mod:`vam_testing.netns`), the link between the prefill and decode hosts is
slowed with ``tc netem``. The load stops once every fault happened and ``requests`` requests
ended.

What must hold (:meth:`ChaosReport.problems`): every request answered 200 and complete equals
decode's own colocated answer, every choice (greedy for ``n`` 1, seeded sampling for ``n`` 2:
float32 agrees across P/D token for token); every other request (clients that stayed) ends
with an error body within ``request_bound_s``; decode and both prefills are alive and hold no KV
block once settled. Decode's memory growth per 1,000 requests is measured, not bounded.

``python -m benchmarks.e2e.chaos --requests 240`` runs the full version and prints the report
(``--json`` to keep it); ``tests/e2e/test_chaos.py`` runs a bounded one in CI.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import math
import os
import random
import signal
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import add_json_arg, make_parser, write_json
from benchmarks.e2e.fault_attribution import (
    UNATTRIBUTED,
    causes,
    count_by_cause,
    failed_pulls,
    fault_windows,
)
from vam_testing.netns import TwoHostNetwork, missing_requirements
from vllm_ascend_mooncake.launch.deployment import LOOPBACK, DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.ports import free_port_range
from vllm_ascend_mooncake.launch.prometheus import metric_sum, metrics_text
from vllm_ascend_mooncake.launch.servers import VllmServer, process_group_members
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

TEXT = " ".join(f"chaos{i} keeps the decode instance honest" for i in range(120))
#: prompt lengths in tokens and max_tokens drawn per request
PROMPT_LENGTHS = (12, 40, 100, 250, 450)
MAX_TOKENS = (1, 4, 16, 32)
SIDE_CHANNEL_TIMEOUT_S = 5.0
RELEASE_TIMEOUT_S = 30.0
#: the slowed link: one-way delay (ms) and rate (Mbit/s)
SLOW_LINK = (20.0, 100.0)
#: n > 1 needs sampling (vLLM refuses n > 1 with greedy); seeded, so colocated is the reference
SAMPLED = {"temperature": 0.8, "seed": 7}


def sampling(n: int) -> dict[str, Any]:
    """Greedy for one sequence, seeded sampling for several."""
    return {"n": n, **SAMPLED} if n > 1 else {"n": 1, "temperature": 0}


@dataclass(frozen=True)
class ChaosSettings:
    requests: int = 60  # requests that must end before the load stops (after every fault)
    concurrency: int = 6
    freeze_s: float = 10.0
    seed: int = 0
    #: run prefill and decode on two emulated hosts and slow the link (needs root, iproute2)
    two_hosts: bool = True
    log_dir: str | None = None

    @property
    def request_bound_s(self) -> float:
        """The longest any request may take: it may wait out the frozen prefill, then a prefill
        leg's retry on the other one and decode's claim and read timeouts (two attempts each)."""
        return self.freeze_s + 4 * SIDE_CHANNEL_TIMEOUT_S + 40.0


@dataclass
class Outcome:
    prompt_tokens: int
    max_tokens: int
    n: int
    stream: bool
    leaves: bool
    status: int = 0
    texts: list[str] = field(default_factory=list)
    error: str = ""
    complete: bool = False
    started: float = 0.0
    ended: float = 0.0

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def key(self) -> tuple[int, int, int]:
        """What decides the answer: prompt length, max_tokens, n."""
        return (self.prompt_tokens, self.max_tokens, self.n)


@dataclass
class ChaosReport:
    settings: dict[str, Any]
    two_hosts: bool
    outcomes: list[Outcome]
    wrong: list[str]
    faults: dict[str, float]  # fault -> seconds after the load started
    decode_rss_mib: tuple[float, float]  # before and after the load
    leaked: dict[str, float]  # instance -> KV cache usage still held once settled
    dead: list[str]
    #: decode's failed pulls by kind (the faults make some: each ends a request with an error)
    failed_pulls: dict[str, int] = field(default_factory=dict)
    #: errors and decode's logged failed pulls by the fault that caused them
    #: (:mod:`.fault_attribution`; "unattributed": no fault explains it)
    errors_by_fault: dict[str, int] = field(default_factory=dict)
    failed_pulls_by_fault: dict[str, int] = field(default_factory=dict)
    #: what no fault explains, one line each
    unattributed: list[str] = field(default_factory=list)

    @property
    def answered(self) -> int:
        return sum(o.complete for o in self.outcomes)

    @property
    def left(self) -> int:
        return sum(o.leaves for o in self.outcomes)

    @property
    def errors(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.leaves and not o.complete]

    @property
    def rss_growth_mib_per_1000(self) -> float:
        before, after = self.decode_rss_mib
        return (after - before) * 1000 / max(1, len(self.outcomes))

    def problems(self, request_bound_s: float) -> list[str]:
        found = [f"wrong answer: {w}" for w in self.wrong]
        found += [f"{name} is not alive" for name in self.dead]
        found += [f"{name} still holds KV ({usage:.3%})" for name, usage in self.leaked.items()]
        for o in self.outcomes:
            if o.leaves:
                continue
            if o.seconds > request_bound_s:
                found.append(f"a request took {o.seconds:.1f} s > {request_bound_s:.0f} s: {o}")
            if not o.complete and not o.error:
                found.append(f"a request ended with neither an answer nor an error: {o}")
        if self.answered == 0:
            found.append("no request was answered")
        found += [f"no fault explains {what}" for what in self.unattributed]
        return found

    def summary(self) -> str:
        statuses: dict[int, int] = {}
        samples: dict[int, str] = {}  # one error body per status, to tell what they were
        for o in self.errors:
            statuses[o.status] = statuses.get(o.status, 0) + 1
            samples.setdefault(o.status, o.error[:200])
        slowest = max((o.seconds for o in self.outcomes if not o.leaves), default=0.0)
        return (
            f"chaos: {len(self.outcomes)} requests ({self.answered} answered, {self.left} "
            f"clients left, {len(self.errors)} errors by status {statuses}), slowest "
            f"{slowest:.1f} s; faults at {self.faults}; decode RSS "
            f"{self.decode_rss_mib[0]:.0f} -> {self.decode_rss_mib[1]:.0f} MiB "
            f"({self.rss_growth_mib_per_1000:+.1f} MiB per 1,000 requests); failed pulls by "
            f"kind {self.failed_pulls}; errors by fault {self.errors_by_fault}, failed pulls by "
            f"fault {self.failed_pulls_by_fault}; "
            f"{'two hosts, link slowed' if self.two_hosts else 'loopback, no link fault'}"
            + "".join(f"\n  HTTP {status}: {body}" for status, body in samples.items())
        )


def rss_mib(pgid: int) -> float:
    """Resident memory of a process group, in MiB."""
    total_kib = 0
    for pid in process_group_members(pgid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
    return total_kib / 1024


def kv_usage(url: str) -> float:
    return metric_sum(metrics_text(url), "vllm:kv_cache_usage_perc")


class Client:
    """One request of the mix, sent to the proxy and recorded as an :class:`Outcome`."""

    def __init__(self, proxy_url: str, name: str, ids: list[int], timeout_s: float) -> None:
        self._url, self._name, self._ids, self._timeout_s = proxy_url, name, ids, timeout_s

    def body(self, o: Outcome) -> dict[str, Any]:
        return {
            "model": self._name,
            "prompt": self._ids[: o.prompt_tokens],
            "max_tokens": o.max_tokens,
            **sampling(o.n),
            "ignore_eos": True,
            "stream": o.stream,
            "cache_salt": uuid.uuid4().hex,  # every request pulls its whole prompt
        }

    def send(self, o: Outcome) -> Outcome:
        o.started = time.monotonic()
        try:
            if o.leaves:
                self._leave(o)
            elif o.stream:
                self._stream(o)
            else:
                response = httpx.post(
                    f"{self._url}/v1/completions", json=self.body(o), timeout=self._timeout_s
                )
                o.status = response.status_code
                if o.status == 200:
                    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
                    o.texts = [c["text"] for c in choices]
                    o.complete = len(o.texts) == o.n
                else:
                    o.error = response.text[:300] or f"HTTP {o.status} without a body"
        except httpx.HTTPError as exc:
            o.error = f"{type(exc).__name__}: {exc}"
        o.ended = time.monotonic()
        return o

    def _stream(self, o: Outcome) -> None:
        texts = [""] * o.n
        done = False
        with httpx.stream(
            "POST", f"{self._url}/v1/completions", json=self.body(o), timeout=self._timeout_s
        ) as response:
            o.status = response.status_code
            if o.status != 200:
                o.error = response.read().decode(errors="replace")[:300] or f"HTTP {o.status}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    o.error = data[:300]
                    return
                for choice in chunk.get("choices", []):
                    texts[choice["index"]] += choice.get("text", "")
        o.texts, o.complete = texts, done
        if not done:
            o.error = "the stream ended without [DONE]"

    def _leave(self, o: Outcome) -> None:
        """Stream, and hang up once the first bytes of the answer arrive (or after 2 s)."""
        address = httpx.URL(self._url)
        payload = json.dumps(self.body(o)).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {address.host}:{address.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        with socket.create_connection((address.host, address.port), timeout=2.0) as sock:
            sock.sendall(head.encode() + payload)
            with contextlib.suppress(OSError):
                sock.recv(1)
        o.status = -1  # the client left


def draw(rng: random.Random) -> Outcome:
    leaves = rng.random() < 0.1
    return Outcome(
        prompt_tokens=rng.choice(PROMPT_LENGTHS),
        max_tokens=rng.choice(MAX_TOKENS),
        n=1 if rng.random() < 0.8 else 2,
        stream=leaves or rng.random() < 0.5,
        leaves=leaves,
    )


def set_session_priority(pgid: int, nice: int) -> None:
    """Nice a server's process group and, where the kernel groups CPU time by session
    (autogroup: every server runs in a session of its own, and sessions share the CPUs
    equally whatever their processes' nice values), its session's group."""
    os.setpriority(os.PRIO_PGRP, pgid, nice)
    autogroup = Path(f"/proc/{pgid}/autogroup")
    if autogroup.exists():
        autogroup.write_text(str(nice))


@contextlib.contextmanager
def booting_first(pgid: int):
    """Raise a starting instance above the load while it starts (as root; else nothing
    changes): on a small machine the load otherwise starves the start-up (a TP 1 prefill took
    66-69 s instead of ~20 s beside six clients on two cores, its session one of five sharing
    them) and the scenario lasts as long as that start-up. Back to the default once it answers."""
    try:
        set_session_priority(pgid, -10)
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            set_session_priority(pgid, 0)


def run_chaos(settings: ChaosSettings) -> ChaosReport:
    """Deploy, load, inject the faults, settle and check; see the module docstring."""
    two_hosts = settings.two_hosts and missing_requirements() is None
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2, dtype="float32")))
    spec = DeploymentSpec(
        model=model,
        prefill_tp=1,
        decode_tp=1,
        release_timeout_s=RELEASE_TIMEOUT_S,
        extra_connector_config={"side_channel_timeout_s": SIDE_CHANNEL_TIMEOUT_S},
        log_dir=settings.log_dir,
    )
    with contextlib.ExitStack() as stack:
        network = stack.enter_context(TwoHostNetwork()) if two_hosts else None
        pd = LocalDeployment(
            spec,
            prefill_host=network.prefill if network else LOOPBACK,
            decode_host=network.decode if network else LOOPBACK,
        )
        b_side_channel = free_port_range(1)
        prefill_b = pd.add_server("kv_producer", name="prefill-b", side_channel_port=b_side_channel)
        servers: dict[str, VllmServer] = {"prefill-b": prefill_b}
        stack.callback(lambda: servers["prefill-b"].stop())  # B's restarted incarnation
        stack.callback(pd.stop)
        pd.start()
        proxy_url = pd.add_proxy("--prefill", prefill_b.base_url)
        decode = pd.decode.base_url
        name = httpx.get(f"{decode}/v1/models", timeout=60).json()["data"][0]["id"]
        ids = httpx.post(
            f"{decode}/tokenize", json={"model": name, "prompt": TEXT}, timeout=60
        ).json()["tokens"]
        reference = {
            (length, tokens, n): [
                c["text"]
                for c in sorted(
                    httpx.post(
                        f"{decode}/v1/completions",
                        json={
                            "model": name,
                            "prompt": ids[:length],
                            "max_tokens": tokens,
                            **sampling(n),
                            "ignore_eos": True,
                            "cache_salt": "colocated",
                        },
                        timeout=120,
                    ).json()["choices"],
                    key=lambda c: c["index"],
                )
            ]
            for length in PROMPT_LENGTHS
            for tokens in MAX_TOKENS
            for n in (1, 2)
        }
        client = Client(proxy_url, name, ids, timeout_s=2 * settings.request_bound_s)
        for _ in range(4):  # the proxy learns both prefills before the faults
            client.send(Outcome(40, 4, 1, False, False))
        rss_before = rss_mib(pd.decode.pid)

        rng = random.Random(settings.seed)
        outcomes: list[Outcome] = []
        faults: dict[str, float] = {}
        faults_done = threading.Event()
        lock = threading.Lock()
        load_started = time.monotonic()
        load_started_wall = datetime.datetime.now()

        def worker() -> None:
            while not (faults_done.is_set() and len(outcomes) >= settings.requests):
                with lock:
                    o = draw(rng)
                client.send(o)
                with lock:
                    outcomes.append(o)

        def since() -> float:
            """Seconds since the load started, to a tenth, rounded down (a fault's start is
            never stamped after the fault began)."""
            return math.floor((time.monotonic() - load_started) * 10) / 10

        def wait_ended(count: int) -> None:
            while len(outcomes) < count:
                time.sleep(0.1)

        def inject() -> None:
            try:
                wait_ended(settings.requests // 5)
                # Each fault is stamped as it begins (before the signal), so a request it
                # breaks at once ends inside its window.
                faults["prefill B killed"] = since()
                os.killpg(servers["prefill-b"].pid, signal.SIGKILL)
                servers["prefill-b"].stop()
                restarted = pd.make_server(
                    "kv_producer",
                    port=prefill_b.port,
                    name="prefill-b-2",
                    side_channel_port=b_side_channel,
                )
                servers["prefill-b"] = restarted
                restarted.start()
                with booting_first(restarted.pid):
                    restarted.wait_ready()
                faults["prefill B back"] = since()
                wait_ended(len(outcomes) + settings.requests // 5)
                faults["prefill A frozen"] = since()
                os.killpg(pd.prefill.pid, signal.SIGSTOP)
                time.sleep(settings.freeze_s)
                os.killpg(pd.prefill.pid, signal.SIGCONT)
                faults["prefill A thawed"] = since()
                if network is not None:
                    wait_ended(len(outcomes) + settings.requests // 5)
                    faults["link slowed"] = since()
                    network.set_link(*SLOW_LINK)
                    wait_ended(len(outcomes) + settings.requests // 5)
            finally:
                faults_done.set()

        with concurrent.futures.ThreadPoolExecutor(settings.concurrency + 1) as pool:
            injector = pool.submit(inject)
            clients = [pool.submit(worker) for _ in range(settings.concurrency)]
            injector.result()
            for future in clients:
                future.result()
        load_end = since()
        if network is not None:
            network.set_link(0.0, None)

        wrong = [
            f"{o.prompt_tokens}-token prompt, {o.max_tokens} tokens, n={o.n}, "
            f"stream={o.stream}: {o.texts!r} vs {reference[o.key]!r}"
            for o in outcomes
            if o.complete and o.texts != reference[o.key]
        ]
        instances = {
            "decode": pd.decode,
            "prefill A": pd.prefill,
            "prefill B": servers["prefill-b"],
        }
        dead = [
            role
            for role, server in instances.items()
            if not server.is_running()
            or httpx.get(f"{server.base_url}/health", timeout=30).status_code != 200
        ]
        deadline = time.monotonic() + RELEASE_TIMEOUT_S + 30
        leaked: dict[str, float] = {}
        for role, server in instances.items():
            if role in dead:
                continue
            while (usage := kv_usage(server.base_url)) > 0 and time.monotonic() < deadline:
                time.sleep(0.5)
            if usage > 0:
                leaked[role] = usage
        rss_after = rss_mib(pd.decode.pid)
        failed_pulls = pd.failed_pulls_by_kind()
        decode_log = pd.decode.log_path.read_text(errors="replace")
    report = ChaosReport(
        asdict(settings),
        two_hosts,
        outcomes,
        wrong,
        faults,
        (rss_before, rss_after),
        leaked,
        dead,
        failed_pulls,
    )
    attribute(report, load_started, load_started_wall, load_end, decode_log)
    return report


#: How long after a fault ends it may still cause errors: a claim's and a read's timeouts, two
#: attempts each, and some slack.
FAULT_LAG_S = 4 * SIDE_CHANNEL_TIMEOUT_S + 10.0


def attribute(
    report: ChaosReport,
    load_started: float,
    load_started_wall: datetime.datetime,
    load_end: float,
    decode_log: str,
) -> None:
    """Fill in which fault caused each error and each of decode's failed pulls."""
    windows = fault_windows(report.faults, load_end, FAULT_LAG_S)
    lifetimes = [(o.started - load_started, o.ended - load_started) for o in report.errors]
    report.errors_by_fault = count_by_cause(lifetimes, windows)
    pulls = failed_pulls(decode_log, load_started_wall)
    report.failed_pulls_by_fault = count_by_cause(
        [(pull.seconds - 1, pull.seconds + 1) for pull in pulls],
        windows,  # whole-second stamps
    )
    for o, (start, end) in zip(report.errors, lifetimes, strict=True):
        if causes(start, end, windows) == [UNATTRIBUTED]:
            report.unattributed.append(f"an error at {start:.1f}-{end:.1f} s: {o}")
    for pull in pulls:
        if causes(pull.seconds - 1, pull.seconds + 1, windows) == [UNATTRIBUTED]:
            report.unattributed.append(
                f"a failed pull at {pull.seconds:.0f} s ({pull.kind}): {pull.reason[:200]}"
            )


def main() -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--freeze-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loopback", action="store_true", help="no namespaces, no link fault")
    add_json_arg(parser, "the report")
    args = parser.parse_args()
    settings = ChaosSettings(
        requests=args.requests,
        concurrency=args.concurrency,
        freeze_s=args.freeze_s,
        seed=args.seed,
        two_hosts=not args.loopback,
    )
    report = run_chaos(settings)
    print(report.summary())
    for problem in report.problems(settings.request_bound_s):
        print("PROBLEM:", problem)
    if args.json:
        write_json(args.json, {**asdict(report), "summary": report.summary()})


if __name__ == "__main__":
    main()
