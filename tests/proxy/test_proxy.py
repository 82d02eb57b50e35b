"""The P/D proxy over real loopback HTTP, in front of fake vLLM instances.

The fakes (``fake_vllm.py``) record what they receive, so each test checks both what the client
gets back and what each prefill and decode instance was asked.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fake_vllm import OMIT, FakeVllm
from loopback_server import StartProxy, refusing_port, serve_on_loopback

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.connector.params import MAX_TRANSFER_ID_CHARS
from vllm_ascend_mooncake.handoff import PREFILL_KV_TRANSFER_PARAMS
from vllm_ascend_mooncake.launch.ports import free_port
from vllm_ascend_mooncake.proxy import create_app
from vllm_ascend_mooncake.proxy.balancer import Balancer, EjectionPolicy
from vllm_ascend_mooncake.proxy.cli import main

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
CLIENT_BODIES = {
    COMPLETIONS: {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0.0},
    CHAT: {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 8,
        "max_completion_tokens": 8,
        "seed": 7,
    },
}


@dataclass
class Fleet:
    """Fake instances served for the whole module, and a URL where nothing listens."""

    prefill_a: FakeVllm
    prefill_b: FakeVllm
    decode_a: FakeVllm
    decode_b: FakeVllm
    urls: dict[str, str]
    dead_url: str

    def url(self, fake: FakeVllm) -> str:
        return self.urls[fake.name]

    def all(self) -> list[FakeVllm]:
        return [self.prefill_a, self.prefill_b, self.decode_a, self.decode_b]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    fakes = [FakeVllm(name) for name in ("prefill-a", "prefill-b", "decode-a", "decode-b")]
    with ExitStack() as stack:
        urls = {fake.name: stack.enter_context(serve_on_loopback(fake.app())) for fake in fakes}
        dead_url = stack.enter_context(refusing_port())
        yield Fleet(*fakes, urls=urls, dead_url=dead_url)


@pytest.fixture(autouse=True)
def well_behaved_fleet(fleet: Fleet) -> Iterator[None]:
    for fake in fleet.all():
        fake.reset()
    yield
    for fake in fleet.all():  # never leave a fake stream waiting on a gate
        fake.stream_gate.set()


@pytest.fixture
def proxy(fleet: Fleet, start_proxy: StartProxy) -> httpx.Client:
    """A 1P1D proxy: prefill-a and decode-a."""
    return start_proxy([fleet.url(fleet.prefill_a)], [fleet.url(fleet.decode_a)])


def only_request(fake: FakeVllm) -> dict[str, Any]:
    """The body of the single generation request ``fake`` received."""
    requests = fake.generation_requests()
    assert len(requests) == 1, f"{fake.name} received {len(requests)} requests"
    return requests[0].body


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_non_streamed_request_is_prefilled_then_decoded_with_the_prefill_params(
    fleet: Fleet, proxy: httpx.Client, path: str
) -> None:
    client_body = CLIENT_BODIES[path]

    response = proxy.post(path, json=client_body)

    assert response.status_code == 200
    assert response.json() == fleet.decode_a.completion(path)
    prefill_request = fleet.prefill_a.generation_requests()[0]
    assert prefill_request.path == path
    assert prefill_request.body == {
        **client_body,
        "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS,
        "max_tokens": 1,
        **({"max_completion_tokens": 1} if "max_completion_tokens" in client_body else {}),
        "stream": False,
    }
    assert only_request(fleet.decode_a) == {
        **client_body,
        "kv_transfer_params": fleet.prefill_a.kv_transfer_params,
    }


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_streamed_request_relays_each_event_as_the_decode_sends_it(
    fleet: Fleet, proxy: httpx.Client, path: str
) -> None:
    client_body = {
        **CLIENT_BODIES[path],
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 2,
        "n": 2,
        "temperature": 0.8,
    }
    first_event, *later_events = fleet.decode_a.stream_events(path)
    fleet.decode_a.stream_gate.clear()  # the decode sends its first event, then waits

    with proxy.stream("POST", path, json=client_body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = response.iter_raw()
        received = b""
        while len(received) < len(first_event):
            received += next(chunks)
        assert received == first_event, "the proxy must relay events before the stream ends"
        fleet.decode_a.stream_gate.set()
        received += b"".join(chunks)

    assert received == first_event + b"".join(later_events)
    prefill = only_request(fleet.prefill_a)
    assert prefill["stream"] is False
    assert prefill["max_tokens"] == 1
    assert prefill["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert "stream_options" not in prefill
    assert "min_tokens" not in prefill
    assert prefill["n"] == 1  # the prompt's KV once, not once per sequence
    assert only_request(fleet.decode_a) == {
        **client_body,
        "kv_transfer_params": fleet.prefill_a.kv_transfer_params,
    }


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("status", "body", "media_type"),
    [
        (400, b'{"error": {"message": "prompt is too long", "code": 400}}', "application/json"),
        (503, b"engine is overloaded", "text/plain"),
    ],
    ids=["json-400", "text-503"],
)
def test_prefill_error_reaches_the_client_unchanged_and_skips_decode(
    fleet: Fleet, proxy: httpx.Client, stream: bool, status: int, body: bytes, media_type: str
) -> None:
    fleet.prefill_a.canned_answer = (status, body, media_type)

    response = proxy.post(COMPLETIONS, json={**CLIENT_BODIES[COMPLETIONS], "stream": stream})

    assert response.status_code == status
    assert response.content == body
    assert response.headers["content-type"].startswith(media_type)
    assert fleet.decode_a.generation_requests() == []


@pytest.mark.parametrize("stream", [False, True])
def test_decode_error_reaches_the_client_unchanged(
    fleet: Fleet, proxy: httpx.Client, stream: bool
) -> None:
    error_body = b'{"error": {"message": "KV cache pull failed", "code": 500}}'
    fleet.decode_a.canned_answer = (500, error_body, "application/json")

    response = proxy.post(CHAT, json={**CLIENT_BODIES[CHAT], "stream": stream})

    assert response.status_code == 500
    assert response.content == error_body
    assert len(fleet.decode_a.generation_requests()) == 1


@pytest.mark.parametrize("bad_params", ["engine-1", [1, 2], 7, True])
def test_prefill_params_that_are_not_an_object_give_502_naming_the_prefill(
    fleet: Fleet, proxy: httpx.Client, bad_params: Any
) -> None:
    fleet.prefill_a.kv_transfer_params = bad_params

    response = proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])

    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert fleet.url(fleet.prefill_a) in message
    assert "kv_transfer_params must be a JSON object" in message
    assert fleet.decode_a.generation_requests() == []


def test_prefill_success_without_json_body_gives_502(fleet: Fleet, proxy: httpx.Client) -> None:
    fleet.prefill_a.canned_answer = (200, b"<html>gateway page</html>", "text/html")

    response = proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])

    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert fleet.url(fleet.prefill_a) in message
    assert "not JSON" in message


@pytest.mark.parametrize("missing", [None, OMIT], ids=["null", "absent"])
def test_decode_recomputes_when_prefill_returns_no_params(
    fleet: Fleet, proxy: httpx.Client, missing: object
) -> None:
    fleet.prefill_a.kv_transfer_params = missing

    response = proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])

    assert response.status_code == 200
    assert only_request(fleet.decode_a) == CLIENT_BODIES[COMPLETIONS]


def test_client_request_id_reaches_prefill_decode_and_the_response(
    fleet: Fleet, proxy: httpx.Client
) -> None:
    response = proxy.post(
        COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS], headers={"X-Request-Id": "req-42"}
    )

    assert response.headers["x-request-id"] == "req-42"
    assert fleet.prefill_a.generation_requests()[0].headers["x-request-id"] == "req-42"
    assert fleet.decode_a.generation_requests()[0].headers["x-request-id"] == "req-42"


def test_generated_request_id_is_the_same_for_prefill_and_decode(
    fleet: Fleet, proxy: httpx.Client
) -> None:
    first = proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])
    second = proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])

    prefill_ids = [r.headers["x-request-id"] for r in fleet.prefill_a.generation_requests()]
    decode_ids = [r.headers["x-request-id"] for r in fleet.decode_a.generation_requests()]
    assert (
        prefill_ids == decode_ids == [first.headers["x-request-id"], second.headers["x-request-id"]]
    )
    assert prefill_ids[0] != prefill_ids[1]


def test_request_body_that_is_not_a_json_object_gives_400(
    fleet: Fleet, proxy: httpx.Client
) -> None:
    not_json = proxy.post(COMPLETIONS, content=b"prompt=hello")
    array = proxy.post(COMPLETIONS, json=["prompt"])

    assert not_json.status_code == array.status_code == 400
    assert fleet.prefill_a.generation_requests() == []


def test_deeply_nested_json_gives_400_in_the_openai_shape(
    fleet: Fleet, proxy: httpx.Client
) -> None:
    nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"

    response = proxy.post(COMPLETIONS, content=nested, headers={"X-Request-Id": "deep"})

    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"
    assert response.headers["X-Request-Id"] == "deep"
    assert fleet.prefill_a.generation_requests() == []


def test_oversized_body_gives_413_before_any_upstream_is_asked(
    fleet: Fleet, start_proxy: StartProxy
) -> None:
    proxy = start_proxy(
        [fleet.url(fleet.prefill_a)], [fleet.url(fleet.decode_a)], max_body_bytes=1 << 16
    )
    body = {**CLIENT_BODIES[COMPLETIONS], "prompt": "x" * (1 << 17)}

    declared = proxy.post(COMPLETIONS, json=body)
    chunked = proxy.post(COMPLETIONS, content=iter([json.dumps(body).encode()]))  # no length
    fits = proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])

    for response in (declared, chunked):
        assert response.status_code == 413, response.text
        assert "65536" in response.json()["error"]["message"]
        assert response.headers["X-Request-Id"]
    assert fits.status_code == 200
    assert len(fleet.prefill_a.generation_requests()) == 1


def test_the_proxys_own_errors_carry_the_request_id(fleet: Fleet, start_proxy: StartProxy) -> None:
    unreachable = start_proxy([fleet.dead_url], [fleet.url(fleet.decode_a)])
    slow = start_proxy([fleet.url(fleet.prefill_a)], [fleet.url(fleet.decode_a)], timeout_s=0.3)
    fleet.decode_a.delay_s = 1.5

    answers = {
        400: unreachable.post(COMPLETIONS, content=b"not json", headers={"X-Request-Id": "a"}),
        502: unreachable.post(
            COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS], headers={"X-Request-Id": "b"}
        ),
        504: slow.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS], headers={"X-Request-Id": "c"}),
    }

    for (status, response), request_id in zip(answers.items(), "abc", strict=True):
        assert response.status_code == status
        assert response.headers["X-Request-Id"] == request_id
    generated = unreachable.post(COMPLETIONS, content=b"not json")
    assert generated.headers["X-Request-Id"]  # one is made up when the client sent none


def test_idle_instances_are_used_in_turn(fleet: Fleet, start_proxy: StartProxy) -> None:
    proxy = start_proxy(
        [fleet.url(fleet.prefill_a), fleet.url(fleet.prefill_b)],
        [fleet.url(fleet.decode_a), fleet.url(fleet.decode_b)],
    )

    for _ in range(4):
        assert proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS]).status_code == 200

    for fake in fleet.all():
        assert len(fake.generation_requests()) == 2, fake.name
    engines_pulled_from = Counter(
        request.body["kv_transfer_params"]["remote_engine_id"]
        for decode in (fleet.decode_a, fleet.decode_b)
        for request in decode.generation_requests()
    )
    assert engines_pulled_from == {"engine-prefill-a": 2, "engine-prefill-b": 2}


def test_busy_decode_is_avoided_until_its_stream_ends(
    fleet: Fleet, start_proxy: StartProxy
) -> None:
    proxy = start_proxy(
        [fleet.url(fleet.prefill_a)], [fleet.url(fleet.decode_a), fleet.url(fleet.decode_b)]
    )
    fleet.decode_a.stream_gate.clear()

    streamed_body = {**CLIENT_BODIES[COMPLETIONS], "stream": True}
    with proxy.stream("POST", COMPLETIONS, json=streamed_body) as stream:
        chunks = stream.iter_raw()
        received = next(chunks)  # decode-a is now mid-stream
        for _ in range(2):  # plain round-robin would send one of these to decode-a
            assert proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS]).status_code == 200
        fleet.decode_a.stream_gate.set()
        received += b"".join(chunks)

    assert received == b"".join(fleet.decode_a.stream_events(COMPLETIONS))

    assert len(fleet.decode_a.generation_requests()) == 1
    assert len(fleet.decode_b.generation_requests()) == 2
    ready = proxy.get("/ready").json()
    assert [report["in_flight"] for report in ready["prefill"] + ready["decode"]] == [0, 0, 0]


def test_client_leaving_mid_stream_frees_the_decode(fleet: Fleet, proxy: httpx.Client) -> None:
    fleet.decode_a.stream_gate.clear()

    streamed_body = {**CLIENT_BODIES[COMPLETIONS], "stream": True}
    with proxy.stream("POST", COMPLETIONS, json=streamed_body) as stream:
        next(stream.iter_raw())
    proxy.close()  # the client hangs up while the decode is still streaming

    with httpx.Client(base_url=proxy.base_url, timeout=20, trust_env=False) as observer:
        wait_until(
            lambda: observer.get("/ready").json()["decode"][0]["in_flight"] == 0,
            "the proxy stops counting the abandoned stream",
        )


def test_instances_that_refuse_connections_are_skipped(
    fleet: Fleet, start_proxy: StartProxy
) -> None:
    proxy = start_proxy(
        [fleet.dead_url, fleet.url(fleet.prefill_a)], [fleet.dead_url, fleet.url(fleet.decode_a)]
    )

    for _ in range(3):
        assert proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS]).status_code == 200

    assert len(fleet.prefill_a.generation_requests()) == 3
    assert len(fleet.decode_a.generation_requests()) == 3


def test_no_reachable_decode_gives_502_naming_what_was_tried(
    fleet: Fleet, start_proxy: StartProxy
) -> None:
    proxy = start_proxy([fleet.url(fleet.prefill_a)], [fleet.dead_url])

    response = proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])

    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "no decode instance answered" in message
    assert fleet.dead_url in message
    assert len(fleet.prefill_a.generation_requests()) == 1


def test_no_reachable_prefill_gives_502_and_skips_decode(
    fleet: Fleet, start_proxy: StartProxy
) -> None:
    proxy = start_proxy([fleet.dead_url], [fleet.url(fleet.decode_a)])

    response = proxy.post(COMPLETIONS, json={**CLIENT_BODIES[COMPLETIONS], "stream": True})

    assert response.status_code == 502
    assert "no prefill instance answered" in response.json()["error"]["message"]
    assert fleet.decode_a.generation_requests() == []


def test_slow_upstream_gives_504_after_the_timeout(fleet: Fleet, start_proxy: StartProxy) -> None:
    proxy = start_proxy([fleet.url(fleet.prefill_a)], [fleet.url(fleet.decode_a)], timeout_s=0.3)
    fleet.decode_a.delay_s = 1.5

    started = time.monotonic()
    response = proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])

    assert response.status_code == 504
    assert fleet.url(fleet.decode_a) in response.json()["error"]["message"]
    assert time.monotonic() - started < 1.5


def test_ready_reports_each_upstream_as_the_health_checks_found_it(
    fleet: Fleet, start_proxy: StartProxy
) -> None:
    fleet.decode_b.health_status = 503
    proxy = start_proxy(
        [fleet.url(fleet.prefill_a), fleet.dead_url],
        [fleet.url(fleet.decode_a), fleet.url(fleet.decode_b)],
        ejection=EjectionPolicy(base_backoff_s=600, max_backoff_s=600),  # still ejected when read
    )

    response = proxy.get("/ready")  # waits for the first round of probes

    assert response.status_code == 200
    report = response.json()
    assert report["status"] == "ready"
    assert [(p["url"], p["state"], p["healthy"]) for p in report["prefill"]] == [
        (fleet.url(fleet.prefill_a), "healthy", True),
        (fleet.dead_url, "ejected", False),
    ]
    assert "ConnectError" in report["prefill"][1]["last_failure"]
    assert report["prefill"][1]["ejected_until"] is not None
    assert [(d["healthy"], d["last_failure"]) for d in report["decode"]] == [
        (True, None),
        (False, "health check answered 503"),
    ]
    for entry in report["prefill"] + report["decode"]:
        assert entry["in_flight"] == 0
        assert (entry["consecutive_failures"] == 0) == entry["healthy"]


def test_ready_is_503_without_a_healthy_decode(fleet: Fleet, start_proxy: StartProxy) -> None:
    fleet.decode_a.health_status = 500
    proxy = start_proxy([fleet.url(fleet.prefill_a)], [fleet.url(fleet.decode_a), fleet.dead_url])

    response = proxy.get("/ready")

    assert response.status_code == 503
    assert response.json()["status"] == "unready"
    assert proxy.get("/health").status_code == 200  # the proxy itself is alive


def test_models_come_from_a_decode_instance(fleet: Fleet, start_proxy: StartProxy) -> None:
    proxy = start_proxy([fleet.url(fleet.prefill_a)], [fleet.dead_url, fleet.url(fleet.decode_b)])

    response = proxy.get("/v1/models")

    assert response.status_code == 200
    assert response.json()["data"][0]["owned_by"] == "decode-b"
    assert fleet.prefill_a.received == []


def test_balancer_breaks_ties_round_robin() -> None:
    balancer = Balancer("decode", ["http://a", "http://b/", "http://c"])
    chosen = []
    for _ in range(6):
        upstream = balancer.ranked()[0]
        balancer.acquire(upstream)
        balancer.release(upstream)
        chosen.append(upstream.url)

    assert chosen == ["http://a", "http://b", "http://c"] * 2


def test_balancer_prefers_the_least_busy_instance() -> None:
    balancer = Balancer("decode", ["http://a", "http://b", "http://c"])
    a, b, c = balancer.upstreams
    for upstream in (a, b, c, a):
        balancer.acquire(upstream)  # in flight: a=2, b=1, c=1; the cursor is on b
    balancer.release(c)

    assert balancer.ranked() == [c, b, a]


@pytest.mark.parametrize(
    ("prefill", "decode", "error"),
    [
        ([], ["http://d"], "at least one prefill"),
        (["http://p"], ["http://d", "http://d/"], "listed more than once"),
    ],
)
def test_create_app_rejects_bad_instance_lists(
    prefill: list[str], decode: list[str], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        create_app(prefill, decode)


def test_balancer_refuses_to_release_more_than_it_acquired() -> None:
    balancer = Balancer("prefill", ["http://a"])
    with pytest.raises(RuntimeError, match="released more than acquired"):
        balancer.release(balancer.upstreams[0])


@pytest.mark.parametrize("bad_url", ["127.0.0.1:8100", "http://host:8100/v1", "ftp://host"])
def test_cli_rejects_urls_that_are_not_base_urls(
    bad_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--prefill", bad_url, "--decode", "http://127.0.0.1:8200"])

    assert exit_info.value.code == 2
    assert "--prefill" in capsys.readouterr().err


def test_cli_serves_the_proxy(fleet: Fleet) -> None:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm_ascend_mooncake.proxy",
        "--port",
        str(port),
        "--prefill",
        fleet.url(fleet.prefill_a),
        "--decode",
        fleet.url(fleet.decode_a),
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False) as client:

            def health_answer() -> httpx.Response | None:
                try:
                    return client.get("/health")
                except httpx.ConnectError:
                    assert process.poll() is None, process.stdout.read().decode()
                    return None

            health = wait_until(health_answer, "vam-proxy answers /health", interval_s=0.1)
            completion = client.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])
    finally:
        process.terminate()
        process.wait(timeout=10)

    assert health.status_code == 200
    assert completion.status_code == 200
    assert json.loads(completion.content) == fleet.decode_a.completion(COMPLETIONS)


def overlapped_decode_params(fleet: Fleet, prefill_body: dict[str, Any]) -> dict[str, Any]:
    """What decode must get when the legs overlap: the prefill's address, no block ids."""
    return {
        "do_remote_prefill": True,
        "remote_request_id": prefill_body["kv_transfer_params"]["transfer_id"],
        "remote_engine_id": "engine-prefill-a",
        "remote_host": "127.0.0.1",
        "remote_port": 5555,
        "remote_tp_size": 1,
    }


