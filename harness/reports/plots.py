"""Small server-side SVG charts: line charts with error bars and reference lines, grouped bars.

No plotting library: the report needs a handful of chart shapes, and an SVG string is easy to
cache, to embed in a page and to check in a test (it is XML). Axes: a log-2 or linear x axis, a
linear or log-10 y axis, "nice" ticks, a legend to the right. Every piece of text is escaped:
series names come from evidence, which carries submitted text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

WIDTH, HEIGHT = 720, 340
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 64, 190, 34, 48
# Colour-blind-safe: Okabe-Ito, then Paul Tol's muted wine, teal, olive and grey, so the ten
# contexts of a large scope get ten colours (seven wrapped: 1024 and 32768 drew alike). Stock
# lines are dashed, so pairs stay apart in grey print too.
PALETTE = (
    "#0072B2",
    "#D55E00",
    "#009E73",
    "#CC79A7",
    "#E69F00",
    "#56B4E9",
    "#000000",
    "#882255",
    "#44AA99",
    "#999933",
    "#888888",
)
SVG_NS = "http://www.w3.org/2000/svg"


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]
    errors: Sequence[tuple[float, float]] | None = None  # (low, high) per point
    color: int = 0  # index into PALETTE
    dashed: bool = False


@dataclass(frozen=True)
class RefLine:
    """A horizontal line across the plot, e.g. a claim's bound."""

    y: float
    label: str


@dataclass(frozen=True)
class LineChart:
    title: str
    x_label: str
    y_label: str
    series: Sequence[Series]
    ref_lines: Sequence[RefLine] = field(default_factory=tuple)
    log2_x: bool = True
    log10_y: bool = False
    y_from_zero: bool = True


@dataclass(frozen=True)
class Axis:
    """Maps data values to pixels along one side of the plot area."""

    low: float
    high: float
    pixel_low: float
    pixel_high: float
    log_base: float | None = None

    def __call__(self, value: float) -> float:
        low, high, v = self.low, self.high, value
        if self.log_base:
            low, high = math.log(low, self.log_base), math.log(high, self.log_base)
            v = math.log(max(value, 1e-300), self.log_base)
        span = (high - low) or 1.0
        return self.pixel_low + (v - low) / span * (self.pixel_high - self.pixel_low)


def line_chart(chart: LineChart) -> str:
    """The chart as a standalone <svg> element."""
    ys = [y for s in chart.series for _, y in s.points if _finite(y)]
    ys += [v for s in chart.series for e in (s.errors or []) for v in e if _finite(v)]
    ys += [r.y for r in chart.ref_lines]
    xs = [x for s in chart.series for x, _ in s.points if _finite(x)]
    if not xs or not ys:
        return _empty(chart.title, "no data to plot")
    x_axis, x_ticks = _x_axis(xs, chart.log2_x)
    y_axis, y_ticks = _y_axis(ys, chart.log10_y, chart.y_from_zero)
    parts = [_frame(chart.title, chart.x_label, chart.y_label)]
    parts += [_ticks(x_axis, x_ticks, y_axis, y_ticks)]
    parts += [_ref_line(x_axis, y_axis, ref) for ref in chart.ref_lines]
    parts += [_series(x_axis, y_axis, s) for s in chart.series]
    legend = [(s.name, s.color, s.dashed) for s in chart.series]
    parts += [_legend(legend + [(r.label, -1, True) for r in chart.ref_lines])]
    return _svg(chart.title, "".join(parts))


