"""What every benchmark shares: its parser, the request-shape and output arguments, and how it
writes its results as JSON (and describes the machine they were measured on).

Standard library only at import time, so that the fast tests can import it without torch or vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def make_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """A parser for ``python -m module``, described by the first paragraph of its docstring,
    whose ``--help`` shows every default."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc.split("\n\n")[0] if doc else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )


def add_request_shape_args(parser: argparse.ArgumentParser) -> None:
    """The shape of the request whose KV is planned or moved (by default a realistic one:
    32 layers, 8 KV heads, head_dim 128, 4,096 tokens, block size 128: 512 MiB in bf16)."""
    group = parser.add_argument_group("request shape")
    group.add_argument("--layers", type=int, default=32, help="model layers")
    group.add_argument("--kv-heads", type=int, default=8, help="KV heads of the whole model")
    group.add_argument("--head-dim", type=int, default=128, help="elements per head and token")
    group.add_argument("--tokens", type=int, default=4096, help="prompt tokens of the request")
    group.add_argument("--block-size", type=int, default=128, help="tokens per KV block")


def add_repeats_arg(parser: argparse.ArgumentParser, default: int, what: str) -> None:
    """``--repeats``: how many times each measurement runs; ``what`` says which figure is kept
    (``"best of"``, ``"median of"``)."""
    parser.add_argument(
        "--repeats", type=int, default=default, help=f"runs per measurement ({what} them)"
    )


def add_json_arg(parser: argparse.ArgumentParser, what: str = "the results") -> None:
    """``--json PATH``: where :func:`write_json` writes the results (none when not given)."""
    parser.add_argument("--json", type=Path, default=None, help=f"write {what} as JSON here")


def request_rows_args(module: str, doc: str | None) -> argparse.Namespace:
    """The command line of a benchmark that measures one request's shape in rows: the shape,
    ``--repeats`` (best of 3) and ``--json`` for the rows."""
    parser = make_parser(module, doc)
    add_request_shape_args(parser)
    add_repeats_arg(parser, 3, "best of")
    add_json_arg(parser, "the rows")
    return parser.parse_args()


def write_json(path: str | os.PathLike[str], payload: Any) -> Path:
    """Write ``payload`` as indented JSON (its folder created if needed); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path


def environment() -> dict[str, Any]:
    """The machine and the versions a result was measured with (imports torch and vLLM)."""
    import torch
    import vllm

    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": getattr(vllm, "__version__", "unknown"),
    }


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """The shortest of ``repeats`` wall-clock runs of ``fn``, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def place_regions(layouts: Sequence[Any], base: int) -> list[Any]:
    """``Region``s for these layouts laid one after another from ``base`` (no gaps)."""
    from vllm_ascend_mooncake.core.layout import Region

    regions, offset = [], 0
    for i, layout in enumerate(layouts):
        regions.append(Region(f"r{i}", base + offset, layout))
        offset += layout.span_bytes
    return regions


def kv_layouts(
    head_major: bool,
    layers: int,
    heads: int,
    block: int,
    head_dim: int,
    blocks: int,
    *,
    element: int = 2,
    packing: Any = None,
) -> list[Any]:
    """One rank's KV cache layouts, ``layers`` layers of ``blocks`` blocks: vLLM's fused
    head-major view (one region per layer, K|V in the content axis; ``packing``: how a chunk's
    bytes are ordered, see ``core.packing``) or separate token-major K and V tensors (two
    regions per layer)."""
    from vllm_ascend_mooncake.core.layout import BlockOrder, RegionLayout

    if head_major:
        width = 2 * head_dim * element
        layout = RegionLayout(
            BlockOrder.HEAD_MAJOR,
            blocks,
            heads * block * width,
            heads,
            block,
            width,
            packing=packing,
        )
        return [layout] * layers
    width = head_dim * element
    layout = RegionLayout(
        BlockOrder.TOKEN_MAJOR, blocks, heads * block * width, heads, block, width
    )
    return [layout] * (2 * layers)


def against_memcpy(nbytes: int, seconds: float, repeats: int) -> tuple[float, float, float]:
    """Work on ``nbytes`` that took ``seconds`` against a plain copy of as many bytes, measured
    now (best of ``repeats``): the work's GB/s, the copy's GB/s, and the copy's time over the
    work's (above 1: the work is faster)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s = best_of(lambda: dst.copy_(src), repeats)
    return nbytes / seconds / 1e9, nbytes / copy_s / 1e9, copy_s / seconds
