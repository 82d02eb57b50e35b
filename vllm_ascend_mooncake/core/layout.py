"""Describe a registered KV region exactly as the engine lays it out (pure; no torch import).

A region is one tensor of the KV cache: a vLLM 0.32 per-layer view ``[num_blocks, H, N, C]`` (K and
V fused in ``C``), one of vllm-ascend's separate K or V tensors ``[num_blocks, N, H, D]`` (or its
flattened ``[num_blocks, N, H*D]`` form), or one MLA latent tensor (vLLM's single latent, or one of
vllm-ascend's nope and rope tensors, which differ in width). The description is derived from
the tensor's shape and strides plus what the model config says, never guessed: a tensor that does
not match any layout the planner understands is refused with an error that says what to change.

Inside a block the planner only needs to know where a head's bytes are:

* ``HEAD_MAJOR`` (vLLM ``LBHNC``): ``[heads][tokens][content]``; a run of heads is one contiguous
  byte range per block. How a (block, head) chunk orders its tokens is the attention backend's
  choice (vLLM CPU packs K and V per ISA kernel, see :mod:`.packing`): the region's ``packing``
  says it where it is known, and only then can a chunk be split by token (different block sizes);
  otherwise chunks are only ever moved whole.
* ``TOKEN_MAJOR`` (vLLM ``LBNHC``, vllm-ascend NHD tensors): ``[tokens][heads][content]``; a run
  of heads is contiguous only within one token.
* ``LATENT`` (MLA): no head axis; a block is one unit, replicated on every rank. Regions of one
  layer may differ in width (vllm-ascend's nope and rope); pairs are checked region by region.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class LayoutError(ValueError):
    """A KV tensor has a layout the planner cannot describe, or two layouts cannot be combined."""


class BlockOrder(enum.Enum):
    HEAD_MAJOR = "head_major"
    TOKEN_MAJOR = "token_major"
    LATENT = "latent"


@dataclass(frozen=True)
class RowGroup:
    """Part of a head-major (block, head) chunk: ``rows`` rows, one after the other, each holding
    ``token_bytes`` of every token of the block in token order (row length: block size x
    ``token_bytes``). Tokens are packed in units of ``token_unit`` (AMX tiles), so a token range
    can only be cut at multiples of it."""

    rows: int
    token_bytes: int
    token_unit: int = 1

    def __post_init__(self) -> None:
        for name in ("rows", "token_bytes", "token_unit"):
            if getattr(self, name) < 1:
                raise LayoutError(f"row group {name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        return self.rows * self.token_bytes


#: How a head-major chunk orders its bytes, group after group; empty: unknown (the chunk is only
#: moved whole).
ChunkPacking = tuple[RowGroup, ...]


def token_rows(head_token_bytes: int) -> ChunkPacking:
    """The plain packing: one row per token (``[tokens][content]``), as in CUDA's HND caches."""
    return (RowGroup(rows=1, token_bytes=head_token_bytes),)


def packing_text(packing: ChunkPacking) -> str:
    """A packing for messages: its row groups (rows x bytes per token, token unit where > 1)
    and the bytes per head and token they hold; ``unknown`` when empty."""
    if not packing:
        return "unknown"
    groups = " + ".join(
        f"{g.rows} row(s) x {g.token_bytes} B"
        + (f" in units of {g.token_unit} tokens" if g.token_unit > 1 else "")
        for g in packing
    )
    return f"{groups} = {sum(g.bytes_per_token for g in packing)} B per head and token"


def head_chunk_token_bytes(
    shape: Sequence[int], strides: Sequence[int], element_size: int, *, block_size: int
) -> int | None:
    """Bytes per head and token of the (block, head) chunks of a per-layer view
    ``[blocks, heads, rows, content]``, derived from its shape *and* strides: what a chunk
    packing (:mod:`.packing`) must account for, byte for byte.

    A chunk is one head's contiguous bytes inside a block: ``rows x content`` elements with
    contiguous content, rows one after the other and heads one chunk apart (any block stride:
    vLLM carves every layer's view out of one shared allocation). ``rows`` is the block size (vLLM
    0.32: ``[blocks, heads, tokens, 2 * head_size]``) or a whole multiple of it (a backend's
    ``[blocks, heads, 2 * tokens, head_size]``); the chunk's bytes are then spread over the
    block's tokens. None when the view has no such chunks (token-major, strided content, rows
    not whole tokens, not 4-D): a packing then does not apply and blocks move whole."""
    if len(shape) != 4 or len(strides) != 4 or block_size < 1:
        return None
    _, heads, rows, content = shape
    _, s_head, s_row, s_content = _byte_strides(strides, element_size)
    if heads < 1 or rows < 1 or content < 1 or rows % block_size:
        return None
    row_bytes = content * element_size
    if content > 1 and s_content != element_size:
        return None
    if rows > 1 and s_row != row_bytes:
        return None
    chunk_bytes = rows * row_bytes
    if heads > 1 and s_head != chunk_bytes:
        return None
    return chunk_bytes // block_size


