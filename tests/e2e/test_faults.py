"""Fault injection with real `vllm serve` instances on loopback.

Every request must end within its configured timeouts; outputs either match what a colocated
instance answers or are clean errors; no KV blocks leak on either side; the decode instance keeps
serving everyone else. One prefill (TP 1) and two decode instances share a deployment: one decode
recomputes failed loads (``kv_load_failure_policy=recompute``), the other fails them. Their side
channel is authenticated with a shared secret; every scenario through the proxy runs with
overlapped and with serial legs, decode sampling the first token (``--first-token decode``: the
legs these faults strike; a request continued from prefill's token is one serial leg each, whose
failures ``tests/proxy/test_continuation.py`` covers).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from pd_checks import metric, settled_totals, transfer_evidence, wait_for_metric

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.connector.params import release_target
from vllm_ascend_mooncake.handoff import SECRET_ENV
from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.ports import free_port
from vllm_ascend_mooncake.launch.prometheus import metric_sum, metrics_text
from vllm_ascend_mooncake.launch.servers import process_group_members
from vllm_ascend_mooncake.launch.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.engine

SIDE_CHANNEL_TIMEOUT_S = 2.0
RELEASE_TIMEOUT_S = 8.0
# Metadata fetch: 3 attempts of SIDE_CHANNEL_TIMEOUT_S plus 1.2 s of backoff, then the claim.
FAILURE_BOUND_S = 4 * SIDE_CHANNEL_TIMEOUT_S + 1.2 + 10.0
MAX_NUM_SEQS = 2
MAX_MODEL_LEN = 1024  # the tiny model's longest context: long generations keep decode busy
PROMPT = " ".join(f"fault{i} tolerant decoding" for i in range(12))
OTHER = "a second prompt that keeps the decode instance busy " * 3


def completion(url: str, name: str, prompt: str, **extra) -> httpx.Response:
    body = {
        "model": name,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def tokens(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


class LeavingClient:
    """A streamed completion over a plain socket, so the test picks the instant its client hangs
    up (an HTTP library's read timeout would tie that instant to how fast the machine decodes)."""

    def __init__(self, url: str, name: str, prompt: str, **extra) -> None:
        address = httpx.URL(url)
        body = json.dumps(
            {
                "model": name,
                "prompt": prompt,
                "max_tokens": 50,
                "temperature": 0,
                "stream": True,
                **extra,
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {address.host}:{address.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self._socket = socket.create_connection((address.host, address.port), timeout=30)
        self._socket.sendall(head.encode() + body)

    def hang_up(self) -> bool:
        """Close the connection; True if a token (or the end of the answer) had arrived."""
        received = b""
        self._socket.setblocking(False)
        try:
            while chunk := self._socket.recv(65536):
                received += chunk
        except BlockingIOError:
            pass
        finally:
            self._socket.close()
        return b'"choices"' in received or b"[DONE]" in received


def signal_all(pids: list[int], signum: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def usage(url: str) -> float:
    return metric(url, "vllm:kv_cache_usage_perc")


def wait_no_blocks_in_use(url: str, within_s: float) -> None:
    wait_until(
        lambda: usage(url) <= 0, f"{url} frees every KV block", timeout_s=within_s, interval_s=0.5
    )


def assert_no_failed_pull_since(pd: LocalDeployment, failed_before: int) -> None:
    """The recomputing decode would hide a failed pull behind a right answer: count them."""
    assert settled_totals(pd)["failed"] == failed_before, transfer_evidence(pd)


def admitted(url: str) -> float:
    """Requests the engine at ``url`` has taken in since it started: those waiting, running
    and finished (one scrape, so the three agree)."""
    text = metrics_text(url)
    return sum(
        metric_sum(text, name)
        for name in (
            "vllm:num_requests_waiting",
            "vllm:num_requests_running",
            "vllm:request_success_total",
        )
    )


def prefill_params(pd: LocalDeployment, name: str, prompt: str) -> dict:
    response = completion(
        pd.prefill.base_url,
        name,
        prompt,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True},
    )
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    model = str(build_tiny_model(TinyModelSpec(num_kv_heads=2, dtype="float32")))
    spec = DeploymentSpec(
        model=model,
        prefill_tp=1,
        decode_tp=1,
        decode_failure_policy="recompute",
        prefill_engine_id="faults-prefill",
        release_timeout_s=RELEASE_TIMEOUT_S,
        max_model_len=MAX_MODEL_LEN,
        extra_connector_config={"side_channel_timeout_s": SIDE_CHANNEL_TIMEOUT_S},
        log_dir=str(tmp_path_factory.mktemp("faults")),
        # A small batch, so that requests queue on a busy decode (client hang-up test).
        decode_args=("--max-num-seqs", str(MAX_NUM_SEQS)),
        # Faults with an authenticated side channel (the other E2E tests run without one).
        extra_env={SECRET_ENV: "fault-suite-side-channel-secret"},
        proxy_args=("--first-token", "decode"),
    )
    pd = LocalDeployment(spec)
    strict = pd.add_server("kv_consumer", name="decode-fail", decode_failure_policy="fail")
    with pd:
        name = httpx.get(f"{pd.decode.base_url}/v1/models").json()["data"][0]["id"]
        reference = {p: tokens(completion(pd.prefill.base_url, name, p)) for p in (PROMPT, OTHER)}
        yield pd, strict, name, reference


@pytest.fixture(scope="module")
def serial_proxy_url(deployment) -> str:
    """A second proxy in front of the same instances that never overlaps the legs."""
    return deployment[0].add_proxy("--serial-legs", "--first-token", "decode")


@pytest.fixture(params=["overlapped", "serial"])
def proxy_url(request, deployment) -> str:
    """Each fault through the proxy both ways: the default proxy, which sends both legs at once
    once it knows the prefill (a first request teaches it), and one with ``--serial-legs``."""
    if request.param == "serial":
        return request.getfixturevalue("serial_proxy_url")
    pd, _, name, reference = deployment
    assert tokens(completion(pd.proxy_url, name, OTHER)) == reference[OTHER]
    return pd.proxy_url


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda p: {**p, "remote_block_ids": "all of them"}, id="wrong-type"),
        pytest.param(lambda p: {**p, "remote_num_tokens": 3}, id="other-prompt-length"),
        pytest.param(lambda p: {**p, "remote_block_ids": [0] * 100000}, id="huge-block-list"),
        pytest.param(lambda p: {k: v for k, v in p.items() if k != "remote_host"}, id="missing"),
    ],
)
def test_malformed_params_fall_back_to_local_prefill(deployment, corrupt) -> None:
    """Decode computes the prompt itself; when the params still say which prefill holds the
    KV, decode tells it, and prefill frees the blocks at once rather than at its timeout."""
    pd, strict, name, reference = deployment
    expired_before = pd.transfer_totals()["expired"]
    params = corrupt(prefill_params(pd, name, PROMPT))
    for url in (pd.decode.base_url, strict.base_url):
        assert tokens(completion(url, name, PROMPT, kv_transfer_params=params)) == reference[PROMPT]
    if release_target(params) is not None:
        wait_no_blocks_in_use(pd.prefill.base_url, RELEASE_TIMEOUT_S / 2)
        assert pd.transfer_totals()["expired"] == expired_before


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(
            lambda p: {**p, "remote_block_ids": [10**7] * len(p["remote_block_ids"])},
            id="out-of-range-blocks",
        ),
        pytest.param(lambda p: {**p, "remote_engine_id": "someone-else"}, id="unknown-engine"),
        pytest.param(lambda p: {**p, "remote_port": free_port()}, id="unreachable-prefill"),
    ],
)
def test_unloadable_kv_is_recomputed_or_a_clean_error(deployment, corrupt) -> None:
    pd, strict, name, reference = deployment
    params = corrupt(prefill_params(pd, name, PROMPT))
    started = time.monotonic()
    assert (
        tokens(completion(pd.decode.base_url, name, PROMPT, kv_transfer_params=params))
        == (reference[PROMPT])
    )
    failed = completion(strict.base_url, name, PROMPT, kv_transfer_params=params)
    assert failed.status_code >= 400 and "error" in failed.json()
    assert time.monotonic() - started < 2 * FAILURE_BOUND_S
    # Both decode instances still serve other requests through P/D.
    for url in (pd.decode.base_url, strict.base_url):
        good = prefill_params(pd, name, OTHER)
        assert tokens(completion(url, name, OTHER, kv_transfer_params=good)) == reference[OTHER]
    wait_no_blocks_in_use(pd.prefill.base_url, RELEASE_TIMEOUT_S + 10)


