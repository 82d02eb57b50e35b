"""The soak's curves as a PNG: each process's RSS growth (MiB since the first sample) against
requests completed, one panel per system on the same scales, drawn with Pillow (which vLLM
brings; no plotting library needed). The last half of the run, the part fitted, is shaded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from .rss_growth import RssSample, series

_COLOURS = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#7f7f7f",
    "#bcbd22",
)


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values covering [low, high]."""
    span = max(high - low, 1e-9)
    raw = span / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    ticks = [(low // step) * step]
    while ticks[-1] < high:
        ticks.append(ticks[-1] + step)
    return ticks


def write_png(runs: Mapping[str, Sequence[RssSample]], path: Path, title: str) -> Path:
    """One panel per system (name -> its samples); returns ``path``."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=13)
    curves = {
        system: {
            label: [(x, y - points[0][1]) for x, y in points]
            for label, points in sorted(series(samples).items())
        }
        for system, samples in runs.items()
    }
    values = [p for c in curves.values() for pts in c.values() for p in pts] or [(0.0, 0.0)]
    x_max = max(x for x, _ in values) or 1.0
    y_ticks = _ticks(min(0.0, min(y for _, y in values)), max(1.0, max(y for _, y in values)))
    x_ticks = _ticks(0.0, x_max)
    y_low, y_high = y_ticks[0], y_ticks[-1]
    x_high = x_ticks[-1]

    width, panel_h, left, right, legend_w = 1100, 300, 70, 20, 260
    plot_w = width - left - right - legend_w
    height = 40 + len(curves) * (panel_h + 50)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 10), title, fill="black", font=font)
    top = 40
    for system, lines in curves.items():
        bottom = top + panel_h

        def at(x: float, y: float, top: int = top, bottom: int = bottom) -> tuple[float, float]:
            return (
                left + x / x_high * plot_w,
                bottom - (y - y_low) / (y_high - y_low) * (bottom - top),
            )

        draw.rectangle([*at(x_max / 2, y_high), *at(x_max, y_low)], fill="#f0f0f0")
        for tick in y_ticks:
            x0, y0 = at(0, tick)
            draw.line([(x0, y0), (left + plot_w, y0)], fill="#dddddd")
            draw.text((5, y0 - 7), f"{tick:+.0f}", fill="black", font=font)
        for tick in x_ticks:
            x0, y0 = at(tick, y_low)
            draw.line([(x0, top), (x0, y0)], fill="#dddddd")
            draw.text((x0 - 12, y0 + 4), f"{tick:.0f}", fill="black", font=font)
        draw.rectangle([left, top, left + plot_w, bottom], outline="black")
        draw.text(
            (left + 6, top + 4), f"{system}: MiB since the first sample", fill="black", font=font
        )
        for index, (label, points) in enumerate(lines.items()):
            colour = _COLOURS[index % len(_COLOURS)]
            if len(points) > 1:
                draw.line([at(x, y) for x, y in points], fill=colour, width=2)
            ly = top + 8 + index * 18
            draw.rectangle([width - legend_w, ly + 3, width - legend_w + 12, ly + 13], fill=colour)
            draw.text((width - legend_w + 18, ly), label, fill="black", font=font)
        draw.text(
            (left + plot_w / 2 - 120, bottom + 20),
            "requests completed (last half shaded: the fit)",
            fill="black",
            font=font,
        )
        top = bottom + 50
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
