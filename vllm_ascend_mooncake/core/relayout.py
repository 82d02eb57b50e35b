"""Fix-up kernels: the local byte permutations and copies a plan asks for, in plain torch ops.

The same code runs on CPU, CUDA and NPU tensors. All operations work on flat ``uint8`` views of the
registered storages, addressed by the absolute addresses the planner produced, so they are
independent of dtype and of how the engine views the cache.

A device may provide a faster kernel for swaps (vllm-ascend ships a fused NPU transpose): register
it with :func:`register_swap_fast_path`. It is used only where its ``supports`` check accepts the
memory, and tests hold it to the torch path, which stays the oracle.

Ordering contract. On an accelerator, :func:`apply_row_copies` and :func:`apply_swaps` only
*queue* their copies on the calling thread's current stream and return before they ran, while the
transport writes memory outside any stream (RDMA, the NPU's DMA engines) and vLLM reads it from its
own stream. So the caller must call :meth:`LocalMemory.fence` after queuing fix-ups and before
(1) their source bytes may be overwritten (a staging area read again by the next batch, or handed
to another request), and (2) their destination blocks are reported loaded to vLLM. On CPU every op
has finished when it returns and the fence costs nothing.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .plan_types import RowCopies, SwapAxes

if TYPE_CHECKING:
    import torch


def wait_for_device(device: torch.device) -> None:
    """Block until the work this thread queued on ``device``'s current stream has finished.

    Waits on the calling thread's stream only (the one the fix-ups were queued on), not on the
    whole device, so vLLM's forward on another stream is not waited for."""
    if device.type == "cpu":
        return
    import torch

    module = getattr(torch, device.type, None)  # torch.cuda; torch.npu once torch_npu is loaded
    if module is not None and hasattr(module, "current_stream"):
        module.current_stream(device).synchronize()
    else:
        torch.accelerator.current_stream(device).synchronize()


class LocalMemory:
    """Flat ``uint8`` tensors over this process's registered storages, found by address."""

    def __init__(self, buffers: Iterable[torch.Tensor]) -> None:
        ordered = sorted(buffers, key=lambda t: t.data_ptr())
        self._bases = [t.data_ptr() for t in ordered]
        self._buffers = ordered
        self._scratch = threading.local()
        # Devices whose queued work a fence waits for (CPU ops are done when they return).
        self._devices = list({t.device: None for t in ordered if t.device.type != "cpu"})
        for prev, nxt in itertools.pairwise(ordered):
            if prev.data_ptr() + prev.numel() > nxt.data_ptr():
                raise ValueError("local memory buffers overlap; register each storage once")

    def fence(self) -> None:
        """Wait until every fix-up this thread queued on this memory has run (see the module's
        ordering contract); a no-op for memory on CPU."""
        for device in self._devices:
            wait_for_device(device)

    @classmethod
    def from_tensors(cls, tensors: Iterable[torch.Tensor]) -> LocalMemory:
        """One flat byte view per distinct storage behind ``tensors`` (vLLM layers share one)."""
        import torch

        storages = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            storages.setdefault(storage.data_ptr(), (storage, tensor.device))
        flats = []
        for storage, device in storages.values():
            flat = torch.empty(0, dtype=torch.uint8, device=device)
            flat.set_(storage)
            flats.append(flat)
        return cls(flats)

    @property
    def buffers(self) -> Sequence[torch.Tensor]:
        return self._buffers

    def _locate(self, addr: int, length: int) -> tuple[torch.Tensor, int]:
        index = bisect.bisect_right(self._bases, addr) - 1
        if index >= 0:
            buffer = self._buffers[index]
            offset = addr - self._bases[index]
            if offset + length <= buffer.numel():
                return buffer, offset
        raise ValueError(f"[{addr:#x}, +{length}) is not inside one registered local buffer")

    @contextlib.contextmanager
    def own_streams(self) -> Iterator[None]:
        """Run the block's device work on streams of this thread's own (one per device of this
        memory, kept for reuse), not on the device's default stream: a sum ended by ``.item()``
        then waits for its own kernels only, never behind the model's forward queued on the
        compute stream. For reading bytes no queued kernel writes (a held prefill block, whose
        forward finished before vLLM handed the request over): nothing orders the work after
        the compute stream's. A no-op on CPU, and where the device module has no ``Stream``.

        Tested on CPU only (where it does nothing); that a CUDA or NPU checksum no longer waits
        for a long kernel on the compute stream needs a device to show."""
        with contextlib.ExitStack() as stack:
            streams = self._scratch.__dict__.setdefault("streams", {})
            for device in self._devices:
                import torch

                module = getattr(torch, device.type, None)  # torch.npu once torch_npu is loaded
                if module is None or not hasattr(module, "Stream") or not hasattr(module, "stream"):
                    continue
                stream = streams.get(device)
                if stream is None:
                    stream = streams[device] = module.Stream(device=device)
                stack.enter_context(module.stream(stream))
            yield

    def scratch(self, length: int, device: torch.device) -> torch.Tensor:
        """A per-thread temporary of at least ``length`` bytes on ``device``, kept for reuse."""
        import torch

        buffers = self._scratch.__dict__.setdefault("by_device", {})
        buffer = buffers.get(device)
        if buffer is None or buffer.numel() < length:
            buffer = torch.empty(length, dtype=torch.uint8, device=device)
            buffers[device] = buffer
        return buffer[:length]

    def view(self, addr: int, length: int) -> torch.Tensor:
        buffer, offset = self._locate(addr, length)
        return buffer[offset : offset + length]

    def rows(
        self,
        addr: int,
        rows: int,
        stride: int,
        row_bytes: int,
        planes: int = 1,
        plane_stride: int = 0,
    ) -> torch.Tensor:
        """A ``[planes, rows, row_bytes]`` view with the given plane and row strides."""
        extent = (planes - 1) * plane_stride + (rows - 1) * stride + row_bytes
        buffer, offset = self._locate(addr, extent)
        return buffer.as_strided(
            (planes, rows, row_bytes), (plane_stride, stride, 1), buffer.storage_offset() + offset
        )


