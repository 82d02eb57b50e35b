"""The fleet's results as a markdown table and a PNG of curves against peer count.

matplotlib is not installed in this project's environment, so the PNG is drawn with Pillow (which
vLLM brings), as ``benchmarks/e2e/soak_plot.py`` does; without Pillow no PNG is written.
"""

from __future__ import annotations

import math
from pathlib import Path

_HEADER = (
    "| shape | peers | requests | done | failed (attributed / unattributed) "
    "| decode proc threads setup/max/end | decode proc fds setup/max/end "
    "| decode proc RSS MiB setup/max/end "
    "| prefill proc threads setup/max/end | prefill proc fds setup/max/end "
    "| prefill proc RSS MiB setup/max/end "
    "| claim→grant p50/p99 ms | early hold→grant p50/p99 ms | read-done→release p50/p99 ms "
    "| CPU µs/pull decode / prefill (net of idle) | TIME_WAIT |"
)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _three(summary: dict, what: str) -> str:
    unit = "_mib" if what == "rss" else ""
    text = "/".join(_fmt(summary[f"{what}_{k}{unit}"]) for k in ("setup", "max", "end"))
    idle = summary.get(f"{what}_idle{unit}")
    return text if idle is None else f"{text} (idle {_fmt(idle)})"


def _lat(latency: dict) -> str:
    return f"{_fmt(latency['p50_ms'])} / {_fmt(latency['p99_ms'])}"


def markdown_table(results: list[dict]) -> str:
    lines = [_HEADER, "|" + "---|" * (_HEADER.count("|") - 1)]
    for r in results:
        d, p = r["per_process_max"]["decode"], r["per_process_max"]["prefill"]
        attributed = sum(r["failed_by_cause"].values())
        causes = ", ".join(f"{k} {v}" for k, v in sorted(r["failed_by_cause"].items()))
        cpu = r["cpu_us_per_pull"]
        net = r.get("cpu_us_per_pull_net_of_idle", {})
        lines.append(
            f"| {r['shape']} | {r['size']} | {r['requests']} | {r['pulls_done']} "
            f"| {attributed}{f' ({causes})' if causes else ''} / {r['failed_unattributed']} "
            f"| {_three(d, 'threads')} | {_three(d, 'fds')} "
            f"| {_three(d, 'rss')} "
            f"| {_three(p, 'threads')} | {_three(p, 'fds')} "
            f"| {_three(p, 'rss')} "
            f"| {_lat(r['latency']['claim_to_grant'])} "
            f"| {_lat(r['latency']['early_hold_to_grant'])} "
            f"| {_lat(r['latency']['read_done_to_release'])} "
            f"| {_fmt(cpu.get('decode'))} / {_fmt(cpu.get('prefill'))} "
            f"({_fmt(net.get('decode'))} / {_fmt(net.get('prefill'))}) "
            f"| {_fmt(r.get('tcp_time_wait_at_end'))} |"
        )
    return "\n".join(lines)


_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e")


def write_png(results: list[dict], path: Path) -> Path | None:
    """Four panels against peers (log scale): threads, fds and RSS of the busiest decode and
    prefill process (max during the run), and the p99 latencies. None without Pillow or with
    fewer than two sizes."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return None
    if len(results) < 2:
        return None
    xs = [r["size"] for r in results]

    def role(r, who, key):
        return r["per_process_max"][who][key]

    panels = [
        (
            "threads per process (max)",
            {w: [role(r, w, "threads_max") for r in results] for w in ("decode", "prefill")},
        ),
        (
            "open fds per process (max)",
            {w: [role(r, w, "fds_max") for r in results] for w in ("decode", "prefill")},
        ),
        (
            "RSS MiB per process (max)",
            {w: [role(r, w, "rss_max_mib") for r in results] for w in ("decode", "prefill")},
        ),
        (
            "p99 latency ms",
            {
                name: [r["latency"][key]["p99_ms"] for r in results]
                for name, key in (
                    ("claim->grant", "claim_to_grant"),
                    ("early hold->grant", "early_hold_to_grant"),
                    ("read-done->release", "read_done_to_release"),
                )
            },
        ),
    ]
    width, height, pw, ph = 1000, 760, 500, 380
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    lx0, lx1 = math.log10(max(1, min(xs))), math.log10(max(xs))
    lx1 = lx1 if lx1 > lx0 else lx0 + 1
    for n, (title, series) in enumerate(panels):
        ox, oy = (n % 2) * pw, (n // 2) * ph
        left, top, right, bottom = ox + 60, oy + 30, ox + pw - 20, oy + ph - 40
        values = [v for vs in series.values() for v in vs if v is not None]
        high = max(values, default=1) * 1.1 or 1
        draw.rectangle([left, top, right, bottom], outline="black")
        draw.text((left, oy + 8), f"{results[0]['shape']}: {title}", fill="black")
        for frac in (0, 0.5, 1):
            y = bottom - frac * (bottom - top)
            draw.text((ox + 5, y - 6), f"{high * frac:.4g}", fill="black")
        for x in xs:
            px = left + (math.log10(max(1, x)) - lx0) / (lx1 - lx0) * (right - left)
            draw.text((px - 8, bottom + 5), str(x), fill="black")
        draw.text((right - 60, bottom + 20), "peers (log)", fill="black")
        for k, (name, vs) in enumerate(series.items()):
            colour = _COLOURS[k % len(_COLOURS)]
            points = [
                (
                    left + (math.log10(max(1, x)) - lx0) / (lx1 - lx0) * (right - left),
                    bottom - v / high * (bottom - top),
                )
                for x, v in zip(xs, vs, strict=True)
                if v is not None
            ]
            if len(points) > 1:
                draw.line(points, fill=colour, width=2)
            for px, py in points:
                draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=colour)
            draw.text((left + 8, top + 6 + 14 * k), name, fill=colour)
    image.save(path)
    return path
