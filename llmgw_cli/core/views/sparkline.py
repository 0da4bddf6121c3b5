"""Small inline charts for server-rendered pages (pure): a series of numbers as an SVG
line with the area under it, no script, a fixed size.

The result is markup (``markupsafe.Markup``), so a jinja2 template with autoescape puts
it in as it is; everything in it that is not a number is escaped here, the label first:
it names a model, and every value that reaches a page is treated as hostile. A number
that is not finite or is below zero is drawn as zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from markupsafe import Markup

WIDTH = 120
HEIGHT = 28
PAD = 2  # keeps the line's stroke inside the box at the top and bottom
COLOR = "#3b6fd4"


def _clean(v: float) -> float:
    return v if math.isfinite(v) and v > 0 else 0.0


def points(values: Sequence[float], width: int = WIDTH, height: int = HEIGHT) -> list[tuple[float, float]]:
    """Where each value is drawn: x from 0 to ``width`` in equal steps (one value: the
    middle), y from the baseline (``height - PAD``: zero) up to ``PAD`` (the largest)."""
    clean = [_clean(v) for v in values]
    top = max(clean, default=0.0)
    base, span = height - PAD, height - 2 * PAD
    step = width / (len(clean) - 1) if len(clean) > 1 else 0.0
    return [
        (width / 2 if len(clean) == 1 else i * step, base - (v / top * span if top else 0.0))
        for i, v in enumerate(clean)
    ]


def _number(v: float) -> str:
    return f"{v:.1f}".removesuffix(".0")


def _amount(v: float) -> str:
    return f"{int(v)}" if v == int(v) else f"{v:.3g}"


def sparkline(values: Sequence[float], label: str, width: int = WIDTH, height: int = HEIGHT) -> Markup:
    """``values`` (oldest first) as an ``<svg>`` of ``width`` x ``height`` pixels, its
    ``<title>`` (what a screen reader says, and the tooltip) ``label`` and the largest
    value: ``"chat: requests per minute; max 12"``, or ``"...; no data"`` for none."""
    drawn = points(values, width, height)
    top = max((_clean(v) for v in values), default=0.0)
    title = f"{label}; max {_amount(top)}" if values else f"{label}; no data"
    base = _number(height - PAD)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="spark" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">',
        f"<title>{escape(title, quote=True)}</title>",
        f'<line x1="0" y1="{base}" x2="{width}" y2="{base}" stroke="#c7ccd1" stroke-width="1"/>',
    ]
    if drawn:
        line = " ".join(f"{_number(x)},{_number(y)}" for x, y in drawn)
        first, last = _number(drawn[0][0]), _number(drawn[-1][0])
        parts += [
            f'<polygon points="{first},{base} {line} {last},{base}" fill="{COLOR}" fill-opacity="0.15"/>',
            f'<polyline points="{line}" fill="none" stroke="{COLOR}" stroke-width="1.5" '
            'stroke-linejoin="round"/>',
        ]
    parts.append("</svg>")
    return Markup("".join(parts))
