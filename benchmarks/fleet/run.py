"""The coordinator: builds a fleet of host processes, plays a request stream against it, injects
faults, samples every process, and turns what it saw into one result per shape and size.

Shapes: ``fan-in`` (one decode worker pulling from N prefill workers) and ``fan-out`` (one prefill
worker serving M decode workers). A request is routed to one prefill and one decode worker; it
arrives (Poisson, ``--rate``), prefill holds its blocks and decode pulls them; an early pull
(overlapped legs) is submitted ``--early-delay-ms`` before prefill registers the hold; an aborted
request is either dropped by prefill before its hold (an early one) or cancelled by decode just
after its pull was submitted.

Faults (fan-in with at least 4 prefill workers, unless ``--no-faults``): one prefill worker, alone
in its process, is killed (SIGKILL) at 30 % of the stream (the router stops sending it requests;
decode's transport is told its session is unreachable); another, alone in its process, is frozen
(SIGSTOP) at 45 % for ``--freeze-s`` seconds (the router keeps sending it requests: it cannot know);
and one is replaced at 60 %: its side channel closes and it comes back under a new port and
incarnation (the router sends later requests to the new address). A failed pull is attributed to
a fault when it went to the faulty worker, or to the abort it was part of; every other failed pull
is unattributed.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

from .workers import Geometry, HostProcess, Timing

SHAPES = ("fan-in", "fan-out")
_TICK_S = 0.01


@dataclass
class Request:
    index: int
    arrival: float
    prefill: int
    decode: int
    tokens: int
    remote: tuple[int, ...]
    local: tuple[int, ...]
    early: bool
    abort: bool
    port: int = 0  # the prefill worker's port it was sent to
    incarnation: int = 0  # the prefill worker's generation it was sent to (replaced pods)
    held_skipped: bool = False

    @property
    def request_id(self) -> str:
        return f"r{self.index}"

    @property
    def transfer_id(self) -> str:
        return f"t{self.index}"


@dataclass
class Settings:
    shape: str
    size: int
    requests: int
    rate: float
    early_fraction: float
    abort_fraction: float
    min_tokens: int
    max_tokens: int
    early_delay_s: float
    faults: bool
    freeze_s: float
    workers_per_host: int
    seed: int
    drain_s: float
    idle_cpu_s: float = 2.0  # before the stream: how long the idle fleet's CPU is measured
    idle_s: float = 0.0  # after the run: wait this long with no traffic, then sample again
    log_level: str = "ERROR"
    timing: Timing = field(default_factory=Timing)
    geometry: Geometry = field(default_factory=Geometry)


# -- /proc sampling -----------------------------------------------------------------------------


def proc_sample(pid: int) -> tuple[int, int, int] | None:
    """(threads, open fds, RSS bytes) of ``pid``, or None when it is gone."""
    try:
        threads = rss = 0
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Threads:"):
                    threads = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return threads, fds, rss
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def fd_kinds(pid: int) -> dict[str, int]:
    """``pid``'s open file descriptors by kind (socket, pipe, anon_inode:[eventpoll], ...)."""
    counts: dict[str, int] = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError):
        return counts
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        kind = target.split(":[")[0] if ":[" in target else "file"
        if target.startswith("anon_inode:"):
            kind = target
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def time_wait(ports: set[int]) -> int:
    """Loopback TCP connections in TIME_WAIT with one end on one of ``ports`` (connections this
    fleet closed in the last minute: how often its sockets reconnect)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    if fields[3] != "06":  # TIME_WAIT
                        continue
                    local = int(fields[1].rsplit(":", 1)[1], 16)
                    remote = int(fields[2].rsplit(":", 1)[1], 16)
                    count += local in ports or remote in ports
        except (FileNotFoundError, StopIteration):
            continue
    return count


def proc_cpu_s(pid: int) -> float | None:
    """User plus system CPU seconds ``pid`` used so far (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (FileNotFoundError, ProcessLookupError):
        return None


class Sampler:
    """Samples every host process every ``period_s`` on a thread of the coordinator."""

    def __init__(self, hosts: list[HostProcess], period_s: float = 0.2) -> None:
        self.hosts = hosts
        self.samples: dict[str, list[tuple[int, int, int]]] = {h.label: [] for h in hosts}
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self.sample()

    def sample(self) -> dict[str, tuple[int, int, int]]:
        now = {}
        for host in self.hosts:
            if not host.alive:
                continue
            sample = proc_sample(host.pid)
            if sample is not None:
                self.samples[host.label].append(sample)
                now[host.label] = sample
        return now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- the stream ---------------------------------------------------------------------------------


def make_requests(s: Settings, prefills: int, decodes: int) -> list[Request]:
    rng = random.Random(s.seed)
    g = s.geometry
    requests, t = [], 0.0
    for index in range(s.requests):
        t += rng.expovariate(s.rate)
        tokens = rng.randint(s.min_tokens, s.max_tokens)
        blocks = min(math.ceil(tokens / g.block_size), g.prefill_blocks, g.decode_blocks)
        tokens = min(tokens, blocks * g.block_size)
        early = rng.random() < s.early_fraction
        requests.append(
            Request(
                index=index,
                arrival=t,
                prefill=rng.randrange(prefills),
                decode=rng.randrange(decodes),
                tokens=tokens,
                remote=tuple(sorted(rng.sample(range(g.prefill_blocks), blocks))),
                local=tuple(sorted(rng.sample(range(g.decode_blocks), blocks))),
                early=early,
                abort=rng.random() < s.abort_fraction,
            )
        )
    return requests


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "p50_ms": None, "p99_ms": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"n": len(ordered), "p50_ms": at(0.50), "p99_ms": at(0.99), "max_ms": at(1.0)}


