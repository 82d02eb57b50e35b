"""Per-request P/D timeline: join the instances' ``request timeline`` log lines by transfer id.

Our proxy, prefill and decode each log one line per request (``vllm_ascend_mooncake.timeline``;
the benchmark sets ``VAM_TIMELINE_LOG=1``). This module reads them back from the logs, joins the
lines of one request by the transfer id both instances hold its KV under, and splits the proxy's
time from receiving the request to relaying its first token into consecutive segments along the
request's critical path. With overlapped legs decode is admitted and asks for its lease while
prefill computes, so those stamps are off the path; with serial legs they are on it.

Each segment is the time from the latest earlier stamp on the path to its own stamp (zero when
that stamp came earlier), so the segments of a request add up to exactly its proxy-side TTFT.
All processes run on one host here, so their wall clocks agree.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_ascend_mooncake.timeline import parse_timeline_line


@dataclass(frozen=True)
class Stamp:
    label: str  # the segment that ends at this stamp, as the report prints it
    source: str  # which process logged it: proxy, prefill, decode, decode_scheduler
    name: str  # its key in that record's stamps


_PREFILL = (
    Stamp("proxy to prefill scheduler", "prefill", "scheduled"),
    Stamp("prefill computing", "prefill", "finished"),
    Stamp("prefill hold registered", "prefill", "held"),
)
_PULL = (
    Stamp("decode read (lane + bytes)", "decode", "landed"),
    Stamp("decode fix-up", "decode", "fixed_up"),
    Stamp("decode report to vLLM", "decode", "reported"),
    Stamp("vLLM learns load done", "decode_scheduler", "load_reported"),
    Stamp("first decode step scheduled", "decode_scheduler", "first_step"),
    Stamp("first token to proxy", "proxy", "first_chunk"),
)
#: The critical path of a request per proxy mode, after the proxy received it.
CRITICAL_PATHS: dict[str, tuple[Stamp, ...]] = {
    "overlapped": (*_PREFILL, Stamp("lease granted to decode", "decode", "granted"), *_PULL),
    "serial": (
        *_PREFILL,
        Stamp("prefill answer to proxy", "proxy", "prefill_answered"),
        Stamp("decode admits", "decode_scheduler", "admitted"),
        Stamp("decode worker gets pull", "decode", "submitted"),
        Stamp("lease granted to decode", "decode", "granted"),
        *_PULL,
    ),
}
CRITICAL_PATHS["resent"] = CRITICAL_PATHS["serial"]
#: The first token from prefill: decode is off the path to it.
CRITICAL_PATHS["continued"] = (
    *_PREFILL[:2],
    Stamp("prefill answer to proxy", "proxy", "prefill_answered"),
    Stamp("prefill's token to client", "proxy", "first_chunk"),
)
#: A continued request's hand-off, from the client's first token (prefill's) to its second
#: (decode's first): the gap the inter-token latency sees once per request.
HANDOFF_PATH: tuple[Stamp, ...] = (
    Stamp("decode admits", "decode_scheduler", "admitted"),
    Stamp("decode worker gets pull", "decode", "submitted"),
    Stamp("lease granted to decode", "decode", "granted"),
    *_PULL[:-1],
    Stamp("decode's token to client", "proxy", "decode_first_chunk"),
)
#: Every segment label, in the order a stacked chart shows them.
SEGMENTS: tuple[str, ...] = tuple(
    dict.fromkeys(stamp.label for path in CRITICAL_PATHS.values() for stamp in path)
)
HANDOFF_SEGMENTS: tuple[str, ...] = tuple(stamp.label for stamp in HANDOFF_PATH)


def read_records(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every timeline record in the given log files (missing files are skipped)."""
    records = []
    for path in paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            record = parse_timeline_line(line)
            if record is not None:
                records.append(record)
    return records