def bar_chart(
    title: str,
    y_label: str,
    categories: Sequence[str],
    groups: Sequence[tuple[str, list[float]]],
    colors: Sequence[int] | None = None,
) -> str:
    """Grouped vertical bars: one group of bars per category, one bar per (name, values) pair;
    `colors` are PALETTE indices per pair (default: in order)."""
    colors = colors or list(range(len(groups)))
    values = [v for _, vs in groups for v in vs if _finite(v)]
    if not categories or not values:
        return _empty(title, "no data to plot")
    y_axis, y_ticks = _y_axis(values, log10=False, from_zero=True)
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    slot = plot_w / len(categories)
    bar_w = slot * 0.8 / max(1, len(groups))
    parts = [_frame(title, "case", y_label), _y_ticks(y_axis, y_ticks)]
    # Past ~24 categories only every few are labelled, or the labels overlap.
    stride = max(1, math.ceil(len(categories) / 24))
    for index, category in enumerate(categories):
        x0 = MARGIN_LEFT + slot * index + slot * 0.1
        if index % stride == 0:
            parts.append(_category_label(x0 + slot * 0.4, category))
        for g, (name, vs) in enumerate(groups):
            if index < len(vs) and _finite(vs[index]):
                bar = _bar(x0 + g * bar_w, bar_w, y_axis, vs[index], colors[g], name, category)
                parts.append(bar)
    parts.append(_legend([(name, colors[g], False) for g, (name, _) in enumerate(groups)]))
    return _svg(title, "".join(parts))


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _svg(title: str, body: str) -> str:
    return (
        f'<svg xmlns="{SVG_NS}" class="plot" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
        f'height="{HEIGHT}" role="img" font-family="sans-serif" font-size="11">'
        f"<title>{escape(title)}</title>{body}</svg>"
    )


def _empty(title: str, message: str) -> str:
    text = f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">{escape(message)}</text>'
    return _svg(title, _frame(title, "", "") + text)


def _frame(title: str, x_label: str, y_label: str) -> str:
    right, bottom = WIDTH - MARGIN_RIGHT, HEIGHT - MARGIN_BOTTOM
    mid_y = (MARGIN_TOP + bottom) / 2
    return (
        f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#fff"/>'
        f'<text x="{MARGIN_LEFT}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>'
        f'<rect x="{MARGIN_LEFT}" y="{MARGIN_TOP}" width="{right - MARGIN_LEFT}" '
        f'height="{bottom - MARGIN_TOP}" fill="none" stroke="#888"/>'
        f'<text x="{(MARGIN_LEFT + right) / 2}" y="{HEIGHT - 10}" text-anchor="middle">'
        f"{escape(x_label)}</text>"
        f'<text x="14" y="{mid_y}" text-anchor="middle" transform="rotate(-90 14 {mid_y})">'
        f"{escape(y_label)}</text>"
    )


def _x_axis(xs: list[float], log2: bool) -> tuple[Axis, list[float]]:
    right = WIDTH - MARGIN_RIGHT
    if log2 and min(xs) > 0:
        low = 2.0 ** math.floor(math.log2(min(xs)))
        high = 2.0 ** math.ceil(math.log2(max(xs)))
        high = high if high > low else low * 2
        ticks = [2.0**k for k in range(int(math.log2(low)), int(math.log2(high)) + 1)]
        return Axis(low, high, MARGIN_LEFT + 8, right - 8, 2.0), ticks
    low, high, ticks = _nice_range(min(xs), max(xs))
    return Axis(low, high, MARGIN_LEFT + 8, right - 8), ticks


def _y_axis(ys: list[float], log10: bool, from_zero: bool) -> tuple[Axis, list[float]]:
    bottom = HEIGHT - MARGIN_BOTTOM
    positive = [y for y in ys if y > 0]
    if log10 and positive:
        low = 10.0 ** math.floor(math.log10(min(positive)))
        high = 10.0 ** math.ceil(math.log10(max(positive)))
        high = high if high > low else low * 10
        ticks = [10.0**k for k in range(round(math.log10(low)), round(math.log10(high)) + 1)]
        return Axis(low, high, bottom, MARGIN_TOP, 10.0), ticks
    low = min(0.0, min(ys)) if from_zero else min(ys)
    low, high, ticks = _nice_range(low, max(ys))
    return Axis(low, high, bottom, MARGIN_TOP), ticks


def _nice_range(low: float, high: float, count: int = 5) -> tuple[float, float, list[float]]:
    """A range covering [low, high] that starts and ends on round ticks (1, 2 or 5 x 10^k)."""
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / count
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    start, end = math.floor(low / step) * step, math.ceil(high / step) * step
    ticks = [start + i * step for i in range(round((end - start) / step) + 1)]
    return start, end, ticks


def _tick_label(value: float) -> str:
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.0e}"
    return f"{value:g}"


def _ticks(x_axis: Axis, x_ticks: list[float], y_axis: Axis, y_ticks: list[float]) -> str:
    bottom = HEIGHT - MARGIN_BOTTOM
    parts = [_y_ticks(y_axis, y_ticks)]
    for tick in x_ticks:
        x = x_axis(tick)
        parts.append(
            f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#888"/>'
            f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{_tick_label(tick)}</text>'
        )
    return "".join(parts)


