"""vLLM's real scheduler in process, with this connector built by vLLM's own factory.

The tier between the connector's unit tests (``tests/connector/test_scheduler.py``, our scheduler
side on its own) and real ``vllm serve`` engines: ``vllm.v1.core.sched.scheduler.Scheduler``
drives :class:`~vllm_ascend_mooncake.connector.facade.MooncakeHeteroConnector` in the SCHEDULER
role exactly as an engine core does (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``update_connector_output``, ``request_finished``), while nothing runs
a model or moves bytes. What a worker would report is fed in by hand: a
:class:`~vllm.v1.outputs.ModelRunnerOutput` with sampled tokens and a
:class:`~vllm.v1.outputs.KVConnectorOutput` (``finished_sending``, ``finished_recving``,
``invalid_block_ids``), as ``KVConnectorModelRunnerMixin`` fills it from the worker side's
``get_finished`` and ``get_block_ids_with_load_errors``.

Built the way vLLM's ``tests/v1/kv_connector/unit/utils.py`` builds its scheduler: a
``VllmConfig`` on the CPU device, a one-group ``KVCacheConfig`` with as many blocks as a test
wants, requests carrying ``kv_transfer_params`` and a block hasher (prefix caching on). The model
is a ``config.json`` of a tiny Llama written to a temporary directory (offline; no weights, no
tokenizer). vLLM inspects the architecture in a subprocess and caches the answer under
``$VLLM_CACHE_ROOT/modelinfos`` (one entry per architecture, stale when the installed vLLM's model
source differs): the first build after installing a vLLM takes 10 to 25 s on 2 cores, later ones
milliseconds.

``Instance`` is one instance's scheduler and its steps; :func:`remote_prefill_params` the params
our prefill hands out, :func:`decode_accepts` a decode's check of them. The tests are in
``tests/scheduler/``.

Constructor signatures differ between the vLLM versions the project supports; the differences are
handled by feature detection where they occur, never by version number. Imports vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import random
import tempfile
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_ascend_mooncake.connector.config import config_from_vllm
from vllm_ascend_mooncake.connector.facade import MooncakeHeteroConnector, StepMetadata
from vllm_ascend_mooncake.connector.params import RemotePrefill, parse_remote_prefill
from vllm_ascend_mooncake.core.topology import Topologies
from vllm_ascend_mooncake.datapath.orders import StepOrders
from vllm_ascend_mooncake.names import CONNECTOR_NAME

#: The token a request stops on (its EOS), and the one sampled otherwise.
EOS_TOKEN_ID = 2
OTHER_TOKEN_ID = 7

#: Prefill's side-channel address in every config built here (decode's pulls name it).
SIDE_CHANNEL_HOST = "127.0.0.1"
SIDE_CHANNEL_PORT = 47000

#: The shape of the tiny model; its KV heads are what the connector's topology splits.
NUM_KV_HEADS = 4
HEAD_SIZE = 16
VOCAB_SIZE = 512


@functools.cache
def _model_dir() -> str:
    """A directory holding only a tiny Llama's ``config.json``: all ``ModelConfig`` reads. One
    per content under the temporary directory, shared by every run (written atomically)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2 * NUM_KV_HEADS * HEAD_SIZE,
        "intermediate_size": 4 * NUM_KV_HEADS * HEAD_SIZE,
        "num_attention_heads": 2 * NUM_KV_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_SIZE,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID,
    }
    text = json.dumps(config, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    directory = Path(tempfile.gettempdir()) / f"vam-scheduler-model-{digest}"
    target = directory / "config.json"
    if not target.is_file():
        directory.mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, delete=False) as partial:
            partial.write(text)
        os.replace(partial.name, target)
    return str(directory)