def test_prefill_eos_on_its_single_token_still_hands_off(deployment, proxy_url) -> None:
    pd, _, name, _ = deployment
    failed_before = pd.transfer_totals()["failed"]
    first = completion(pd.prefill.base_url, name, PROMPT, max_tokens=1, return_token_ids=True)
    first_token = first.json()["choices"][0]["token_ids"][0]
    # Prefill's single token is a stop token: it finishes FINISHED_STOPPED, not length-capped.
    stop = {"stop_token_ids": [first_token], "ignore_eos": False, "return_token_ids": True}
    proxied = completion(proxy_url, name, PROMPT, **stop)
    colocated = completion(pd.prefill.base_url, name, PROMPT, **stop)
    assert proxied.status_code == colocated.status_code == 200, proxied.text
    assert proxied.json()["choices"][0]["token_ids"] == colocated.json()["choices"][0]["token_ids"]
    assert proxied.json()["choices"][0]["finish_reason"] == "stop"
    assert_no_failed_pull_since(pd, failed_before)
    wait_no_blocks_in_use(pd.prefill.base_url, RELEASE_TIMEOUT_S + 10)


def test_aborted_streams_leak_no_blocks(deployment, proxy_url) -> None:
    pd, _, name, _ = deployment
    failed_before = pd.transfer_totals()["failed"]
    for _ in range(3):
        body = {
            "model": name,
            "prompt": PROMPT,
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"{proxy_url}/v1/completions", json=body, timeout=300
        ) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # first chunk, then hang up
    assert_no_failed_pull_since(pd, failed_before)
    wait_no_blocks_in_use(pd.decode.base_url, 30)
    wait_no_blocks_in_use(pd.prefill.base_url, RELEASE_TIMEOUT_S + 10)