def test_once_prefill_answered_later_requests_send_both_legs_at_once(
    fleet: Fleet, proxy: httpx.Client
) -> None:
    fleet.prefill_a.hands_off_like_the_connector = True
    assert proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS]).status_code == 200
    fleet.prefill_a.delay_s = 0.5  # decode must be asked while prefill still computes

    response = proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])

    assert response.status_code == 200
    assert response.json() == fleet.decode_a.completion(COMPLETIONS)
    first_prefill, second_prefill = fleet.prefill_a.generation_requests()
    first_decode, second_decode = fleet.decode_a.generation_requests()
    assert first_decode.body["kv_transfer_params"]["remote_block_ids"] == [3, 1, 4]  # serial
    assert "transfer_id" not in first_prefill.body["kv_transfer_params"]
    assert second_prefill.body["kv_transfer_params"] == {
        **PREFILL_KV_TRANSFER_PARAMS,
        "transfer_id": second_prefill.body["kv_transfer_params"]["transfer_id"],
    }
    assert second_decode.body == {
        **CLIENT_BODIES[COMPLETIONS],
        "kv_transfer_params": overlapped_decode_params(fleet, second_prefill.body),
    }
    assert second_decode.at < second_prefill.at + fleet.prefill_a.delay_s


def test_transfer_ids_differ_even_for_one_client_request_id(
    fleet: Fleet, proxy: httpx.Client
) -> None:
    fleet.prefill_a.hands_off_like_the_connector = True
    for _ in range(3):
        response = proxy.post(
            COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS], headers={"X-Request-Id": "same"}
        )
        assert response.status_code == 200
    transfer_ids = [
        r.body["kv_transfer_params"].get("transfer_id")
        for r in fleet.prefill_a.generation_requests()
    ]
    assert transfer_ids[0] is None and len(set(transfer_ids[1:])) == 2
    assert all(t.startswith("same-") for t in transfer_ids[1:])