def register_connector() -> None:
    """Make the connector known to vLLM's factory the way every vLLM process does: by loading
    the ``vllm.general_plugins`` entry points (ours is ``connector.plugin.register``)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        raise RuntimeError(
            f"vLLM's general plugins did not register {CONNECTOR_NAME}: is this package "
            f"installed (pip install -e .) in this environment, with its entry points?"
        )


def vllm_config(
    kv_role: str,
    *,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 2048,
    tensor_parallel_size: int = 1,
    prefill_tp: int | None = None,
    decode_tp: int | None = None,
    kv_load_failure_policy: str | None = None,
    engine_id: str | None = None,
    extra: dict[str, Any] | None = None,
    async_scheduling: bool = False,
    enable_prefix_caching: bool = True,
) -> VllmConfig:
    """A CPU ``VllmConfig`` of a ``kv_role`` (``kv_producer``: prefill, ``kv_consumer``: decode)
    instance running this connector (prefix caching on unless told).

    ``prefill_tp`` / ``decode_tp`` (default: ``tensor_parallel_size``) go to the connector's
    ``kv_connector_extra_config``, with prefill's side channel on :data:`SIDE_CHANNEL_PORT`;
    ``extra`` adds to it (``pair_before_pull`` is off unless it turns it on: the caller then
    answers the pairing probes, :meth:`Instance.step`'s ``stats``). ``kv_load_failure_policy``:
    vLLM's ``"recompute"`` or ``"fail"`` (None: vLLM's default). ``async_scheduling``: what
    GPU and NPU engines run by default (``AsyncScheduler``, two batches in flight); vLLM's CPU
    platform turns it off, so CPU engines run the synchronous ``Scheduler``."""
    register_connector()  # VllmConfig asks the connector class for its KV cache layout
    model_config = ModelConfig(
        model=_model_dir(),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=model_config.is_encoder_decoder,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    transfer = {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": kv_role,
        "kv_connector_extra_config": {
            "prefill": {"tp_size": prefill_tp or tensor_parallel_size},
            "decode": {"tp_size": decode_tp or tensor_parallel_size},
            "side_channel_host": SIDE_CHANNEL_HOST,
            "side_channel_port": SIDE_CHANNEL_PORT,
            "pair_before_pull": False,  # no worker answers a probe here (see Instance.step)
            **(extra or {}),
        },
    }
    if engine_id is not None:
        transfer["engine_id"] = engine_id
    if kv_load_failure_policy is not None:
        transfer["kv_load_failure_policy"] = kv_load_failure_policy
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        kv_transfer_config=KVTransferConfig(**transfer),
        device_config=DeviceConfig("cpu"),
    )
    # The CPU platform resets async scheduling ("not required on CPU"); a GPU or NPU platform
    # keeps it, and the scheduler then defers block frees past the batch in flight.
    config.scheduler_config.async_scheduling = async_scheduling
    return config


def kv_cache_config(config: VllmConfig, num_blocks: int) -> KVCacheConfig:
    """One full-attention KV cache group of ``num_blocks`` blocks (one of them vLLM's null
    block); no tensors: the scheduler only counts blocks."""
    spec = FullAttentionSpec(
        block_size=config.cache_config.block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float32,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )


def build_scheduler(config: VllmConfig, num_blocks: int = 128) -> Scheduler:
    """vLLM's scheduler over ``num_blocks`` KV blocks (``AsyncScheduler`` under async
    scheduling, as an engine core picks it); it builds the connector (role SCHEDULER) with
    vLLM's ``KVConnectorFactory``."""
    register_connector()
    config.cache_config.num_gpu_blocks = num_blocks
    block_size = config.cache_config.block_size
    scheduler_cls = AsyncScheduler if config.scheduler_config.async_scheduling else Scheduler
    return scheduler_cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config(config, num_blocks),
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        log_stats=True,
    )


_none_hash_ready = False


def _block_hasher(block_size: int) -> Any:
    """The prefix-cache block hasher an engine core gives each request (sha256)."""
    global _none_hash_ready
    from vllm.utils.hashing import sha256

    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    return get_request_block_hasher(block_size, sha256)


