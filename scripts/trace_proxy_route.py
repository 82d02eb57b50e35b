"""Which proxy modules one continued request visits, and how often it comes back to one it left.

Runs the proxy in process (its ASGI app driven by httpx, in this thread) in front of the fake
vLLM servers of ``tests/proxy``, sends a completion request that teaches the proxy the prefill
engine's address, then traces a second one (the first token from prefill, the prefill leg
streamed: the default route's steady state) with ``sys.settrace``. Every call into a function
of ``vllm_ascend_mooncake/proxy/`` and every return to one names the module execution is in;
consecutive repeats collapse into one visit. Printed: the modules in order, their number, and
the returns to a module already left (a visit to a module seen before, not just before), and
which modules each module calls into (what a reader of that module must open), counted twice:
every "call" event (``sys.settrace`` reports a coroutine resumed after an ``await`` as a call
too, so these include resumptions) and first entries only (calls between modules proper).

    PYTHONPATH=. python scripts/trace_proxy_route.py [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "proxy"))

from fake_vllm import FakeVllm  # noqa: E402
from loopback_server import serve_on_loopback  # noqa: E402

from vllm_ascend_mooncake.proxy import create_app  # noqa: E402

PROXY = ROOT / "vllm_ascend_mooncake" / "proxy"
BODY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 6, "temperature": 0.0}


def _module(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename)
    return str(path.relative_to(PROXY)) if path.is_relative_to(PROXY) else None


class ModuleVisits:
    """The proxy modules execution passes through, in order (repeats collapsed)."""

    def __init__(self) -> None:
        self.path: list[str] = []
        #: the modules entered by calls only (returns to a caller not counted)
        self.calls: list[str] = []
        #: (caller module, called module) -> calls, across modules only
        self.edges: dict[tuple[str, str], int] = {}
        #: the same, first entries only: a coroutine or generator resumed after an ``await`` or
        #: a ``yield`` (a "call" event for a frame seen before) is not counted
        self.first_calls: dict[tuple[str, str], int] = {}
        #: every frame entered, kept alive so that no new frame reuses a seen one's id
        self._entered: dict[int, FrameType] = {}

    def _visit(self, module: str | None, called: bool = False) -> None:
        if module is not None and (not self.path or self.path[-1] != module):
            self.path.append(module)
        if called and module is not None and (not self.calls or self.calls[-1] != module):
            self.calls.append(module)

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            callee, caller = _module(frame), _module(frame.f_back)
            self._visit(callee, called=True)
            resumed = self._entered.get(id(frame)) is frame
            self._entered[id(frame)] = frame
            if callee is not None and caller is not None and callee != caller:
                self.edges[caller, callee] = self.edges.get((caller, callee), 0) + 1
                if not resumed:
                    self.first_calls[caller, callee] = self.first_calls.get((caller, callee), 0) + 1
            return self.trace
        if event == "return":
            self._visit(_module(frame.f_back))
        return self.trace

    @staticmethod
    def returns_to_left_modules(path: list[str]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for i, module in enumerate(path):
            if module in path[:i]:
                counts[module] = counts.get(module, 0) + 1
        return counts


async def _run(prefill_url: str, decode_url: str, stream: bool) -> ModuleVisits:
    app = create_app([prefill_url], [decode_url], health_interval_s=0)
    visits = ModuleVisits()
    body = {**BODY, "stream": stream}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            first = await client.post("/v1/completions", json=body)  # teaches the address
            assert first.status_code == 200, first.text
            sys.settrace(visits.trace)
            try:
                traced = await client.post("/v1/completions", json=body)
            finally:
                sys.settrace(None)
            assert traced.status_code == 200, traced.text
    return visits


def _servers() -> Iterator[tuple[str, str]]:
    with ExitStack() as stack:
        urls = []
        for name in ("prefill", "decode"):
            fake = FakeVllm(name)
            fake.generates = True
            fake.hands_off_like_the_connector = True
            urls.append(stack.enter_context(serve_on_loopback(fake.app())))
        yield urls[0], urls[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stream", action="store_true", help="a streamed client request")
    args = parser.parse_args()
    for prefill_url, decode_url in _servers():
        visits = asyncio.run(_run(prefill_url, decode_url, args.stream))
    print(" -> ".join(visits.path))
    print(f"modules visited: {len(set(visits.path))}")
    for what, path in (("calls and returns", visits.path), ("calls only", visits.calls)):
        returns = visits.returns_to_left_modules(path)
        print(f"returns to a module already left ({what}): {sum(returns.values())}")
        for module, count in sorted(returns.items(), key=lambda item: -item[1]):
            print(f"  {module}: {count}")
    for title, edges in (
        ("calls; a coroutine resumed counts too", visits.edges),
        ("first entries only: a coroutine resumed is no call", visits.first_calls),
    ):
        print(f"what each module calls in other modules ({title}): {sum(edges.values())}")
        for caller in sorted({caller for caller, _ in edges}):
            called = {c: n for (a, c), n in edges.items() if a == caller}
            print(f"  {caller} -> " + ", ".join(f"{c} {n}" for c, n in sorted(called.items())))


if __name__ == "__main__":
    main()
