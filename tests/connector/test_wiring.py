"""The one assembly of a worker's data path (connector/wiring.py): the configuration's keys reach
the receiver in the right units, staging is allocated exactly when a pull may need it, and the
built prefill and decode sides move real bytes (over the in-process transport, no Mooncake)."""

from __future__ import annotations

import uuid

import pytest
import torch

from vam_testing.waiting import wait_until
from vllm_ascend_mooncake.connector.config import MIB, parse_config
from vllm_ascend_mooncake.connector.wiring import (
    KVCacheMemory,
    PrefillSettings,
    WorkerIdentity,
    build_decode_side,
    build_prefill_side,
    decode_settings,
    prefill_settings,
    receiver_options,
    staging_areas,
)
from vllm_ascend_mooncake.core.layout import BlockOrder, RegionLayout
from vllm_ascend_mooncake.core.packing import chunk_packing
from vllm_ascend_mooncake.core.topology import TransferTopology
from vllm_ascend_mooncake.datapath.fake import InProcessTransport
from vllm_ascend_mooncake.datapath.orders import PullOrder
from vllm_ascend_mooncake.datapath.registration import regions_from_vllm_views
from vllm_ascend_mooncake.datapath.wire import ModelIdentity
from vllm_ascend_mooncake.launch.ports import free_port_range


def config(prefill_tp: int = 2, decode_tp: int = 1, **extra):
    return parse_config(
        kv_role="kv_consumer",
        engine_id="decode-engine",
        extra={"prefill": {"tp_size": prefill_tp}, "decode": {"tp_size": decode_tp}, **extra},
        local_tp=decode_tp,
        local_dp=1,
        num_kv_heads=4,
        is_mla=False,
        block_size=32,
        device_type="cpu",
    )


def test_every_receiver_key_reaches_the_receiver_in_bytes_and_seconds() -> None:
    cfg = config(
        max_descriptors_per_batch=100,
        coalesce_runs=False,
        block_reads_from_kib=8,
        max_descriptor_kib=64,
        receiver_threads=3,
        claim_wait_s=3.5,
        prefill_wait_s=7.0,
        read_retries=0,
        side_channel_timeout_s=6.0,
    )
    options = receiver_options(cfg)
    assert options.max_descriptors_per_batch == 100
    assert options.coalesce_runs is False
    assert options.block_reads_from_bytes == 8 << 10
    assert options.max_descriptor_bytes == 64 << 10
    assert options.num_threads == 3
    assert (options.claim_wait_s, options.prefill_wait_s) == (3.5, 7.0)
    assert options.read_retries == 0
    assert options.claim_park_s == cfg.claim_park_s <= 3.0  # at most half the exchange timeout
    assert decode_settings(cfg).side_channel_timeout_s == 6.0


@pytest.mark.parametrize(
    ("decode_tp", "local_heads", "head_major", "stages"),
    [
        (1, 4, False, False),  # a decode rank holds every head: no prefill TP gives it a slice
        (2, 2, False, True),  # token-major blocks: a prefill TP 1 rank's slice is staged
        (2, 2, True, False),  # head-major blocks with 2 heads: slices are read in place
        (4, 1, True, True),  # one head per block: the prefill's block order decides
        (8, 1, False, True),  # heads replicated on decode: still a slice of a TP 1 prefill
        (2, None, False, True),  # layout unknown: allocated whenever a prefill TP could stage
        # head-major blocks of known packing (vLLM CPU): a prefill of another block size stages
        (1, 4, "packed", True),
        (2, 2, "packed", True),
    ],
)
def test_staging_buffer_only_when_some_prefill_makes_a_decode_rank_stage(
    decode_tp: int, local_heads: int | None, head_major: bool | str, stages: bool
) -> None:
    # 4 KV heads; the configured prefill TP does not matter: any prefill TP may feed decode.
    cfg = config(2, decode_tp, staging_buffer_mib=3)
    local = None
    if local_heads is not None:
        order = BlockOrder.HEAD_MAJOR if head_major else BlockOrder.TOKEN_MAJOR
        block_len = local_heads * 32 * 256
        packing = chunk_packing("CPU_ATTN/vec", "auto", 64, 2) if head_major == "packed" else ()
        local = RegionLayout(order, 8, block_len, local_heads, 32, 256, packing=packing)
    layouts = [local] if local is not None else []
    assert decode_settings(cfg, layouts).staging_bytes == (3 * MIB if stages else 0)


def test_prefill_settings_listen_on_the_ranks_port() -> None:
    cfg = parse_config(
        kv_role="kv_producer",
        engine_id="p",
        extra={"prefill": {"tp_size": 2}, "decode": {"tp_size": 1}, "side_channel_port": 41000},
        local_tp=2,
        local_dp=1,
        num_kv_heads=4,
        is_mla=False,
        block_size=32,
        device_type="cpu",
    )
    assert prefill_settings(cfg, 1).port == 41001
    assert prefill_settings(cfg, 0).release_timeout_s == cfg.release_timeout_s


HEADS, BLOCK, CONTENT, LAYERS, BLOCKS = 2, 4, 8, 2, 6  # CONTENT: K and V of a 4-float head