class Fleet:
    """The host processes of one shape and size, and where each worker lives."""

    def __init__(self, s: Settings) -> None:
        from vllm_ascend_mooncake.launch.ports import free_port_range

        self.s = s
        fan_in = s.shape == "fan-in"
        self.num_prefill = s.size if fan_in else 1
        self.num_decode = 1 if fan_in else s.size
        self.faults = s.faults and fan_in and self.num_prefill >= 4
        base = free_port_range(self.num_prefill)
        self.ports = [base + i for i in range(self.num_prefill)]
        self.incarnations = [0] * self.num_prefill
        self.sessions: list[str] = [""] * self.num_prefill
        self.prefill_host: list[HostProcess] = []  # per prefill worker
        self.decode_host: list[HostProcess] = []  # per decode worker
        self.hosts: list[HostProcess] = []
        # the fault victims: kill and freeze alone in their processes, replace among the others
        self.kill, self.freeze, self.replace = (0, 1, 2) if self.faults else (-1, -1, -1)
        groups: list[list[int]] = []
        regular = list(range(self.num_prefill))
        if self.faults:
            groups += [[self.kill], [self.freeze]]
            regular = regular[2:]
        per = s.workers_per_host
        groups += [regular[i : i + per] for i in range(0, len(regular), per)]
        for n, group in enumerate(groups):
            host = HostProcess("prefill", f"prefill-{n}", s.geometry, s.timing, s.log_level)
            self.hosts.append(host)
            self.prefill_host += [host] * len(group)
        self._prefill_groups = groups
        decode_groups = [
            list(range(i, min(i + per, self.num_decode))) for i in range(0, self.num_decode, per)
        ]
        for n, group in enumerate(decode_groups):
            host = HostProcess("decode", f"decode-{n}", s.geometry, s.timing, s.log_level)
            self.hosts.append(host)
            self.decode_host += [host] * len(group)
        self._decode_groups = decode_groups
        self.workers = {h.label: 0 for h in self.hosts}

    def start(self) -> None:
        for host, group in zip(self.hosts, self._prefill_groups, strict=False):
            host.send("start", [(f"p{i}", self.ports[i]) for i in group])
        decode_hosts = self.hosts[len(self._prefill_groups) :]
        for host, group in zip(decode_hosts, self._decode_groups, strict=True):
            host.send("start", [f"d{i}" for i in group])
        for host, group in zip(self.hosts, self._prefill_groups, strict=False):
            for i, session in zip(group, host.receive(300), strict=True):
                self.sessions[i] = session
            self.workers[host.label] = len(group)
        for host, group in zip(decode_hosts, self._decode_groups, strict=True):
            host.receive(300)
            self.workers[host.label] = len(group)

    def close(self) -> None:
        for host in self.hosts:
            if host.alive and host.process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(host.pid, signal.SIGCONT)
        for host in self.hosts:
            host.close()


