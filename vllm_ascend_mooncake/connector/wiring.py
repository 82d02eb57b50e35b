"""Assemble a worker's data path: one function per role, used by the connector's worker and by
the multi-process test harness alike, so that the tests exercise the wiring production runs.

The configuration is mapped to the data path's settings once (:func:`prefill_settings`,
:func:`decode_settings`: keys to bytes and seconds); :func:`build_prefill_side` and
:func:`build_decode_side` then register the KV memory (and decode's staging buffer) with the
transport, advertise it in the worker's metadata, and start the sender or receiver. The harness
passes settings of its own where it needs sizes the keys cannot express (descriptors of a few
hundred bytes), and the same builders.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.layout import Region, RegionLayout
from ..core.plan import StagingArea, may_need_staging
from ..core.relayout import LocalMemory
from ..core.topology import TransferTopology
from ..datapath.mooncake import NPU_ADDRESS_ALIGNMENT, MooncakeOptions, MooncakeTransport
from ..datapath.pairing import PairingProbes
from ..datapath.peers import PeerDirectory
from ..datapath.prefill_service import PrefillSender
from ..datapath.receiver import Receiver, ReceiverOptions
from ..datapath.registration import kv_memory_ranges
from ..datapath.sender import SendTracker
from ..datapath.side_channel import SideChannelClient
from ..datapath.staging_pool import StagingPool
from ..datapath.transport import TRANSPORTS, Transport, TransportSetupError
from ..datapath.wire import ModelIdentity, RegionInfo, WorkerMetadata
from ..options import default_of
from .config import ConnectorConfig

if TYPE_CHECKING:
    import torch

#: The staging buffer is split into up to this many areas of at least ``MIN_STAGING_AREA_MIB``,
#: one per request in flight: a request holds its area from planning to its report, so with
#: several areas the next request is planned and queued while one still reads.
MAX_STAGING_AREAS = 4
MIN_STAGING_AREA_MIB = 32


@dataclass(frozen=True)
class KVCacheMemory:
    """A worker's KV cache as the data path sees it: the tensors whose storages are registered
    with the transport, and the regions described from them, in layer order;
    ``region_groups``: each region's KV cache group (vLLM's hybrid manager, -1: not
    transferred), empty when the model has one group."""

    tensors: list[torch.Tensor]
    regions: list[Region]
    region_groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class WorkerIdentity:
    """Who a worker is, as its metadata tells peers (the transport adds its session)."""

    engine_id: str
    incarnation: str  # unique per process start: a restarted peer is never mistaken for this one
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    model: ModelIdentity


@dataclass(frozen=True)
class PrefillSettings:
    host: str  # where the side channel listens
    port: int  # this rank's side-channel port
    release_timeout_s: float
    secret: bytes | None = None


@dataclass(frozen=True)
class DecodeSettings:
    receiver: ReceiverOptions = field(default_factory=ReceiverOptions)
    staging_bytes: int = 0  # 0: no staging buffer (no pull of this topology can need one)
    side_channel_timeout_s: float = default_of(ConnectorConfig, "side_channel_timeout_s")
    secret: bytes | None = None


def prefill_settings(config: ConnectorConfig, tp_rank: int) -> PrefillSettings:
    return PrefillSettings(
        host=config.side_channel_host,
        port=config.side_channel_base_port() + tp_rank,
        release_timeout_s=config.release_timeout_s,
        secret=config.side_channel_secret,
    )


def receiver_options(config: ConnectorConfig) -> ReceiverOptions:
    """The receiver's options: the keys it declares, as the configuration read them."""
    return config.receiver


def decode_settings(
    config: ConnectorConfig, layouts: Sequence[RegionLayout] = ()
) -> DecodeSettings:
    """``layouts``: the worker's KV regions', which rule staging out when their blocks are
    head-major (none: unknown, allocated whenever a prefill TP could need it)."""
    staging = may_need_staging(config.topology(), layouts)
    return DecodeSettings(
        receiver=receiver_options(config),
        staging_bytes=config.staging_buffer_bytes if staging else 0,
        side_channel_timeout_s=config.side_channel_timeout_s,
        secret=config.side_channel_secret,
    )


def create_transport(
    kind: str, hostname: str, mooncake: MooncakeOptions, device_type: str = "cpu"
) -> Transport:
    """The transport the configuration names (``transport`` key), started on ``hostname`` with
    the keys it declares (``mooncake``)."""
    if kind == "mooncake":
        return MooncakeTransport(
            hostname,
            mooncake.protocol,
            mooncake.device_name,
            device_type=device_type,
            read_wait=mooncake.read_wait,
        )
    raise TransportSetupError(f"transport must be one of {TRANSPORTS}, not {kind!r}")