def prompt_tokens(seed: str, count: int) -> list[int]:
    """``count`` token ids drawn from ``seed`` (never EOS): the same seed, the same prompt."""
    rng = random.Random(seed)
    return [rng.randrange(EOS_TOKEN_ID + 1, VOCAB_SIZE) for _ in range(count)]


def make_request(
    request_id: str,
    prompt: int | list[int],
    *,
    params: dict[str, Any] | None = None,
    max_tokens: int = 8,
    block_size: int = 16,
    **sampling_params: Any,
) -> Request:
    """A vLLM request as an engine core builds it: ``prompt`` token ids (or that many drawn
    from the request id, so that two requests share no prefix by chance), ``params`` as its
    ``kv_transfer_params`` (carried in ``SamplingParams.extra_args`` like the OpenAI server
    does; the request keeps that dict, which the connector may change, and the sequences of an
    ``n > 1`` request share one), EOS :data:`EOS_TOKEN_ID`, and a prefix-cache block hasher;
    ``sampling_params`` go to ``SamplingParams`` (``prompt_logprobs``, ...)."""
    tokens = prompt_tokens(request_id, prompt) if isinstance(prompt, int) else list(prompt)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        extra_args={"kv_transfer_params": params} if params is not None else None,
        **sampling_params,
    )
    sampling.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=_block_hasher(block_size),
    )


