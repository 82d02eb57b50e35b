"""Loopback ports for local deployments, tests and benchmarks, chosen where nobody else looks.

A port is probed free and then handed to a server that binds it later, so something else can
take it in between. The usual probe (bind port 0) returns a port from the kernel's ephemeral
range, the very range the kernel also gives every other bind-to-0 (vLLM's internal ZMQ and
``torch.distributed`` ports of an instance starting next to ours) and every outgoing connection:
in CI a prefill's side channel lost its port that way. So ports here come from below the
ephemeral range and above Mooncake's RPC range (15000-17000), at random, and a port handed out
once is not handed out again by this process. Only another process choosing ports the same way
can still collide, with odds of about ``count / 12,000`` per choice.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_LOWEST_PORT = 20000  # above Mooncake's RPC ports (15000-17000) and the well-known services
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL_LOW = 32768  # Linux's default when /proc cannot be read
_ATTEMPTS = 500

# OS entropy, not the global ``random`` state that a test or library may have seeded: two
# processes seeded alike would otherwise choose the same ports in the same order.
_rng = random.SystemRandom()
_handed_out: set[int] = set()
_lock = threading.Lock()


def ephemeral_port_low() -> int:
    """The first port of the kernel's ephemeral range (where bind-to-0 and connections land)."""
    try:
        return int(_EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def free_port_range(count: int = 1, host: str = "127.0.0.1") -> int:
    """A base port such that ``base .. base + count - 1`` are free on ``host`` right now.

    The ports lie below the ephemeral range (see the module docstring), are released before
    returning, and are never returned again by this process.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    high = ephemeral_port_low() - count  # highest base whose whole range stays below it
    if high < _LOWEST_PORT:
        raise RuntimeError(
            f"the kernel's ephemeral port range starts at {ephemeral_port_low()}, leaving no "
            f"room for {count} ports above {_LOWEST_PORT}; lower net.ipv4.ip_local_port_range's "
            "start or raise its end"
        )
    with _lock:
        for _ in range(_ATTEMPTS):
            base = _rng.randint(_LOWEST_PORT, high)
            ports = range(base, base + count)
            if any(port in _handed_out for port in ports):
                continue
            if all(_bindable(host, port) for port in ports):
                _handed_out.update(ports)
                return base
    raise RuntimeError(
        f"found no {count} consecutive free ports on {host} between {_LOWEST_PORT} and "
        f"{high + count - 1} in {_ATTEMPTS} tries"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """One free port on ``host``, chosen as :func:`free_port_range` chooses."""
    return free_port_range(1, host)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True
