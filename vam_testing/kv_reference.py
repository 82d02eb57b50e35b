"""A deliberately simple reference model of KV placement, and a numpy executor for plans.

The reference holds the *full* KV content of a request, all heads, as one array
``[regions, blocks, heads, tokens, head_token_bytes]``, and answers "which heads does rank ``r`` of
TP ``T`` own" with the plainest rule that matches vLLM. From it, the bytes any rank must hold in any
layout are written out directly, without the planner's arithmetic, so a plan can be checked by
executing it on numpy buffers standing for process memories and comparing bytes exactly.

It is used by the planner's property tests, by the data-path tests (to fill prefill caches) and by
benchmarks. It imports numpy only.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_ascend_mooncake.core.layout import (
    BlockOrder,
    ChunkPacking,
    Region,
    RegionLayout,
    RowGroup,
)
from vllm_ascend_mooncake.core.plan_types import RequestPlan, RowCopies, SwapAxes, TransferBatch
from vllm_ascend_mooncake.core.staging import copies_must_finish_first


def owned_heads(num_heads: int, tp: int, rank: int, is_mla: bool = False) -> list[int]:
    """Global KV heads rank ``rank`` of TP ``tp`` holds (vLLM's sharding, stated plainly)."""
    if is_mla:
        return [0]
    if tp <= num_heads:
        per_rank = num_heads // tp
        return list(range(rank * per_rank, rank * per_rank + per_rank))
    replicas = tp // num_heads
    return [rank // replicas]


def pack_chunk(chunk: np.ndarray, packing: ChunkPacking) -> np.ndarray:
    """One head's chunk ``[tokens, head_token_bytes]`` in a backend's packing, written plainly:
    group after group, row after row, each row taking its bytes of every token. Inside a token
    unit the bytes are stored transposed, ``[token_bytes][unit]`` (as AMX tiles interleave
    them), so that a plan cutting a unit apart gets wrong bytes."""
    tokens = chunk.shape[0]
    parts, column = [], 0
    for group in packing:
        w, unit = group.token_bytes, group.token_unit
        for row in range(group.rows):
            cells = chunk[:, column + row * w : column + (row + 1) * w]
            parts.append(cells.reshape(tokens // unit, unit, w).transpose(0, 2, 1).reshape(-1))
        column += group.rows * w
    return np.concatenate(parts)


def unpack_chunk(data: np.ndarray, packing: ChunkPacking, tokens: int) -> np.ndarray:
    """The inverse of :func:`pack_chunk`: ``[tokens, head_token_bytes]``."""
    width = sum(group.bytes_per_token for group in packing)
    chunk = np.empty((tokens, width), dtype=data.dtype)
    start = column = 0
    for group in packing:
        w, unit = group.token_bytes, group.token_unit
        for row in range(group.rows):
            cells = data[start : start + tokens * w].reshape(tokens // unit, w, unit)
            chunk[:, column + row * w : column + (row + 1) * w] = cells.transpose(0, 2, 1).reshape(
                tokens, w
            )
            start += tokens * w
        column += group.rows * w
    return chunk


def block_bytes(content: np.ndarray, order: BlockOrder, packing: ChunkPacking = ()) -> np.ndarray:
    """Serialise one block's content ``[heads, tokens, head_token_bytes]`` in a block order
    (head-major chunks in ``packing`` where one is given)."""
    if order is BlockOrder.TOKEN_MAJOR:
        return np.ascontiguousarray(content.transpose(1, 0, 2)).reshape(-1)
    if order is BlockOrder.HEAD_MAJOR and packing:
        return np.concatenate([pack_chunk(head, packing) for head in content])
    return np.ascontiguousarray(content).reshape(-1)


@dataclass
class ReferenceKV:
    """Full KV content: ``data[region, block, head, token, byte]`` (uint8).

    ``widths``, when set, gives each region's bytes per head and token (regions of one layer may
    differ: vllm-ascend's MLA nope and rope caches); ``data`` is then as wide as the widest and a
    region's content is its first ``widths[region]`` bytes.
    """

    data: np.ndarray
    widths: tuple[int, ...] | None = None

    @classmethod
    def random(
        cls,
        num_regions: int,
        num_blocks: int,
        num_heads: int,
        tokens_per_block: int,
        head_token_bytes: int | Sequence[int],
        seed: int = 0,
    ) -> ReferenceKV:
        """Random content; ``head_token_bytes`` is one width for all regions or one per region."""
        widths = None
        if not isinstance(head_token_bytes, int):
            widths = tuple(int(w) for w in head_token_bytes)
            if len(widths) != num_regions:
                raise ValueError(f"{len(widths)} region widths for {num_regions} regions")
            head_token_bytes = max(widths)
        rng = np.random.default_rng(seed)
        shape = (num_regions, num_blocks, num_heads, tokens_per_block, head_token_bytes)
        return cls(rng.integers(0, 256, size=shape, dtype=np.uint8), widths)

    def expected_block(
        self,
        region: int,
        block: int,
        heads: Sequence[int],
        order: BlockOrder,
        packing: ChunkPacking = (),
    ):
        """The bytes a block holding ``heads`` of reference block ``block`` must contain."""
        content = self.data[region, block][list(heads)]
        if self.widths is not None:
            content = content[..., : self.widths[region]]
        return block_bytes(content, order, packing)

    def fill(
        self,
        memory: np.ndarray,
        layouts: Sequence[RegionLayout],
        offsets: Sequence[int],
        heads: Sequence[int],
        block_map: Iterable[tuple[int, int]],
        first_region: int = 0,
    ) -> None:
        """Write reference blocks into ``memory``: ``(local block, reference block)`` pairs.

        ``layouts[i]`` holds reference region ``first_region + i``.
        """
        pairs = list(block_map)
        for i, (layout, offset) in enumerate(zip(layouts, offsets, strict=True)):
            region = first_region + i
            for local_block, ref_block in pairs:
                start = offset + local_block * layout.block_stride
                memory[start : start + layout.block_len] = self.expected_block(
                    region, ref_block, heads, layout.block_order, layout.packing
                )


def block_content(serialized: np.ndarray, layout: RegionLayout) -> np.ndarray:
    """The inverse of :func:`block_bytes`: one block's bytes as ``[heads, tokens, bytes]``."""
    h, n, c = layout.num_heads, layout.tokens_per_block, layout.head_token_bytes
    if layout.block_order is BlockOrder.TOKEN_MAJOR:
        return serialized.reshape(n, h, c).transpose(1, 0, 2)
    if layout.block_order is BlockOrder.HEAD_MAJOR and layout.packing:
        chunks = serialized.reshape(h, n * c)
        return np.stack([unpack_chunk(chunk, layout.packing, n) for chunk in chunks])
    return serialized.reshape(h, n, c)


@dataclass
class ReferencePrompt:
    """Full KV of a prompt token by token: ``data[region, token, head, byte]`` (uint8).

    Independent of any block size: a side with ``B`` tokens per block holds token ``t`` in its
    ``t // B``-th block of the request at slot ``t % B``. Used to check plans between prefill and
    decode instances whose block sizes differ.
    """

    data: np.ndarray

    @classmethod
    def random(
        cls,
        num_regions: int,
        num_tokens: int,
        num_heads: int,
        head_token_bytes: int,
        seed: int = 0,
    ) -> ReferencePrompt:
        rng = np.random.default_rng(seed)
        shape = (num_regions, num_tokens, num_heads, head_token_bytes)
        return cls(rng.integers(0, 256, size=shape, dtype=np.uint8))

    @property
    def num_tokens(self) -> int:
        return self.data.shape[1]

    def place(
        self,
        memory: np.ndarray,
        layouts: Sequence[RegionLayout],
        offsets: Sequence[int],
        heads: Sequence[int],
        block_ids: Sequence[int],
        first_block: int = 0,
        first_region: int = 0,
    ) -> None:
        """Write the tokens a side holds into ``memory``, token by token.

        ``block_ids[i]`` is the side's ``first_block + i``-th block of the prompt, holding tokens
        ``(first_block + i) * B + s`` at slot ``s``. Slots past the reference's last token keep
        their bytes. ``layouts[i]`` holds reference region ``first_region + i`` with the given
        global heads.
        """
        for i, (layout, offset) in enumerate(zip(layouts, offsets, strict=True)):
            region = first_region + i
            size = layout.tokens_per_block
            for i, block in enumerate(block_ids):
                first = (first_block + i) * size
                count = max(0, min(size, self.num_tokens - first))
                if count == 0:
                    continue
                start = offset + int(block) * layout.block_stride
                span = memory[start : start + layout.block_len]
                content = block_content(span.copy(), layout).copy()
                tokens = self.data[region, first : first + count][:, list(heads)]
                content[:, :count] = tokens.transpose(1, 0, 2)
                span[:] = block_bytes(content, layout.block_order, layout.packing)


class AddressSpace:
    """Numpy buffers at fake addresses; every access must stay inside one buffer."""

    def __init__(self) -> None:
        self._bases: list[int] = []
        self._buffers: list[np.ndarray] = []

    def add(self, base: int, buffer: np.ndarray) -> None:
        index = bisect.bisect(self._bases, base)
        self._bases.insert(index, base)
        self._buffers.insert(index, buffer)

    def view(self, addr: int, length: int) -> np.ndarray:
        """A writable view of ``[addr, addr + length)``; fails if it crosses a buffer boundary."""
        index = bisect.bisect(self._bases, addr) - 1
        if index < 0:
            raise AssertionError(f"address {addr:#x} is below every registered buffer")
        base, buffer = self._bases[index], self._buffers[index]
        offset = addr - base
        if offset + length > len(buffer):
            raise AssertionError(
                f"[{addr:#x}, +{length}) leaves the buffer at {base:#x} of {len(buffer)} bytes"
            )
        return buffer[offset : offset + length]

    def strided(self, addr: int, rows: int, stride: int, row_bytes: int) -> np.ndarray:
        """A writable ``[rows, row_bytes]`` view with the given row stride."""
        span = self.view(addr, (rows - 1) * stride + row_bytes) if rows else self.view(addr, 0)
        return np.lib.stride_tricks.as_strided(
            span, shape=(rows, row_bytes), strides=(stride, 1), writeable=True
        )


def read_batch(local: AddressSpace, remote: AddressSpace, batch: TransferBatch) -> None:
    """Read each descriptor remote -> local."""
    for dst, src, length in zip(batch.local_addrs, batch.remote_addrs, batch.lengths, strict=True):
        local.view(int(dst), int(length))[:] = remote.view(int(src), int(length))


def run_copies(local: AddressSpace, batch: TransferBatch) -> None:
    """Run a landed batch's row copies."""
    for copies in batch.after_landing:
        run_row_copies(local, copies)


def run_row_copies(memory: AddressSpace, copies: RowCopies) -> None:
    """Plane by plane, row by row: the plainest reading of :class:`RowCopies`."""
    for src, dst in zip(copies.src_addrs, copies.dst_addrs, strict=True):
        for plane in range(copies.planes):
            src_plane = int(src) + plane * copies.src_plane_stride
            dst_plane = int(dst) + plane * copies.dst_plane_stride
            source = memory.strided(
                src_plane, copies.rows, copies.src_stride, copies.row_bytes
            ).copy()
            memory.strided(dst_plane, copies.rows, copies.dst_stride, copies.row_bytes)[:] = source


def run_swap(memory: AddressSpace, swap: SwapAxes) -> None:
    for addr in swap.addrs:
        span = memory.view(int(addr), swap.span)
        swapped = span.reshape(swap.outer, swap.inner, swap.unit).transpose(1, 0, 2).copy()
        span[:] = swapped.reshape(-1)


def execute_plan(plan: RequestPlan, local: AddressSpace, remotes: dict[int, AddressSpace]) -> None:
    """Run a plan the way the receiver does: every batch of every peer, then the fix-ups.

    A batch's row copies run while the peer's next batch is read, unless that read must wait
    for them (:func:`copies_must_finish_first`); here the read lands first, the order in which
    copies that should have waited would see overwritten bytes."""
    for peer in plan.peers:
        remote = remotes[peer.prefill_rank]
        pending: TransferBatch | None = None  # landed, its copies not run yet
        for batch in peer.batches:
            if pending is not None and copies_must_finish_first(pending, batch):
                run_copies(local, pending)
                pending = None
            read_batch(local, remote, batch)
            if pending is not None:
                run_copies(local, pending)
            pending = batch if batch.after_landing else None
        if pending is not None:
            run_copies(local, pending)
    for swap in plan.fixups:
        run_swap(local, swap)


def region_table(
    name_prefix: str, base: int, layouts: Sequence[RegionLayout], gap: int = 64
) -> tuple[list[Region], list[int]]:
    """Place regions one after another from ``base`` in one buffer; returns regions and offsets."""
    regions, offsets, offset = [], [], 0
    for i, layout in enumerate(layouts):
        regions.append(Region(f"{name_prefix}{i}", base + offset, layout))
        offsets.append(offset)
        offset += layout.span_bytes + gap
    return regions, offsets


def table_bytes(layouts: Sequence[RegionLayout], gap: int = 64) -> int:
    return sum(layout.span_bytes + gap for layout in layouts)


#: The KV cache layouts the planner tests draw from. ``packed_head_major`` is head-major with
#: chunks packed like vLLM CPU's (:func:`cpu_like_packing`).
LAYOUT_KINDS = ("fused_head_major", "packed_head_major", "fused_token_major", "split_kv", "latent")


def cpu_like_packing(head_token_bytes: int, token_unit: int = 1) -> ChunkPacking:
    """A chunk packing shaped like vLLM CPU's: one-byte "channel" rows (K, column-major) then
    one row of the rest (V), both in units of ``token_unit`` tokens."""
    groups = []
    if head_token_bytes >= 2:
        groups.append(RowGroup(rows=head_token_bytes // 2, token_bytes=1, token_unit=token_unit))
    rest = head_token_bytes - head_token_bytes // 2
    groups.append(RowGroup(rows=1, token_bytes=rest, token_unit=token_unit))
    return tuple(groups)


def region_layouts(
    kind: str,
    num_layers: int,
    heads: int,
    tokens: int,
    head_token_bytes: int,
    blocks: int,
    pad: int,
    flip_single_head: bool = False,
    token_unit: int = 1,
) -> list[RegionLayout]:
    """The region layouts of one instance for a layout kind of :data:`LAYOUT_KINDS`
    (``token_unit``: the packing unit of ``packed_head_major``)."""
    order = {
        "fused_head_major": BlockOrder.HEAD_MAJOR,
        "packed_head_major": BlockOrder.HEAD_MAJOR,
        "fused_token_major": BlockOrder.TOKEN_MAJOR,
        "split_kv": BlockOrder.TOKEN_MAJOR,
        "latent": BlockOrder.LATENT,
    }[kind]
    packing = cpu_like_packing(head_token_bytes, token_unit) if kind == "packed_head_major" else ()
    if flip_single_head and heads == 1 and order is not BlockOrder.LATENT and not packing:
        # One head: both orders give the same bytes, and engines may declare either.
        order = BlockOrder.HEAD_MAJOR if order is BlockOrder.TOKEN_MAJOR else BlockOrder.TOKEN_MAJOR
    per_layer = 2 if kind == "split_kv" else 1
    block_len = heads * tokens * head_token_bytes
    layout = RegionLayout(
        order, blocks, block_len + pad, heads, tokens, head_token_bytes, packing=packing
    )
    return [layout] * (num_layers * per_layer)