def _broadcast(batches: dict[HostProcess, tuple[str, list]]) -> None:
    """Send each host its batch, then wait for every answer."""
    for host, (command, items) in batches.items():
        host.send(command, items)
    for host in batches:
        host.receive()


def run_point(s: Settings, log=print) -> dict:
    """Build the fleet for one shape and size, play the stream, and measure."""
    setup_started = time.monotonic()
    fleet = Fleet(s)
    try:
        fleet.start()
        return _play(s, fleet, setup_started, log)
    finally:
        fleet.close()


def _play(s: Settings, fleet: Fleet, setup_started: float, log) -> dict:
    from vllm_ascend_mooncake.launch.ports import free_port_range

    requests = make_requests(s, fleet.num_prefill, fleet.num_decode)
    setup_s = time.monotonic() - setup_started
    sampler = Sampler(fleet.hosts)
    # what the fleet costs with no traffic (side channels' polls, the harness's step threads):
    # on one host every simulated worker's idle cost adds up, in production each has its own
    idle_before = {h.label: proc_cpu_s(h.pid) or 0.0 for h in fleet.hosts}
    time.sleep(s.idle_cpu_s)
    idle_cpu = {
        h.label: ((proc_cpu_s(h.pid) or 0.0) - idle_before[h.label]) / s.idle_cpu_s
        for h in fleet.hosts
    }
    setup_samples = sampler.sample()
    cpu_start = {h.label: proc_cpu_s(h.pid) or 0.0 for h in fleet.hosts}
    ports_ever = set(fleet.ports)
    sampler.start()
    duration = requests[-1].arrival if requests else 0.0
    # events: (time, order, kind, request); order keeps holds before pulls at the same time
    events: list[tuple[float, int, str, Request]] = []
    rng = random.Random(s.seed + 1)
    for r in requests:
        if r.early:
            events.append((r.arrival, 1, "pull", r))
            events.append((r.arrival + s.early_delay_s, 0, "drop" if r.abort else "hold", r))
        else:
            events.append((r.arrival, 0, "hold", r))
            events.append((r.arrival, 1, "pull", r))
            if r.abort:
                events.append((r.arrival + rng.uniform(0, 0.005), 2, "cancel", r))
    events.sort(key=lambda e: (e[0], e[1], e[3].index))
    faults: list[dict] = []
    plan = []
    if fleet.faults:
        plan = [
            (0.30 * duration, "kill"),
            (0.45 * duration, "freeze"),
            (0.45 * duration + s.freeze_s, "thaw"),
            (0.60 * duration, "replace"),
        ]
        plan.sort()
    killed = False
    frozen = False
    deferred: list[Request] = []  # holds for the frozen worker, sent once it thaws
    routed: set[int] = set()
    started = time.monotonic()
    at = 0
    while at < len(events) or plan:
        now = time.monotonic() - started
        while plan and plan[0][0] <= now:
            _, kind = plan.pop(0)
            now_s = round(time.monotonic() - started, 3)
            if kind == "kill":
                host = fleet.prefill_host[fleet.kill]
                os.kill(host.pid, signal.SIGKILL)
                host.alive = False
                host.process.join(timeout=5)
                for d in {id(h): h for h in fleet.decode_host}.values():
                    d.call("dead", fleet.sessions[fleet.kill])
                killed = True
                faults.append({"fault": "kill", "worker": f"p{fleet.kill}", "at_s": now_s})
            elif kind == "freeze":
                os.kill(fleet.prefill_host[fleet.freeze].pid, signal.SIGSTOP)
                frozen = True
                faults.append({"fault": "freeze", "worker": f"p{fleet.freeze}", "at_s": now_s})
            elif kind == "thaw":
                os.kill(fleet.prefill_host[fleet.freeze].pid, signal.SIGCONT)
                frozen = False
                next(f for f in faults if f["fault"] == "freeze")["thawed_at_s"] = now_s
                if deferred:
                    host = fleet.prefill_host[fleet.freeze]
                    host.call(
                        "hold",
                        [(f"p{r.prefill}", r.transfer_id, r.remote, r.tokens) for r in deferred],
                    )
                    deferred.clear()
            elif kind == "replace":
                i = fleet.replace
                port = free_port_range(1)
                fleet.sessions[i] = fleet.prefill_host[i].call("replace", f"p{i}", port)
                fleet.ports[i] = port
                ports_ever.add(port)
                fleet.incarnations[i] += 1
                faults.append({"fault": "replace", "worker": f"p{i}", "at_s": now_s})
        due = []
        while at < len(events) and events[at][0] <= now:
            due.append(events[at])
            at += 1
        holds: dict[HostProcess, list] = {}
        drops: dict[HostProcess, list] = {}
        pulls: dict[HostProcess, list] = {}
        cancels: dict[HostProcess, list] = {}
        for _, _, kind, r in due:
            if r.index not in routed:  # the router picks the address when the request arrives
                routed.add(r.index)
                if killed and r.prefill == fleet.kill:
                    r.prefill = rng.choice([i for i in range(fleet.num_prefill) if i != fleet.kill])
                r.port, r.incarnation = fleet.ports[r.prefill], fleet.incarnations[r.prefill]
            prefill_host = fleet.prefill_host[r.prefill]
            gone = r.incarnation != fleet.incarnations[r.prefill]  # its pod was replaced
            if kind in ("hold", "drop") and (not prefill_host.alive or gone):
                r.held_skipped = True
                continue
            if kind == "hold" and frozen and r.prefill == fleet.freeze:
                deferred.append(r)
                continue
            if kind == "drop" and frozen and r.prefill == fleet.freeze:
                continue  # a drop of a request the frozen worker never held: nothing to do
            if kind == "hold":
                holds.setdefault(prefill_host, []).append(
                    (f"p{r.prefill}", r.transfer_id, r.remote, r.tokens)
                )
            elif kind == "drop":
                drops.setdefault(prefill_host, []).append((f"p{r.prefill}", r.transfer_id))
            elif kind == "pull":
                pulls.setdefault(fleet.decode_host[r.decode], []).append(
                    (
                        f"d{r.decode}",
                        r.request_id,
                        r.transfer_id,
                        r.local,
                        None if r.early else r.remote,
                        r.port,
                        r.tokens,
                    )
                )
            else:
                cancels.setdefault(fleet.decode_host[r.decode], []).append(
                    (f"d{r.decode}", r.request_id)
                )
        if holds or drops:
            _broadcast({h: ("hold", items) for h, items in holds.items()})
            _broadcast({h: ("drop", items) for h, items in drops.items()})
        if pulls:
            _broadcast({h: ("pull", items) for h, items in pulls.items()})
        if cancels:
            _broadcast({h: ("cancel", items) for h, items in cancels.items()})
        if not due:
            next_at = min([events[at][0]] if at < len(events) else [now + _TICK_S])
            time.sleep(max(0.0, min(_TICK_S, next_at - now)))
    stream_s = time.monotonic() - started
    log(f"  stream played in {stream_s:.1f} s; draining")
    # drain: every pull is reported (done or failed)
    decode_hosts = list({id(h): h for h in fleet.decode_host}.values())
    outcomes: dict[str, tuple[str, str]] = {}
    timelines: dict[str, tuple] = {}
    deadline = time.monotonic() + s.drain_s
    while True:
        outcomes, timelines = {}, {}
        for host in decode_hosts:
            got = host.call("collect")
            outcomes.update(got["outcomes"])
            timelines.update(got["timelines"])
        if len(outcomes) >= len(requests) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    time.sleep(0.5)  # the last releases
    end_samples = sampler.sample()
    cpu_window_s = time.monotonic() - started
    time_wait_end = time_wait(ports_ever)
    anatomy = {
        h.label: {"threads": h.call("threads"), "fds": fd_kinds(h.pid)}
        for h in fleet.hosts
        if h.alive
    }
    cpu_end = {h.label: proc_cpu_s(h.pid) for h in fleet.hosts if h.alive}
    sampler.stop()
    stamps: dict[str, tuple[float, float | None]] = {}
    expired = held_now = 0
    for host in fleet.hosts:
        if host.role == "prefill" and host.alive:
            got = host.call("collect")
            stamps.update(got["stamps"])
            expired += got["expired"]
            held_now += got["held_now"]
    wall_s = time.monotonic() - started
    idle_samples: dict[str, tuple[int, int, int]] = {}
    if s.idle_s > 0:
        log(f"  idle for {s.idle_s:g} s")
        time.sleep(s.idle_s)
        idle_samples = sampler.sample()
        for label in idle_samples:
            sampler.samples[label].pop()  # not part of the run's max
        anatomy_idle = {
            h.label: {"threads": h.call("threads"), "fds": fd_kinds(h.pid)}
            for h in fleet.hosts
            if h.alive
        }
    return _results(
        s,
        fleet,
        requests,
        outcomes,
        timelines,
        stamps,
        sampler,
        setup_samples,
        end_samples,
        cpu_start,
        cpu_end,
        faults,
        {
            "setup_s": round(setup_s, 2),
            "stream_s": round(stream_s, 2),
            "wall_s": round(wall_s, 2),
            "expired_holds": expired,
            "held_at_end": held_now,
            "anatomy_at_end": anatomy,
            "tcp_time_wait_at_end": time_wait_end,
            "idle_cpu_cores": {k: round(v, 3) for k, v in idle_cpu.items()},
            "cpu_window_s": round(cpu_window_s, 2),
            "idle_s": s.idle_s,
            **({"anatomy_after_idle": anatomy_idle} if s.idle_s > 0 else {}),
        },
        idle_samples,
    )


