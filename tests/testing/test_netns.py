"""The emulated link of the two-host test: the relay's delay, and the namespaces' isolation.

The relay is tested on loopback (``--upstream``, no NAT); the network itself needs root and the
tools :func:`missing_requirements` names. Delays are checked as lower bounds only: a slow machine
can only add time, so the bounds cannot fail by chance.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vam_testing import child_env
from vam_testing.netns import TwoHostNetwork, missing_requirements
from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.launch.ports import free_port


@contextlib.contextmanager
def echo_server() -> Iterator[int]:
    """A TCP server on loopback that echoes each connection until the client half-closes, then
    sends b"bye" and closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve(connection: socket.socket) -> None:
        with connection:
            while data := connection.recv(65536):
                connection.sendall(data)
            connection.sendall(b"bye")

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = listener.accept()
                threading.Thread(target=serve, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield port
    finally:
        listener.close()


@contextlib.contextmanager
def relay_to(upstream_port: int, control: Path, stats: Path) -> Iterator[int]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vam_testing.delay_relay",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--control",
            str(control),
            "--stats",
            str(stats),
            "--upstream",
            f"127.0.0.1:{upstream_port}",
        ],
        env=child_env(),  # the relay imports vam_testing, outside the installed package
    )
    try:

        def started() -> bool:
            if stats.exists():
                return True
            assert process.poll() is None, f"the relay exited with code {process.returncode}"
            return False

        wait_until(started, "the relay writes its stats file")
        yield port
    finally:
        process.kill()
        process.wait()


def round_trip(port: int, payload: bytes) -> tuple[bytes, float]:
    """Send ``payload``, half-close, read everything back; return it and the seconds taken."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(payload)
        connection.shutdown(socket.SHUT_WR)
        received = bytearray()
        while chunk := connection.recv(1 << 20):
            received += chunk
    return bytes(received), time.monotonic() - started


def read_stats(stats: Path) -> dict:
    """The relay's counters (it replaces the file whole, about every 100 ms)."""
    return json.loads(stats.read_text())


def test_the_relay_delays_both_directions_and_keeps_every_byte_in_order(tmp_path) -> None:
    control, stats = tmp_path / "delay_ms", tmp_path / "stats.json"
    control.write_text("0")
    payload = bytes(range(256)) * 20_000  # 5 MB, several chunks
    with echo_server() as upstream, relay_to(upstream, control, stats) as relay:
        echoed, _ = round_trip(relay, payload)
        assert echoed == payload + b"bye"  # the half-close went through, the answer came back
        control.write_text("150")
        # The relay polls the control file every 100 ms and writes the delay it took.
        wait_until(lambda: read_stats(stats)["delay_ms"] == 150, "the relay takes the new delay")
        echoed, seconds = round_trip(relay, b"ping")
        assert echoed == b"pingbye"
        # The ping waits 150 ms out, the echo and the end of stream 150 ms back.
        assert seconds >= 0.3

        def both_round_trips_counted() -> dict | None:  # written every 100 ms
            counters = read_stats(stats)
            counted = (
                counters["bytes_to_destination"] >= len(payload) + 4
                and counters["bytes_to_client"] >= len(payload) + 4 + 2 * 3
            )
            return counters if counted else None

        counters = wait_until(both_round_trips_counted, "the relay counts both round trips")
    assert counters["connections"] == 2
    assert counters["bytes_to_destination"] == len(payload) + 4
    assert counters["bytes_to_client"] == len(payload) + 4 + 2 * 3
    assert counters["delay_ms"] == 150
    assert counters["destinations"] == {f"127.0.0.1:{upstream}": 2}


@pytest.mark.netns
@pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))
def test_two_emulated_hosts_reach_each_other_only_through_the_slow_link(tmp_path) -> None:
    listening = tmp_path / "listening"
    listen = (
        "import pathlib,socket,sys; s=socket.create_server((sys.argv[1], 8000)); "
        "pathlib.Path(sys.argv[2]).touch(); c,_=s.accept(); c.sendall(c.recv(100)); c.close()"
    )
    with TwoHostNetwork() as network:
        prefill, decode = network.prefill, network.decode
        assert prefill.address != decode.address
        server = subprocess.Popen(
            [*prefill.command_prefix, sys.executable, "-c", listen, prefill.address, listening]
        )
        try:
            network.set_link(delay_ms=100, rate_mbit=50)

            def server_listens() -> bool:
                if listening.exists():
                    return True
                assert server.poll() is None, f"the server exited with code {server.returncode}"
                return False

            wait_until(server_listens, "the server in prefill's namespace listens")
            ask = (
                "import socket,sys,time; t=time.monotonic(); "
                "c=socket.create_connection((sys.argv[1], 8000), timeout=20); c.sendall(b'hi'); "
                "assert c.recv(100) == b'hi'; print(time.monotonic()-t)"
            )
            seconds = subprocess.run(
                [*decode.command_prefix, sys.executable, "-c", ask, prefill.address],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
            assert float(seconds) >= 0.2  # one round trip over a link 100 ms each way
            assert server.wait(timeout=30) == 0
        finally:
            server.kill()
        # Decode's loopback is its own: prefill's port is not there.
        reach_loopback = "import socket; socket.create_connection(('127.0.0.1', 8000), timeout=5)"
        assert (
            subprocess.run(
                [*decode.command_prefix, sys.executable, "-c", reach_loopback], capture_output=True
            ).returncode
            != 0
        )
        assert network.relay_stats()["connections"] >= 1