@dataclass(frozen=True)
class RegionLayout:
    """Byte geometry of one KV region: blocks at a fixed stride, each with the given interior.

    ``head_token_bytes`` is the content of one head for one token (``C * element_size``; for a
    latent region the whole per-token latent). ``packing`` is the order of the bytes inside a
    head-major (block, head) chunk where the backend's is known (empty otherwise; ignored for
    token-major and latent blocks, whose tokens are rows by definition).

    ``num_blocks``, ``block_stride`` and ``tokens_per_block`` count the tensor's own blocks, the
    attention kernel's. An engine may cut each of its blocks into ``kernel_blocks`` of them
    (vllm-ascend: ``--block-size 256`` on a 128-token kernel; vLLM's ``kernel_block_sizes``):
    the engine's block ``b`` is then this region's blocks ``b * kernel_blocks`` to
    ``b * kernel_blocks + kernel_blocks - 1`` (:func:`kernel_block_ids`).

    ``kv_heads`` names the head group the region belongs to: the total KV heads (across TP) of
    its layer where that is not the model's (a draft layer's own count, see
    :mod:`.topology`); 0: the model's. ``num_heads`` is what this rank holds of them.
    """

    block_order: BlockOrder
    num_blocks: int
    block_stride: int
    num_heads: int
    tokens_per_block: int
    head_token_bytes: int
    packing: ChunkPacking = ()
    kernel_blocks: int = 1
    kv_heads: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_blocks",
            "num_heads",
            "tokens_per_block",
            "head_token_bytes",
            "kernel_blocks",
        ):
            if getattr(self, name) < 1:
                raise LayoutError(f"region {name} must be >= 1, got {getattr(self, name)}")
        if self.packing:
            packed = sum(group.bytes_per_token for group in self.packing)
            if packed != self.head_token_bytes:
                raise LayoutError(
                    f"chunk packing holds {packed} B per head per token, the region "
                    f"{self.head_token_bytes} B"
                )
            for group in self.packing:
                if self.tokens_per_block % group.token_unit:
                    raise LayoutError(
                        f"chunk packing groups tokens by {group.token_unit}, which does not "
                        f"divide the block size {self.tokens_per_block}"
                    )
        if self.kv_heads < 0:
            raise LayoutError(f"region kv_heads must be >= 0, got {self.kv_heads}")
        if self.block_order is BlockOrder.LATENT and self.num_heads != 1:
            raise LayoutError(f"a latent (MLA) region has no head axis, got {self.num_heads} heads")
        if self.block_stride < self.block_len:
            raise LayoutError(
                f"block stride {self.block_stride} B is smaller than the block payload "
                f"{self.block_len} B: blocks overlap, so this is not a block-outermost layout"
            )

    @property
    def block_len(self) -> int:
        """Payload bytes of one block."""
        return self.num_heads * self.tokens_per_block * self.head_token_bytes

    @property
    def head_chunk_bytes(self) -> int:
        """Bytes of one head across a block's tokens (contiguous only when head-major)."""
        return self.tokens_per_block * self.head_token_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes of one token across the region's heads (contiguous only when token-major)."""
        return self.num_heads * self.head_token_bytes

    @property
    def dense(self) -> bool:
        """Consecutive blocks are adjacent in memory, so a run of blocks is one byte range."""
        return self.block_stride == self.block_len

    @property
    def span_bytes(self) -> int:
        """Bytes from the first block's start to the last block's end (what to register)."""
        return (self.num_blocks - 1) * self.block_stride + self.block_len


