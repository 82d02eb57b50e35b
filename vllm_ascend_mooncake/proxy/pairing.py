"""Prefill instances no decode instance can read: found on decode's ``/metrics``, routed around.

A decode instance that finds it cannot read a prefill engine's KV (another dtype, cache geometry,
model...) computes that engine's requests itself: the answers stay right, but every prefill leg
sent there is wasted work and latency. It says so on its ``/metrics`` with
:data:`UNPAIRABLE_METRIC`, one sample per such prefill engine (label ``prefill_engine``, the
engine id prefill answers carry as ``remote_engine_id``; the reason is in the decode's log).

After each health-check round, :class:`PairingWatch` reads that metric from every healthy decode
instance (only those lines of the page are parsed). A prefill instance all of whose known engine
ids every one of them reports is marked *unpairable* on the prefill balancer
(:meth:`~.balancer.Balancer.mark_unpairable`): ``/ready`` shows it with the reason, one WARNING
is logged, and requests go to the other prefill instances. When no other prefill instance is
routable, requests go to decode alone (:meth:`.serial_route.SerialRoute.decode_alone`): decode
would compute the prompt anyway, so a prefill leg would only add its latency and waste its compute.

The mark is lifted (INFO) as soon as the instance's engine ids are no longer all reported: its
answer to a retry request (due after a back-off that doubles, see the balancer) shows a new
engine id once it was restarted; a decode instance restarted or added that has not found it
unpairable counts too, as does the proxy forgetting the instance's engines (it stopped
answering). A scrape that fails leaves every mark as it is for that round; a decode page without
the metric (no such engine found, or a decode without this connector) reports nothing.
"""

from __future__ import annotations

import asyncio
import logging
import re

import httpx

from .balancer import Balancer, Upstream
from .errors import describe_error
from .prefill_ranks import PrefillRanks

logger = logging.getLogger(__name__)

#: The decode-side counter (see ``connector/stats.py``), as its samples are named on the page.
UNPAIRABLE_METRIC = "vllm:mooncake_hetero_unpairable_prefill_engines"
#: The label value decode uses for engines past its label bound: names no engine.
OTHER_ENGINES = "other"

_SAMPLE_PREFIX = f"{UNPAIRABLE_METRIC}_total{{"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def unpairable_engines(page: str) -> set[str]:
    """The prefill engine ids a decode's Prometheus page reports unpairable (a sample above 0),
    reading only that metric's sample lines."""
    engines = set()
    for line in page.splitlines():
        if not line.startswith(_SAMPLE_PREFIX):
            continue
        labels_text, _, rest = line[len(_SAMPLE_PREFIX) :].rpartition("}")
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        labels = {
            key: value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
            for key, value in _LABEL.findall(labels_text)
        }
        engine = labels.get("prefill_engine")
        if value > 0 and engine and engine != OTHER_ENGINES:
            engines.add(engine)
    return engines


class PairingWatch:
    """Marks prefill instances every decode reports unpairable, and lifts the marks."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        prefill: Balancer,
        decode: Balancer,
        prefill_ranks: PrefillRanks,
        timeout_s: float,
    ) -> None:
        self.client = client
        self.prefill = prefill
        self.decode = decode
        self.prefill_ranks = prefill_ranks
        self.timeout_s = timeout_s
        #: engine ids every healthy decode instance reported at the last complete scrape
        self.refused_by_all: frozenset[str] = frozenset()
        prefill_ranks.on_engines_changed = self.engines_changed

    async def scrape(self, upstream: Upstream) -> set[str] | None:
        """The engines one decode instance reports unpairable; None when its page could not be
        read (that round decides nothing)."""
        try:
            response = await self.client.get(f"{upstream.url}/metrics", timeout=self.timeout_s)
        except httpx.HTTPError as error:
            logger.debug("decode %s /metrics: %s", upstream.url, describe_error(error))
            return None
        if response.status_code != 200:
            logger.debug("decode %s /metrics answered %d", upstream.url, response.status_code)
            return None
        return unpairable_engines(response.text)

    async def check(self) -> None:
        """Read every healthy decode's page, then judge every prefill instance."""
        healthy = [
            upstream for upstream in self.decode.upstreams if self.decode.is_healthy(upstream)
        ]
        if not healthy:
            return  # nothing to learn; nothing is served either
        reports = await asyncio.gather(*(self.scrape(upstream) for upstream in healthy))
        read = [report for report in reports if report is not None]
        if len(read) < len(reports):
            return
        self.refused_by_all = frozenset(set.intersection(*read))
        for upstream in self.prefill.upstreams:
            self.judge(upstream)

    def engines_changed(self, url: str) -> None:
        """A prefill answer (or its absence) changed what the proxy knows of ``url``'s
        engines: judge it again now, against the last scrape."""
        for upstream in self.prefill.upstreams:
            if upstream.url == url:
                self.judge(upstream)

    def judge(self, upstream: Upstream) -> None:
        engines = self.prefill_ranks.engine_ids(upstream.url)
        if engines and engines <= self.refused_by_all:
            names = ", ".join(sorted(engines))
            reason = (
                f"no decode instance can read its KV (prefill engine {names}; see the decode "
                "instances' log for why)"
            )
            retry_s = self.prefill.mark_unpairable(upstream, reason)
            if retry_s is not None:
                if self.prefill.only_unpairable_left():
                    meanwhile = (
                        "no other prefill instance is routable: requests go to decode alone, "
                        "which computes their prompts"
                    )
                else:
                    meanwhile = "requests go to the other prefill instances"
                logger.warning(
                    "prefill instance %s taken out of routing: %s; %s; one request tries it "
                    "again in %g s (a restarted instance reports a new engine id)",
                    upstream.url,
                    reason,
                    meanwhile,
                    retry_s,
                )
        elif upstream.unpairable is not None:
            self.prefill.clear_unpairable(upstream)
            now = ", ".join(sorted(engines)) or "not known until it answers"
            logger.info(
                "prefill instance %s routed again: a decode instance may read its KV now "
                "(engine %s)",
                upstream.url,
                now,
            )
