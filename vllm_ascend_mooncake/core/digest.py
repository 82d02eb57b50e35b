"""A checksum of byte ranges that prefill and decode compute alike, wherever the bytes live.

The optional end-to-end integrity check (``verify_reads``) compares, for every batch of a pull,
the checksum of the ranges prefill serves with that of the ranges they landed in on decode,
before the pull is reported: a corruption in flight, bytes that did not land where the plan put
them, or blocks that changed under the read become a failed pull. Both sides checksum the ranges
the plan chose, so a wrong plan, and the copies and swaps after landing, are not covered
(:mod:`~..datapath.verify` says exactly what is).

The ranges are one stream of little-endian 64-bit words (each range zero-padded to a whole word):
the checksum is ``sum(word[p] * (p * A + B)) mod 2**64``. Every weight is odd, so any change of a
single word changes the sum; the weights grow with the position, so moved or swapped words do
too. It is computed with torch integer ops on the device that holds the bytes (CPU, CUDA, NPU:
wrapping int64 arithmetic is exact and order-independent, so every device gets the same value),
in chunks that bound the temporaries. It detects accidents, not an adversary: the side channel's
secret is what authenticates peers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: The position weights' constants: A even and B odd, so that every weight ``p * A + B`` is odd
#: (invertible mod 2**64: no change of one word can cancel out).
_A = 0x9E3779B97F4A7C16
_B = 0x632BE59BD9B4E019
#: Words per chunk: the temporaries (weights, products) stay at a few MiB.
_CHUNK_WORDS = 1 << 18
_MASK = (1 << 64) - 1


def _signed(value: int) -> int:
    """``value`` mod 2**64 as the int64 torch holds."""
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def checksum(views: Sequence[torch.Tensor]) -> int:
    """The checksum (0 to 2**64 - 1) of ``views`` (flat ``uint8`` tensors) taken in order."""
    import torch

    total = 0
    position = 0
    for view in views:
        words = _as_words(view)
        ramp = _ramp(words.device)
        for start in range(0, words.numel(), _CHUNK_WORDS):
            chunk = words[start : start + _CHUNK_WORDS]
            # sum(word[j] * ((first + j) * A + B)) = sum(word[j] * j * A) + (first*A + B) * sum
            first = position + start
            ramped = int(torch.sum(chunk * ramp[: chunk.numel()]).item())
            total += ramped + (first * _A + _B) * int(torch.sum(chunk).item())
        position += words.numel()
    return total & _MASK


_ramps: dict[str, torch.Tensor] = {}


def _ramp(device: torch.device) -> torch.Tensor:
    """``j * A`` (int64, wrapped) for every word index j of a chunk, kept per device."""
    import torch

    ramp = _ramps.get(str(device))
    if ramp is None:
        ramp = torch.arange(_CHUNK_WORDS, dtype=torch.int64, device=device) * _signed(_A)
        _ramps[str(device)] = ramp
    return ramp


def _as_words(view: torch.Tensor) -> torch.Tensor:
    """``view``'s bytes as int64 words, zero-padded to a whole word (copied where the bytes are
    not word-aligned: a view of another dtype needs an aligned start)."""
    import torch

    length = view.numel()
    padded = -length % 8
    aligned = view.data_ptr() % 8 == 0
    if aligned and not padded:
        return view.view(torch.int64)
    words = torch.zeros(length + padded, dtype=torch.uint8, device=view.device)
    words[:length] = view
    return words.view(torch.int64)


def checksum_ranges(
    view: Callable[[int, int], torch.Tensor], addrs: Sequence[int], lengths: Sequence[int]
) -> int:
    """The checksum of the byte ranges ``(addrs[i], lengths[i])``, in order; ``view(addr,
    length)`` returns a range's bytes (:meth:`~.relayout.LocalMemory.view`)."""
    return checksum([view(int(a), int(n)) for a, n in zip(addrs, lengths, strict=True)])
