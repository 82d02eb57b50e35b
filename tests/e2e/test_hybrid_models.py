"""End to end with a hybrid model: real `vllm serve` P/D of a tiny sliding-window Llama, bfloat16,
with vLLM's hybrid KV cache manager on (issue #45, ``docs/design/hma.md`` section 5).

The model (:class:`TinySlidingWindowModelSpec`) interleaves sliding-window layers (window 64) and
full-attention layers, so each engine's KV cache has two groups with block ids of their own: a
``SlidingWindowSpec`` group, whose blocks wholly before a request's window vLLM drops (nulls),
and a ``FullAttentionSpec`` group. With ``--block-size 32`` a request of ``n`` computed tokens
keeps its sliding blocks from position ``(n - 63) // 32`` on, so every prompt past 95 tokens
drops some; ``(n - 63) % 32 == 0`` (127, 191 tokens) puts the window's first token on a block
boundary, where recomputing the last loaded token would read a dropped block (design 4.1).

Served P/D through vam-proxy's default route at prefill->decode TP 1->1, 2->1 and 1->2, each
prompt asked twice (the second time decode's own prefix cache may serve the leading blocks and
the pull reads the rest). The route continues from prefill's token (decode loads the whole
prompt and computes the continued token) except where that token is part of a character, which
the tiny model's random tokens often are: decode then samples the first token again (a
decode-first-token leg). Checks:

* the hybrid manager stays on in both instances: no "Turning off hybrid kv cache manager" in
  their logs, and vLLM logs two KV cache groups of 32-token blocks;
* every answer equals the colocated instance's prefix-cached answer (the second identical
  request) at decode's TP: the same tokens for 1->1 (logprobs within the bfloat16 bound), the
  bfloat16 comparison of ``test_mla.py`` across TP, with a bound this model needs
  (``CROSS_TP_LOGPROB_BOUND``: TP alone moves its logprobs by up to 0.74);
* decode loaded the prompts from prefill (external prefix-cache hits, pulls counted), no pull
  failed, both engines are alive and every block is freed by read-done notices;
* a first request pulls exactly the blocks its window needs (pulled bytes): the full group's
  whole prompt, the sliding group's blocks from the window's first on (design 4.2), for the
  tokens decode loads (design 4.1: all of prefill's prompt on a continued leg, all but the last
  token on a decode-first-token leg);
* a negative control: decode given prompt X continued from prefill's token, with the KV prefill
  computed for prompt Y (same length; one token before the window and one inside it differ),
  must continue Y, not recompute X.

One colocated instance per decode TP (module scope) boots beside the first deployment that needs
it and keeps serving: the cross-TP comparison asks it again where P/D resolved a near-tie the
other way (``pd_checks.compare_every_position``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pd_checks import (
    BF16_LOGPROB_BOUND,
    ID_MAX_TOKENS,
    assert_clean_transfers,
    compare_every_position,
    compared_positions,
    hand_off,
    metric,
)
from pd_checks import complete_ids as complete

from vllm_ascend_mooncake.handoff import prefill_address
from vllm_ascend_mooncake.launch.deployment import DeploymentSpec, LocalDeployment
from vllm_ascend_mooncake.launch.servers import VllmServer
from vllm_ascend_mooncake.launch.tiny_hybrid_model import TinySlidingWindowModelSpec
from vllm_ascend_mooncake.launch.tiny_model import build_tiny_model

pytestmark = pytest.mark.engine

DTYPE = "bfloat16"
#: vLLM CPU's default (128) would keep every sliding block of prompts under 192 tokens.
BLOCK_SIZE = 32
SPEC = TinySlidingWindowModelSpec(dtype=DTYPE)
WINDOW = SPEC.sliding_window
#: prompt lengths in tokens: within the first window (2 blocks, nothing dropped); the window's
#: first token on a block boundary (127 loaded tokens: the sliding group keeps blocks 2-3 of 4,
#: 191: blocks 4-5 of 6); the window starting mid-block (150); the boundary just missed (192);
#: many blocks dropped (300: blocks 7-9 of 10)
PROMPT_LENGTHS = (40, 127, 150, 191, 192, 300)
#: the negative control's prompt: on the window's block boundary
NEGATIVE_CONTROL_LENGTH = 191
TOPOLOGIES = [(1, 1), (2, 1), (1, 2)]
#: bytes of one block of one layer (2 KV heads x 64, K and V, bf16). TP 2 splits the 2 KV heads
#: (never replicates them), so a request's pulled bytes summed over decode's ranks are the same
#: at every topology here (measured with the hybrid manager off: cdiv(n, 32) blocks x 4 layers
#: x 16384 bytes at 1->1, 2->1 and 1->2 alike).
BLOCK_LAYER_BYTES = SPEC.num_kv_heads * BLOCK_SIZE * SPEC.head_dim * 2 * 2
#: layers per KV cache group: sliding ones (0, 2) and full ones (1, 3)
LAYERS_PER_GROUP = SPEC.num_layers // 2

#: what vLLM logs when a KV connector does not subclass SupportsHMA (``config/vllm.py``)
HMA_OFF = "Turning off hybrid kv cache manager"
#: what vLLM logs once it has grouped the layers (``v1/core/kv_cache_utils.py``): one block size
#: per KV cache group, here the sliding group and the full-attention group
TWO_GROUPS = f"kv cache group sizes ({BLOCK_SIZE}, {BLOCK_SIZE})"
#: the proxy's count of requests whose first token decode sampled (not continued): here only
#: where prefill's token decodes to part of a character (the tiny model's random tokens are often
#: byte pieces), so the default route runs both legs, continued and decode-first-token
DECODE_FIRST_TOKENS = "vam_proxy_decode_first_tokens_total"
PARTIAL_CHARACTER = {"reason": "partial character"}
#: decode's pulled bytes, summed over its ranks
PULL_BYTES = "vllm:mooncake_hetero_pull_bytes_sum"
#: |logprob - colocated| allowed where prefill's TP differs from decode's. This model moves
#: more than the MLA model's ``BF16_LOGPROB_BOUND`` (0.5) with TP alone: colocated TP 1 and TP 2,
#: no P/D, answered the same tokens for all six prompts, but their top-5 logprobs differed by up
#: to 0.74 (150-token prompt, position 7; 0.73 at its position 3, 0.60 at the 192-token prompt's
#: position 3). P/D across TP mixes the two (prefill's KV at one TP, decode's at the other): 2->1
#: measured 0.86 at the 150-token prompt's position 3, 1->2 0.58 at the 127-token prompt's
#: position 4 (vLLM's hybrid manager off, the whole prompt moved); with it on (only the windows'
#: blocks moved, hand-offs straight to decode) every topology stayed within 1.0. Tokens must
#: still agree but at near-ties (``2 * bound``); a pull of wrong blocks moves logprobs by units
#: (the negative control's X and Y).
CROSS_TP_LOGPROB_BOUND = 1.0


def make_prompt(length: int) -> list[int]:
    """Token ids of a ``length``-token prompt; prompts of different lengths differ from their
    first token on (no prompt is another's prefix, so no prefix-cache hit across them)."""
    return [(7 * i + 3 * length) % 500 + 5 for i in range(length)]


PROMPTS = {n: make_prompt(n) for n in PROMPT_LENGTHS}


def negative_control_prompts() -> tuple[list[int], list[int]]:
    """X and Y of the negative control: the same length, Y's token 4 (long out of the window
    by the last token) and a token inside the last window changed."""
    x = PROMPTS[NEGATIVE_CONTROL_LENGTH]
    y = list(x)
    for position in (4, len(y) - WINDOW // 4):
        y[position] = 3 + (y[position] + 1) % 400
    return x, y


def pulled_bytes(loaded: int) -> int:
    """What decode pulls for a request of ``loaded`` tokens with nothing cached locally, by the
    design (``docs/design/hma.md`` 4.2, ``held_positions``): the full group's blocks
    ``[0, cdiv(n, bs))``, the sliding group's ``[max(0, n - W + 1) // bs, cdiv(n, bs))``."""
    end = -(-loaded // BLOCK_SIZE)
    start = max(0, loaded - WINDOW + 1) // BLOCK_SIZE
    return LAYERS_PER_GROUP * (end + end - start) * BLOCK_LAYER_BYTES


def loaded_tokens(prompt_tokens: int, decode_first: bool) -> int:
    """The tokens decode loads (design 4.1): a continued leg all of prefill's prompt (decode
    computes the continued token), a decode-first-token leg all but the last prompt token
    (prefill stops one short, decode computes the last one and samples from it)."""
    return prompt_tokens - 1 if decode_first else prompt_tokens


def log_text(path: Path) -> str:
    return path.read_text(errors="replace")


def ignored_params(pd: LocalDeployment, lines: int = 4) -> str:
    """Why decode computed requests itself: the last lines of its log that say so."""
    told = [
        line[line.find("ignoring kv_transfer_params") :][:300]
        for line in log_text(pd.decode.log_path).splitlines()
        if "ignoring kv_transfer_params" in line
    ]
    return f"{len(told)} requests' kv_transfer_params ignored by decode, last: {told[-lines:]}"


class Colocated:
    """A colocated instance (no connector: vLLM keeps its hybrid manager on) at one TP, started
    at once and waited for at first use; its reference answers are computed once."""

    def __init__(self, model: str, tp: int, log_path: Path) -> None:
        self.tp = tp
        self.server = VllmServer(
            model,
            tensor_parallel_size=tp,
            dtype=DTYPE,
            block_size=BLOCK_SIZE,
            log_path=log_path,
        )
        self.server.start()
        self._name: str | None = None
        self._answers: dict[int, dict] | None = None

    @property
    def name(self) -> str:
        if self._name is None:
            self.server.wait_ready()
            url = self.server.base_url
            self._name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        return self._name

    def ask(self, prompt: list[int], max_tokens: int = ID_MAX_TOKENS) -> dict:
        """Colocated's answer the second time: its prompt served from the prefix cache."""
        complete(self.server.base_url, self.name, prompt, max_tokens=max_tokens)
        return complete(self.server.base_url, self.name, prompt, max_tokens=max_tokens)

    def answers(self) -> dict[int, dict]:
        """The prefix-cached answer per prompt length, each prompt asked twice (the two agree
        within the bfloat16 bound); the instance must be serving the model with two groups."""
        if self._answers is None:
            url, name = self.server.base_url, self.name
            log = log_text(self.server.log_path)
            assert TWO_GROUPS in log and HMA_OFF not in log, self.server.log_path
            hits_before = metric(url, "vllm:prefix_cache_hits_total")
            answers = {}
            for n, prompt in PROMPTS.items():
                first, second = complete(url, name, prompt), complete(url, name, prompt)
                compared_positions(first, second, f"colocated TP {self.tp}, {n} tokens repeated")
                answers[n] = second
            assert metric(url, "vllm:prefix_cache_hits_total") > hits_before, "no prefix hit"
            self._answers = answers
        return self._answers


@pytest.fixture(scope="module")
def model() -> str:
    return str(build_tiny_model(SPEC))


@pytest.fixture(scope="module")
def colocated_at(model: str, tmp_path_factory) -> Iterator[Callable[[int], Colocated]]:
    """``colocated_at(tp)``: the module's colocated instance at TP ``tp``, started when first
    asked for; one at a time (the topologies are ordered so that each starts once)."""
    running: dict[int, Colocated] = {}

    def at(tp: int) -> Colocated:
        if tp not in running:
            for other in running.values():
                other.server.stop()
            running.clear()
            log = tmp_path_factory.mktemp(f"colocated-tp{tp}") / "colocated.log"
            running[tp] = Colocated(model, tp, log)
        return running[tp]

    try:
        yield at
    finally:
        for instance in running.values():
            instance.server.stop()


@dataclass
class Case:
    pd: LocalDeployment
    colocated: Colocated
    prefill_tp: int
    decode_tp: int

    @property
    def bound(self) -> float:
        """The logprob bound against colocated at decode's TP."""
        same_tp = self.prefill_tp == self.decode_tp
        return BF16_LOGPROB_BOUND if same_tp else CROSS_TP_LOGPROB_BOUND

    def __str__(self) -> str:
        return f"{self.prefill_tp}->{self.decode_tp}"


@pytest.fixture(scope="module", params=TOPOLOGIES, ids=[f"tp{p}-{d}" for p, d in TOPOLOGIES])
def deployment(request, model: str, colocated_at, tmp_path_factory) -> Iterator[Case]:
    """A P/D deployment of the topology, its colocated reference at decode's TP booting beside
    it; shared by the topology's tests."""
    prefill_tp, decode_tp = request.param
    colocated = colocated_at(decode_tp)
    spec = DeploymentSpec(
        model=model,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        dtype=DTYPE,
        block_size=BLOCK_SIZE,
        log_dir=str(tmp_path_factory.mktemp(f"pd-{prefill_tp}-{decode_tp}")),
    )
    with LocalDeployment(spec) as pd:
        yield Case(pd, colocated, prefill_tp, decode_tp)


def test_hybrid_kv_cache_manager_stays_on(deployment: Case) -> None:
    """The connector keeps vLLM's hybrid manager on: both instances serve two KV cache groups."""
    for server in (deployment.pd.prefill, deployment.pd.decode):
        log = log_text(server.log_path)
        told = [line for line in log.splitlines() if HMA_OFF in line or "group sizes" in line]
        turned_off, two_groups = HMA_OFF in log, TWO_GROUPS in log
        assert not turned_off, f"{server.log_path}: {told}"
        assert two_groups, f"{server.log_path}: no '{TWO_GROUPS}'; {told}"


def assert_first_pulls(
    pd: LocalDeployment,
    totals_before: dict[str, int],
    bytes_before: float,
    expected_bytes: dict[tuple[int, str], int],
    what: str,
) -> None:
    """The first attempt's pulls: every continued leg pulled on every decode rank, none failed,
    and decode pulled exactly the blocks the windows need (``expected_bytes``, per prompt and
    leg). A decode-first-token leg either pulls all but the last prompt token (design 4.1) or,
    until prefill can stop one token short (``prefill_all_but_last``), is computed by decode
    itself with prefill's hold released ("only requests continued from prefill's token ... are
    pulled" in decode's log): all such legs alike, never some of them."""
    continued = [key for key in expected_bytes if key[1] == "continued"]
    decode_first = [key for key in expected_bytes if key[1] == "decode-first"]
    assert continued, f"{what}: no continued leg to check"
    assert_clean_transfers(pd, requests=len(continued), since=totals_before, left=len(decode_first))
    totals = pd.transfer_totals()
    pulls = (totals["successful"] - totals_before["successful"]) // pd.spec.decode_tp
    pulled = metric(pd.decode.base_url, PULL_BYTES) - bytes_before
    if pulls == len(continued):  # decode computed the decode-first-token legs itself
        wanted = {key: expected_bytes[key] for key in continued}
    else:
        assert pulls == len(expected_bytes), f"{what}: {pulls} pulls, legs {list(expected_bytes)}"
        wanted = expected_bytes
    assert pulled == sum(wanted.values()), (
        f"{what}: pulled {pulled:.0f} bytes, the windows need {sum(wanted.values())}: {wanted} "
        f"(one block of one layer {BLOCK_LAYER_BYTES} bytes)"
    )
    print(f"[sliding window {what}] first pulls: {sorted(wanted)}")


def test_answers_match_colocated(deployment: Case) -> None:
    pd, colocated = deployment.pd, deployment.colocated
    reference = colocated.answers()
    name, decode_url = colocated.name, pd.decode.base_url
    first_tokens_before = metric(pd.proxy_url, DECODE_FIRST_TOKENS)
    partial_before = metric(pd.proxy_url, DECODE_FIRST_TOKENS, PARTIAL_CHARACTER)
    divergences = 0
    for attempt in ("first", "second"):
        external_before = metric(decode_url, "vllm:external_prefix_cache_hits_total")
        bytes_before = metric(decode_url, PULL_BYTES)
        totals_before = pd.transfer_totals()
        expected_bytes = {}
        for n, prompt in PROMPTS.items():
            legs_before = metric(pd.proxy_url, DECODE_FIRST_TOKENS)
            got = complete(pd.proxy_url, name, prompt)
            decode_first = metric(pd.proxy_url, DECODE_FIRST_TOKENS) > legs_before
            expected_bytes[n, "decode-first" if decode_first else "continued"] = pulled_bytes(
                loaded_tokens(n, decode_first)
            )
            what = f"{deployment} {attempt} {n}-token prompt"
            if (deployment.prefill_tp, deployment.decode_tp) == (1, 1):
                want = reference[n]
                assert got["tokens"] == want["tokens"], (
                    f"{what}: tokens {got['tokens']} != colocated {want['tokens']}"
                )
                compared_positions(got, want, what)
            else:
                divergences += compare_every_position(
                    got, prompt, colocated.ask, what, deployment.bound
                )
        # decode loaded the prompts (or, the second time, what its own prefix cache lacks)
        assert metric(decode_url, "vllm:external_prefix_cache_hits_total") > external_before, (
            f"{deployment} {attempt}: decode loaded nothing; {ignored_params(pd)}"
        )
        if attempt == "first":
            assert_first_pulls(
                pd,
                totals_before,
                bytes_before,
                expected_bytes,
                str(deployment),
            )
        else:
            # a second request may find every block prefill computed in decode's own prefix
            # cache: prefill's hold is then released without a pull
            assert_clean_transfers(pd, requests=0, since=totals_before, left=len(PROMPTS))
    # the default route continued each request from prefill's token, or had decode sample the
    # first token again only for a partial character
    decode_first = metric(pd.proxy_url, DECODE_FIRST_TOKENS) - first_tokens_before
    partial = metric(pd.proxy_url, DECODE_FIRST_TOKENS, PARTIAL_CHARACTER) - partial_before
    assert decode_first == partial, f"{decode_first} decode-first-token legs, {partial} partial"
    print(
        f"[sliding window {deployment}] {2 * len(PROMPTS) - decode_first:.0f} continued and "
        f"{decode_first:.0f} decode-first-token legs; near-ties resolved the other way: "
        f"{divergences}"
    )


def test_decode_continues_the_pulled_kv(deployment: Case) -> None:
    """Negative control: decode gets prompt X continued from prefill's token, with the KV of
    prompt Y (same length). Having recomputed X it would answer X; it must continue Y."""
    pd, colocated = deployment.pd, deployment.colocated
    name = colocated.name
    x, y = negative_control_prompts()
    before = pd.transfer_totals()
    params = hand_off(pd.prefill.base_url, name, y)
    assert prefill_address(params)
    continued = params["remote_output_token_ids"]
    assert len(continued) == 1, params
    decoded = complete(
        pd.decode.base_url,
        name,
        x + continued,
        kv_transfer_params=params,
        cache_salt="negative-control",  # never served from decode's cache of X
    )
    assert_clean_transfers(pd, requests=1, since=before)
    want_x, want_y = colocated.ask(x + continued), colocated.ask(y + continued)
    assert want_x["tokens"] != want_y["tokens"], "X and Y must answer differently"
    assert decoded["tokens"] != want_x["tokens"], f"{deployment}: decode recomputed prompt X"
    control = compared_positions(decoded, want_y, f"{deployment} X|KV(Y)", deployment.bound)
    assert control >= 1, "negative control: not even the first token continues Y"