def remote_prefill_params(
    num_tokens: int,
    block_ids: list[int] | None,
    *,
    transfer_id: str = "p-1",
    engine_id: str = "engine-p",
    tp_size: int = 1,
    block_size: int = 16,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` our prefill returns for a prompt of ``num_tokens`` held in
    ``block_ids`` (None: overlapped legs, the proxy's params before prefill answered), as the
    proxy hands them to decode."""
    if block_ids is None:
        return {
            "do_remote_prefill": True,
            "remote_request_id": transfer_id,
            "remote_engine_id": engine_id,
            "remote_host": SIDE_CHANNEL_HOST,
            "remote_port": SIDE_CHANNEL_PORT,
            "remote_tp_size": tp_size,
        }
    return RemotePrefill(
        remote_engine_id=engine_id,
        remote_request_id=transfer_id,
        remote_host=SIDE_CHANNEL_HOST,
        remote_port=SIDE_CHANNEL_PORT,
        remote_tp_size=tp_size,
        remote_block_ids=list(block_ids),
        remote_num_tokens=num_tokens,
        remote_block_size=block_size,
    ).to_dict()


def decode_accepts(params: dict[str, Any], prompt: int | list[int], **config: Any) -> RemotePrefill:
    """``params`` (a prefill's ``kv_transfer_params``) validated as a decode instance of
    :func:`vllm_config` ``("kv_consumer", **config)`` validates them on arrival for a request
    with ``prompt`` (token ids, or only their number); raises ``InvalidTransferParams`` where
    that decode would compute the prompt itself."""
    decode = config_from_vllm(vllm_config("kv_consumer", **config))
    return parse_remote_prefill(
        params,
        topologies=Topologies(decode.topology(), local_is_decode=True),
        block_size=decode.block_size,
        prompt_token_ids=[0] * prompt if isinstance(prompt, int) else prompt,
    )


def sampling_requests(scheduler: Scheduler, scheduler_output: SchedulerOutput) -> set[str]:
    """The requests of ``scheduler_output`` (just scheduled) that sample a token: all but
    partial prefill chunks (the scheduler's own test, taken right after ``schedule()``)."""
    return {
        req_id
        for req_id in scheduler_output.num_scheduled_tokens
        if not scheduler.requests[req_id].is_prefill_chunk
    }


def runner_output(
    scheduler_output: SchedulerOutput,
    sampling: set[str],
    *,
    tokens: dict[str, int] | None = None,
    finished_sending: Iterable[str] | None = None,
    finished_recving: Iterable[str] | None = None,
    invalid_block_ids: Iterable[int] | None = None,
    stats: KVConnectorStats | None = None,
) -> ModelRunnerOutput:
    """What a model runner returns for ``scheduler_output``: one sampled token (``tokens``, else
    :data:`OTHER_TOKEN_ID`) for each request in ``sampling`` (:func:`sampling_requests`), none
    for a partial prefill chunk; plus the worker side's KV report when any is given."""
    tokens = tokens or {}
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = [
        [tokens.get(req_id, OTHER_TOKEN_ID)] if req_id in sampling else [] for req_id in req_ids
    ]
    report = None
    if finished_sending or finished_recving or invalid_block_ids or stats:
        report = KVConnectorOutput(
            finished_sending=set(finished_sending) if finished_sending else None,
            finished_recving=set(finished_recving) if finished_recving else None,
            invalid_block_ids=set(invalid_block_ids or ()),
            kv_connector_stats=stats,
        )
    kwargs: dict[str, Any] = {
        "req_ids": req_ids,
        "sampled_token_ids": sampled,
        "logprobs": None,
        "prompt_logprobs_dict": {},
        "pooler_output": None,
        "kv_connector_output": report,
    }
    # vLLM 0.34 dropped ModelRunnerOutput.req_id_to_index (0.30 to 0.33 require it).
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        kwargs["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(**kwargs)


@dataclass
class Step:
    """One engine step: what was scheduled (None: nothing was, under async scheduling), the
    orders our connector shipped to the workers with it, and what the engine core returned to
    the front end from the batch that came back (under async scheduling, an earlier one's)."""

    output: SchedulerOutput | None
    outputs: list[EngineCoreOutput] = field(default_factory=list)

    @property
    def orders(self) -> StepOrders:
        if self.output is None:
            return StepOrders()
        metadata = self.output.kv_connector_metadata
        assert isinstance(metadata, StepMetadata), metadata
        return metadata.orders

    @property
    def scheduled(self) -> dict[str, int]:
        """Request id -> tokens scheduled this step."""
        return {} if self.output is None else dict(self.output.num_scheduled_tokens)

    @property
    def new_request_ids(self) -> list[str]:
        return [] if self.output is None else [n.req_id for n in self.output.scheduled_new_reqs]

    def finished(self, request_id: str) -> EngineCoreOutput | None:
        """The output that finished ``request_id`` this step, if one did."""
        for out in self.outputs:
            if out.request_id == request_id and out.finish_reason is not None:
                return out
        return None


_instance_ids = itertools.count()


class Instance:
    """One vLLM instance's scheduler with this connector; :meth:`step` runs one engine step with
    the worker side's report given by the caller.

    ``config`` goes to :func:`vllm_config`. Under ``async_scheduling`` the steps follow an
    engine core's batch queue (``EngineCore.step_with_batch_queue``): up to two scheduled
    batches in flight, the older one's output processed once the queue is full or nothing more
    can be scheduled; a report waits for the next output processed."""

    def __init__(self, kv_role: str, *, num_blocks: int = 128, **config: Any) -> None:
        config.setdefault("engine_id", f"engine-{kv_role}-{next(_instance_ids)}")
        self.config = vllm_config(kv_role, **config)
        self.scheduler = build_scheduler(self.config, num_blocks)
        self.block_size = self.config.cache_config.block_size
        self.initial_free_blocks = self.free_blocks()
        self.batch_queue_size = self.config.max_concurrent_batches
        #: scheduled batches whose output has not been processed yet, newest first
        self.in_flight: deque[tuple[SchedulerOutput, set[str]]] = deque()
        self._report: dict[str, set[Any]] = {}
        self._stats: KVConnectorStats | None = None

    @property
    def connector(self) -> MooncakeHeteroConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, MooncakeHeteroConnector), connector
        return connector

    @property
    def engine_id(self) -> str:
        engine_id = self.config.kv_transfer_config.engine_id
        assert engine_id is not None
        return engine_id

    def spy(self, method: str) -> list[tuple[Any, ...]]:
        """Record every call vLLM makes to the connector's ``method``: (args..., result)."""
        calls: list[tuple[Any, ...]] = []
        connector = self.connector
        real = getattr(connector, method)

        def recording(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            calls.append((*args, *kwargs.values(), result))
            return result

        setattr(connector, method, recording)
        return calls

    def request(self, request_id: str, prompt: int | list[int], **kwargs: Any) -> Request:
        """A request for this instance (its block size), added to its scheduler."""
        request = make_request(request_id, prompt, block_size=self.block_size, **kwargs)
        self.scheduler.add_request(request)
        return request

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def block_ids(self, request_id: str) -> list[int]:
        """The KV block ids the scheduler has allocated to ``request_id`` (none when freed)."""
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        return [block.block_id for block in manager.req_to_blocks.get(request_id, ())]

    def step(
        self,
        *,
        tokens: dict[str, int] | None = None,
        finished_sending: Iterable[str] | None = None,
        finished_recving: Iterable[str] | None = None,
        invalid_block_ids: Iterable[int] | None = None,
        stats: KVConnectorStats | None = None,
    ) -> Step:
        """schedule(), a model runner's output with the given worker report (``tokens``: the
        token each request samples, default :data:`OTHER_TOKEN_ID`; ``stats``: the workers'
        connector stats, e.g. pairing verdicts), then update_from_output(), as an engine
        core's step does."""
        if stats is not None:
            self._stats = stats if self._stats is None else self._stats.aggregate(stats)
        for name, ids in (
            ("finished_sending", finished_sending),
            ("finished_recving", finished_recving),
            ("invalid_block_ids", invalid_block_ids),
        ):
            if ids:
                self._report.setdefault(name, set()).update(ids)
        output = None
        if self.scheduler.has_requests():
            output = self.scheduler.schedule()
            self.in_flight.appendleft((output, sampling_requests(self.scheduler, output)))
            executed = output.total_num_scheduled_tokens > 0
            if len(self.in_flight) < self.batch_queue_size and (
                executed or self.scheduler.has_requests()
            ):
                return Step(output)  # the engine core does not wait for the batch yet
        elif not self.in_flight:
            return Step(None)
        batch, sampling = self.in_flight.pop()
        report, self._report = self._report, {}
        stats, self._stats = self._stats, None
        result = self.scheduler.update_from_output(
            batch, runner_output(batch, sampling, tokens=tokens, stats=stats, **report)
        )
        return Step(output, [out for engine in result.values() for out in engine.outputs])

    def abort(self, request_id: str) -> None:
        """What the front end does when a client goes away."""
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def assert_empty(self) -> None:
        """No request left, no block leaked: the pool is back to its initial free count."""
        assert not self._report, f"a worker report was never delivered: {self._report}"
        assert self._stats is None, f"worker stats were never delivered: {self._stats}"
        while self.in_flight:  # the engine core runs until its batch queue is empty
            self.step()
        # Block frees deferred past a batch in flight (async scheduling; vLLM 0.30 and later).
        assert not getattr(self.scheduler, "deferred_frees", ())
        assert not self.scheduler.requests, sorted(self.scheduler.requests)
        assert not self.scheduler.running and not self.scheduler.waiting
        assert not self.scheduler.finished_recving_kv_req_ids
        assert self.free_blocks() == self.initial_free_blocks
        for block in self.scheduler.kv_cache_manager.block_pool.blocks:
            assert block.ref_cnt == 0 or block.is_null, block


__all__ = [
    "EOS_TOKEN_ID",
    "OTHER_TOKEN_ID",
    "SIDE_CHANNEL_HOST",
    "SIDE_CHANNEL_PORT",
    "Instance",
    "Step",
    "build_scheduler",
    "decode_accepts",
    "kv_cache_config",
    "make_request",
    "prompt_tokens",
    "register_connector",
    "remote_prefill_params",
    "runner_output",
    "sampling_requests",
    "vllm_config",
]