def test_transfer_ids_fit_the_connectors_limit_whatever_the_client_request_id(
    fleet: Fleet, proxy: httpx.Client
) -> None:
    """A prefill ignores a transfer id longer than MAX_TRANSFER_ID_CHARS, and decode would then
    wait for it in vain: the proxy's ids always fit, and stay unique."""
    fleet.prefill_a.hands_off_like_the_connector = True
    long_id = "r" * 1000
    for _ in range(3):
        response = proxy.post(
            COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS], headers={"X-Request-Id": long_id}
        )
        assert response.status_code == 200
        assert response.headers["X-Request-Id"] == long_id
    transfer_ids = [
        r.body["kv_transfer_params"].get("transfer_id")
        for r in fleet.prefill_a.generation_requests()[1:]
    ]
    assert len(set(transfer_ids)) == 2
    for transfer_id in transfer_ids:
        assert 0 < len(transfer_id) <= MAX_TRANSFER_ID_CHARS and transfer_id.startswith("rrr")


@pytest.mark.parametrize("stream", [False, True])
def test_overlapped_prefill_error_reaches_the_client_and_abandons_the_decode(
    fleet: Fleet, proxy: httpx.Client, stream: bool
) -> None:
    fleet.prefill_a.hands_off_like_the_connector = True
    assert proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS]).status_code == 200
    fleet.prefill_a.canned_answer = (503, b"engine is overloaded", "text/plain")
    fleet.prefill_a.delay_s = 0.3
    fleet.decode_a.delay_s = 3.0  # still waiting for the KV when prefill fails

    response = proxy.post(COMPLETIONS, json={**CLIENT_BODIES[COMPLETIONS], "stream": stream})

    assert (response.status_code, response.content) == (503, b"engine is overloaded")
    assert len(fleet.decode_a.generation_requests()) == 2  # it had been asked, then dropped
    ready = proxy.get("/ready").json()
    assert [report["in_flight"] for report in ready["prefill"] + ready["decode"]] == [0, 0]


