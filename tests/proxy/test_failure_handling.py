"""The proxy routes around failing instances: ejection with back-off, background health checks.

The balancer's state machine is tested with a fake clock; the rest over real loopback HTTP, with
fake vLLM servers that are stopped and started again on the same port, ports that refuse
connections, and a port whose connection attempts hang. Nothing asserts how long something took:
the counts (requests each fake received, the proxy's metrics) say what was tried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fake_vllm import FakeVllm
from loopback_server import (
    StartProxy,
    black_hole,
    drops_every_connection,
    refusing_port,
    serve_on_loopback,
)

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.proxy import create_app
from vllm_ascend_mooncake.proxy.balancer import Balancer, CircuitState, EjectionPolicy
from vllm_ascend_mooncake.proxy.cli import build_parser

COMPLETIONS = "/v1/completions"
BODY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8}
#: Long enough that nothing an ejection decides runs out during a test, however slow the VM.
NEVER_EXPIRES = EjectionPolicy(base_backoff_s=600, max_backoff_s=600)
#: Health checks fast enough for a test to see several rounds.
FAST_CHECKS = {"health_interval_s": 0.2, "health_timeout_s": 2.0}


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --- the balancer's state machine ---------------------------------------------------------


def balancer_with(
    urls: Sequence[str] = ("http://a", "http://b", "http://c"),
    policy: EjectionPolicy | None = None,
    request_trials: bool = True,
) -> tuple[Balancer, FakeClock]:
    clock = FakeClock()
    return Balancer("decode", urls, policy, request_trials=request_trials, clock=clock), clock


def test_an_instance_is_ejected_once_its_failures_reach_the_threshold() -> None:
    balancer, _ = balancer_with(policy=EjectionPolicy(failure_threshold=2))
    a = balancer.upstreams[0]

    assert balancer.record_failure(a, "refused") is None
    assert balancer.state(a) is CircuitState.HEALTHY
    assert balancer.record_failure(a, "refused again") == 1.0

    assert balancer.state(a) is CircuitState.EJECTED
    assert not balancer.is_healthy(a)
    assert (a.consecutive_failures, a.last_failure) == (2, "refused again")
    assert balancer.healthy_count() == 2


def test_a_success_between_failures_resets_the_count() -> None:
    balancer, _ = balancer_with(policy=EjectionPolicy(failure_threshold=2))
    a = balancer.upstreams[0]

    balancer.record_failure(a, "refused")
    assert balancer.record_success(a) is False  # it had not been ejected
    assert balancer.record_failure(a, "refused") is None

    assert balancer.state(a) is CircuitState.HEALTHY


def test_back_off_doubles_per_ejection_in_a_row_up_to_the_cap() -> None:
    balancer, clock = balancer_with(policy=EjectionPolicy(base_backoff_s=1, max_backoff_s=5))
    a = balancer.upstreams[0]

    backoffs = []
    for _ in range(6):
        backoff_s = balancer.record_failure(a, "refused")
        backoffs.append(backoff_s)
        assert a.ejected_until == clock.now + backoff_s
        clock.advance(backoff_s)  # half-open: the next failure re-ejects
        assert balancer.state(a) is CircuitState.HALF_OPEN

    assert backoffs == [1, 2, 4, 5, 5, 5]


def test_failures_during_the_back_off_confirm_the_ejection_without_lengthening_it() -> None:
    balancer, clock = balancer_with()
    a = balancer.upstreams[0]
    balancer.record_failure(a, "refused")
    ends = a.ejected_until

    clock.advance(0.5)
    assert balancer.record_failure(a, "refused") is None

    assert (a.ejected_until, a.ejections_in_a_row, a.consecutive_failures) == (ends, 1, 2)
    clock.advance(0.5)
    assert balancer.record_failure(a, "refused") == 2.0  # over: a real re-ejection


def test_half_open_instance_gets_one_trial_request_and_a_success_closes_the_circuit() -> None:
    balancer, clock = balancer_with()
    a, b, c = balancer.upstreams
    balancer.acquire(b)  # b and c are busy, so an idle healthy a would be first
    balancer.acquire(c)
    balancer.record_failure(a, "refused")
    assert balancer.ranked()[-1] is a

    clock.advance(1.0)
    assert balancer.state(a) is CircuitState.HALF_OPEN
    assert balancer.ranked()[0] is a  # back in rotation: idle, so it is the trial
    balancer.acquire(a)
    assert a.trial_in_flight
    assert balancer.ranked()[-1] is a  # one trial at a time

    assert balancer.record_success(a) is True
    assert balancer.state(a) is CircuitState.HEALTHY
    assert (a.consecutive_failures, a.ejections_in_a_row) == (0, 0)
    assert balancer.record_failure(a, "refused") == 1.0  # the back-off starts over


def test_a_failed_trial_re_ejects_with_a_longer_back_off() -> None:
    balancer, clock = balancer_with()
    a = balancer.upstreams[0]
    balancer.record_failure(a, "refused")
    clock.advance(1.0)
    balancer.acquire(a)

    backoff_s = balancer.record_failure(a, "refused")
    balancer.release(a)

    assert backoff_s == 2.0
    assert balancer.state(a) is CircuitState.EJECTED
    assert not a.trial_in_flight


def test_a_trial_released_without_a_verdict_lets_another_request_try() -> None:
    balancer, clock = balancer_with()
    a, b, c = balancer.upstreams
    balancer.acquire(b)
    balancer.acquire(c)
    balancer.record_failure(a, "refused")
    clock.advance(1.0)
    balancer.acquire(a)
    assert balancer.ranked()[-1] is a

    balancer.release(a)  # e.g. the client left while the connection was being made

    assert not a.trial_in_flight
    assert balancer.ranked()[0] is a


def test_without_request_trials_only_a_success_readmits() -> None:
    balancer, clock = balancer_with(request_trials=False)
    a, b, c = balancer.upstreams
    balancer.acquire(b)
    balancer.acquire(c)
    balancer.record_failure(a, "health check answered 503")
    clock.advance(3600)

    assert balancer.state(a) is CircuitState.HALF_OPEN
    assert balancer.ranked() == [b, c, a]  # idle, yet after the busy healthy ones
    balancer.acquire(a)  # only when every other instance failed too
    assert not a.trial_in_flight
    balancer.release(a)

    assert balancer.record_success(a) is True  # a passing health probe
    assert balancer.ranked()[0] is a


def test_ejected_instances_rank_after_every_healthy_one_however_busy() -> None:
    balancer, _ = balancer_with()
    a, b, c = balancer.upstreams
    for _ in range(3):
        balancer.acquire(b)
    balancer.acquire(c)
    balancer.record_failure(a, "refused")

    assert balancer.ranked() == [c, b, a]


def test_when_every_instance_is_ejected_all_are_still_ranked_soonest_back_off_end_first() -> None:
    balancer, clock = balancer_with()
    a, b, c = balancer.upstreams
    balancer.record_failure(b, "refused")  # ejected until 1001
    clock.advance(0.5)
    balancer.record_failure(c, "refused")  # until 1001.5
    clock.advance(0.25)
    balancer.record_failure(a, "refused")  # until 1001.75, though first in round-robin order

    assert balancer.healthy_count() == 0
    assert balancer.ranked() == [b, c, a]


def test_report_says_how_routing_sees_an_instance() -> None:
    balancer, clock = balancer_with()
    a, b, _ = balancer.upstreams
    balancer.record_failure(a, "ConnectError: refused")
    clock.advance(0.25)
    balancer.acquire(b)

    assert balancer.report(a) == {
        "url": "http://a",
        "state": "ejected",
        "healthy": False,
        "in_flight": 0,
        "consecutive_failures": 1,
        "ejected_for_s": 0.75,
        "last_failure": "ConnectError: refused",
        "unpairable": None,
        "unpairable_retry_in_s": None,
    }
    assert balancer.report(b)["in_flight"] == 1
    assert balancer.report(b)["ejected_for_s"] is None


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"failure_threshold": 0}, "at least 1 failure"),
        ({"base_backoff_s": 0}, "must be positive"),
        ({"base_backoff_s": 2, "max_backoff_s": 1}, "must be at least the first"),
    ],
)
def test_ejection_policy_rejects_settings_that_cannot_work(
    options: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        EjectionPolicy(**options)


@pytest.mark.parametrize(
    ("flag", "value", "error"),
    [
        ("--health-interval-s", "-1", "or 0 to turn it off"),
        ("--eject-after-failures", "0", "at least 1 failure"),
        ("--max-eject-s", "0.5", "at least the first ejection's 1 s"),
        ("--connect-timeout-s", "0", "must be positive"),
    ],
)
def test_cli_rejects_failure_handling_settings_that_cannot_work(
    flag: str, value: str, error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, flag, value])
    assert error in capsys.readouterr().err


def test_cli_passes_the_failure_handling_settings() -> None:
    args = build_parser().parse_args(
        [
            *("--prefill", "http://p:1", "--decode", "http://d:2", "--health-interval-s", "0"),
            *("--eject-after-failures", "2", "--max-eject-s", "60", "--health-timeout-s", "1"),
        ]
    )

    assert (args.health_interval_s, args.eject_after_failures) == (0, 2)
    assert (args.max_eject_s, args.health_timeout_s, args.connect_timeout_s) == (60, 1, 10)


# --- over real HTTP -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefill() -> Iterator[tuple[FakeVllm, str]]:
    fake = FakeVllm("prefill")
    with serve_on_loopback(fake.app()) as url:
        yield fake, url


@pytest.fixture(scope="module")
def decode() -> Iterator[tuple[FakeVllm, str]]:
    fake = FakeVllm("decode-live")
    with serve_on_loopback(fake.app()) as url:
        yield fake, url


@pytest.fixture(autouse=True)
def fresh_fakes(prefill: tuple[FakeVllm, str], decode: tuple[FakeVllm, str]) -> None:
    prefill[0].reset()
    decode[0].reset()


class Restartable:
    """A fake instance that can be stopped and started again on the same port."""

    def __init__(self, name: str) -> None:
        self.fake = FakeVllm(name)
        self._stack = ExitStack()
        self.url = self._stack.enter_context(serve_on_loopback(self.fake.app()))
        self.port = urlsplit(self.url).port

    def stop(self) -> None:
        self._stack.close()

    def start(self) -> None:
        self._stack = ExitStack()
        self._stack.enter_context(serve_on_loopback(self.fake.app(), port=self.port))


@contextmanager
def restartable(name: str) -> Iterator[Restartable]:
    server = Restartable(name)
    try:
        yield server
    finally:
        server.stop()


def metric_samples(proxy: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(proxy.get("/metrics").text)
        for sample in family.samples
    }


def failovers(proxy: httpx.Client, role: str) -> float:
    return metric_samples(proxy).get(("vam_proxy_failovers_total", (("role", role),)), 0.0)


def instance_metric(proxy: httpx.Client, name: str, role: str, url: str) -> float:
    return metric_samples(proxy)[(name, (("instance", url), ("role", role)))]


def entry(proxy: httpx.Client, role: str, url: str) -> dict[str, Any]:
    """The ``/ready`` entry of one instance."""
    return next(e for e in proxy.get("/ready").json()[role] if e["url"] == url)


def complete(proxy: httpx.Client) -> httpx.Response:
    return proxy.post(COMPLETIONS, json=BODY)


def test_a_dead_decode_is_ejected_after_its_first_refusal_and_not_tried_again(
    prefill: tuple[FakeVllm, str], decode: tuple[FakeVllm, str], start_proxy: StartProxy
) -> None:
    live, live_url = decode
    with refusing_port() as dead_url:
        # No probes: the requests themselves must find the dead instance.
        proxy = start_proxy(
            [prefill[1]], [dead_url, live_url], health_interval_s=0, ejection=NEVER_EXPIRES
        )

        answers = [complete(proxy) for _ in range(6)]

        assert [answer.status_code for answer in answers] == [200] * 6
        assert len(live.generation_requests()) == 6
        # Round-robin alone would have tried the dead instance first on every other request.
        assert failovers(proxy, "decode") == 1
        assert instance_metric(proxy, "vam_proxy_ejections_total", "decode", dead_url) == 1
        assert instance_metric(proxy, "vam_proxy_upstream_healthy", "decode", dead_url) == 0
        dead = entry(proxy, "decode", dead_url)
        assert (dead["state"], dead["consecutive_failures"]) == ("ejected", 1)
        assert "ConnectError" in dead["last_failure"]


def test_http_error_statuses_are_relayed_and_never_eject(
    prefill: tuple[FakeVllm, str], decode: tuple[FakeVllm, str], start_proxy: StartProxy
) -> None:
    live, live_url = decode
    live.canned_answer = (500, b'{"error": {"message": "pull failed"}}', "application/json")
    proxy = start_proxy([prefill[1]], [live_url], health_interval_s=0)

    answers = [complete(proxy) for _ in range(3)]

    assert [answer.status_code for answer in answers] == [500] * 3
    assert entry(proxy, "decode", live_url)["state"] == "healthy"
    assert instance_metric(proxy, "vam_proxy_ejections_total", "decode", live_url) == 0


def test_a_restarted_instance_is_readmitted_by_the_health_checks_and_no_request_fails(
    prefill: tuple[FakeVllm, str],
    decode: tuple[FakeVllm, str],
    start_proxy: StartProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    live, live_url = decode
    with restartable("decode-restarting") as server, caplog.at_level(logging.INFO):
        proxy = start_proxy([prefill[1]], [server.url, live_url], **FAST_CHECKS)
        assert complete(proxy).status_code == 200
        assert complete(proxy).status_code == 200
        assert len(server.fake.generation_requests()) == 1  # both in rotation

        server.stop()
        wait_until(
            lambda: entry(proxy, "decode", server.url)["state"] != "healthy",
            "the health checks eject the stopped instance",
        )
        live.received.clear()
        while_down = [complete(proxy) for _ in range(4)]
        assert len(live.generation_requests()) == 4
        server.fake.received.clear()
        server.start()
        wait_until(
            lambda: entry(proxy, "decode", server.url)["state"] == "healthy",
            "the health checks readmit the restarted instance",
        )
        after = [complete(proxy) for _ in range(4)]

        assert [answer.status_code for answer in while_down + after] == [200] * 8
        assert failovers(proxy, "decode") == 0  # the probes found it down, not a request
        assert len(server.fake.generation_requests()) == 2  # back in the rotation
        assert instance_metric(proxy, "vam_proxy_ejections_total", "decode", server.url) >= 1
        assert instance_metric(proxy, "vam_proxy_upstream_healthy", "decode", server.url) == 1
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if server.url in r.getMessage()]
    assert any(level == logging.WARNING and "ejected" in text for level, text in messages)
    assert any(
        level == logging.INFO and "readmitted" in text and "health check" in text
        for level, text in messages
    )


def test_ready_is_503_while_every_decode_is_down_and_200_once_one_is_back(
    prefill: tuple[FakeVllm, str], start_proxy: StartProxy
) -> None:
    with restartable("decode-only") as server, refusing_port() as dead_url:
        proxy = start_proxy([prefill[1]], [dead_url, server.url], **FAST_CHECKS)
        assert proxy.get("/ready").status_code == 200

        server.stop()
        wait_until(lambda: proxy.get("/ready").status_code == 503, "/ready turns 503")
        report = proxy.get("/ready").json()
        down = complete(proxy)  # every decode ejected: still tried, and both refuse

        server.start()
        wait_until(lambda: proxy.get("/ready").status_code == 200, "/ready turns 200")
        up = complete(proxy)

    assert report["status"] == "unready"
    assert [d["healthy"] for d in report["decode"]] == [False, False]
    assert [p["healthy"] for p in report["prefill"]] == [True]
    assert down.status_code == 502
    assert dead_url in down.json()["error"]["message"]
    assert server.url in down.json()["error"]["message"]
    assert up.status_code == 200


def test_when_every_instance_is_ejected_the_first_one_back_is_used_at_once(
    prefill: tuple[FakeVllm, str], start_proxy: StartProxy
) -> None:
    with restartable("decode-flaky") as server:
        # No probes, and a back-off that outlasts the test: only "still try them" can help.
        proxy = start_proxy([prefill[1]], [server.url], health_interval_s=0, ejection=NEVER_EXPIRES)
        server.stop()
        assert complete(proxy).status_code == 502
        assert entry(proxy, "decode", server.url)["state"] == "ejected"

        server.start()
        answer = complete(proxy)

        assert answer.status_code == 200
        assert entry(proxy, "decode", server.url)["state"] == "healthy"


def test_health_is_answered_by_the_proxy_alone(
    prefill: tuple[FakeVllm, str], decode: tuple[FakeVllm, str], start_proxy: StartProxy
) -> None:
    proxy = start_proxy([prefill[1]], [decode[1]], health_interval_s=0)
    with refusing_port() as dead_url:
        orphan = start_proxy([dead_url], [dead_url], health_interval_s=0)

        answers = [proxy.get("/health") for _ in range(5)] + [orphan.get("/health")]

    assert [answer.status_code for answer in answers] == [200] * 6
    assert answers[0].json() == {"status": "alive"}
    assert prefill[0].health_checks == decode[0].health_checks == 0
    assert prefill[0].received == decode[0].received == []


def test_a_black_holed_decode_costs_one_connect_timeout_not_one_per_request(
    prefill: tuple[FakeVllm, str], decode: tuple[FakeVllm, str], start_proxy: StartProxy
) -> None:
    live, live_url = decode
    with black_hole() as hole_url:
        proxy = start_proxy(
            [prefill[1]],
            [hole_url, live_url],
            health_interval_s=0,
            connect_timeout_s=1.0,
            ejection=NEVER_EXPIRES,
        )

        answers = [complete(proxy) for _ in range(6)]

        assert [answer.status_code for answer in answers] == [200] * 6
        assert len(live.generation_requests()) == 6
        assert failovers(proxy, "decode") == 1
        hole = entry(proxy, "decode", hole_url)
        assert hole["state"] == "ejected"
        assert "ConnectTimeout" in hole["last_failure"]


@pytest.mark.parametrize("overlap_legs", [True, False], ids=["overlapped", "serial"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_instance_that_drops_requests_unanswered_costs_the_client_nothing(
    prefill: tuple[FakeVllm, str],
    decode: tuple[FakeVllm, str],
    start_proxy: StartProxy,
    role: str,
    overlap_legs: bool,
) -> None:
    """A prefill restarting after a crash accepts connections before its engine is ready and
    drops them unanswered; the chaos run (#27) saw its half-open trials answered 502 ("Server
    disconnected without sending a response"). Nothing was answered, so the proxy moves on."""
    with drops_every_connection() as dropping_url:
        live = {"prefill": prefill, "decode": decode}[role]
        urls = {"prefill": [prefill[1]], "decode": [decode[1]]}
        urls[role] = [dropping_url, live[1]]
        proxy = start_proxy(
            urls["prefill"],
            urls["decode"],
            health_interval_s=0,
            ejection=NEVER_EXPIRES,
            overlap_legs=overlap_legs,
        )

        answers = [complete(proxy) for _ in range(6)]

        assert [answer.status_code for answer in answers] == [200] * 6
        assert len(live[0].generation_requests()) == 6
        dropping = entry(proxy, role, dropping_url)
        assert dropping["state"] == "ejected"
        assert "RemoteProtocolError" in dropping["last_failure"]


def test_an_instance_whose_health_check_hangs_is_ejected_and_gets_no_requests(
    prefill: tuple[FakeVllm, str], decode: tuple[FakeVllm, str], start_proxy: StartProxy
) -> None:
    live, live_url = decode
    with restartable("decode-hung") as hung:
        hung.fake.health_delay_s = 30.0  # accepts, then never answers in time
        proxy = start_proxy([prefill[1]], [hung.url, live_url], **FAST_CHECKS)
        stuck = entry(proxy, "decode", hung.url)  # /ready waits for the first round of probes

        answers = [complete(proxy) for _ in range(6)]

    assert stuck["state"] != "healthy"
    assert "ReadTimeout" in stuck["last_failure"]
    assert [answer.status_code for answer in answers] == [200] * 6
    assert hung.fake.generation_requests() == []
    assert len(live.generation_requests()) == 6


def test_health_checks_stop_with_the_proxy(
    prefill: tuple[FakeVllm, str], decode: tuple[FakeVllm, str]
) -> None:
    app = create_app([prefill[1]], [decode[1]], health_interval_s=0.05)
    with serve_on_loopback(app):
        wait_until(lambda: decode[0].health_checks >= 3, "the proxy probes every 50 ms")
    time.sleep(0.2)  # a probe sent just before the stop may still be on its way
    probes_after_shutdown = decode[0].health_checks

    time.sleep(0.5)  # ten intervals

    assert decode[0].health_checks == probes_after_shutdown


def test_a_keep_alive_connection_closed_at_reuse_does_not_fail_a_health_check() -> None:
    """A healthy decode was ejected twice within 10 s while it served requests ("health check:
    RemoteProtocolError: Server disconnected without sending a response", #27): the server had
    closed the pooled connection just as the probe reused it. One retry on a new connection."""
    import asyncio

    from loopback_server import one_request_per_connection

    from vllm_ascend_mooncake.proxy.health import HealthChecker, UpstreamOutcomes
    from vllm_ascend_mooncake.proxy.metrics import ProxyMetrics

    async def probe_three_times(url: str) -> Balancer:
        balancer = Balancer("decode", [url], EjectionPolicy(failure_threshold=1))
        async with httpx.AsyncClient() as client:
            checker = HealthChecker(client, [balancer], UpstreamOutcomes(ProxyMetrics([balancer])))
            for _ in range(3):  # the 2nd and 3rd reuse the pooled connection
                await checker.check_all()
                assert balancer.upstreams[0].consecutive_failures == 0
        return balancer

    with one_request_per_connection() as url:
        balancer = asyncio.run(probe_three_times(url))
    assert balancer.state(balancer.upstreams[0]) is CircuitState.HEALTHY


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
def test_a_prefill_killed_before_its_first_token_costs_the_client_nothing(
    start_proxy: StartProxy, streamed: bool
) -> None:
    """The chaos run (#43) saw a client answered 502 ("incomplete chunked read") when the
    prefill its streamed first-token leg went to was killed mid-stream. The client had seen
    nothing, so the proxy asks another prefill, as for one that never answered."""
    dying, live, decode = FakeVllm("dying"), FakeVllm("live"), FakeVllm("decode")
    for fake in (dying, live, decode):
        fake.generates = fake.hands_off_like_the_connector = True
    with ExitStack() as stack:
        dying_url, live_url, decode_url = (
            stack.enter_context(serve_on_loopback(fake.app())) for fake in (dying, live, decode)
        )
        proxy = start_proxy(
            [dying_url, live_url],
            [decode_url],
            first_token="prefill",
            health_interval_s=0,
            ejection=NEVER_EXPIRES,
        )
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for _ in range(2):  # whole legs teach the proxy both prefills' addresses
            assert proxy.post("/v1/chat/completions", json=chat).is_success
        assert len(dying.generation_requests()) == 1
        dying.stream_ends_early = "dies"

        answers = [
            proxy.post("/v1/chat/completions", json={**chat, "stream": streamed}) for _ in range(4)
        ]

        assert [answer.status_code for answer in answers] == [200] * 4
        for answer in answers:
            assert '"error"' not in answer.text, answer.text
            if streamed:
                assert answer.text.endswith("data: [DONE]\n\n")
        dying_legs = dying.generation_requests()[1:]
        assert [leg.body["stream"] for leg in dying_legs] == [True]  # then it was ejected
        assert "before its first token" in entry(proxy, "prefill", dying_url)["last_failure"]