def _metadata(who: WorkerIdentity, transport: Transport, regions: list[Region]) -> WorkerMetadata:
    return WorkerMetadata(
        engine_id=who.engine_id,
        incarnation=who.incarnation,
        tp_rank=who.tp_rank,
        tp_size=who.tp_size,
        dp_rank=who.dp_rank,
        dp_size=who.dp_size,
        pp_size=1,
        transport_session=transport.session,
        identity=who.model,
        regions=[RegionInfo.of(r) for r in regions],
    )


@dataclass
class PrefillSide:
    sender: PrefillSender
    metadata: WorkerMetadata

    def close(self) -> None:
        self.sender.close()


@dataclass
class DecodeSide:
    receiver: Receiver
    client: SideChannelClient
    peers: PeerDirectory
    metadata: WorkerMetadata
    #: the memory the receiver's fix-ups copy in: the KV cache and the staging buffers
    memory: LocalMemory
    #: the registered staging buffers (empty when the topology never stages)
    staging: list[torch.Tensor] = field(default_factory=list)
    #: pairing with prefill engines before their first pull (answered by TP rank 0 only)
    pairings: PairingProbes | None = None

    def close(self) -> None:
        if self.pairings is not None:
            self.pairings.close()
        self.receiver.shutdown()
        self.client.close()


def build_prefill_side(
    who: WorkerIdentity,
    topology: TransferTopology,
    transport: Transport,
    memory: KVCacheMemory,
    settings: PrefillSettings,
) -> PrefillSide:
    """Register the KV cache and serve it: holds, read leases and releases on the side channel."""
    transport.register(kv_memory_ranges(memory.tensors))
    metadata = _metadata(who, transport, memory.regions)
    tracker = SendTracker(topology, who.tp_rank, settings.release_timeout_s)
    sender = PrefillSender(
        metadata,
        tracker,
        settings.host,
        settings.port,
        secret=settings.secret,
        memory=LocalMemory.from_tensors(memory.tensors),  # what integrity checks read
    )
    return PrefillSide(sender, metadata)


def build_decode_side(
    who: WorkerIdentity,
    topology: TransferTopology,
    transport: Transport,
    memory: KVCacheMemory,
    settings: DecodeSettings,
    memory_type: type[LocalMemory] = LocalMemory,
) -> DecodeSide:
    """Register the KV cache and a staging buffer (when pulls may need one), and start the
    receiver that pulls requests' KV from the prefill ranks the topology names.

    ``memory_type``: how fix-ups copy (tests pass a fake of an accelerator's queued copies)."""
    import torch

    device = torch.device(memory.tensors[0].device if memory.tensors else "cpu")
    staging = [staging_buffer(settings.staging_bytes, device)] if settings.staging_bytes else []
    transport.register(kv_memory_ranges(memory.tensors) + kv_memory_ranges(staging))
    metadata = _metadata(who, transport, memory.regions)
    client = SideChannelClient(settings.side_channel_timeout_s, secret=settings.secret)
    peers = PeerDirectory(client, metadata, topology)
    local_memory = memory_type.from_tensors([*memory.tensors, *staging])
    receiver = Receiver(
        transport,
        topology,
        who.tp_rank,
        memory.regions,
        local_memory,
        peers,
        client,
        settings.receiver,
        StagingPool([area for t in staging for area in staging_areas(t.data_ptr(), t.numel())]),
        region_groups=memory.region_groups,
    )
    pairings = PairingProbes(peers) if who.tp_rank == 0 else None
    return DecodeSide(receiver, client, peers, metadata, local_memory, staging, pairings)


def staging_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Decode's staging buffer; on an NPU it starts on a 2 MiB boundary, as vllm-ascend aligns
    its KV caches for Mooncake (``_allocate_int8_cache_tensor``), by slicing it out of an
    allocation 2 MiB larger."""
    import torch

    if device.type != "npu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw = torch.empty(nbytes + NPU_ADDRESS_ALIGNMENT, dtype=torch.uint8, device=device)
    offset = -raw.data_ptr() % NPU_ADDRESS_ALIGNMENT
    return raw[offset : offset + nbytes]


def staging_areas(base: int, size: int) -> list[StagingArea]:
    """A staging buffer as up to :data:`MAX_STAGING_AREAS` equal areas of at least
    :data:`MIN_STAGING_AREA_MIB` (one area when the buffer is smaller than two)."""
    count = max(1, min(MAX_STAGING_AREAS, size // (MIN_STAGING_AREA_MIB << 20)))
    share = size // count
    return [StagingArea(base + i * share, share) for i in range(count)]
