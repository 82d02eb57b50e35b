"""Describe one rank's Mamba/GDN state page (pure; no torch import), so that
:mod:`.plan_state` can move a request's state between ranks of different TP sizes in place.

A state page holds its components (GDN: conv state, then SSM state) one after the other, each
``prod(shape) * itemsize`` bytes, padding after them. vLLM CPU hands the worker one int8 page view
per layer (:func:`describe_state_page`: every component shares the view's address, at cumulative
offsets); vllm-ascend one tensor per component (:func:`describe_state_tensors`: each its own
address, offset 0). Either way blocks are one padded page apart.

A component is seen as ``rows`` rows of ``columns x column_bytes`` bytes, its columns a TP shard
of global columns (:class:`ShardedAxis`): what a rank holds follows from the global sizes and
the sharding rule alone, so two ranks of different TP sizes can be intersected column by column.

* GDN conv state, ``SD`` layout ``(K-1, conv_dim/t)``: ``K-1`` rows, one element per column.
* GDN conv state, ``DS`` layout ``(conv_dim/t, K-1)``: one row, a column is ``K-1`` elements.
* GDN SSM state ``(Hv/t, dv, dk)``: one row, a column is one value head (``dv * dk`` elements).

The conv columns are ``[Q | K | V]`` (lengths ``key_dim, key_dim, value_dim``), each cut into
``t`` contiguous parts: rank ``r`` holds ``[Q_r | K_r | V_r]``; SSM value heads are cut into ``t``
contiguous parts (vLLM's ``mamba_v2_sharded_weight_loader`` and ``gated_delta_net_state_shape``;
docs/design/hma.md, section 1).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import prod

from .layout import LayoutError


class StateLayoutError(LayoutError):
    """A state page or its shard map does not match what the model config says."""


class ConvLayout(enum.Enum):
    """vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``: ``SD`` (default) puts the kernel axis first."""

    SD = "SD"
    DS = "DS"


@dataclass(frozen=True)
class GdnSizes:
    """A Gated DeltaNet layer's global sizes, from the model config (``linear_num_key_heads``,
    ``linear_key_head_dim``, ``linear_num_value_heads``, ``linear_value_head_dim``,
    ``linear_conv_kernel_dim``)."""

    num_k_heads: int
    head_k_dim: int
    num_v_heads: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "head_k_dim", "num_v_heads", "head_v_dim"):
            if getattr(self, name) < 1:
                raise StateLayoutError(f"GDN {name} must be >= 1, got {getattr(self, name)}")
        if self.conv_kernel < 2:
            raise StateLayoutError(f"GDN conv_kernel must be >= 2, got {self.conv_kernel}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def check_tp(self, tp_size: int) -> None:
        """vLLM asserts that TP divides both head counts (no replication as for KV heads)."""
        if tp_size < 1:
            raise StateLayoutError(f"TP size must be >= 1, got {tp_size}")
        for name in ("num_k_heads", "num_v_heads"):
            if getattr(self, name) % tp_size:
                raise StateLayoutError(
                    f"TP size {tp_size} does not divide the GDN {name} ({getattr(self, name)}): "
                    f"vLLM cannot shard this model's state at this TP"
                )


@dataclass(frozen=True)
class ShardedAxis:
    """The global columns a component's column axis shards: sub-projections of ``parts``
    columns each, every one cut into ``tp`` contiguous parts (rank ``r`` holds the ``r``-th part
    of each, in order). ``replicated``: every rank holds all columns (``MambaSpec.tp_replicated``).
    """

    parts: tuple[int, ...]
    replicated: bool = False

    def __post_init__(self) -> None:
        if not self.parts or min(self.parts) < 1:
            raise StateLayoutError(f"sharded axis parts must be >= 1, got {self.parts}")

    @property
    def global_columns(self) -> int:
        return sum(self.parts)

    def columns_per_rank(self, tp_size: int) -> int:
        return sum(len(s) for s in self.segments(0, tp_size))

    def segments(self, rank: int, tp_size: int) -> tuple[range, ...]:
        """The global columns rank ``rank`` of TP ``tp_size`` holds, in its local order."""
        if not 0 <= rank < tp_size:
            raise StateLayoutError(f"rank {rank} is outside TP size {tp_size}")
        if self.replicated:
            return (range(self.global_columns),)
        found = []
        start = 0
        for part in self.parts:
            if part % tp_size:
                raise StateLayoutError(
                    f"TP size {tp_size} does not divide a state sub-projection of {part} columns"
                )
            per_rank = part // tp_size
            found.append(range(start + rank * per_rank, start + (rank + 1) * per_rank))
            start += part
        return tuple(found)


@dataclass(frozen=True)
class StateComponent:
    """One state component of a rank: ``rows`` rows, each the rank's columns of
    ``column_bytes`` bytes, contiguous; ``offset`` bytes from its base address in a block."""

    name: str
    rows: int
    column_bytes: int
    axis: ShardedAxis
    offset: int = 0

    def __post_init__(self) -> None:
        if self.rows < 1 or self.column_bytes < 1 or self.offset < 0:
            raise StateLayoutError(
                f"state component {self.name}: rows {self.rows}, column_bytes "
                f"{self.column_bytes} and offset {self.offset} must be >= 1, >= 1 and >= 0"
            )

    def row_bytes(self, tp_size: int) -> int:
        return self.axis.columns_per_rank(tp_size) * self.column_bytes

    def nbytes(self, tp_size: int) -> int:
        return self.rows * self.row_bytes(tp_size)

    def same_global_state(self, other: StateComponent) -> bool:
        """Whether two ranks' components are shards of the same global bytes."""
        return (self.name, self.rows, self.column_bytes, self.axis) == (
            other.name,
            other.rows,
            other.column_bytes,
            other.axis,
        )