def test_decode_that_never_reads_is_released_by_prefill(deployment) -> None:
    pd, _, name, _ = deployment
    for _ in range(2):
        prefill_params(pd, name, OTHER)  # handed off, but no decode instance ever asks
    wait_until(  # the gauge is refreshed once per engine step
        lambda: usage(pd.prefill.base_url) != 0,
        "prefill holds the handed-off blocks",
        timeout_s=5,
        interval_s=0.2,
    )
    wait_no_blocks_in_use(pd.prefill.base_url, RELEASE_TIMEOUT_S + 10)


def test_a_decode_request_queued_past_the_release_timeout_keeps_its_kv(
    deployment, proxy_url
) -> None:
    """Issue #27 item 4: a decode request that waits in decode's queue longer than prefill's
    ``release_timeout_s`` found its KV released (HTTP 500, or a recompute). Decode's engine is
    frozen here (its API server keeps accepting requests) for 1.5 release timeouts after prefill
    answered, so the request waits and nothing claims meanwhile, as in a full queue, whatever the
    machine's speed; the proxy renews prefill's hold, and once the engine runs it pulls the KV:
    the answer is right, no pull failed (none recomputed), no block was released by timeout."""
    pd, _, name, reference = deployment
    before = settled_totals(pd)
    prompts_before = metric(pd.prefill.base_url, "vllm:prompt_tokens_total")
    engine = [pid for pid in process_group_members(pd.decode.pid) if pid != pd.decode.pid]
    assert engine, "decode runs no engine process of its own"
    signal_all(engine, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(completion, proxy_url, name, PROMPT)
            wait_for_metric(
                pd.prefill.base_url,
                "vllm:prompt_tokens_total",
                prompts_before + 1,
                "prefill never computed the prompt",
            )
            time.sleep(1.5 * RELEASE_TIMEOUT_S)  # the fault's length, not a wait for speed
            signal_all(engine, signal.SIGCONT)
            assert tokens(answer.result()) == reference[PROMPT]
    finally:
        signal_all(engine, signal.SIGCONT)
    after = settled_totals(pd)
    assert after["failed"] == before["failed"], transfer_evidence(pd)
    assert after["expired"] == before["expired"], f"prefill released by timeout; {pd.log_dir}"
    assert after["successful"] == before["successful"] + 1
    assert_engines_alive(pd.decode.base_url, pd.prefill.base_url)
    wait_no_blocks_in_use(pd.prefill.base_url, 30)


def test_killed_prefill_then_restart_under_the_same_engine_id(deployment) -> None:
    pd, strict, name, reference = deployment
    params = prefill_params(pd, name, PROMPT)
    pd.kill("prefill")
    started = time.monotonic()
    assert (
        tokens(completion(pd.decode.base_url, name, PROMPT, kv_transfer_params=params))
        == (reference[PROMPT])
    )
    failed = completion(strict.base_url, name, PROMPT, kv_transfer_params=params)
    assert failed.status_code >= 400
    assert time.monotonic() - started < 2 * FAILURE_BOUND_S

    pd.restart("prefill")
    # Same engine id, same ports, new worker incarnation: decode re-fetches and serves.
    assert tokens(completion(pd.proxy_url, name, OTHER)) == reference[OTHER]
    stale_params = params  # KV of the dead instance: must never be read from the new one
    assert (
        tokens(completion(pd.decode.base_url, name, PROMPT, kv_transfer_params=stale_params))
        == reference[PROMPT]
    )
    wait_no_blocks_in_use(pd.prefill.base_url, RELEASE_TIMEOUT_S + 10)
    wait_no_blocks_in_use(pd.decode.base_url, 30)


def assert_recovered(pd: LocalDeployment, failed_before: int) -> None:
    """After a restart: no pull failed since, both engines alive, every block free."""
    assert settled_totals(pd)["failed"] == failed_before, "a pull after the restart failed"
    assert_engines_alive(pd.decode.base_url, pd.prefill.base_url)
    wait_no_blocks_in_use(pd.prefill.base_url, 30)
    wait_no_blocks_in_use(pd.decode.base_url, 30)


def legs(pd: LocalDeployment, proxy_url: str) -> str:
    return "overlapped" if proxy_url == pd.proxy_url else "serial"


def assert_engines_alive(*urls: str) -> None:
    """``/health`` is 200 only while the engine core runs, not just the API server."""
    for url in urls:
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200, url


def test_prompt_logprobs_through_the_proxy_keep_decode_alive(deployment, proxy_url) -> None:
    """vLLM loads no external KV for a prompt_logprobs request: its pull only releases prefill's
    hold, and reporting it to vLLM as loaded used to kill the decode engine core."""
    pd, _, name, reference = deployment
    response = completion(proxy_url, name, PROMPT, prompt_logprobs=1)
    assert tokens(response) == reference[PROMPT]
    assert response.json()["choices"][0]["prompt_logprobs"]
    assert_engines_alive(pd.decode.base_url, pd.prefill.base_url)
    assert tokens(completion(proxy_url, name, OTHER)) == reference[OTHER]
    wait_no_blocks_in_use(pd.prefill.base_url, 30)
    wait_no_blocks_in_use(pd.decode.base_url, 30)


def test_several_sequences_per_request_pull_once_and_answer_right(deployment, proxy_url) -> None:
    """n > 1: the proxy prefills one sequence; decode's sequences share the params, the first
    pulls and the others compute locally (prefill frees its copy after the first read)."""
    pd, _, name, _ = deployment
    sampling = {"n": 2, "temperature": 0.8, "seed": 7}
    colocated = completion(pd.prefill.base_url, name, PROMPT, **sampling)
    assert colocated.status_code == 200, colocated.text
    failed_before = pd.transfer_totals()["failed"]
    for _ in range(2):
        response = completion(proxy_url, name, PROMPT, **sampling)
        assert response.status_code == 200, response.text
        assert [c["text"] for c in response.json()["choices"]] == [
            c["text"] for c in colocated.json()["choices"]
        ]
    assert settled_totals(pd)["failed"] == failed_before
    assert_engines_alive(pd.decode.base_url, pd.prefill.base_url)
    wait_no_blocks_in_use(pd.prefill.base_url, 30)
    wait_no_blocks_in_use(pd.decode.base_url, 30)


def test_clients_leaving_while_queued_on_a_busy_decode_keep_it_alive(deployment, proxy_url) -> None:
    """Requests aborted before decode ever scheduled them release prefill's blocks and are never
    reported to vLLM (which asserts on an id it already freed).

    Each step waits for decode's own gauges instead of sleeping, and the clients hang up the
    moment all of them are seen queued: how fast this machine decodes does not matter."""
    pd, _, name, reference = deployment
    decode = pd.decode.base_url
    long_body = {"max_tokens": MAX_MODEL_LEN - 100, "ignore_eos": True}
    failed_before = settled_totals(pd)["failed"]
    admitted_before = admitted(decode)
    # Straight to decode, no hand-off: QUEUED_BATCHES batches of them queue ahead of the leaving
    # requests, with no prefill hold that could expire meanwhile (a P/D request queued past
    # release_timeout_s finds its KV released and is recomputed). The leaving requests are seen
    # queued while at least one of those batches still waits: that margin is whole batches of
    # long generations, however fast this machine decodes (one batch alone ran out on a fast one;
    # with 4 queued batches, a machine decoding 440 tokens/s drained them about as fast as its
    # API server admitted them, and fewer than 6 were ever seen waiting): queue 10, wait for 3.
    queued_batches = 10
    seen_waiting_batches = 3
    pulls = "vllm:mooncake_hetero_pull_seconds_count"
    pulled_before = metric(decode, pulls)
    with concurrent.futures.ThreadPoolExecutor(2 * MAX_NUM_SEQS) as pool:
        running = [  # through P/D: they fill decode's batch
            pool.submit(completion, proxy_url, name, OTHER, **long_body)
            for _ in range(MAX_NUM_SEQS)
        ]
        # Their KV landed: they are decode's batch, or next in its queue (first come, first
        # served). A counter, not the running gauge: a clean-clone CI run never saw that gauge
        # at 2 within 60 s although decode's log showed both running for the 3 s their 924
        # tokens took, so the test must not depend on polling inside that window.
        wait_for_metric(decode, pulls, pulled_before + MAX_NUM_SEQS, "the batch's KV never landed")
        # The first queued batch is answered; the batches behind it only hold the leaving
        # requests back, and their clients leave too once those left (nobody waits for their
        # ~17,000 tokens).
        queued = [
            pool.submit(completion, decode, name, OTHER, **long_body) for _ in range(MAX_NUM_SEQS)
        ]
        fillers = [
            LeavingClient(decode, name, OTHER, **long_body)
            for _ in range((queued_batches - 1) * MAX_NUM_SEQS)
        ]
        wait_for_metric(
            decode,
            "vllm:num_requests_waiting",
            seen_waiting_batches * MAX_NUM_SEQS,
            "nothing queued",
        )
        # Every filler in decode's queue first, then the leaving requests behind them: counted
        # as requests decode took in, not as its queue's length, which the fillers alone fill.
        wait_until(
            lambda: admitted(decode) >= admitted_before + len(running + queued + fillers),
            "decode takes in every filler",
        )
        leaving = [LeavingClient(proxy_url, name, f"{PROMPT} leaving {i}") for i in range(3)]
        wait_until(
            lambda: admitted(decode) >= admitted_before + len(running + queued + fillers) + 3,
            "the leaving requests queue on decode",
        )
        answered = [client.hang_up() for client in leaving]
        assert not any(answered), "a leaving request got tokens before its client left"
        for client in fillers:
            client.hang_up()
        for future in running + queued:
            assert future.result().status_code == 200
    assert_engines_alive(pd.decode.base_url, pd.prefill.base_url)
    started = time.monotonic()
    assert tokens(completion(proxy_url, name, PROMPT)) == reference[PROMPT]
    wait_no_blocks_in_use(pd.decode.base_url, 30)
    wait_no_blocks_in_use(pd.prefill.base_url, 30)
    assert_no_failed_pull_since(pd, failed_before)
    print(
        f"[fault] clients left while queued ({legs(pd, proxy_url)} legs): next request and every "
        f"block freed within {time.monotonic() - started:.1f} s",
        flush=True,
    )


def test_clients_leaving_while_prefill_still_computes_cancel_their_pull(deployment) -> None:
    """Overlapped legs: decode was admitted and waits for prefill's grant when the client leaves
    (prefill frozen, as on a stalled host). Decode stops waiting at once instead of holding its
    blocks until ``prefill_wait_s``, counts no failed pull, and prefill frees what it finishes
    later on decode's notice, not at its release timeout. (With serial legs decode has not been
    asked yet when prefill computes: the proxy only closes the prefill leg.)"""
    pd, _, name, reference = deployment
    assert tokens(completion(pd.proxy_url, name, OTHER)) == reference[OTHER]  # overlapped now
    before = pd.transfer_totals()
    cancelled_before = pd.decode.log_path.read_text(errors="replace").count("cancelled")
    pd.freeze("prefill")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            leaving = [
                pool.submit(hang_up_after, pd.proxy_url, name, f"{PROMPT} computing {i}", 1.0)
                for i in range(2)
            ]
            assert all(f.result() for f in leaving), "a request finished while prefill was frozen"
        time.sleep(0.5)
        assert metric(pd.decode.base_url, "vllm:num_requests_waiting") == 0
    finally:
        pd.thaw("prefill")
    started = time.monotonic()
    wait_no_blocks_in_use(pd.decode.base_url, 30)
    wait_no_blocks_in_use(pd.prefill.base_url, 30)
    freed_s = time.monotonic() - started
    assert tokens(completion(pd.proxy_url, name, PROMPT)) == reference[PROMPT]
    after = settled_totals(pd)
    assert after["failed"] == before["failed"], "a cancelled pull was counted as failed"
    assert after["expired"] == before["expired"], "prefill freed a hold at its timeout"
    log = pd.decode.log_path.read_text(errors="replace")
    assert log.count("cancelled") >= cancelled_before + 2, "decode did not cancel the pulls"
    assert_engines_alive(pd.decode.base_url, pd.prefill.base_url)
    print(
        f"[fault] clients left while prefill computed: every block free {freed_s:.1f} s after "
        f"prefill resumed",
        flush=True,
    )


def hang_up_after(url: str, name: str, prompt: str, seconds: float) -> bool:
    """Stream a request and hang up when no token came for ``seconds``; True if it hung up."""
    body = {"model": name, "prompt": prompt, "max_tokens": 50, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=seconds) as response:
            for _ in response.iter_lines():
                pass
    except httpx.TimeoutException:
        return True
    return False


def answer_or_clean_error(url: str, name: str, prompt: str, **extra) -> int:
    """A request that a fault may break: its status (or 599 when the connection broke)."""
    try:
        return completion(url, name, prompt, **extra).status_code
    except httpx.HTTPError:
        return 599


def test_prefill_killed_with_requests_in_flight_then_restarted_under_a_new_engine_id(
    deployment, proxy_url
) -> None:
    """Kill -9 prefill while requests are in their prefill leg (it is frozen first, so they
    pile up there; decode already admitted them, overlapped): each ends in bounded time with a
    clean error, decode survives and cancels the pulls; restarted (same ports, new engine id,
    which the proxy has not seen yet), the very first requests through the proxy are answered
    right, from transferred KV."""
    pd, strict, name, reference = deployment
    failed_before = pd.transfer_totals()["failed"]
    pd.freeze("prefill")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = [
            pool.submit(answer_or_clean_error, proxy_url, name, f"{PROMPT} {i}", max_tokens=60)
            for i in range(3)
        ]
        time.sleep(1.0)
        pd.kill("prefill")
        killed = time.monotonic()
        statuses = [future.result() for future in running]
    ended_s = time.monotonic() - killed
    assert ended_s < 2 * FAILURE_BOUND_S, statuses
    assert all(status >= 500 for status in statuses), statuses  # each was in its prefill leg
    assert_engines_alive(pd.decode.base_url, strict.base_url)
    wait_no_blocks_in_use(pd.decode.base_url, 30)
    assert settled_totals(pd)["failed"] == failed_before, "an abandoned pull counted as failed"

    restart_s = pd.restart("prefill", prefill_engine_id=None)
    first_s = []
    for prompt in (PROMPT, OTHER, PROMPT):  # overlapped, the first names the old engine id
        started = time.monotonic()
        assert tokens(completion(proxy_url, name, prompt)) == reference[prompt]
        first_s.append(round(time.monotonic() - started, 2))
    print(
        f"[fault] prefill killed ({legs(pd, proxy_url)} legs): in-flight requests ended "
        f"{ended_s:.1f} s later with {statuses}; restart took {restart_s:.0f} s; the next "
        f"requests took {first_s} s",
        flush=True,
    )
    assert_recovered(pd, failed_before)


def test_prefill_killed_under_load_ends_every_request_in_bounded_time(deployment) -> None:
    """Kill -9 prefill, not frozen, while four clients keep requests at every stage (prefill
    computing, decode pulling, decode generating): every request ends within the failure bound
    with the colocated answer (decode recomputes a pull the kill broke) or a clean error, decode
    stays alive and frees every block, and once prefill is back the proxy serves right again
    with no failed pull."""
    pd, _, name, reference = deployment
    stop = threading.Event()
    outcomes: list[tuple[str, int, str, float, float]] = []  # prompt, status, text, start, end

    def client(index: int) -> None:
        prompt = (PROMPT, OTHER)[index % 2]
        for n in range(1000):
            if stop.is_set():
                return
            started = time.monotonic()
            try:  # a fresh cache_salt: every request pulls its whole prompt
                response = completion(pd.proxy_url, name, prompt, cache_salt=f"load-{index}-{n}")
                text = response.json()["choices"][0]["text"] if response.status_code == 200 else ""
                status = response.status_code
            except httpx.HTTPError:
                status, text = 599, ""
            outcomes.append((prompt, status, text, started, time.monotonic()))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client, i) for i in range(4)]
        time.sleep(3.0)
        answered_before_kill = len(outcomes)
        pd.kill("prefill")
        killed = time.monotonic()
        time.sleep(2.0)
        stop.set()
        for future in clients:
            future.result(timeout=4 * FAILURE_BOUND_S)
    ended_s = max(ended for *_, ended in outcomes) - killed
    assert answered_before_kill > 0, "no request was answered before the kill"
    in_flight = [o for o in outcomes if o[3] < killed < o[4]]
    assert in_flight, "no request was in flight at the kill: the fault did not happen"
    assert ended_s < 2 * FAILURE_BOUND_S, f"a request ended {ended_s:.1f} s after the kill"
    wrong = [
        (p[:20], status)
        for p, status, text, *_ in outcomes
        if status == 200 and text != reference[p]
    ]
    assert not wrong, f"answered wrong: {wrong}"
    errors = [status for _, status, *_ in outcomes if status != 200]
    assert_engines_alive(pd.decode.base_url)
    wait_no_blocks_in_use(pd.decode.base_url, 30)

    restart_s = pd.restart("prefill", prefill_engine_id=None)
    failed_before = pd.transfer_totals()["failed"]
    for prompt in (PROMPT, OTHER):
        assert tokens(completion(pd.proxy_url, name, prompt)) == reference[prompt]
    print(
        f"[fault] prefill killed under load: {len(outcomes)} requests, {len(in_flight)} in "
        f"flight at the kill ({[o[1] for o in in_flight]}), {len(errors)} errors in all, the "
        f"last ended {ended_s:.1f} s after the kill; restart took "
        f"{restart_s:.0f} s",
        flush=True,
    )
    assert_recovered(pd, failed_before)