def _y_ticks(y_axis: Axis, y_ticks: list[float]) -> str:
    right = WIDTH - MARGIN_RIGHT
    parts = []
    for tick in y_ticks:
        y = y_axis(tick)
        parts.append(
            f'<line x1="{MARGIN_LEFT}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#eee"/>'
            f'<text x="{MARGIN_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{_tick_label(tick)}</text>"
        )
    return "".join(parts)


def _ref_line(x_axis: Axis, y_axis: Axis, ref: RefLine) -> str:
    y = y_axis(ref.y)
    return (
        f'<g class="ref-line" data-label={quoteattr(ref.label)}>'
        f'<line x1="{MARGIN_LEFT}" y1="{y:.1f}" x2="{WIDTH - MARGIN_RIGHT}" y2="{y:.1f}" '
        f'stroke="#c00" stroke-width="1.5" stroke-dasharray="2 3"/></g>'
    )


def _series(x_axis: Axis, y_axis: Axis, series: Series) -> str:
    color = PALETTE[series.color % len(PALETTE)]
    points = [(x, y) for x, y in series.points if _finite(x) and _finite(y)]
    coords = " ".join(f"{x_axis(x):.1f},{y_axis(y):.1f}" for x, y in points)
    dash = ' stroke-dasharray="6 4"' if series.dashed else ""
    parts = [
        f'<g class="series" data-series={quoteattr(series.name)}>',
        f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>',
    ]
    for index, (x, y) in enumerate(series.points):
        if not (_finite(x) and _finite(y)):
            continue
        if series.errors is not None and index < len(series.errors):
            parts.append(_error_bar(x_axis(x), y_axis, series.errors[index], color))
        tip = escape(f"{series.name}: x={x:g}, y={y:.4g}")
        parts.append(
            f'<circle cx="{x_axis(x):.1f}" cy="{y_axis(y):.1f}" r="3" fill="{color}">'
            f"<title>{tip}</title></circle>"
        )
    return "".join(parts) + "</g>"


def _error_bar(x: float, y_axis: Axis, bounds: tuple[float, float], color: str) -> str:
    if not (_finite(bounds[0]) and _finite(bounds[1])):
        return ""
    top, bottom = y_axis(bounds[1]), y_axis(bounds[0])
    return (
        f'<path class="error-bar" d="M{x:.1f},{bottom:.1f}V{top:.1f}M{x - 4:.1f},{top:.1f}'
        f'h8M{x - 4:.1f},{bottom:.1f}h8" stroke="{color}" stroke-width="1.2" fill="none"/>'
    )


def _legend(entries: list[tuple[str, int, bool]]) -> str:
    x0 = WIDTH - MARGIN_RIGHT + 14
    parts = ['<g class="legend">']
    for row, (name, color_index, dashed) in enumerate(entries):
        y = MARGIN_TOP + 8 + row * 18
        color = "#c00" if color_index < 0 else PALETTE[color_index % len(PALETTE)]
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        label = name if len(name) <= 28 else name[:27] + "…"
        parts.append(
            f'<line x1="{x0}" y1="{y}" x2="{x0 + 22}" y2="{y}" stroke="{color}" '
            f'stroke-width="2"{dash}/><text x="{x0 + 28}" y="{y + 4}">{escape(label)}</text>'
        )
    return "".join(parts) + "</g>"


def _category_label(x: float, category: str) -> str:
    y = HEIGHT - MARGIN_BOTTOM + 14
    text = escape(category if len(category) <= 12 else category[:11] + "…")
    return (
        f'<text x="{x:.1f}" y="{y}" text-anchor="end" font-size="10" '
        f'transform="rotate(-30 {x:.1f} {y})">{text}</text>'
    )


def _bar(
    x: float, width: float, y_axis: Axis, value: float, group: int, name: str, category: str
) -> str:
    top, base = y_axis(value), y_axis(0.0)
    tip = escape(f"{name} at {category}: {value:g}")
    return (
        f'<rect class="bar" x="{x:.1f}" y="{min(top, base):.1f}" width="{max(width - 1, 1):.1f}" '
        f'height="{abs(base - top):.1f}" fill="{PALETTE[group % len(PALETTE)]}">'
        f"<title>{tip}</title></rect>"
    )
