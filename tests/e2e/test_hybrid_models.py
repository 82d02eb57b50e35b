"""End to end with hybrid models: real `vllm serve` P/D of tiny models whose layers differ in
kind, bfloat16, with vLLM's hybrid KV cache manager on (issue #45, ``docs/design/hma.md``).

* a sliding-window Llama (:class:`TinySlidingWindowModelSpec`): sliding-window layers (window 64)
  and full-attention layers, two KV cache groups of 32-token blocks; vLLM drops a request's
  sliding blocks wholly before its window, and only the window's blocks move;
* a Qwen3-Next (:class:`TinyQwen3NextModelSpec`): Gated DeltaNet layers, whose cache is one
  state page per request (conv and SSM state, sharded across TP by Q/K/V columns and value
  heads), and full-attention layers; vLLM makes both groups' blocks 128 tokens.

A prefill of such a model computes the prompt but its last token (decode must not recompute a
token it loaded: the window may have dropped what that token attends to, a state would advance
twice), so vam-proxy's default route has decode sample every answer's first token ("prompt
prefix"); decode pulls every group's blocks for all but the last prompt token and computes that
one. Served at prefill->decode TP 1->1, 2->1 and 1->2, each prompt asked twice. Checks:

* the hybrid manager stays on in both instances (no "Turning off hybrid kv cache manager", two
  KV cache groups logged);
* every answer equals the colocated instance's prefix-cached answer (the second identical
  request) at decode's TP: the same tokens at equal TP (logprobs within the bfloat16 bound),
  the bfloat16 comparison of ``test_mla.py`` across TP;
* decode loaded the prompts from prefill, no pull failed, both engines are alive, every block is
  freed by read-done notices, and the first requests pulled exactly what each group keeps
  (pulled bytes: the full group's prompt, the window's blocks, one state page per layer);
* a negative control: decode given prompt X with the KV prefill computed for prompt Y (two
  earlier tokens differ) must answer Y's prefix followed by X's last token, not X.
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
from vllm_ascend_mooncake.launch.tiny_hybrid_model import (
    TinyQwen3NextModelSpec,
    TinySlidingWindowModelSpec,
)
from vllm_ascend_mooncake.launch.tiny_model import build_tiny_model

pytestmark = pytest.mark.engine

DTYPE = "bfloat16"
TOPOLOGIES = [(1, 1), (2, 1), (1, 2)]

#: what vLLM logs when a KV connector does not subclass SupportsHMA (``config/vllm.py``)
HMA_OFF = "Turning off hybrid kv cache manager"
#: the proxy's count of requests whose first token decode sampled, by reason: a hybrid model's
#: prefill computes the prompt but its last token, so every request is one ("prompt prefix")
DECODE_FIRST_TOKENS = "vam_proxy_decode_first_tokens_total"
PROMPT_PREFIX = {"reason": "prompt prefix"}
#: decode's pulled bytes, summed over its ranks
PULL_BYTES = "vllm:mooncake_hetero_pull_bytes_sum"
#: |logprob - colocated| allowed where prefill's TP differs from decode's. The sliding-window
#: model moves more than the MLA model's ``BF16_LOGPROB_BOUND`` (0.5) with TP alone: colocated
#: TP 1 and TP 2, no P/D, answered the same tokens for all six prompts, but their top-5 logprobs
#: differed by up to 0.74 (150-token prompt, position 7). P/D across TP mixes the two (prefill's
#: KV at one TP, decode's at the other): with the windows' blocks moved, every topology stayed
#: within 1.0. Tokens must still agree but at near-ties (``2 * bound``); a pull of wrong blocks
#: moves logprobs by units (the negative control's X and Y).
CROSS_TP_LOGPROB_BOUND = 1.0
#: The tiny Qwen3-Next (bf16, a mixture of 4 experts routed top-2) moves far more with TP
#: alone: colocated TP 1 and TP 2, no P/D, same greedy tokens for its 129- and 385-token prompts
#: but top-5 logprobs up to 2.25 and 4.5 apart (a near-tie of the expert router goes the other
#: way), and its 257-token prompt's tokens part at position 4. Across TP its answers are held to
#: this bound and greedy tokens but at near-ties; that the state moves right across TP rests on
#: the exact 1->1 answers and ``tests/core/test_plan_state.py``'s byte-exact shard property test.
QWEN3_NEXT_CROSS_TP_BOUND = 5.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class HybridModel:
    """A tiny hybrid model as the tests serve it: its KV cache groups' block size, the prompts
    (lengths around its blocks' and window's edges) and what a pull of ``n`` tokens moves."""

    name: str
    spec: TinySlidingWindowModelSpec | TinyQwen3NextModelSpec
    block_size: int
    prompt_lengths: tuple[int, ...]
    negative_control_length: int
    #: |logprob - colocated| allowed where prefill's TP differs from decode's
    cross_tp_bound: float = CROSS_TP_LOGPROB_BOUND

    @property
    def two_groups(self) -> str:
        """What vLLM logs once it grouped the layers (``v1/core/kv_cache_utils.py``)."""
        return f"kv cache group sizes ({self.block_size}, {self.block_size})"

    def block_layer_bytes(self) -> int:
        """One attention block of one layer, every KV head (K and V, bf16)."""
        return self.spec.num_kv_heads * self.block_size * self.spec.head_dim * 2 * 2

    def pulled_bytes(self, loaded: int) -> int:
        """What decode pulls for ``loaded`` tokens with nothing cached locally, summed over its
        ranks (no head is replicated here, so every topology moves the same bytes): per group,
        the blocks its kind keeps (``core.groups``)."""
        end = cdiv(loaded, self.block_size)
        full_layers = self.spec.num_layers // 2
        if isinstance(self.spec, TinySlidingWindowModelSpec):
            start = max(0, loaded - self.spec.sliding_window + 1) // self.block_size
            return full_layers * (end + end - start) * self.block_layer_bytes()
        spec = self.spec
        conv_dim = 2 * spec.linear_num_key_heads * spec.linear_key_head_dim + (
            spec.linear_num_value_heads * spec.linear_value_head_dim
        )
        conv = (spec.linear_conv_kernel_dim - 1) * conv_dim * 2
        ssm = spec.linear_num_value_heads * spec.linear_value_head_dim * spec.linear_key_head_dim
        state_layers = spec.num_layers - full_layers
        return full_layers * end * self.block_layer_bytes() + state_layers * (conv + ssm * 2)


#: The sliding-window Llama (window 64) with 32-token blocks: prompts within the first window;
#: the window's first token on a block boundary for the tokens prefill computes (128, 192: the
#: load of 127, 191); blocks dropped mid-block (150); many dropped (300).
#: Qwen3-Next: vLLM makes its blocks 128 tokens (the attention page must hold a GDN state page).
#: Its prompts are one token past whole blocks, so that colocated's prefix-cached answer takes
#: the very path P/D takes: the cached blocks' state (a checkpoint at the block boundary) and
#: the last token alone. P/D then equals it bit for bit (measured: every top logprob equal at
#: 129 and 257 tokens, 1->1). A prompt computed in one piece by colocated differs from the
#: pulled prefix and one token by up to 1.0 in bf16 logprobs (40 and 150 tokens, 1->1): GDN's
#: chunked kernel over the whole prompt against the same kernel over all but its last token
#: and a one-token step, not a difference in the state moved.
MODELS = [
    HybridModel(
        "sliding", TinySlidingWindowModelSpec(dtype=DTYPE), 32, (40, 128, 150, 192, 300), 192
    ),
    HybridModel(
        "qwen3_next",
        TinyQwen3NextModelSpec(dtype=DTYPE),
        128,
        (129, 257, 385),
        257,
        cross_tp_bound=QWEN3_NEXT_CROSS_TP_BOUND,
    ),
]


def make_prompt(length: int) -> list[int]:
    """Token ids of a ``length``-token prompt; prompts of different lengths differ from their
    first token on (no prompt is another's prefix, so no prefix-cache hit across them)."""
    return [(7 * i + 3 * length) % 500 + 5 for i in range(length)]


def negative_control_prompts(model: HybridModel) -> tuple[list[int], list[int]]:
    """X and Y of the negative control: the same length, Y's token 4 and one among its last 16
    tokens changed (in the window; in the GDN state's recent past)."""
    x = make_prompt(model.negative_control_length)
    y = list(x)
    for position in (4, len(y) - 16):
        y[position] = 3 + (y[position] + 1) % 400
    return x, y


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

    def __init__(self, model: HybridModel, path: str, tp: int, log_path: Path) -> None:
        self.model = model
        self.tp = tp
        self.server = VllmServer(
            path,
            tensor_parallel_size=tp,
            dtype=DTYPE,
            block_size=model.block_size,
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
            assert self.model.two_groups in log and HMA_OFF not in log, self.server.log_path
            hits_before = metric(url, "vllm:prefix_cache_hits_total")
            answers = {}
            for n in self.model.prompt_lengths:
                prompt = make_prompt(n)
                first, second = complete(url, name, prompt), complete(url, name, prompt)
                compared_positions(first, second, f"colocated TP {self.tp}, {n} tokens repeated")
                answers[n] = second
            assert metric(url, "vllm:prefix_cache_hits_total") > hits_before, "no prefix hit"
            self._answers = answers
        return self._answers


@dataclass
class Case:
    model: HybridModel
    pd: LocalDeployment
    colocated: Colocated
    prefill_tp: int
    decode_tp: int

    @property
    def bound(self) -> float:
        """The logprob bound against colocated at decode's TP."""
        same_tp = self.prefill_tp == self.decode_tp
        return BF16_LOGPROB_BOUND if same_tp else self.model.cross_tp_bound

    def __str__(self) -> str:
        return f"{self.model.name} {self.prefill_tp}->{self.decode_tp}"


@pytest.fixture(scope="module", params=MODELS, ids=[m.name for m in MODELS])
def hybrid(request, tmp_path_factory) -> Iterator[tuple[HybridModel, Callable[[int], Colocated]]]:
    """A model and ``colocated_at(tp)``: its colocated instance at TP ``tp``, started when first
    asked for; one at a time (the topologies are ordered so that each starts once)."""
    model: HybridModel = request.param
    path = str(build_tiny_model(model.spec))
    running: dict[int, Colocated] = {}

    def at(tp: int) -> Colocated:
        if tp not in running:
            for other in running.values():
                other.server.stop()
            running.clear()
            log = tmp_path_factory.mktemp(f"colocated-{model.name}-tp{tp}") / "colocated.log"
            running[tp] = Colocated(model, path, tp, log)
        return running[tp]

    try:
        yield model, at
    finally:
        for instance in running.values():
            instance.server.stop()


@pytest.fixture(scope="module", params=TOPOLOGIES, ids=[f"tp{p}-{d}" for p, d in TOPOLOGIES])
def deployment(request, hybrid, tmp_path_factory) -> Iterator[Case]:
    """A P/D deployment of the topology, its colocated reference at decode's TP booting beside
    it; shared by the topology's tests."""
    model, colocated_at = hybrid
    prefill_tp, decode_tp = request.param
    colocated = colocated_at(decode_tp)
    spec = DeploymentSpec(
        model=colocated.server.model,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        dtype=DTYPE,
        block_size=model.block_size,
        log_dir=str(tmp_path_factory.mktemp(f"pd-{model.name}-{prefill_tp}-{decode_tp}")),
    )
    with LocalDeployment(spec) as pd:
        yield Case(model, pd, colocated, prefill_tp, decode_tp)


def test_hybrid_kv_cache_manager_stays_on(deployment: Case) -> None:
    """The connector keeps vLLM's hybrid manager on: both instances serve two KV cache groups."""
    for server in (deployment.pd.prefill, deployment.pd.decode):
        log = log_text(server.log_path)
        told = [line for line in log.splitlines() if HMA_OFF in line or "group sizes" in line]
        assert HMA_OFF not in log, f"{server.log_path}: {told}"
        assert deployment.model.two_groups in log, f"{server.log_path}: {told}"


def test_answers_match_colocated(deployment: Case) -> None:
    """Through vam-proxy's default route: prefill computes each prompt but its last token, the
    proxy has decode sample the first token ("prompt prefix"), decode pulls every group's blocks
    (exactly what each kind keeps, by the bytes) and computes the last prompt token."""
    pd, colocated, model = deployment.pd, deployment.colocated, deployment.model
    reference = colocated.answers()
    name, decode_url = colocated.name, pd.decode.base_url
    prefixes_before = metric(pd.proxy_url, DECODE_FIRST_TOKENS, PROMPT_PREFIX)
    divergences = 0
    for attempt in ("first", "second"):
        external_before = metric(decode_url, "vllm:external_prefix_cache_hits_total")
        bytes_before = metric(decode_url, PULL_BYTES)
        totals_before = pd.transfer_totals()
        for n in model.prompt_lengths:
            prompt = make_prompt(n)
            got = complete(pd.proxy_url, name, prompt)
            what = f"{deployment} {attempt} {n}-token prompt"
            if deployment.prefill_tp == deployment.decode_tp:
                want = reference[n]
                assert got["tokens"] == want["tokens"], (
                    f"{what}: tokens {got['tokens']} != colocated {want['tokens']}"
                )
                compared_positions(got, want, what)
            else:
                divergences += compare_every_position(
                    got, prompt, colocated.ask, what, deployment.bound
                )
        if attempt == "first":
            loaded = metric(decode_url, "vllm:external_prefix_cache_hits_total")
            assert loaded > external_before, (
                f"{deployment}: decode loaded nothing; {ignored_params(pd)}"
            )
            assert_clean_transfers(pd, requests=len(model.prompt_lengths), since=totals_before)
            pulled = metric(decode_url, PULL_BYTES) - bytes_before
            wanted = sum(model.pulled_bytes(n - 1) for n in model.prompt_lengths)
            assert pulled == wanted, (
                f"{deployment}: pulled {pulled:.0f} bytes, the groups keep {wanted} for loads of "
                f"all but the last prompt token"
            )
        else:
            # decode's own prefix cache may hold all prefill computed (whole blocks, and the
            # state checkpoint at their end): a hold is then released without a pull
            assert_clean_transfers(
                pd, requests=0, since=totals_before, left=len(model.prompt_lengths)
            )
    prefixes = metric(pd.proxy_url, DECODE_FIRST_TOKENS, PROMPT_PREFIX) - prefixes_before
    assert prefixes == 2 * len(model.prompt_lengths), f"{prefixes} prompt-prefix legs"
    print(f"[{deployment}] near-ties resolved the other way: {divergences}")


def test_decode_continues_the_pulled_kv(deployment: Case) -> None:
    """Negative control: decode gets prompt X with the KV prefill computed for Y (all but the
    last token; Y differs from X in two earlier tokens). Having recomputed X it would answer X;
    it must answer Y's prefix followed by X's last token."""
    pd, colocated = deployment.pd, deployment.colocated
    name = colocated.name
    x, y = negative_control_prompts(deployment.model)
    before = pd.transfer_totals()
    params = hand_off(pd.prefill.base_url, name, y)
    assert prefill_address(params) and params["remote_prompt_prefix"] is True, params
    assert params["remote_num_tokens"] == len(y) - 1, params
    decoded = complete(
        pd.decode.base_url,
        name,
        x,
        kv_transfer_params=params,
        cache_salt="negative-control",  # never served from decode's cache of X
    )
    assert_clean_transfers(pd, requests=1, since=before)
    mixed = y[:-1] + x[-1:]
    want_x, want_mixed = colocated.ask(x), colocated.ask(mixed)
    assert want_x["tokens"] != want_mixed["tokens"], "X and Y must answer differently"
    assert decoded["tokens"] != want_x["tokens"], f"{deployment}: decode recomputed prompt X"
    control = compared_positions(decoded, want_mixed, f"{deployment} X|KV(Y)", deployment.bound)
    assert control >= 1, "negative control: not even the first token continues Y"
