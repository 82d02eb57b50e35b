"""A TCP relay that delays every byte by a fixed one-way latency: a slow link, in user space.

The two-host test (:mod:`.netns`) needs a link with latency between its emulated hosts. Linux's
``netem`` qdisc is the usual tool, but kernels built without ``CONFIG_NET_SCH_NETEM`` (this
project's test machines) cannot load it. This relay runs on the emulated router instead: an
``nftables`` rule redirects every TCP connection crossing the router to it, it reads the
connection's original destination (``SO_ORIGINAL_DST``), connects there, and forwards each chunk
it reads in either direction ``delay`` seconds after it arrived, in order. Both directions are
delayed, so a round trip costs twice the delay, as on a real link; the bandwidth cap stays in the
kernel (``tc tbf`` on the router's interfaces).

The delay is read from a control file, so a test can change it without restarting anything;
chunks already queued keep the delay they arrived with. Counters (connections, bytes each way)
are written to a stats file about every 100 ms, so a test can prove traffic crossed the link.

Run on the router: ``python -m vam_testing.delay_relay --port P --control F
--stats F``. ``--upstream HOST:PORT`` sends every connection there instead of to its original
destination (for testing the relay without NAT).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: ``SO_ORIGINAL_DST`` from ``linux/netfilter_ipv4.h``: where a redirected connection was going.
SO_ORIGINAL_DST = 80

_CHUNK_BYTES = 256 << 10
#: Chunks queued per direction before the relay stops reading (the link's "window").
_QUEUE_CHUNKS = 256
_CONTROL_POLL_S = 0.1


@dataclass
class RelayStats:
    """What crossed the relay since it started."""

    connections: int = 0
    bytes_to_destination: int = 0  # client -> original destination
    bytes_to_client: int = 0  # original destination -> client
    delay_ms: float = 0.0
    #: connections per original destination, "address:port"
    destinations: dict[str, int] = field(default_factory=dict)


def read_delay_ms(control: Path) -> float:
    """The one-way delay the control file asks for (0 when missing, empty or unreadable)."""
    try:
        text = control.read_text().strip()
    except OSError:
        return 0.0
    try:
        return max(0.0, float(text)) if text else 0.0
    except ValueError:
        return 0.0


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """The (address, port) a connection redirected by NAT was addressed to."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed_address = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed_address), port


class DelayRelay:
    """The relay's state: where the delay comes from, where connections go, what crossed."""

    def __init__(self, control: Path, stats_path: Path | None, upstream: tuple[str, int] | None):
        self.control = control
        self.stats_path = stats_path
        self.upstream = upstream
        self.stats = RelayStats(delay_ms=read_delay_ms(control))

    async def watch_control(self) -> None:
        """Follow the control file and write the stats file, until cancelled."""
        while True:
            self.stats.delay_ms = read_delay_ms(self.control)
            if self.stats_path is not None:
                temporary = self.stats_path.with_suffix(".tmp")
                temporary.write_text(json.dumps(asdict(self.stats)))
                os.replace(temporary, self.stats_path)
            await asyncio.sleep(_CONTROL_POLL_S)

    async def handle(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        """Relay one redirected connection to where it was going, both directions delayed."""
        client_socket = client_writer.get_extra_info("socket")
        try:
            host, port = self.upstream or original_destination(client_socket)
            server_reader, server_writer = await asyncio.open_connection(host, port)
        except OSError:
            client_writer.close()
            return
        for writer in (client_writer, server_writer):
            with contextlib.suppress(OSError):
                writer.get_extra_info("socket").setsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
                )
        self.stats.connections += 1
        destination = f"{host}:{port}"
        self.stats.destinations[destination] = self.stats.destinations.get(destination, 0) + 1
        writers = (client_writer, server_writer)
        try:
            await asyncio.gather(
                self._pipe(client_reader, server_writer, writers, "bytes_to_destination"),
                self._pipe(server_reader, client_writer, writers, "bytes_to_client"),
            )
        finally:
            for writer in writers:
                writer.close()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        both_writers: tuple[asyncio.StreamWriter, ...],
        counter: str,
    ) -> None:
        """Forward ``reader`` to ``writer``, each chunk ``delay`` after it was read. End of
        stream is forwarded (after the same delay) as a half-close, so the other direction goes
        on; a reset closes both sides, as it would end the connection end to end."""
        # (due time, chunk); b"" is the end of the stream, None a reset.
        queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue(_QUEUE_CHUNKS)

        def due() -> float:
            return time.monotonic() + self.stats.delay_ms / 1000

        async def read_side() -> None:
            try:
                while chunk := await reader.read(_CHUNK_BYTES):
                    await queue.put((due(), chunk))
            except OSError:
                await queue.put((due(), None))
                return
            await queue.put((due(), b""))

        reading = asyncio.create_task(read_side())
        try:
            while True:
                due_at, chunk = await queue.get()
                wait = due_at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if chunk is None:
                    raise ConnectionResetError("the other side reset the connection")
                if not chunk:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    break
                writer.write(chunk)
                await writer.drain()
                setattr(self.stats, counter, getattr(self.stats, counter) + len(chunk))
        except OSError:
            for each in both_writers:
                each.close()
        finally:
            reading.cancel()


async def serve(port: int, relay: DelayRelay, host: str = "0.0.0.0") -> None:
    server = await asyncio.start_server(relay.handle, host, port, backlog=1024)
    watcher = asyncio.create_task(relay.watch_control())
    try:
        async with server:
            await server.serve_forever()
    finally:
        watcher.cancel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--control", type=Path, required=True, help="file with the delay in ms")
    parser.add_argument("--stats", type=Path, default=None, help="file the counters go to")
    parser.add_argument("--upstream", default=None, help="HOST:PORT instead of SO_ORIGINAL_DST")
    args = parser.parse_args(argv)
    upstream = None
    if args.upstream:
        upstream_host, _, upstream_port = args.upstream.rpartition(":")
        upstream = (upstream_host, int(upstream_port))
    relay = DelayRelay(args.control, args.stats, upstream)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, relay, args.host))


if __name__ == "__main__":
    main()