def _cause(r: Request, fleet: Fleet, outcome: tuple[str, str] | None) -> str | None:
    if r.abort:
        return "abort"
    if r.prefill == fleet.kill:
        return "kill"
    if r.prefill == fleet.freeze:
        return "freeze"
    if r.prefill == fleet.replace and r.incarnation < fleet.incarnations[r.prefill]:
        return "replace"
    return None


def _results(
    s,
    fleet,
    requests,
    outcomes,
    timelines,
    stamps,
    sampler,
    setup,
    end,
    cpu0,
    cpu1,
    faults,
    extra,
    idle,
) -> dict:
    processes = []
    for host in fleet.hosts:
        samples = sampler.samples[host.label]
        first = setup.get(host.label)
        last = end.get(host.label)
        after = idle.get(host.label)
        cpu = None
        if host.label in cpu1 and cpu1[host.label] is not None:
            cpu = round(cpu1[host.label] - cpu0.get(host.label, 0.0), 3)
        processes.append(
            {
                "label": host.label,
                "role": host.role,
                "workers": fleet.workers[host.label],
                "alive_at_end": host.alive,
                "threads_setup": first[0] if first else None,
                "threads_max": max((x[0] for x in samples), default=None),
                "threads_end": last[0] if last else None,
                "fds_setup": first[1] if first else None,
                "fds_max": max((x[1] for x in samples), default=None),
                "fds_end": last[1] if last else None,
                "rss_setup_mib": round(first[2] / 2**20, 1) if first else None,
                "rss_max_mib": round(max((x[2] for x in samples), default=0) / 2**20, 1),
                "rss_end_mib": round(last[2] / 2**20, 1) if last else None,
                "threads_idle": after[0] if after else None,
                "fds_idle": after[1] if after else None,
                "rss_idle_mib": round(after[2] / 2**20, 1) if after else None,
                "cpu_s": cpu,
            }
        )
    done = [r for r in requests if outcomes.get(r.request_id, ("", ""))[0] == "done"]
    failed_by_cause: dict[str, int] = {}
    unattributed: list[str] = []
    for r in requests:
        outcome = outcomes.get(r.request_id)
        if outcome is not None and outcome[0] == "done":
            continue
        cause = _cause(r, fleet, outcome)
        if cause is None:
            unattributed.append(
                f"{r.request_id} (p{r.prefill}, early={r.early}): "
                + (outcome[1] if outcome else "never reported")
            )
        else:
            failed_by_cause[cause] = failed_by_cause.get(cause, 0) + 1
    healthy = [r for r in done if _cause(r, fleet, None) is None]
    grant, early_grant, release, total = [], [], [], []
    # healthy pulls that arrived while a peer was frozen, against those that did not: what one
    # frozen peer makes the others wait
    frozen = next((f for f in faults if f["fault"] == "freeze" and "thawed_at_s" in f), None)
    grant_frozen: list[float] = []
    grant_otherwise: list[float] = []
    for r in healthy:
        t = timelines.get(r.request_id)
        if t is None:
            continue
        submitted, granted, landed = t
        held, released = stamps.get(r.transfer_id, (None, None))
        if granted is not None:
            if r.early:
                if held is not None:
                    early_grant.append(max(0.0, granted - held))
            else:
                grant.append(granted - submitted)
                if frozen is not None:
                    during = frozen["at_s"] <= r.arrival <= frozen["thawed_at_s"]
                    (grant_frozen if during else grant_otherwise).append(granted - submitted)
        if landed is not None:
            total.append(landed - submitted)
            if released is not None:
                release.append(released - landed)
    pulls = len(requests)
    cpu_by_role: dict[str, float] = {}
    net_by_role: dict[str, float] = {}
    for p in processes:
        if p["cpu_s"] is not None:
            cpu_by_role[p["role"]] = cpu_by_role.get(p["role"], 0.0) + p["cpu_s"]
            idle_cost = extra["idle_cpu_cores"][p["label"]] * extra["cpu_window_s"]
            net_by_role[p["role"]] = net_by_role.get(p["role"], 0.0) + p["cpu_s"] - idle_cost

    def role_max(role: str, key: str):
        values = [p[key] for p in processes if p["role"] == role and p[key] is not None]
        return max(values, default=None)

    summary = {
        role: {
            key: role_max(role, key)
            for key in (
                "threads_setup",
                "threads_max",
                "threads_end",
                "fds_setup",
                "fds_max",
                "fds_end",
                "rss_setup_mib",
                "rss_max_mib",
                "rss_end_mib",
                "threads_idle",
                "fds_idle",
                "rss_idle_mib",
            )
        }
        for role in ("decode", "prefill")
    }
    return {
        "shape": s.shape,
        "size": s.size,
        "prefill_workers": fleet.num_prefill,
        "decode_workers": fleet.num_decode,
        "requests": pulls,
        "rate_per_s": s.rate,
        "early_fraction": s.early_fraction,
        "abort_fraction": s.abort_fraction,
        **extra,
        "pulls_done": len(done),
        "pulls_failed": pulls - len(done),
        "failed_by_cause": failed_by_cause,
        "failed_unattributed": len(unattributed),
        "unattributed_examples": unattributed[:10],
        "faults": faults,
        "latency": {
            "claim_to_grant": percentiles(grant),
            "early_hold_to_grant": percentiles(early_grant),
            "read_done_to_release": percentiles(release),
            "submit_to_landed": percentiles(total),
            **(
                {
                    "claim_to_grant_while_one_frozen": percentiles(grant_frozen),
                    "claim_to_grant_otherwise": percentiles(grant_otherwise),
                }
                if frozen is not None
                else {}
            ),
        },
        "cpu_us_per_pull": {
            role: round(1e6 * cpu / max(1, pulls), 1) for role, cpu in cpu_by_role.items()
        },
        "cpu_us_per_pull_net_of_idle": {
            role: round(1e6 * cpu / max(1, pulls), 1) for role, cpu in net_by_role.items()
        },
        "per_process_max": summary,
        "processes": processes,
    }