@dataclass(frozen=True)
class SwapFastPath:
    """A device kernel for :class:`SwapAxes`; ``supports`` decides per buffer device."""

    name: str
    supports: Callable[[torch.Tensor], bool]
    run: Callable[[LocalMemory, SwapAxes], None]


_FAST_PATHS: list[SwapFastPath] = []


def register_swap_fast_path(fast_path: SwapFastPath) -> None:
    """Add a device kernel; later registrations take precedence. Idempotent by name."""
    global _FAST_PATHS
    _FAST_PATHS = [fp for fp in _FAST_PATHS if fp.name != fast_path.name] + [fast_path]


def unregister_swap_fast_path(name: str) -> None:
    global _FAST_PATHS
    _FAST_PATHS = [fp for fp in _FAST_PATHS if fp.name != name]


def _widest_dtype(unit: int, addrs: Sequence[int]) -> tuple[torch.dtype, int]:
    """The widest integer type that tiles ``unit`` and every address: fewer, wider elements."""
    import torch

    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if unit % size == 0 and all(addr % size == 0 for addr in addrs):
            return dtype, size
    return torch.uint8, 1


def swap_axes_torch(memory: LocalMemory, swap: SwapAxes) -> None:
    """Transpose each span into a reused scratch buffer, then copy it back.

    Reusing the scratch avoids faulting in fresh pages for every span, which otherwise costs more
    than the copies themselves; viewing bytes as the widest aligned integer type cuts the number
    of elements the strided copy walks.
    """
    addrs = swap.addrs.tolist()
    dtype, size = _widest_dtype(swap.unit, addrs)
    unit = swap.unit // size
    for addr in addrs:
        span = memory.view(addr, swap.span).view(dtype)
        scratch = memory.scratch(swap.span, span.device).view(dtype)
        scratch.view(swap.inner, swap.outer, unit).copy_(
            span.view(swap.outer, swap.inner, unit).transpose(0, 1)
        )
        span.copy_(scratch)


def apply_swaps(memory: LocalMemory, swaps: Sequence[SwapAxes]) -> None:
    """Queue a request's fix-ups, in place. Call only after every pull of the request landed,
    and :meth:`LocalMemory.fence` before the request is reported loaded."""
    for swap in swaps:
        if not len(swap.addrs):
            continue
        device_buffer = memory.view(int(swap.addrs[0]), swap.span)
        for fast_path in reversed(_FAST_PATHS):
            if fast_path.supports(device_buffer):
                fast_path.run(memory, swap)
                break
        else:
            swap_axes_torch(memory, swap)


def apply_row_copies(memory: LocalMemory, copies: Sequence[RowCopies]) -> None:
    """Queue row copies out of a staging buffer into KV blocks (source and destination never
    overlap); :meth:`LocalMemory.fence` before the staging bytes are written again or released."""
    for group in copies:
        rows, row_bytes, planes = group.rows, group.row_bytes, group.planes
        for src, dst in zip(group.src_addrs.tolist(), group.dst_addrs.tolist(), strict=True):
            source = memory.rows(
                src, rows, group.src_stride, row_bytes, planes, group.src_plane_stride
            )
            memory.rows(
                dst, rows, group.dst_stride, row_bytes, planes, group.dst_plane_stride
            ).copy_(source)