def test_serial_legs_when_overlap_is_off(fleet: Fleet, start_proxy: StartProxy) -> None:
    proxy = start_proxy(
        [fleet.url(fleet.prefill_a)], [fleet.url(fleet.decode_a)], overlap_legs=False
    )
    fleet.prefill_a.hands_off_like_the_connector = True
    for _ in range(2):
        assert proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS]).status_code == 200
    for request in fleet.decode_a.generation_requests():
        assert request.body["kv_transfer_params"]["remote_block_ids"] == [3, 1, 4]


def test_a_prefill_that_ignores_the_transfer_id_gets_a_serial_decode_leg(
    fleet: Fleet, proxy: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet.prefill_a.hands_off_like_the_connector = True
    assert proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS]).status_code == 200
    own_id = fleet.prefill_a.connector_params({})  # e.g. an older connector version
    # undone after the test: the fleet serves the whole module
    monkeypatch.setattr(fleet.prefill_a, "connector_params", lambda body, dp_rank=0: own_id)

    response = proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])

    assert response.status_code == 200
    _, overlapped, resent = fleet.decode_a.generation_requests()
    assert "remote_block_ids" not in overlapped.body["kv_transfer_params"]
    assert resent.body["kv_transfer_params"] == own_id
    ready = proxy.get("/ready").json()
    assert [report["in_flight"] for report in ready["decode"]] == [0]


