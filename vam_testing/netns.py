"""Two emulated hosts on one machine: network namespaces joined by a router with a slow link.

A multi-host P/D deployment differs from a loopback one in what the connector must get right:
instances advertise an address the other host can reach, every byte (HTTP, side channel,
Mooncake) crosses a link with latency and a bandwidth limit, and nothing can shortcut through
loopback. :class:`TwoHostNetwork` builds that here, for tests (root only)::

    this namespace (test harness) --mgmt-- router --link-- prefill host
                                              \\----link-- decode host

* each host is a network namespace with one veth interface, its own address in the benchmarking
  range 198.18.0.0/15 (RFC 2544, never routed on a real network) and a default route through the
  router; the hosts share no interface, so traffic between them crosses the router;
* the router forwards between them; an ``nftables`` rule redirects every TCP connection from one
  host to the other through :mod:`.delay_relay`, which adds the one-way delay of
  :meth:`TwoHostNetwork.set_link` (``tc netem`` would do it in the kernel, but kernels built
  without ``CONFIG_NET_SCH_NETEM``, as this project's test machines are, lack it); a ``tc tbf``
  qdisc on the router's two interfaces caps the bandwidth in both directions;
* the harness reaches both hosts over a third veth ("management"), outside the emulated link.

Needs root, ``ip`` (iproute2), ``nft`` (nftables) and ``tc``; ``scripts/setup.sh`` installs them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_ascend_mooncake.launch.deployment import Host
from vllm_ascend_mooncake.launch.servers import StartedInContext

from . import child_env

#: Where the router's relay listens (inside the router's namespace, so it clashes with nothing).
RELAY_PORT = 7700

_NAME = re.compile(r"^vam(\d+)[pdr]$")
_COMMAND_TIMEOUT_S = 30


class NetworkSetupError(RuntimeError):
    """The emulated network could not be built (missing tool, no privilege, kernel support)."""


def missing_requirements() -> str | None:
    """Why :class:`TwoHostNetwork` cannot run here, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    missing = [tool for tool in ("ip", "nft", "tc") if shutil.which(tool) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found: install iproute2 and nftables "
            "(scripts/setup.sh does it as root)"
        )
    return None