def test_decode_killed_holding_leases_then_restarted(deployment, proxy_url) -> None:
    """Kill -9 decode while it generates from pulled KV: prefill frees every block by the end of
    its leases, and a restarted decode on the same port serves right through the proxy."""
    pd, _, name, reference = deployment
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = [
            pool.submit(
                answer_or_clean_error,
                proxy_url,
                name,
                f"{OTHER} {i}",
                max_tokens=MAX_MODEL_LEN - 100,
            )
            for i in range(3)
        ]
        wait_for_metric(pd.decode.base_url, "vllm:num_requests_running", 1, "nothing generating")
        pd.kill("decode")
        killed = time.monotonic()
        statuses = [future.result() for future in running]
    assert any(status != 200 for status in statuses), f"nothing was in flight: {statuses}"
    wait_no_blocks_in_use(pd.prefill.base_url, RELEASE_TIMEOUT_S + 30)
    print(
        f"[fault] decode killed: requests ended with {statuses}; prefill freed every block "
        f"{time.monotonic() - killed:.1f} s later (release_timeout_s {RELEASE_TIMEOUT_S:.0f})",
        flush=True,
    )
    assert_engines_alive(pd.prefill.base_url)

    pd.restart("decode")
    for prompt in (PROMPT, OTHER):
        assert tokens(completion(proxy_url, name, prompt)) == reference[prompt]
    assert settled_totals(pd)["failed"] == 0  # the restarted decode's own counters
    assert_engines_alive(pd.decode.base_url, pd.prefill.base_url)
    wait_no_blocks_in_use(pd.prefill.base_url, 30)
    wait_no_blocks_in_use(pd.decode.base_url, 30)