@dataclass(frozen=True)
class StateLayout:
    """One state group's geometry on a rank of TP ``tp_size``: blocks ``block_stride`` apart
    (the padded page), each holding ``components``. A layer's base addresses are given per
    component (one tensor each on vllm-ascend, the same page address on vLLM CPU)."""

    tp_size: int
    num_blocks: int
    block_stride: int
    components: tuple[StateComponent, ...]

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.num_blocks < 1 or not self.components:
            raise StateLayoutError(
                f"a state layout needs tp_size >= 1, num_blocks >= 1 and components, got "
                f"{self.tp_size}, {self.num_blocks}, {len(self.components)}"
            )
        for component in self.components:
            end = component.offset + component.nbytes(self.tp_size)
            if end > self.block_stride:
                raise StateLayoutError(
                    f"state component {component.name} ends at byte {end} of a block, past the "
                    f"block stride {self.block_stride}"
                )

    def segments(self, component: int, rank: int) -> tuple[range, ...]:
        return self.components[component].axis.segments(rank, self.tp_size)


def gdn_rank_shapes(
    sizes: GdnSizes, tp_size: int, conv_layout: ConvLayout
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (conv, SSM) state shapes of one rank, as vLLM's ``gated_delta_net_state_shape``."""
    sizes.check_tp(tp_size)
    conv_columns = sizes.conv_dim // tp_size
    rows = sizes.conv_kernel - 1
    conv = (rows, conv_columns) if conv_layout is ConvLayout.SD else (conv_columns, rows)
    return conv, (sizes.num_v_heads // tp_size, sizes.head_v_dim, sizes.head_k_dim)


def check_engine_shapes(
    derived: Sequence[Sequence[int]], engine: Sequence[Sequence[int]], *, what: str = "state"
) -> None:
    """Refuse shapes the engine reports (``MambaSpec.shapes``) that the config does not give."""
    derived_t = tuple(tuple(s) for s in derived)
    engine_t = tuple(tuple(s) for s in engine)
    if derived_t != engine_t:
        raise StateLayoutError(
            f"{what} shapes {engine_t} reported by the engine differ from {derived_t} derived "
            f"from the model config: the GDN sizes, TP size or conv layout "
            f"(VLLM_SSM_CONV_STATE_LAYOUT) do not match the engine's"
        )


def gdn_components(
    sizes: GdnSizes,
    tp_size: int,
    *,
    conv_layout: ConvLayout,
    itemsizes: tuple[int, int],
    engine_shapes: Sequence[Sequence[int]] | None = None,
) -> tuple[StateComponent, StateComponent]:
    """A GDN rank's (conv, SSM) components at their page offsets (conv first), checked against
    the engine's shapes when given. ``itemsizes``: bytes per element of (conv, SSM)."""
    conv_shape, ssm_shape = gdn_rank_shapes(sizes, tp_size, conv_layout)
    if engine_shapes is not None:
        check_engine_shapes((conv_shape, ssm_shape), engine_shapes, what="GDN state")
    conv_item, ssm_item = itemsizes
    kernel_rows = sizes.conv_kernel - 1
    conv_axis = ShardedAxis((sizes.key_dim, sizes.key_dim, sizes.value_dim))
    if conv_layout is ConvLayout.SD:
        conv = StateComponent("conv", rows=kernel_rows, column_bytes=conv_item, axis=conv_axis)
    else:
        conv = StateComponent("conv", rows=1, column_bytes=kernel_rows * conv_item, axis=conv_axis)
    ssm = StateComponent(
        "ssm",
        rows=1,
        column_bytes=sizes.head_v_dim * sizes.head_k_dim * ssm_item,
        axis=ShardedAxis((sizes.num_v_heads,)),
        offset=conv.nbytes(tp_size),
    )
    return conv, ssm


def replicated_components(
    shapes: Sequence[Sequence[int]], itemsizes: Sequence[int]
) -> tuple[StateComponent, ...]:
    """Components every rank holds whole (``tp_replicated``), at cumulative page offsets: each
    one column of all its bytes, copied whole from one rank."""
    if len(shapes) != len(itemsizes):
        raise StateLayoutError(f"{len(shapes)} state shapes but {len(itemsizes)} dtypes")
    components = []
    offset = 0
    for i, (shape, itemsize) in enumerate(zip(shapes, itemsizes, strict=True)):
        nbytes = prod(shape) * itemsize
        axis = ShardedAxis((1,), replicated=True)
        components.append(StateComponent(f"state{i}", 1, nbytes, axis, offset=offset))
        offset += nbytes
    return tuple(components)


def describe_state_page(
    shape: Sequence[int],
    byte_strides: Sequence[int],
    components: Sequence[StateComponent],
    *,
    tp_size: int,
) -> StateLayout:
    """vLLM CPU's int8 page view of a state layer, ``[num_blocks, 1, 1, state_bytes]`` a padded
    page apart: ``state_bytes`` must be exactly the components' bytes (padding is never moved)."""
    if len(shape) != 4 or tuple(shape[1:3]) != (1, 1) or len(byte_strides) != 4:
        raise StateLayoutError(
            f"expected a state page view [num_blocks, 1, 1, state_bytes], got shape "
            f"{tuple(shape)} with byte strides {tuple(byte_strides)}"
        )
    content = sum(c.nbytes(tp_size) for c in components)
    if shape[3] != content or byte_strides[3] != 1:
        raise StateLayoutError(
            f"state page view {tuple(shape)} (byte strides {tuple(byte_strides)}) does not hold "
            f"the {content} contiguous bytes of its components "
            f"({', '.join(f'{c.name} {c.nbytes(tp_size)} B' for c in components)})"
        )
    return StateLayout(tp_size, shape[0], byte_strides[0], tuple(components))


def describe_state_tensors(
    shapes: Sequence[Sequence[int]],
    strides: Sequence[Sequence[int]],
    itemsizes: Sequence[int],
    components: Sequence[StateComponent],
    *,
    tp_size: int,
) -> StateLayout:
    """vllm-ascend's state layer: one tensor ``(num_blocks, *shape)`` per component (strides in
    elements of ``itemsizes``), each at its own address (offset 0), contiguous within a block,
    all a padded page apart."""
    if not len(shapes) == len(strides) == len(itemsizes) == len(components):
        raise StateLayoutError(
            f"{len(shapes)} state tensors ({len(strides)} strides, {len(itemsizes)} dtypes) for "
            f"{len(components)} state components"
        )
    block_strides = {st[0] * item for st, item in zip(strides, itemsizes, strict=True)}
    if len({s[0] for s in shapes}) != 1 or len(block_strides) != 1:
        raise StateLayoutError(
            f"state tensors {[tuple(s) for s in shapes]} (strides {[tuple(st) for st in strides]}) "
            f"differ in block count or block stride"
        )
    for shape, tensor_strides, itemsize, component in zip(
        shapes, strides, itemsizes, components, strict=True
    ):
        nbytes = component.nbytes(tp_size)
        contiguous = [prod(shape[i + 1 :]) for i in range(1, len(shape))]
        if prod(shape[1:]) * itemsize != nbytes or list(tensor_strides[1:]) != contiguous:
            raise StateLayoutError(
                f"state tensor {tuple(shape)} (strides {tuple(tensor_strides)}, {itemsize} B "
                f"elements) is not the {nbytes} contiguous bytes per block of component "
                f"{component.name}"
            )
    placed = tuple(replace(c, offset=0) for c in components)
    return StateLayout(tp_size, shapes[0][0], block_strides.pop(), placed)