def kernel_block_ids(
    block_ids: Sequence[int], kernel_blocks: int, kernel_tokens: int, num_tokens: int | None
) -> list[int]:
    """The kernel blocks behind engine blocks ``block_ids`` (a prompt's blocks, or their suffix),
    those past the prompt's last token dropped: each engine block is ``kernel_blocks`` kernel
    blocks of ``kernel_tokens`` tokens, and the prompt's last engine block may fill only some.
    Without ``num_tokens`` every kernel block is kept."""
    if kernel_blocks == 1:
        return list(block_ids)
    ids = [b * kernel_blocks + i for b in block_ids for i in range(kernel_blocks)]
    if num_tokens is not None and ids:
        engine_tokens = kernel_blocks * kernel_tokens
        in_last = num_tokens - (-(-num_tokens // engine_tokens) - 1) * engine_tokens
        unused = kernel_blocks - -(-in_last // kernel_tokens) if num_tokens > 0 else 0
        ids = ids[: len(ids) - unused]
    return ids


def kernel_blocks_of(block_size: int, tokens: int, what: str) -> int:
    """How many of a tensor's ``tokens``-token blocks make one engine block of ``block_size``."""
    _require(
        tokens >= 1 and block_size % tokens == 0,
        f"{what} has {tokens} tokens per block, which does not divide the engine block size "
        f"{block_size}: the attention kernel's block must divide --block-size",
    )
    return block_size // tokens


@dataclass(frozen=True)
class Region:
    """A region at a concrete address in one process."""

    name: str
    base: int
    layout: RegionLayout

    def block_addr(self, block_id: int) -> int:
        return self.base + block_id * self.layout.block_stride


def _byte_strides(strides: Sequence[int], element_size: int) -> list[int]:
    return [s * element_size for s in strides]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise LayoutError(message)


def describe_vllm_layer_view(
    shape: Sequence[int],
    strides: Sequence[int],
    element_size: int,
    *,
    num_kv_heads: int,
    block_size: int,
    is_mla: bool = False,
    packing: ChunkPacking = (),
) -> RegionLayout:
    """Describe a vLLM 0.32 per-layer KV view ``[num_blocks, H, N, C]`` (K and V fused in C).

    ``num_kv_heads`` is the number of heads this rank holds and ``block_size`` the kernel block
    size; both come from the engine config and are checked against the tensor. ``packing`` is the
    attention backend's chunk packing (:func:`.packing.chunk_packing`), kept for head-major
    blocks only.
    """
    _require(
        len(shape) == 4,
        f"expected a 4-D vLLM KV view [blocks, heads, tokens, content], got shape {tuple(shape)}",
    )
    num_blocks, heads, tokens, content = shape
    s_block, s_head, s_token, s_content = _byte_strides(strides, element_size)
    kernel_blocks = kernel_blocks_of(block_size, tokens, f"KV view {tuple(shape)}")
    expected_heads = 1 if is_mla else num_kv_heads
    _require(
        heads == expected_heads,
        f"KV view has {heads} heads but this rank should hold {expected_heads}",
    )
    _require(
        s_content == element_size,
        f"KV view content axis is not contiguous (byte stride {s_content}); layouts that split "
        f"the content dimension are not supported",
    )
    head_token_bytes = content * element_size
    if is_mla:
        _require(
            s_token == head_token_bytes,
            f"MLA latent view tokens are not contiguous (byte stride {s_token}, "
            f"expected {head_token_bytes})",
        )
        order = BlockOrder.LATENT
    elif heads == 1 and s_token == head_token_bytes:
        order = BlockOrder.HEAD_MAJOR  # one head: head-major and token-major coincide
    elif s_token == head_token_bytes and s_head == tokens * head_token_bytes:
        order = BlockOrder.HEAD_MAJOR
    elif s_head == head_token_bytes and s_token == heads * head_token_bytes:
        order = BlockOrder.TOKEN_MAJOR
    else:
        raise LayoutError(
            f"KV view {tuple(shape)} with byte strides {(s_block, s_head, s_token, s_content)} is "
            f"neither head-major (LBHNC) nor token-major (LBNHC) inside a block; set "
            f"VLLM_KV_CACHE_LAYOUT=LBHNC (or LBNHC) for the KV connector"
        )
    layout = RegionLayout(
        block_order=order,
        num_blocks=num_blocks,
        block_stride=s_block,
        num_heads=heads,
        tokens_per_block=tokens,
        head_token_bytes=head_token_bytes,
        packing=packing if order is BlockOrder.HEAD_MAJOR else (),
        kernel_blocks=kernel_blocks,
    )
    return layout


def describe_split_kv_tensor(
    shape: Sequence[int],
    strides: Sequence[int],
    element_size: int,
    *,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    head_major: bool = False,
) -> RegionLayout:
    """Describe one of vllm-ascend's separate K or V tensors, from its shape and strides.

    Accepts the token-major ``[num_blocks, tokens, heads, head_size]`` (vllm-ascend's default
    NHD), the head-major ``[num_blocks, heads, tokens, head_size]`` (its backend under
    ``VLLM_KV_CACHE_LAYOUT=HND`` or ``LBHNC``: ``AscendAttentionBackend.get_kv_cache_shape``) and
    the flattened ``[num_blocks, tokens, heads * head_size]``. ``tokens`` is the kernel block,
    which may divide the engine's ``block_size``. ``head_major`` (the layout variable the backend
    reads) only settles a shape that reads both ways (as many heads as tokens per block); the
    strides must then agree with it.
    """
    byte_strides = _byte_strides(strides, element_size)
    head_token_bytes = head_size * element_size
    name = f"K/V tensor {tuple(shape)} (byte strides {tuple(byte_strides)})"
    if len(shape) == 4:
        num_blocks, second, third, dim = shape
        token_major_fits = third == num_kv_heads and block_size % second == 0
        head_major_fits = second == num_kv_heads and block_size % third == 0
        _require(
            dim == head_size and (token_major_fits or head_major_fits),
            f"{name} does not hold {num_kv_heads} heads of size {head_size} per token in blocks "
            f"that divide the engine block size {block_size}, as its attention layer says",
        )
        order_is_head_major = head_major_fits and (head_major or not token_major_fits)
        _require(byte_strides[3] == element_size, f"{name}: content is not contiguous")
        if order_is_head_major:
            tokens = third
            _require(
                byte_strides[2] == head_token_bytes
                and byte_strides[1] == tokens * head_token_bytes,
                f"{name} is not head-major [blocks, heads, tokens, head_size] inside a block",
            )
        else:
            tokens = second
            _require(
                byte_strides[2] == head_token_bytes
                and byte_strides[1] == num_kv_heads * head_token_bytes,
                f"{name} is not token-major [blocks, tokens, heads, head_size] inside a block",
            )
    elif len(shape) == 3:
        num_blocks, tokens, width = shape
        order_is_head_major = False
        _require(
            width == num_kv_heads * head_size,
            f"flattened {name} last dimension {width} is not {num_kv_heads} heads x {head_size}",
        )
        _require(
            byte_strides[2] == element_size and byte_strides[1] == width * element_size,
            f"flattened {name} is not contiguous within a block",
        )
    else:
        raise LayoutError(
            f"expected a K or V tensor [blocks, tokens, heads, head_size], [blocks, heads, "
            f"tokens, head_size] or [blocks, tokens, heads*head_size], got shape {tuple(shape)}"
        )
    kernel_blocks = kernel_blocks_of(block_size, tokens, name)
    order = BlockOrder.HEAD_MAJOR if order_is_head_major else BlockOrder.TOKEN_MAJOR
    return RegionLayout(
        block_order=order,
        num_blocks=num_blocks,
        block_stride=byte_strides[0],
        num_heads=num_kv_heads,
        tokens_per_block=tokens,
        head_token_bytes=head_token_bytes,
        # a head-major K or V tensor's (block, head) chunk is its tokens' rows, as the tensor says
        packing=token_rows(head_token_bytes) if order_is_head_major else (),
        kernel_blocks=kernel_blocks,
    )


def describe_latent_tensor(
    shape: Sequence[int],
    strides: Sequence[int],
    element_size: int,
    *,
    block_size: int,
) -> RegionLayout:
    """Describe one MLA latent tensor: ``[num_blocks, block_size, width]`` or
    ``[num_blocks, block_size, 1, width]``.

    The 4-D form is how vllm-ascend shapes its MLA caches (the backend's
    ``[num_blocks, block_size, num_kv_heads=1, head_size]``), one tensor per component: the nope
    cache (``kv_lora_rank`` wide) and the rope cache (``qk_rope_head_dim`` wide), or a single
    packed latent. Each is its own region; its width is whatever the tensor says.
    """
    byte_strides = _byte_strides(strides, element_size)
    if len(shape) == 4:
        num_blocks, tokens, heads, width = shape
        _require(
            heads == 1,
            f"an MLA latent tensor [blocks, tokens, 1, width] has no head axis, but shape "
            f"{tuple(shape)} has {heads} there",
        )
        s_token, s_content = byte_strides[1], byte_strides[3]
    elif len(shape) == 3:
        num_blocks, tokens, width = shape
        s_token, s_content = byte_strides[1], byte_strides[2]
    else:
        raise LayoutError(
            f"expected an MLA latent tensor [blocks, tokens, width] or [blocks, tokens, 1, width], "
            f"got shape {tuple(shape)}"
        )
    kernel_blocks = kernel_blocks_of(block_size, tokens, f"latent tensor {tuple(shape)}")
    _require(
        s_content == element_size and s_token == width * element_size,
        f"latent tensor {tuple(shape)} is not contiguous within a block "
        f"(byte strides {tuple(byte_strides)})",
    )
    return RegionLayout(
        block_order=BlockOrder.LATENT,
        num_blocks=num_blocks,
        block_stride=byte_strides[0],
        num_heads=1,
        tokens_per_block=tokens,
        head_token_bytes=width * element_size,
        kernel_blocks=kernel_blocks,
    )


def _order_free(layout: RegionLayout) -> bool:
    """A single-head block has the same bytes in head-major and token-major order, unless its
    backend packs the chunk otherwise."""
    return (
        layout.num_heads == 1
        and layout.block_order is not BlockOrder.LATENT
        and (not layout.packing or layout.packing == token_rows(layout.head_token_bytes))
    )


def effective_order(local: RegionLayout, remote: RegionLayout) -> BlockOrder:
    """The block order that governs a pair: a single-head side takes the other side's order."""
    return remote.block_order if _order_free(local) else local.block_order


def check_pairable(local: RegionLayout, remote: RegionLayout, *, name: str = "region") -> None:
    """Refuse a (decode, prefill) region pair whose bytes cannot be combined head by head.

    Block sizes may differ when one divides the other and blocks can be cut by token on both
    sides (token rows, or head-major chunks packed alike in a known way, whose packing units
    divide the smaller block); the order, head size and dtype must match."""
    problems = []
    if local.block_order is not remote.block_order and not (
        _order_free(local) or _order_free(remote)
    ):
        problems.append(
            f"block order {remote.block_order.value} on prefill vs "
            f"{local.block_order.value} on decode"
        )
    bp, bd = remote.tokens_per_block, local.tokens_per_block
    if bp % bd and bd % bp:
        problems.append(
            f"block size {bp} on prefill vs {bd} on decode: neither divides the other, so "
            f"blocks cannot be mapped onto each other token-aligned"
        )
    elif bp != bd and effective_order(local, remote) is BlockOrder.HEAD_MAJOR:
        problems.extend(_split_problems(local, remote))
    if local.head_token_bytes != remote.head_token_bytes:
        problems.append(
            f"{remote.head_token_bytes} B per head per token on prefill vs "
            f"{local.head_token_bytes} B on decode (head size or dtype differ)"
        )
    if problems:
        raise LayoutError(f"{name}: " + "; ".join(problems))


def _split_problems(local: RegionLayout, remote: RegionLayout) -> list[str]:
    """Why head-major blocks of different sizes cannot be mapped token by token (none: they can)."""
    bp, bd = remote.tokens_per_block, local.tokens_per_block
    sides = (
        f"prefill: {packing_text(remote.packing)}, {remote.head_token_bytes} B per head and "
        f"token in its KV view; decode: {packing_text(local.packing)}, "
        f"{local.head_token_bytes} B"
    )
    if not (local.packing and remote.packing):
        side = " and ".join(
            name for name, layout in (("prefill", remote), ("decode", local)) if not layout.packing
        )
        return [
            f"block size {bp} on prefill vs {bd} on decode with head-major blocks whose packing "
            f"is unknown on {side} ({sides}; only vLLM CPU's vec, vec16 and amx kernels and CUDA "
            f"FlashAttention are described, see core/packing.py, and a side whose KV view does "
            f"not hold the described bytes logs why at start-up): run both with the same "
            f"--block-size ({bp} or {bd}), or use a token-major cache"
        ]
    if local.packing != remote.packing:
        return [
            f"block size {bp} on prefill vs {bd} on decode with head-major chunks packed "
            f"differently ({sides}): run both with the same --block-size ({bp} or {bd}), or "
            f"both with the same dtype, --kv-cache-dtype and attention kernel (vLLM CPU: hosts "
            f"with the same ISA, AMX or not)"
        ]
    return []  # each side's packing units divide its block size, so they divide the smaller
