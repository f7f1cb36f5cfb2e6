"""Charts as self-contained SVG, for the HTML report: grouped bars and lines, with axes, labels and a legend.
Plain text, no plotting library: each chart is one string, embedded in the report as a data URI."""

from __future__ import annotations

import math
from html import escape

WIDTH, HEIGHT = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 36, 56
COLOURS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2")


def nice_top(value: float) -> float:
    """The y axis' top: the first of 1, 2, 2.5, 5 times a power of ten at or above the value."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(step * power for step in (1, 2, 2.5, 5, 10) if step * power >= value)


def _frame(title: str, y_label: str, y_max: float, legend: list[str]) -> list[str]:
    """The SVG's opening, title, y axis with 5 ticks, and the legend."""
    plot_height = HEIGHT - TOP - BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
        'font-size="11">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="13">{escape(title)}</text>',
        f'<text x="14" y="{TOP + plot_height / 2}" transform="rotate(-90 14 {TOP + plot_height / 2})" '
        f'text-anchor="middle">{escape(y_label)}</text>',
    ]
    for tick in range(6):
        value = y_max * tick / 5
        y = TOP + plot_height * (1 - tick / 5)
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y}" y2="{y}" stroke="#ddd"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4}" text-anchor="end">{value:.3g}</text>')
    x = LEFT
    for index, name in enumerate(legend):
        parts.append(f'<rect x="{x}" y="{HEIGHT - 16}" width="10" height="10" fill="{COLOURS[index % 6]}"/>')
        parts.append(f'<text x="{x + 14}" y="{HEIGHT - 7}">{escape(name)}</text>')
        x += 30 + 7 * len(name)  # about 7 px a character at 11 px
    return parts


def bar_chart(
    title: str, categories: list[str], series: dict[str, list[float]], y_label: str, y_max: float | None = None
) -> str:
    """Grouped bars: one group per category, one bar per series (`y_max`: the axis' top, else fitted)."""
    y_max = y_max or nice_top(max(value for values in series.values() for value in values))
    parts = _frame(title, y_label, y_max, list(series))
    plot_width, plot_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    group = plot_width / max(len(categories), 1)
    bar = group * 0.8 / max(len(series), 1)
    for c, category in enumerate(categories):
        x0 = LEFT + c * group + group * 0.1
        for s, values in enumerate(series.values()):
            height = plot_height * values[c] / y_max
            x, y = x0 + s * bar, TOP + plot_height - height
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{height:.1f}" fill="{COLOURS[s % 6]}"/>'
            )
        parts.append(
            f'<text x="{x0 + group * 0.4:.1f}" y="{TOP + plot_height + 16}" text-anchor="middle">'
            f"{escape(category)}</text>"
        )
    return "\n".join([*parts, "</svg>"])


def line_chart(title: str, xs: list[float], series: dict[str, list[float]], x_label: str, y_label: str) -> str:
    """Lines with a marker per point, x on a linear axis."""
    y_max = nice_top(max(value for values in series.values() for value in values))
    parts = _frame(title, y_label, y_max, list(series))
    plot_width, plot_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    x_min, x_max = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1

    def at(x: float, y: float) -> tuple[float, float]:
        return LEFT + plot_width * (x - x_min) / (x_max - x_min), TOP + plot_height * (1 - y / y_max)

    for s, values in enumerate(series.values()):
        points = [at(x, y) for x, y in zip(xs, values, strict=True)]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{COLOURS[s % 6]}" stroke-width="2"/>')
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{COLOURS[s % 6]}"/>' for x, y in points]
    for x in xs:
        px, _ = at(x, 0)
        parts.append(f'<text x="{px:.1f}" y="{TOP + plot_height + 16}" text-anchor="middle">{x:,.0f}</text>')
    parts.append(f'<text x="{LEFT + plot_width / 2}" y="{HEIGHT - 24}" text-anchor="middle">{escape(x_label)}</text>')
    return "\n".join([*parts, "</svg>"])
