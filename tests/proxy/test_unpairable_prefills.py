"""A prefill instance no decode instance can read is routed around (proxy/pairing.py): decode
says so on its ``/metrics``, the proxy's health rounds read it, ``/ready`` says why, requests go
to the other prefill instances (or to decode alone when none is left), and a restarted prefill
(a new engine id) is routed again."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from fake_vllm import FakeVllm
from loopback_server import serve_on_loopback

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.proxy import create_app
from vllm_ascend_mooncake.proxy.balancer import Balancer, EjectionPolicy
from vllm_ascend_mooncake.proxy.pairing import unpairable_engines

COMPLETIONS = "/v1/completions"
BODY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8}
FAST_CHECKS = {"health_interval_s": 0.1, "health_timeout_s": 2.0}
#: No retry of an unpairable instance happens by itself during a test; tests make it due.
NO_RETRY = EjectionPolicy(base_backoff_s=600, max_backoff_s=600)


@contextmanager
def fleet(
    prefills: int = 2, decodes: int = 1, **options: Any
) -> Iterator[tuple[list[FakeVllm], list[FakeVllm], Balancer, httpx.Client]]:
    """Prefill fakes answering like the connector, decode fakes, and a proxy over them."""
    with ExitStack() as stack:
        prefill = [FakeVllm(f"p{index}") for index in range(prefills)]
        decode = [FakeVllm(f"d{index}") for index in range(decodes)]
        for fake in prefill:
            fake.hands_off_like_the_connector = True
        prefill_urls = [stack.enter_context(serve_on_loopback(fake.app())) for fake in prefill]
        decode_urls = [stack.enter_context(serve_on_loopback(fake.app())) for fake in decode]
        options = {"first_token": "decode", "unpairable_retry": NO_RETRY, **FAST_CHECKS, **options}
        app = create_app(prefill_urls, decode_urls, **options)
        url = stack.enter_context(serve_on_loopback(app))
        client = stack.enter_context(httpx.Client(base_url=url, timeout=60, trust_env=False))
        yield prefill, decode, app.state.proxy.prefill, client


def send(client: httpx.Client, count: int) -> None:
    for _ in range(count):
        response = client.post(COMPLETIONS, json=BODY)
        assert response.status_code == 200, response.text


def prefill_report(client: httpx.Client) -> list[dict[str, Any]]:
    return client.get("/ready").json()["prefill"]


def test_a_prefill_every_decode_reports_unpairable_is_routed_around_until_it_restarts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="vllm_ascend_mooncake.proxy.pairing")
    with fleet() as ((a, b), (decode,), balancer, client):
        send(client, 4)  # both answer: the proxy learns their engine ids
        assert a.generation_requests() and b.generation_requests()
        decode.unpairable_engines = ["engine-p0"]
        report = wait_until(
            lambda: (r := prefill_report(client))[0]["state"] == "unpairable" and r,
            "prefill p0 is shown unpairable",
        )
        assert "engine-p0" in report[0]["unpairable"]
        assert "no decode instance can read its KV" in report[0]["unpairable"]
        assert report[1]["state"] == "healthy" and report[1]["unpairable"] is None
        assert client.get("/ready").status_code == 200
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "taken out of routing" in warnings[0].getMessage()
        assert "other prefill instances" in warnings[0].getMessage()

        a.received.clear()
        b.received.clear()
        send(client, 6)
        assert not a.generation_requests()
        assert len(b.generation_requests()) == 6
        wait_until(lambda: decode.metrics_scrapes > 3, "a few more rounds")
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # once

        # p0 is restarted (fixed) under a new engine id; once its retry is due, one request
        # tries it, its answer shows the new id, and it is routed again
        a.engine_id = "engine-p0-restarted"
        balancer.upstreams[0].unpairable_retry_at = 0.0
        send(client, 1)
        assert len(a.generation_requests()) == 1
        assert prefill_report(client)[0]["state"] == "healthy"
        assert prefill_report(client)[0]["unpairable"] is None
        assert any("routed again" in r.getMessage() for r in caplog.records)
        a.received.clear()
        b.received.clear()
        send(client, 4)
        assert a.generation_requests() and b.generation_requests()


def test_a_retry_that_shows_the_same_engine_keeps_it_out_with_a_longer_wait() -> None:
    retry = EjectionPolicy(base_backoff_s=600, max_backoff_s=4800)
    with fleet(unpairable_retry=retry) as ((a, _), (decode,), balancer, client):
        send(client, 4)
        decode.unpairable_engines = ["engine-p0"]
        wait_until(lambda: prefill_report(client)[0]["state"] == "unpairable", "p0 marked")
        balancer.upstreams[0].unpairable_retry_at = 0.0
        a.received.clear()
        send(client, 3)
        assert len(a.generation_requests()) == 1  # the retry, and only it
        report = prefill_report(client)[0]
        assert report["state"] == "unpairable"
        assert 600 < report["unpairable_retry_in_s"] <= 1200  # the second wait doubles


@pytest.mark.parametrize("first_token", ["decode", "prefill"])
def test_with_no_prefill_a_decode_can_read_requests_go_to_decode_alone(first_token: str) -> None:
    with fleet(first_token=first_token) as ((a, b), (decode,), _, client):
        send(client, 4)
        decode.unpairable_engines = ["engine-p0", "engine-p1"]
        wait_until(
            lambda: all(r["state"] == "unpairable" for r in prefill_report(client)),
            "both prefills marked",
        )
        assert client.get("/ready").status_code == 200  # still serving, through decode alone
        for fake in (a, b, decode):
            fake.received.clear()
        response = client.post(COMPLETIONS, json=BODY)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == "d0"
        assert not a.generation_requests() and not b.generation_requests()
        (sent,) = decode.generation_requests()
        assert "kv_transfer_params" not in sent.body
        assert sent.body["prompt"] == BODY["prompt"]
        assert 'vam_proxy_requests_total{legs="decode_alone"} 1.0' in client.get("/metrics").text


def test_a_prefill_only_some_decodes_cannot_read_stays_routed() -> None:
    with fleet(decodes=2) as (_, (d0, d1), _, client):
        send(client, 4)
        d0.unpairable_engines = ["engine-p0"]
        scrapes = d1.metrics_scrapes
        wait_until(lambda: d1.metrics_scrapes > scrapes + 2, "a few rounds")
        assert prefill_report(client)[0]["state"] == "healthy"
        d1.unpairable_engines = ["engine-p0"]
        wait_until(lambda: prefill_report(client)[0]["state"] == "unpairable", "p0 marked")
        # a decode restarted (its counter starts over) may read it: routed again
        d1.unpairable_engines = []
        wait_until(lambda: prefill_report(client)[0]["state"] == "healthy", "p0 routed again")


def test_a_decode_page_that_cannot_be_read_decides_nothing() -> None:
    with fleet() as (_, (decode,), _, client):
        send(client, 4)
        decode.unpairable_engines = ["engine-p0"]
        wait_until(lambda: prefill_report(client)[0]["state"] == "unpairable", "p0 marked")
        decode.unpairable_engines = None  # /metrics answers 404 from now on
        scrapes = decode.metrics_scrapes
        wait_until(lambda: decode.metrics_scrapes > scrapes + 2, "a few rounds")
        assert prefill_report(client)[0]["state"] == "unpairable"


def test_only_the_metric_s_samples_above_zero_are_read() -> None:
    name = "vllm:mooncake_hetero_unpairable_prefill_engines"
    page = "\n".join(
        [
            f'# HELP {name} about {name}_total{{prefill_engine="x"}} 1',
            f"# TYPE {name} counter",
            f'{name}_total{{engine="0",model_name="m",prefill_engine="e1"}} 1.0',
            f'{name}_created{{engine="0",model_name="m",prefill_engine="e1"}} 1.7e9',
            f'{name}_total{{engine="1",model_name="m",prefill_engine="e2_dp1"}} 2.0',
            f'{name}_total{{engine="0",model_name="a \\"q\\" }} b",prefill_engine="e3"}} 1.0',
            f'{name}_total{{engine="0",model_name="m",prefill_engine="zero"}} 0.0',
            f'{name}_total{{engine="0",model_name="m",prefill_engine="other"}} 9.0',
            f'{name}_totalx{{prefill_engine="not-it"}} 1.0',
            'vllm:other_total{prefill_engine="not-it"} 1.0',
        ]
    )
    assert unpairable_engines(page) == {"e1", "e2_dp1", "e3"}
    assert unpairable_engines("") == set()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_unpairable_instance_ranks_last_and_gets_one_retry_when_due() -> None:
    clock = FakeClock()
    retry = EjectionPolicy(base_backoff_s=10, max_backoff_s=40)
    balancer = Balancer(
        "prefill",
        ["http://a", "http://b"],
        request_trials=False,
        clock=clock,
        unpairable_retry=retry,
    )
    a, b = balancer.upstreams
    assert balancer.mark_unpairable(a, "why") == 10
    assert balancer.mark_unpairable(a, "why, again") is None  # the retry time is kept
    assert balancer.ranked() == [b, a] and a.unpairable == "why, again"
    assert not balancer.only_unpairable_left()
    assert balancer.report(a)["state"] == "unpairable" and balancer.is_healthy(a)
    balancer.record_failure(b, "refused")  # b down: a is the last resort, after b
    assert balancer.ranked() == [b, a] and balancer.only_unpairable_left()
    balancer.record_success(b)
    clock.now += 10  # the retry is due: a goes first, once
    assert balancer.ranked() == [a, b]
    balancer.acquire(a)
    balancer.release(a)
    assert balancer.ranked() == [b, a]
    assert balancer.report(a)["unpairable_retry_in_s"] == 20  # doubled
    clock.now += 20
    balancer.acquire(a)
    assert balancer.report(a)["unpairable_retry_in_s"] == 40
    assert balancer.clear_unpairable(a) and not balancer.clear_unpairable(a)
    assert balancer.report(a)["state"] == "healthy"
    assert balancer.report(a)["unpairable_retry_in_s"] is None