def test_a_prefill_restarted_under_a_new_engine_id_keeps_the_overlapped_decode_leg(
    fleet: Fleet, proxy: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same address, same transfer id, only the engine id is new (prefill restarted): decode's
    early pull follows the restart by itself, so the decode leg is not sent again (a second
    leg would race the first for the one hold, and the loser's pull would fail)."""
    fleet.prefill_a.hands_off_like_the_connector = True
    assert proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS]).status_code == 200
    learned = fleet.prefill_a.connector_params

    def restarted(body, dp_rank=0):
        return {**learned(body, dp_rank), "remote_engine_id": "engine-after-restart"}

    # undone after the test: the fleet serves the whole module
    monkeypatch.setattr(fleet.prefill_a, "connector_params", restarted)
    before = len(fleet.decode_a.generation_requests())

    response = proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])

    assert response.status_code == 200
    legs = fleet.decode_a.generation_requests()[before:]
    assert len(legs) == 1  # the overlapped leg, kept
    assert "remote_block_ids" not in legs[0].body["kv_transfer_params"]
    metrics = proxy.get("/metrics").text
    assert "vam_proxy_decode_resends_total 0.0" in metrics


def test_a_known_prefill_that_went_away_abandons_the_decode_and_goes_serial(
    fleet: Fleet, start_proxy: StartProxy
) -> None:
    gone = FakeVllm("prefill-gone")
    gone.hands_off_like_the_connector = True
    with serve_on_loopback(gone.app()) as url:
        # no probes: the request itself must find the prefill gone while overlapping
        proxy = start_proxy([url], [fleet.url(fleet.decode_a)], health_interval_s=0)
        assert proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS]).status_code == 200
    fleet.decode_a.delay_s = 2.0  # would still wait for the KV

    response = proxy.post(COMPLETIONS, json=CLIENT_BODIES[COMPLETIONS])

    assert response.status_code == 502  # the serial retry found no prefill either
    assert "no prefill instance answered" in response.json()["error"]["message"]
    assert len(gone.generation_requests()) == 1
    ready = proxy.get("/ready").json()
    assert [report["in_flight"] for report in ready["decode"]] == [0]


