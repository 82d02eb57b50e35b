"""How attention backends order the bytes of a head-major (block, head) chunk (pure).

A head-major block is ``[heads][chunk]``; what the chunk holds is each backend's own choice, and
the connector must know it to cut a block into token ranges (prefill and decode with different
block sizes). Every entry below was read in vLLM 0.32's sources; a backend not listed is unknown,
and its chunks are only ever moved whole (equal block sizes).

vLLM 0.32 hands the connector a per-layer view ``[blocks, heads, tokens, 2 * head_size]`` at
every TP size (``create_kv_cache_views``; logged from running engines for 4 KV heads, float32:
TP 1 ``[n, 4, 32, 128]`` strides ``(16384, 4096, 128, 1)``, TP 2 ``[n, 2, 64, 128]`` strides
``(16384, 8192, 128, 1)``); the worker checks a packing against each view's chunks as its shape
and strides say (:func:`.layout.head_chunk_token_bytes`):

* CUDA ``FLASH_ATTN`` and ``TRITON_ATTN`` split the content of each token into K and V
  (``kv_cache.split(head_size, dim=-1)``), so a chunk is plain token rows. Read, not run on a GPU.
* vLLM CPU (``CPU_ATTN``, ``v1/attention/backends/cpu_attn.py``) views the chunk as
  ``[2 * tokens, head_size]`` and cuts it in two: the first ``tokens * head_size`` elements are K,
  the rest V, each laid out by the ISA kernel's ``reshape_and_cache``
  (``csrc/cpu/cpu_attn_vec.hpp``, ``cpu_attn_amx.hpp``; ``vec16`` inherits ``vec``'s):

  - ``vec``, ``vec16``: K column-major ``[head_size][tokens]`` (one row per channel), V row-major
    ``[tokens][head_size]``.
  - ``amx`` (bf16): K in groups of 16 tokens, ``[tokens/16][head_size/2][16][2 elements]``, so one
    row of whole 16-token units; V in 16-channel groups ``[head_size/16][tokens/2][16][2]``, one
    row per channel group holding tokens in pairs.

  FP8 caches are quantised by other code paths and are not described (unknown).
"""

from __future__ import annotations

from .layout import ChunkPacking, RowGroup, token_rows

#: Backends whose chunks are ``[tokens][K | V]`` (content split per token).
_TOKEN_ROW_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN"})


def chunk_packing(
    attention_backend: str, kv_cache_dtype: str, head_size: int, element_size: int
) -> ChunkPacking:
    """The packing of a head-major chunk for the backend label a worker advertises
    (``CPU_ATTN/vec``: backend and ISA kernel, see :mod:`..connector.identity`); empty when
    unknown: several backends in one model, an FP8 cache, or a backend not described here."""
    if not attention_backend or "," in attention_backend:
        return ()
    if "fp8" in kv_cache_dtype:
        return ()
    backend, _, isa = attention_backend.partition("/")
    if backend in _TOKEN_ROW_BACKENDS and not isa:
        return token_rows(2 * head_size * element_size)
    if backend != "CPU_ATTN":
        return ()
    if isa in ("vec", "vec16"):
        return (
            RowGroup(rows=head_size, token_bytes=element_size),  # K: one row per channel
            RowGroup(rows=1, token_bytes=head_size * element_size),  # V: token rows
        )
    if isa == "amx" and element_size == 2 and head_size % 16 == 0:
        return (
            RowGroup(rows=1, token_bytes=head_size * element_size, token_unit=16),  # K tiles
            RowGroup(rows=head_size // 16, token_bytes=16 * element_size, token_unit=2),  # V
        )
    return ()