def _kv_cache(fill: float | None) -> KVCacheMemory:
    page = HEADS * BLOCK * CONTENT
    raw = torch.empty(LAYERS * BLOCKS * page, dtype=torch.float32)
    if fill is None:
        raw.copy_(torch.arange(raw.numel(), dtype=torch.float32))
    else:
        raw.fill_(fill)
    views = {
        f"layer.{i}": raw.as_strided(
            (BLOCKS, HEADS, BLOCK, CONTENT), (page, BLOCK * CONTENT, CONTENT, 1), i * BLOCKS * page
        )
        for i in range(LAYERS)
    }
    regions = regions_from_vllm_views(views, num_kv_heads=HEADS, block_size=BLOCK, is_mla=False)
    return KVCacheMemory([raw], regions)


def _who(role: str) -> WorkerIdentity:
    return WorkerIdentity(
        engine_id=f"wiring-{role}",
        incarnation=uuid.uuid4().hex,
        tp_rank=0,
        tp_size=1,
        dp_rank=0,
        dp_size=1,
        model=ModelIdentity(
            model="tiny",
            dtype="float32",
            kv_cache_dtype="auto",
            block_size=BLOCK,
            head_size=CONTENT // 2,
            num_kv_heads=HEADS,
            num_layers=LAYERS,
            is_mla=False,
        ),
    )


def test_built_sides_advertise_their_memory_and_move_a_request() -> None:
    topology = TransferTopology(HEADS, 1, 1)
    port = free_port_range(1)
    prefill_transport, decode_transport = InProcessTransport(), InProcessTransport()
    prefill_cache, decode_cache = _kv_cache(None), _kv_cache(-1.0)
    prefill = build_prefill_side(
        _who("prefill"),
        topology,
        prefill_transport,
        prefill_cache,
        PrefillSettings("127.0.0.1", port, release_timeout_s=30.0),
    )
    decode = build_decode_side(
        _who("decode"), topology, decode_transport, decode_cache, decode_settings(config(1, 1))
    )
    try:
        # What peers are told is what was registered.
        raw = prefill_cache.tensors[0]
        assert prefill.metadata.transport_session == prefill_transport.session
        assert [r.base for r in prefill.metadata.to_regions()] == [
            r.base for r in prefill_cache.regions
        ]
        assert any(
            r.addr <= raw.data_ptr() and raw.data_ptr() + raw.nbytes <= r.end
            for r in prefill_transport.registered
        )
        assert decode.staging == []  # TP 1 -> 1 never stages

        prefill.sender.tracker.hold(
            "t-1", request_id="r-1", block_ids=(4, 1), num_prompt_tokens=2 * BLOCK
        )
        decode.receiver.submit(
            PullOrder(
                request_id="r-1",
                transfer_id="t-1",
                local_block_ids=(0, 5),
                remote_block_ids=(4, 1),
                remote_host="127.0.0.1",
                remote_port=port,
                remote_engine_id=prefill.metadata.engine_id,
                num_prompt_tokens=2 * BLOCK,
            )
        )

        def pulled() -> set[str]:
            decode.receiver.wait_for_news(0.05)
            done, failed = decode.receiver.take_finished()
            assert not failed
            return done

        assert wait_until(pulled, "decode finishes pulling r-1") == {"r-1"}

        page = HEADS * BLOCK * CONTENT
        src = prefill_cache.tensors[0].view(LAYERS, BLOCKS, page)
        dst = decode_cache.tensors[0].view(LAYERS, BLOCKS, page)
        assert torch.equal(dst[:, 0], src[:, 4]) and torch.equal(dst[:, 5], src[:, 1])
        untouched = [b for b in range(BLOCKS) if b not in (0, 5)]
        assert bool((dst[:, untouched] == -1.0).all())  # nothing else was written

        # The read-done notice frees prefill's hold.
        def released() -> set[str]:
            prefill.sender.tracker.wait_for_news(0.05)
            return prefill.sender.tracker.take_finished()

        assert wait_until(released, "prefill frees r-1 on the read-done notice") == {"r-1"}
    finally:
        decode.close()
        prefill.close()
        decode_transport.close()
        prefill_transport.close()


def test_the_transport_key_names_a_known_transport() -> None:
    from vllm_ascend_mooncake.options import ConnectorConfigError

    assert config().transport == "mooncake"
    with pytest.raises(ConnectorConfigError, match=r"\['transport'\] must be one of mooncake"):
        config(transport="nixl")


@pytest.mark.parametrize(("mib", "areas"), [(1, 1), (32, 1), (63, 1), (64, 2), (128, 4), (1024, 4)])
def test_the_staging_buffer_is_split_into_areas_for_requests_in_flight(mib, areas) -> None:
    """Up to four areas of at least 32 MiB: a request keeps its area from planning to its
    report, so the next one can be planned and queued meanwhile; areas never overlap."""
    split = staging_areas(1 << 40, mib * MIB)
    assert len(split) == areas
    assert all(a.capacity >= min(mib, 32) * MIB for a in split)
    ends = [a.base + a.capacity for a in split]
    assert all(end <= nxt.base for end, nxt in zip(ends[:-1], split[1:], strict=True))
    assert ends[-1] <= (1 << 40) + mib * MIB