@pytest.mark.parametrize("stream", [False, True])
def test_timeline_lines_carry_the_transfer_id_prefill_holds_the_kv_under(
    fleet: Fleet, proxy: httpx.Client, stream: bool, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """One line per request: serial legs under prefill's answered id, overlapped ones under the
    proxy's transfer id, with the stamps in the order the request went through them."""
    import logging

    from vllm_ascend_mooncake.proxy import trace as proxy_trace
    from vllm_ascend_mooncake.timeline import TimelineLog, parse_timeline_line

    logger = logging.getLogger("test.proxy.timeline")
    monkeypatch.setattr(
        proxy_trace, "timeline_log", TimelineLog(logger, environ={"VAM_TIMELINE_LOG": "1"})
    )
    fleet.prefill_a.hands_off_like_the_connector = True
    with caplog.at_level(logging.INFO, logger=logger.name):
        for _ in range(2):
            response = proxy.post(
                COMPLETIONS, json={**CLIENT_BODIES[COMPLETIONS], "stream": stream}
            )
            assert response.status_code == 200

        def timeline_lines() -> list | None:
            records = [parse_timeline_line(r.getMessage()) for r in caplog.records]
            records = [r for r in records if r is not None]
            return records if len(records) >= 2 else None

        # a stream's line is written when the proxy closes it, just after the client read it all
        records = wait_until(timeline_lines, "a timeline line for each of the 2 requests")
    serial, overlapped = records
    first_prefill, second_prefill = fleet.prefill_a.generation_requests()
    assert serial["mode"] == "serial"
    assert (
        serial["transfer"]
        == fleet.prefill_a.connector_params(first_prefill.body)["remote_request_id"]
    )
    s = serial["stamps"]
    assert s["received"] <= s["prefill_sent"] <= s["prefill_answered"] <= s["decode_sent"]
    assert s["decode_sent"] <= s["decode_answered"] <= s["done"]
    assert overlapped["mode"] == "overlapped"
    assert overlapped["transfer"] == second_prefill.body["kv_transfer_params"]["transfer_id"]
    o = overlapped["stamps"]
    assert o["received"] <= o["decode_sent"] <= o["prefill_answered"] <= o["done"]
    assert ("first_chunk" in o) == stream


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_legs_failovers_and_in_flight_requests(
    fleet: Fleet, start_proxy: StartProxy
) -> None:
    # no probes, so the first request finds the dead instance (and ejects it) itself
    proxy = start_proxy(
        [fleet.url(fleet.prefill_a)],
        [fleet.dead_url, fleet.url(fleet.decode_a)],
        health_interval_s=0,
    )
    fleet.prefill_a.hands_off_like_the_connector = True
    for stream in (False, True, True):
        body = {**CLIENT_BODIES[COMPLETIONS], "stream": stream}
        assert proxy.post(COMPLETIONS, json=body).status_code == 200

    def scrape() -> tuple[httpx.Response, dict] | None:
        response = proxy.get("/metrics")
        assert response.status_code == 200
        samples = _samples(response.text)
        done = samples.get(("vam_proxy_leg_seconds_count", (("leg", "total"),)), 0)
        return (response, samples) if done >= 3 else None

    # a stream is counted when the proxy closes it
    response, samples = wait_until(scrape, "the proxy counts all 3 requests' total leg")
    assert response.headers["content-type"].startswith("text/plain")
    assert samples[("vam_proxy_requests_total", (("legs", "serial"),))] == 1
    assert samples[("vam_proxy_requests_total", (("legs", "overlapped"),))] == 2
    for leg in ("prefill", "decode_first_chunk", "time_to_first_chunk", "total"):
        assert samples[("vam_proxy_leg_seconds_count", (("leg", leg),))] == 3
    # the dead decode instance is tried first (round-robin ties), ejected, then skipped (tried
    # again only if the 1 s back-off ran out between requests on a slow machine)
    assert samples[("vam_proxy_failovers_total", (("role", "decode"),))] >= 1
    dead = (("instance", fleet.dead_url), ("role", "decode"))
    live = (("instance", fleet.url(fleet.decode_a)), ("role", "decode"))
    assert samples[("vam_proxy_ejections_total", dead)] >= 1
    assert samples[("vam_proxy_ejections_total", live)] == 0
    assert samples[("vam_proxy_upstream_healthy", live)] == 1
    assert samples[("vam_proxy_upstream_healthy", dead)] == 0
    assert samples[("vam_proxy_serial_fallbacks_total", ())] == 0
    in_flight = {
        labels: value
        for (name, labels), value in samples.items()
        if name == "vam_proxy_in_flight_requests"
    }
    assert len(in_flight) == 3 and set(in_flight.values()) == {0}