def _run(*argv: str) -> str:
    try:
        completed = subprocess.run(
            argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkSetupError(f"`{' '.join(argv)}` failed: {exc}") from exc
    if completed.returncode != 0:
        raise NetworkSetupError(
            f"`{' '.join(argv)}` exited with {completed.returncode}: {completed.stderr.strip()}"
        )
    return completed.stdout


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces left by a :class:`TwoHostNetwork` whose process died without cleaning
    up (their names carry the creator's PID); return their names."""
    removed = []
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NAME.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            with contextlib.suppress(NetworkSetupError):
                _run("ip", "netns", "delete", name)
                removed.append(name)
    return removed


def _used_198_18_subnets() -> set[int]:
    """Third octets of 198.18.x.0/24 networks this namespace already has routes to."""
    used = set()
    for match in re.finditer(r"\b198\.18\.(\d+)\.", _run("ip", "-4", "route", "show")):
        used.add(int(match.group(1)))
    return used


@dataclass(frozen=True)
class LinkSettings:
    """The emulated link between the two hosts."""

    delay_ms: float = 0.0  # one way; a round trip costs twice this
    rate_mbit: float | None = None  # per direction; None: no cap


class TwoHostNetwork(StartedInContext):
    """The namespaces, links and relay described in the module docstring; a context manager.

    :attr:`prefill` and :attr:`decode` are the two hosts as
    :class:`~vllm_ascend_mooncake.launch.deployment.Host` values (address and the ``ip netns exec``
    prefix that runs a program there), ready for
    :class:`~vllm_ascend_mooncake.launch.deployment.LocalDeployment`.
    """

    def __init__(self, python: str = sys.executable) -> None:
        problem = missing_requirements()
        if problem:
            raise NetworkSetupError(problem)
        self._python = python
        tag = f"vam{os.getpid()}"
        self._namespaces = {role: f"{tag}{role[0]}" for role in ("prefill", "decode", "router")}
        self._interfaces = {
            # (name in the host's namespace, its peer's name in the router's)
            "prefill": (f"{tag}pr", f"{tag}rp"),
            "decode": (f"{tag}dr", f"{tag}rd"),
            "harness": (f"{tag}hm", f"{tag}mh"),
        }
        self._subnets: dict[str, int] = {}
        self._workdir = Path(tempfile.mkdtemp(prefix="vam-netns-"))
        self.relay_control = self._workdir / "delay_ms"
        self.relay_stats_path = self._workdir / "relay-stats.json"
        self._relay: subprocess.Popen[bytes] | None = None
        self._created = False
        self.link = LinkSettings()

    def _address(self, role: str, router_side: bool = False) -> str:
        return f"198.18.{self._subnets[role]}.{1 if router_side else 2}"

    def _host(self, role: str) -> Host:
        return Host(self._address(role), ("ip", "netns", "exec", self._namespaces[role]))

    @property
    def prefill(self) -> Host:
        return self._host("prefill")

    @property
    def decode(self) -> Host:
        return self._host("decode")

    def _in(self, role: str, *argv: str) -> str:
        return _run("ip", "netns", "exec", self._namespaces[role], *argv)

    def create(self) -> None:
        """Build the namespaces, links, routes, NAT rule and relay (see the module docstring)."""
        remove_stale_namespaces()
        used = _used_198_18_subnets()
        free = [octet for octet in range(10, 250) if octet not in used]
        if len(free) < 3:
            raise NetworkSetupError("no free 198.18.x.0/24 subnets left for the emulated hosts")
        self._subnets = dict(zip(("prefill", "decode", "harness"), free[:3], strict=True))
        self._created = True
        router = self._namespaces["router"]
        for namespace in self._namespaces.values():
            _run("ip", "netns", "add", namespace)
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
        for role, (near, far) in self._interfaces.items():
            _run("ip", "link", "add", near, "type", "veth", "peer", "name", far)
            _run("ip", "link", "set", far, "netns", router)
            _run("ip", "-n", router, "addr", "add", f"{self._address(role, True)}/24", "dev", far)
            _run("ip", "-n", router, "link", "set", far, "up")
            if role == "harness":
                namespace_args: tuple[str, ...] = ()
            else:
                _run("ip", "link", "set", near, "netns", self._namespaces[role])
                namespace_args = ("-n", self._namespaces[role])
            _run("ip", *namespace_args, "addr", "add", f"{self._address(role)}/24", "dev", near)
            _run("ip", *namespace_args, "link", "set", near, "up")
        for role in ("prefill", "decode"):
            _run(
                "ip",
                "-n",
                self._namespaces[role],
                "route",
                "add",
                "default",
                "via",
                self._address(role, True),
            )
            # The harness reaches the hosts, never the hosts each other, through this route.
            _run(
                "ip",
                "route",
                "add",
                f"198.18.{self._subnets[role]}.0/24",
                "via",
                self._address("harness", True),
            )
        self._in("router", "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        host_side = ", ".join(f'"{self._interfaces[role][1]}"' for role in ("prefill", "decode"))
        rules = (
            "table ip vam_link {\n"
            "  chain prerouting {\n"
            "    type nat hook prerouting priority dstnat; policy accept;\n"
            f"    iifname {{ {host_side} }} ip protocol tcp redirect to :{RELAY_PORT}\n"
            "  }\n"
            "}\n"
        )
        rules_file = self._workdir / "rules.nft"
        rules_file.write_text(rules)
        self._in("router", "nft", "-f", str(rules_file))
        self._start_relay()

    def _start_relay(self) -> None:
        self.relay_control.write_text("0")
        log = (self._workdir / "relay.log").open("wb")
        self._relay = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self._namespaces["router"],
                self._python,
                "-m",
                "vam_testing.delay_relay",
                "--port",
                str(RELAY_PORT),
                "--control",
                str(self.relay_control),
                "--stats",
                str(self.relay_stats_path),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=child_env(),  # `-m vam_testing...` from any working directory
        )
        log.close()
        deadline = time.monotonic() + 30
        while not self.relay_stats_path.exists():
            if self._relay.poll() is not None or time.monotonic() > deadline:
                raise NetworkSetupError(
                    "the delay relay did not start: "
                    + (self._workdir / "relay.log").read_text(errors="replace")[-2000:]
                )
            time.sleep(0.1)

    def set_link(self, delay_ms: float = 0.0, rate_mbit: float | None = None) -> None:
        """Set the one-way delay and the per-direction bandwidth cap of the hosts' link.

        New chunks take the new delay within about 100 ms; established connections stay up.
        """
        if delay_ms < 0 or (rate_mbit is not None and rate_mbit <= 0):
            raise ValueError(f"delay must be >= 0 and the rate > 0, got {delay_ms}, {rate_mbit}")
        self.relay_control.write_text(str(delay_ms))
        for role in ("prefill", "decode"):
            router_side = self._interfaces[role][1]
            if rate_mbit is None:
                with contextlib.suppress(NetworkSetupError):
                    self._in("router", "tc", "qdisc", "del", "dev", router_side, "root")
                continue
            # The bucket holds at least one 64 KiB GSO segment (veth offloads) and ~10 ms.
            burst_bytes = max(64 << 10, int(rate_mbit * 1e6 / 8 / 100))
            self._in(
                "router",
                "tc",
                "qdisc",
                "replace",
                "dev",
                router_side,
                "root",
                "tbf",
                "rate",
                f"{rate_mbit}mbit",
                "burst",
                str(burst_bytes),
                "latency",
                "200ms",
            )
        deadline = time.monotonic() + 5
        while self.relay_stats().get("delay_ms") != float(delay_ms):
            if time.monotonic() > deadline:
                raise NetworkSetupError(f"the relay did not take the delay {delay_ms} ms")
            time.sleep(0.05)
        self.link = LinkSettings(delay_ms, rate_mbit)

    def relay_stats(self) -> dict[str, Any]:
        """The relay's counters: connections, bytes_to_destination, bytes_to_client, delay_ms,
        and destinations (connections per original "address:port")."""
        try:
            return dict(json.loads(self.relay_stats_path.read_text()))
        except (OSError, ValueError):
            return {}

    def close(self) -> None:
        """Stop the relay and delete the namespaces (their interfaces and routes go with them).

        Processes still running in a host's namespace keep it alive: stop them first.
        """
        if self._relay is not None and self._relay.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._relay.pid, 9)
            self._relay.wait(timeout=10)
        if self._created:
            for namespace in self._namespaces.values():
                with contextlib.suppress(NetworkSetupError):
                    _run("ip", "netns", "delete", namespace)
            with contextlib.suppress(NetworkSetupError):
                _run("ip", "link", "delete", self._interfaces["harness"][0])
            self._created = False
        shutil.rmtree(self._workdir, ignore_errors=True)

    def _start(self) -> None:
        self.create()

    def _stop(self) -> None:
        self.close()
