"""CPU KV caches allocated the way the engines do, for data-path tests and benchmarks.

One worker's cache is torch tensors shaped like an engine's (so that registration reads them as
it reads a real engine's), the KV regions registration derives from them, and a writable uint8
numpy view of each allocation (so that tests fill and compare bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from vllm_ascend_mooncake.core.layout import ChunkPacking
from vllm_ascend_mooncake.datapath.registration import (
    regions_from_split_caches,
    regions_from_vllm_views,
)

if TYPE_CHECKING:
    import torch

#: How an engine lays out one layer's KV:
#: ``vllm_head_major`` / ``vllm_token_major``: vLLM's one allocation, one ``[blocks, H, N, C]``
#: view per layer (strides give the order); ``mla``: the same with one latent "head";
#: ``split_kv``: a K and a V tensor ``[blocks, N, H, C]`` per layer; ``ascend_mla``:
#: vllm-ascend's MLA cache, per layer one ``[blocks, N, 1, width]`` tensor per latent part
#: (nope, rope), each its own allocation (see datapath/registration.py).
CACHE_LAYOUTS = ("vllm_head_major", "vllm_token_major", "split_kv", "mla", "ascend_mla")


class KVCache:
    """One worker's KV cache: ``tensors`` (the allocations), ``regions`` (as registered) and
    ``arrays`` (a uint8 view of each allocation, in order), filled with random bytes."""

    def __init__(
        self,
        layout: str,
        *,
        num_layers: int,
        heads: int,
        num_blocks: int,
        block_size: int,
        head_size: int,
        dtype: torch.dtype,
        seed: int,
        mla_widths: tuple[int, ...] = (),
        packing: ChunkPacking = (),
    ) -> None:
        """``heads``: KV heads this worker holds; ``head_size``: elements per head and token of
        one tensor (of K+V for the fused vLLM layouts); ``mla_widths``: the latent parts of
        ``ascend_mla``, in elements."""
        import torch  # here: the harness's parent process imports this module without torch

        if layout not in CACHE_LAYOUTS:
            raise ValueError(f"unknown cache layout {layout!r} (one of {CACHE_LAYOUTS})")
        layers = [f"layer.{i}" for i in range(num_layers)]
        if layout == "split_kv":
            split = {
                name: tuple(
                    torch.empty(num_blocks, block_size, heads, head_size, dtype=dtype)
                    for _ in range(2)
                )
                for name in layers
            }
            self.tensors = [t for pair in split.values() for t in pair]
            self.regions = regions_from_split_caches(
                split, num_kv_heads=heads, block_size=block_size, head_size=head_size, is_mla=False
            )
        elif layout == "ascend_mla":
            split = {
                name: tuple(
                    torch.empty(num_blocks, block_size, 1, width, dtype=dtype)
                    for width in mla_widths
                )
                for name in layers
            }
            self.tensors = [t for parts in split.values() for t in parts]
            self.regions = regions_from_split_caches(
                split,
                num_kv_heads=1,
                block_size=block_size,
                head_size=sum(mla_widths),
                is_mla=True,
            )
        else:
            is_mla = layout == "mla"
            h = 1 if is_mla else heads
            page = h * block_size * head_size
            raw = torch.empty(num_layers * num_blocks * page, dtype=dtype)
            if layout == "vllm_token_major":
                strides = (page, head_size, h * head_size, 1)
            else:
                strides = (page, block_size * head_size, head_size, 1)
            views = {
                name: raw.as_strided(
                    (num_blocks, h, block_size, head_size), strides, i * num_blocks * page
                )
                for i, name in enumerate(layers)
            }
            self.tensors = [raw]
            self.regions = regions_from_vllm_views(
                views, num_kv_heads=h, block_size=block_size, is_mla=is_mla, packing=packing
            )
        self.arrays = [t.view(-1).view(torch.uint8).numpy() for t in self.tensors]
        rng = np.random.default_rng(seed)
        for array in self.arrays:
            array[:] = rng.integers(0, 256, array.size, dtype=np.uint8)

    @property
    def bytes(self) -> np.ndarray:
        """A copy of every byte of the cache, its allocations one after another."""
        return np.concatenate(self.arrays)

    def locate(self, addr: int) -> tuple[int, int]:
        """(allocation index, byte offset in it) of an address inside the cache."""
        for index, (tensor, array) in enumerate(zip(self.tensors, self.arrays, strict=True)):
            if tensor.data_ptr() <= addr < tensor.data_ptr() + array.size:
                return index, addr - tensor.data_ptr()
        raise AssertionError(f"address {addr:#x} is in no allocation of the cache")

    def region_array(self, region: int) -> tuple[np.ndarray, int, int]:
        """The array holding a region, the region's offset in it and the array's index."""
        index, offset = self.locate(self.regions[region].base)
        return self.arrays[index], offset, index

    def block(self, region: int, block: int) -> np.ndarray:
        """A writable view of one region's block."""
        index, start = self.locate(self.regions[region].block_addr(block))
        return self.arrays[index][start : start + self.regions[region].layout.block_len]

    def offset(self, region: int, block: int) -> int:
        """Where a region's block starts in :attr:`bytes`."""
        index, start = self.locate(self.regions[region].block_addr(block))
        return sum(a.size for a in self.arrays[:index]) + start
