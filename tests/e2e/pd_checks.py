"""Checks shared by the end-to-end tests: requests, answer comparison, clean-transfer checks.

A P/D answer is compared token for token, top-5 logprobs within ``LOGPROB_TOLERANCE``, against a
colocated instance (float32 models). A deployment is clean when both engines are alive, every
request pulled once on every decode rank and succeeded (a failed pull recomputed by decode would
give the right answer without moving a byte), and every block was freed by a read-done notice
well before prefill's release timeout (a release by timeout would hide a lost notice).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

import httpx
import pytest

from vam_testing.answers import greedy_answer
from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.launch.deployment import LocalDeployment
from vllm_ascend_mooncake.launch.prometheus import metric_sum, metrics_text
from vllm_ascend_mooncake.launch.servers import VllmServer

MAX_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4
TIMEOUT = httpx.Timeout(600.0)
# Blocks are freed by decode's read-done notices within moments; far below release_timeout_s.
RELEASE_BOUND_S = 30.0


Answers = TypeVar("Answers")


class ColocatedReference(Generic[Answers]):
    """The colocated instance a module compares P/D against, booting while the module's first
    P/D deployment starts, and its reference answers, computed once, at first use. A start-up
    is mostly one core importing (a TP 1 instance: 12.5 s alone, two together 13.5 s, three
    20.6 s on 2 cores), so booting beside the deployment saves most of its start-up.

    Made by :func:`colocated_reference_fixtures` before the deployment starts; ``answers()``
    waits for the instance, computes, and stops it unless ``keep_serving`` (a test asking it
    more later)."""

    def __init__(
        self, server: VllmServer, compute: Callable[[str], Answers], keep_serving: bool
    ) -> None:
        self.server = server
        self._compute = compute
        self._keep_serving = keep_serving
        self._answers: list[Answers] = []

    def answers(self) -> Answers:
        if not self._answers:
            self.server.wait_ready()
            self._answers.append(self._compute(self.server.base_url))
            if not self._keep_serving:
                self.server.stop()
        return self._answers[0]


def colocated_reference_fixtures(
    compute: Callable[[str], Answers], keep_serving: bool = False, **server_options
) -> tuple[Callable, Callable]:
    """A module's ``colocated`` and ``reference`` fixtures (module scope): the colocated
    instance (``VllmServer(model, **server_options)`` on the module's ``model`` fixture),
    started when first asked for, stopped when the module ends, and its answers. A module's
    deployment fixture that asks for ``colocated`` starts while it boots::

        colocated, reference = colocated_reference_fixtures(colocated_answers)
    """

    @pytest.fixture(scope="module")
    def colocated(model: str) -> Iterator[ColocatedReference[Answers]]:
        server = VllmServer(model, **server_options)
        server.start()
        try:
            yield ColocatedReference(server, compute, keep_serving)
        finally:
            server.stop()

    @pytest.fixture(scope="module")
    def reference(colocated: ColocatedReference[Answers]) -> Answers:
        return colocated.answers()

    return colocated, reference


def complete(url: str, model_name: str, prompt: str | list[int], **extra) -> dict:
    body = {
        "model": model_name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 5,
        "return_token_ids": True,
        **extra,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def complete_like_vllm_example_proxy(
    prefill_url: str, decode_url: str, model_name: str, prompt: str | list[int], **extra
) -> dict:
    """What vLLM's example disaggregation proxy does, and nothing more: a one-token prefill asking
    to hand off, then decode with prefill's ``kv_transfer_params`` copied verbatim."""
    handoff = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    prefilled = complete(
        prefill_url, model_name, prompt, **{**extra, "max_tokens": 1, "kv_transfer_params": handoff}
    )
    return complete(
        decode_url,
        model_name,
        prompt,
        **extra,
        kv_transfer_params=prefilled["kv_transfer_params"],
    )


def summary(result: dict) -> tuple[list[int], list[dict[str, float]]]:
    choice = result["choices"][0]
    return choice["token_ids"], choice["logprobs"]["top_logprobs"]


def _deviations(top: list[dict[str, float]], ref_top: list[dict[str, float]]) -> list[str]:
    """Per position, the largest |logprob - colocated| over the colocated top-5 (for messages)."""
    return [
        f"{max(abs(got.get(t, float('inf')) - v) for t, v in want.items()):.1e}"
        for got, want in zip(top, ref_top, strict=True)
    ]


def assert_same(actual: dict, expected: dict, what: str) -> None:
    tokens, top = summary(actual)
    ref_tokens, ref_top = summary(expected)
    assert tokens == ref_tokens, f"{what}: tokens {tokens} != colocated {ref_tokens}"
    for position, (got, want) in enumerate(zip(top, ref_top, strict=True)):
        assert got.keys() == want.keys(), f"{what}: top-5 differ at position {position}"
        for token, logprob in want.items():
            assert abs(got[token] - logprob) <= LOGPROB_TOLERANCE, (
                what,
                position,
                token,
                f"logprob {got[token]!r} vs colocated {logprob!r}",
                f"largest deviation per position: {_deviations(top, ref_top)}",
            )


def metric(url: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The sum of metric ``name``'s samples (the sample's own name: ``*_total``, ``*_count``)
    on the instance or proxy at ``url``, over the label sets with ``labels`` (all if None); the
    metric must be exported."""
    return metric_sum(metrics_text(url), name, labels)


def wait_for_metric(
    url: str, name: str, at_least: float, failure: str, within_s: float = 60
) -> None:
    """Poll an instance's metric until it reaches ``at_least`` (tests wait on state, not time).
    A failure says what the polls saw: how many, the largest value, and the longest gap between
    two answers (a poll stuck for seconds is not a metric that never moved)."""
    started = time.monotonic()
    deadline = started + within_s
    readings: list[tuple[float, float]] = []  # (when answered, value)
    while (value := metric(url, name)) < at_least:
        readings.append((time.monotonic(), value))
        if time.monotonic() >= deadline:
            times = [started] + [when for when, _ in readings]
            gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
            raise AssertionError(
                f"{failure}: {name} < {at_least} after {within_s} s ({len(readings)} polls, "
                f"largest value {max(v for _, v in readings)}, longest gap between answers "
                f"{max(gaps):.2f} s, distinct values {sorted({v for _, v in readings})})"
            )
        time.sleep(0.02)


def _wait_blocks_freed(url: str, what: str) -> None:
    """Wait (up to ``RELEASE_BOUND_S``) until the instance at ``url`` holds no KV block."""
    wait_until(
        lambda: metric(url, "vllm:kv_cache_usage_perc") <= 0,
        f"{what} frees every KV block",
        timeout_s=RELEASE_BOUND_S,
        interval_s=0.5,
    )


def settled_totals(pd: LocalDeployment) -> dict[str, int]:
    """The deployment's transfer counters once the last engine step's statistics are in: the API
    server records them just after that step's outputs, which a client may already hold."""
    time.sleep(1)
    return pd.transfer_totals()


#: what a failed-pull assertion quotes from decode's log: the lines that say why
_FAILURE_LINE_MARKS = ("cannot pull", "KV load failed", "refused", "could not tell", "expired")


def transfer_evidence(pd: LocalDeployment, lines: int = 12) -> str:
    """Why pulls failed, for an assertion message: decode's failed pulls by kind and the last
    lines of decode's and prefill's logs that tell of failures (a clean-clone CI run keeps only
    its output, not the logs it names)."""
    parts = [f"failed pulls by kind: {pd.failed_pulls_by_kind()}; logs in {pd.log_dir}"]
    for server in (pd.decode, pd.prefill):
        try:
            text = server.log_path.read_text(errors="replace")
        except OSError:
            continue
        told = [
            line
            for line in text.splitlines()
            if "KV Transfer metrics" not in line and any(m in line for m in _FAILURE_LINE_MARKS)
        ]
        parts.append(f"{server.log_path.name}, last {lines} such lines:")
        parts.extend(f"  {line[:400]}" for line in told[-lines:])
    return "\n".join(parts)


def assert_clean_transfers(
    pd: LocalDeployment,
    requests: int,
    since: Mapping[str, int] | None = None,
    *,
    left: int = 0,
) -> None:
    """Both engines alive; every request pulled exactly once on every decode rank and no pull
    failed; every block freed by a read-done notice well before prefill's release timeout,
    none by that timeout. ``since``: the deployment's :meth:`~LocalDeployment.transfer_totals`
    when the requests began, for a deployment that served others before. ``left``: requests
    beyond ``requests`` whose clients left, whose pulls may have ended or been cut short."""
    for server in (pd.prefill, pd.decode):
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    for server in (pd.prefill, pd.decode):
        _wait_blocks_freed(server.base_url, server.base_url)
    totals = settled_totals(pd)
    if since is not None:
        totals = {name: count - since[name] for name, count in totals.items()}
    logs = f"see {pd.log_dir}"
    assert totals["failed"] == 0, f"{totals}\n{transfer_evidence(pd)}"
    assert totals["expired"] == 0, (totals, logs)
    pulled = range(requests * pd.spec.decode_tp, (requests + left) * pd.spec.decode_tp + 1)
    assert totals["successful"] in pulled, (totals, logs)


def assert_extra_prefill_clean(url: str, what: str) -> None:
    """A prefill instance beside the deployment's own (which :func:`assert_clean_transfers`
    checks): alive, every block freed within the bound, none released by its timeout."""
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200, what
    _wait_blocks_freed(url, what)
    expired = metric(url, "vllm:mooncake_hetero_expired_releases_total")
    assert expired == 0, f"{what} released blocks by timeout"


# Answers keyed by token id, compared exactly (float32) or within bfloat16's rounding.

#: tokens generated per request by :func:`complete_ids`
ID_MAX_TOKENS = 8
#: |logprob - colocated| allowed in bfloat16; justified in test_mla.py's docstring (vLLM rounds
#: logits to bfloat16, whose spacing is 0.125-0.25 at these models' logits of 16-64)
BF16_LOGPROB_BOUND = 0.5


def complete_ids(url: str, name: str, prompt: list[int], **extra) -> dict:
    """:func:`~vam_testing.answers.greedy_answer`, ``ID_MAX_TOKENS`` tokens
    unless ``extra`` says otherwise."""
    return greedy_answer(url, name, prompt, **{"max_tokens": ID_MAX_TOKENS, **extra})


def assert_exact_ids(actual: dict, expected: dict, what: str) -> None:
    """float32: the same tokens and top-5 sets, logprobs within ``LOGPROB_TOLERANCE``."""
    assert actual["tokens"] == expected["tokens"], (
        f"{what}: tokens {actual['tokens']} != colocated {expected['tokens']}"
    )
    for position, (got, want) in enumerate(zip(actual["top"], expected["top"], strict=True)):
        assert got.keys() == want.keys(), f"{what}: top-5 differ at position {position}"
        for token, logprob in want.items():
            assert abs(got[token] - logprob) <= LOGPROB_TOLERANCE, (
                f"{what}, position {position}: {token} logprob {got[token]!r} vs colocated "
                f"{logprob!r}"
            )


def largest_deviation(actual: dict, expected: dict) -> float:
    """The largest |logprob - colocated| over tokens in both top-5 lists, at positions up to
    the first differing token (for logs: what a bound is measured against)."""
    largest = 0.0
    for position, (got, want) in enumerate(zip(actual["top"], expected["top"], strict=True)):
        shared = [abs(got[t] - want[t]) for t in want if t in got]
        largest = max([largest, *shared])
        if actual["tokens"][position] != expected["tokens"][position]:
            break
    return largest


def compared_positions(
    actual: dict, expected: dict, what: str, bound: float = BF16_LOGPROB_BOUND
) -> int:
    """Check ``actual`` against colocated ``expected`` within the bfloat16 bound; return how many
    positions matched token for token before a near-tie went the other way (all if none did).

    At each position: every token in both top-5 lists agrees within ``bound``;
    every colocated top-5 token clearly above colocated's fifth is in P/D's top 5; a different
    greedy token is allowed only where colocated's top two are near-tied."""
    tokens, top = actual["tokens"], actual["top"]
    ref_tokens, ref_top = expected["tokens"], expected["top"]
    assert len(tokens) == len(ref_tokens), what
    for position, (got, want) in enumerate(zip(top, ref_top, strict=True)):
        where = f"{what}, position {position}"
        fifth = min(want.values())
        for token, logprob in want.items():
            if token in got:
                assert abs(got[token] - logprob) <= bound, (
                    f"{where}: {token} logprob {got[token]:.3f} vs colocated {logprob:.3f}"
                )
            else:
                assert logprob <= fifth + 2 * bound, (
                    f"{where}: {token} (colocated {logprob:.3f}) missing from P/D's top 5 {got}"
                )
        if tokens[position] != ref_tokens[position]:
            chosen, ref_chosen = f"token_id:{tokens[position]}", f"token_id:{ref_tokens[position]}"
            assert chosen in want, f"{where}: P/D chose {chosen}, not in colocated's top 5 {want}"
            assert want[ref_chosen] - want[chosen] <= 2 * bound, (
                f"{where}: P/D chose {chosen} ({want[chosen]:.3f}) over colocated's "
                f"{ref_chosen} ({want[ref_chosen]:.3f}), not a near-tie; tokens {tokens} vs "
                f"colocated {ref_tokens}"
            )
            return position
    return len(tokens)


def hand_off(
    prefill_url: str,
    name: str,
    prompt: str | list[int],
    transfer_id: str | None = None,
    **extra,
) -> dict:
    """A one-token prefill that holds the prompt's KV for a decode, as vLLM's example proxy asks
    for it; returns prefill's ``kv_transfer_params`` (what decode's request carries).
    ``transfer_id``: the id a decode admitted first waits on (overlapped legs)."""
    handoff = {"do_remote_decode": True, **({"transfer_id": transfer_id} if transfer_id else {})}
    response = httpx.post(
        f"{prefill_url}/v1/completions",
        json={
            "model": name,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": handoff,
            **extra,
        },
        timeout=TIMEOUT,
    )
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def compare_every_position(
    actual: dict,
    prompt: list[int],
    colocated,
    what: str,
    bound: float = BF16_LOGPROB_BOUND,
) -> int:
    """Check every position of ``actual`` (P/D's answer to ``prompt``, from :func:`complete_ids`)
    against colocated's answer for the same context, within the bfloat16 ``bound``
    (:func:`compared_positions`). Where P/D resolved a near-tie the other way, the answers'
    contexts differ from there on: the comparison goes on against colocated's answer for the
    prompt followed by P/D's tokens so far (``colocated(prompt, max_tokens)``, prefix-cached).
    Returns how many near-ties P/D resolved the other way (each one checked to be a near-tie)."""
    tokens = actual["tokens"]
    start = divergences = 0
    while True:
        expected = colocated(prompt + tokens[:start], len(tokens) - start)
        rest = {"tokens": tokens[start:], "top": actual["top"][start:]}
        matched = compared_positions(rest, expected, f"{what}, from position {start}", bound)
        if start + matched >= len(tokens):
            return divergences
        divergences += 1
        start += matched + 1
        if start >= len(tokens):
            return divergences