def join(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Transfer id -> {"mode", "stamps": {(source, name): latest time over that source's ranks}}.

    A stamp logged by several ranks (each prefill and decode rank logs its own line) keeps the
    latest: the request waits for its slowest rank.
    """
    joined: dict[str, dict[str, Any]] = {}
    for record in records:
        transfer_id = record.get("transfer")
        if not isinstance(transfer_id, str):
            continue
        entry = joined.setdefault(transfer_id, {"mode": None, "stamps": {}})
        source = record.get("source")
        if source == "proxy":
            entry["mode"] = record.get("mode")
        for name, value in record["stamps"].items():
            if isinstance(value, (int, float)):
                key = (source, name)
                entry["stamps"][key] = max(value, entry["stamps"].get(key, value))
    return joined


def segments(
    entry: dict[str, Any],
    path: Sequence[Stamp] | None = None,
    start_stamp: tuple[str, str] = ("proxy", "received"),
) -> dict[str, float] | None:
    """Seconds per segment of ``path`` (by default the critical path to the first token of the
    request's mode) from ``start_stamp`` on, for one joined request; None unless every stamp
    on the path is present."""
    stamps = entry["stamps"]
    if path is None:
        path = CRITICAL_PATHS.get(entry.get("mode") or "")
    start = stamps.get(start_stamp)
    if path is None or start is None:
        return None
    if any((stamp.source, stamp.name) not in stamps for stamp in path):
        return None
    result: dict[str, float] = {}
    cursor = start
    for stamp in path:
        at = stamps[(stamp.source, stamp.name)]
        result[stamp.label] = result.get(stamp.label, 0.0) + max(0.0, at - cursor)
        cursor = max(cursor, at)
    return result


@dataclass
class CellTimeline:
    """Mean milliseconds per segment of the requests a cell's proxy received."""

    requests: int  # joined with every stamp
    unjoined: int  # received by the proxy in the window, some stamp missing
    mean_ms: dict[str, float]
    ttft_p50_ms: float | None  # proxy-side, the sum of a request's segments
    #: continued requests: mean ms per segment from the client's first token to its second
    handoff_ms: dict[str, float] = field(default_factory=dict)
    handoffs: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cell_timeline(
    joined: dict[str, dict[str, Any]], started: float, ended: float
) -> CellTimeline | None:
    """The breakdown of the requests the proxy received between ``started`` and ``ended``
    (wall clock); None when it received none there (no timeline lines: another system)."""
    per_request, handoffs = [], []
    unjoined = 0
    for entry in joined.values():
        received = entry["stamps"].get(("proxy", "received"))
        if received is None or not started <= received <= ended:
            continue
        split = segments(entry)
        if split is None:
            unjoined += 1
        else:
            per_request.append(split)
        if entry.get("mode") == "continued":
            handoff = segments(entry, HANDOFF_PATH, ("proxy", "first_chunk"))
            if handoff is not None:
                handoffs.append(handoff)
    if not per_request and not unjoined:
        return None
    totals = [1e3 * sum(split.values()) for split in per_request]
    return CellTimeline(
        len(per_request),
        unjoined,
        _means(per_request, SEGMENTS),
        statistics.median(totals) if totals else None,
        _means(handoffs, HANDOFF_SEGMENTS),
        len(handoffs),
    )


def _means(splits: list[dict[str, float]], labels: Sequence[str]) -> dict[str, float]:
    """Mean ms per label over the splits that have it (0 where a split lacks it)."""
    return {
        label: 1e3 * statistics.fmean(split.get(label, 0.0) for split in splits)
        for label in labels
        if splits and any(label in split for split in splits)
    }


def breakdown_table(cells: Sequence[tuple[str, int, int, CellTimeline]]) -> str:
    """A text table: one column per (system, prompt, concurrency), one row per segment."""
    shown = [label for label in SEGMENTS if any(label in c.mean_ms for *_, c in cells)]
    header = ["segment (mean ms)"] + [f"{s} {p}/{c}" for s, p, c, _ in cells]
    rows = [header]
    for label in shown:
        rows.append([label] + [_ms(c.mean_ms.get(label)) for *_, c in cells])
    rows.append(["sum = proxy TTFT"] + [_ms(sum(c.mean_ms.values())) for *_, c in cells])
    rows.append(
        ["requests joined"] + [f"{c.requests}/{c.requests + c.unjoined}" for *_, c in cells]
    )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )


def handoff_table(cells: Sequence[tuple[str, int, int, CellTimeline]]) -> str:
    """Like :func:`breakdown_table`, for the hand-off of continued requests (first token to
    second)."""
    cells = [cell for cell in cells if cell[3].handoffs]
    if not cells:
        return ""
    header = ["segment (mean ms)"] + [f"{s} {p}/{c}" for s, p, c, _ in cells]
    rows = [header]
    for label in HANDOFF_SEGMENTS:
        rows.append([label] + [_ms(c.handoff_ms.get(label)) for *_, c in cells])
    rows.append(
        ["sum = first-to-second token gap"] + [_ms(sum(c.handoff_ms.values())) for *_, c in cells]
    )
    rows.append(["requests"] + [str(c.handoffs) for *_, c in cells])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


_COLOURS = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
    (57, 59, 121),
    (132, 60, 57),
    (99, 121, 57),
)


def write_png(cells: Sequence[tuple[str, int, int, CellTimeline]], path: Path) -> Path:
    """A stacked horizontal bar per cell (mean ms per segment), drawn with Pillow."""
    from PIL import Image, ImageDraw, ImageFont

    shown = [label for label in SEGMENTS if any(label in c.mean_ms for *_, c in cells)]
    font = ImageFont.load_default(size=14)
    bar_h, gap, left, right, top = 26, 14, 190, 80, 40
    legend_h = 22 * ((len(shown) + 1) // 2) + 20
    width = 1100
    height = top + len(cells) * (bar_h + gap) + 40 + legend_h
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    longest = max((sum(c.mean_ms.values()) for *_, c in cells), default=1.0) or 1.0
    scale = (width - left - right) / longest
    draw.text(
        (10, 10),
        "Where the time to first token goes (mean ms per request, proxy side)",
        fill="black",
        font=font,
    )
    y = top
    for system, prompt, concurrency, cell in cells:
        draw.text(
            (10, y + 5), f"{system} {prompt} tok, conc {concurrency}", fill="black", font=font
        )
        x = float(left)
        for index, label in enumerate(shown):
            ms = cell.mean_ms.get(label, 0.0)
            if ms <= 0:
                continue
            draw.rectangle([x, y, x + ms * scale, y + bar_h], fill=_COLOURS[index % len(_COLOURS)])
            x += ms * scale
        draw.text((x + 4, y + 5), f"{sum(cell.mean_ms.values()):.0f} ms", fill="black", font=font)
        y += bar_h + gap
    y += 20
    for index, label in enumerate(shown):
        column, row = index % 2, index // 2
        lx, ly = 10 + column * 540, y + row * 22
        draw.rectangle([lx, ly + 2, lx + 14, ly + 16], fill=_COLOURS[index % len(_COLOURS)])
        draw.text((lx + 20, ly), label, fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def by_cell(
    joined: dict[str, dict[str, Any]], windows: Iterable[tuple[Any, float, float]]
) -> dict[Any, CellTimeline]:
    """Cell key -> its breakdown, for the cells whose window holds timeline records."""
    out: dict[Any, CellTimeline] = {}
    for key, started, ended in windows:
        cell = cell_timeline(joined, started, ended)
        if cell is not None:
            out[key] = cell
    return out
