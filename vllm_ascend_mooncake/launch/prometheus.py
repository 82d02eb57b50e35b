"""Reading the Prometheus pages of vLLM instances and of the proxy: the transfer totals every
end-to-end check rests on, gauges tests wait on, and the benchmarks' counters. One parser
(prometheus_client's), samples selected by their own name (``*_total``, ``*_count``) and labels.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from .servers import ServerError


def metrics_text(base_url: str, timeout_s: float = 30.0) -> str:
    """The Prometheus page of the instance (or proxy) at ``base_url``."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as response:
        return response.read().decode()


#: What a family's samples append to its name (the parser strips ``_total`` from a counter's).
_SAMPLE_SUFFIXES = ("", "_total", "_count", "_sum", "_bucket", "_created", "_info")


def metric_samples(
    text: str, name: str, labels: Mapping[str, str] | None = None
) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` in a Prometheus page with its labels; with ``labels``,
    only the samples that carry all of them. Raises :class:`ServerError` when the page does not
    declare the metric at all (a labelled counter nobody incremented yet is declared, with no
    sample: that is an empty list)."""
    wanted = dict(labels or {})
    declared = False
    samples: list[tuple[dict[str, str], float]] = []
    for family in text_string_to_metric_families(text):
        if name.startswith(family.name) and name[len(family.name) :] in _SAMPLE_SUFFIXES:
            declared = True
        samples += [
            (sample.labels, sample.value)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items())
        ]
    if not declared:
        raise ServerError(
            f"{name} is not exported (if it is one of the connector's: is the connector loaded?)"
        )
    return samples


def metric_sum(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of a metric's samples (those with ``labels``, if given): 0 for a label set no
    sample has yet (a counter not incremented yet). Raises :class:`ServerError` when the page
    does not declare the metric."""
    return sum(value for _, value in metric_samples(text, name, labels))
