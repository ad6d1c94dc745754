"""Small static SVG charts for the HTML report: lines, bands, spans, error bars, one raster.

Written for what the report draws, in ~1 ms a chart (matplotlib took ~45 ms: the report was
three times `analyze`). Every text is escaped; a chart is one `<svg>` with a viewBox, its
plotting area clipped, its legend below the plot (never on the data).
"""

from __future__ import annotations

import base64
import html
import itertools
import math
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

FONT = 10  # px, the chart's text
CHAR = 6.0  # px: a generous average advance of a 10 px sans-serif character
TICK = 4
#: Viridis at nine stops (matplotlib's colormap, sampled), interpolated linearly between.
VIRIDIS = (
    (68, 1, 84),
    (71, 44, 122),
    (59, 81, 139),
    (44, 113, 142),
    (33, 144, 141),
    (39, 173, 129),
    (92, 200, 99),
    (170, 220, 50),
    (253, 231, 37),
)
_ids = itertools.count()


def escape(text: object) -> str:
    """Text for an SVG or HTML text node or attribute (the page's one escaping)."""
    return html.escape(str(text), quote=True)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values (1, 2, 2.5 or 5 × 10^k apart) covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return []
    if high <= low:
        return [low]
    raw = (high - low) / max(count, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(0.0 if abs(value) < step * 1e-9 else value)
        value = first + len(ticks) * step
    return ticks


def tick_label(value: float) -> str:
    """A tick as itself: 0.0008, 1e-06, 250, 1.5e+04 (never an offset or a multiplier)."""
    return f"{value:.3g}"


def viridis(share: float) -> tuple[int, int, int]:
    share = min(max(share, 0.0), 1.0) * (len(VIRIDIS) - 1)
    low = min(int(share), len(VIRIDIS) - 2)
    t = share - low
    a, b = VIRIDIS[low], VIRIDIS[low + 1]
    return tuple(round(x + (y - x) * t) for x, y in zip(a, b, strict=True))  # type: ignore[return-value]


def png(rows: Sequence[Sequence[tuple[int, int, int]]]) -> bytes:
    """An RGB PNG of `rows` (top row first), with nothing but the standard library."""
    height, width = len(rows), len(rows[0])
    raw = b"".join(b"\0" + bytes(c for pixel in row for c in pixel) for row in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


@dataclass
class _Item:
    kind: str  # line, band, span, vline, errorbar, image
    color: str = "#1f77b4"
    label: str | None = None
    xs: Sequence[float] = ()
    ys: Sequence[float] = ()
    extra: dict = field(default_factory=dict)


@dataclass
class Chart:
    """A chart in data coordinates; `svg()` lays it out and writes it."""

    width: int = 500
    height: int = 250
    items: list[_Item] = field(default_factory=list)
    ylim: tuple[float, float] | None = None
    xlim: tuple[float, float] | None = None

    def line(
        self,
        xs: Sequence[float],
        ys: Sequence[float | None],
        color: str,
        *,
        label: str | None = None,
        width: float = 1.4,
        opacity: float = 1.0,
        dash: str | None = None,
        markers: bool = False,
    ) -> None:
        values = [math.nan if y is None else float(y) for y in ys]
        extra = {"width": width, "opacity": opacity, "dash": dash, "markers": markers}
        self.items.append(_Item("line", color, label, list(xs), values, extra))

    def band(self, low: float | None, high: float | None, color: str, label: str) -> None:
        """A horizontal band (None: open to that side of the plot)."""
        self.items.append(_Item("band", color, label, extra={"low": low, "high": high}))

    def span(self, x0: float, x1: float, color: str, label: str | None) -> None:
        self.items.append(_Item("span", color, label, xs=[x0, x1]))

    def vline(self, x: float, color: str, label: str | None) -> None:
        self.items.append(_Item("vline", color, label, xs=[x]))

    def errorbar(
        self,
        xs: Sequence[float],
        ys: Sequence[float],
        lows: Sequence[float],
        highs: Sequence[float],
        color: str,
        label: str | None = None,
    ) -> None:
        extra = {"lows": list(lows), "highs": list(highs)}
        self.items.append(_Item("errorbar", color, label, list(xs), list(ys), extra))

    def image(
        self,
        grid: Sequence[Sequence[float]],
        extent: tuple[float, float, float, float],
        vmax: float,
        label: str,
    ) -> None:
        """A heatmap: grid[row][column], row 0 at the bottom, over extent (x0, x1, y0, y1), on
        viridis from 0 to `vmax`, with a colour bar labelled `label`."""
        extra = {"grid": grid, "extent": extent, "vmax": vmax, "bar": label}
        self.items.append(_Item("image", label=None, extra=extra))

    # -- layout ---------------------------------------------------------------------------

    def _ranges(self) -> tuple[float, float, float, float]:
        xs: list[float] = []
        ys: list[float] = []
        for item in self.items:
            if item.kind in ("line", "errorbar"):
                xs += [x for x in item.xs if math.isfinite(x)]
                points = [y for y in item.ys if math.isfinite(y)]
                if item.kind == "errorbar":
                    points += [y - d for y, d in zip(item.ys, item.extra["lows"], strict=True)]
                    points += [y + d for y, d in zip(item.ys, item.extra["highs"], strict=True)]
                ys += points
            elif item.kind in ("span", "vline"):
                xs += [x for x in item.xs if math.isfinite(x)]
            elif item.kind == "image":
                x0, x1, y0, y1 = item.extra["extent"]
                xs += [x0, x1]
                ys += [y0, y1]
        x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
        if self.xlim is not None:
            x0, x1 = self.xlim
        if self.ylim is not None:
            y0, y1 = self.ylim
        else:
            if y1 - y0 <= 1e-9 * max(abs(y0), abs(y1)):  # flat: ±10% of its own size
                pad = abs(y1) * 0.1 if y1 != 0 else 0.05
                y0, y1 = y0 - pad, y1 + pad
            else:
                pad = (y1 - y0) * 0.06
                y0, y1 = y0 - pad, y1 + pad
        if x1 <= x0:
            x0, x1 = x0 - 0.5, x1 + 0.5
        return x0, x1, y0, y1

    def svg(self, xlabel: str, ylabel: str, *, legend: bool = True) -> str:
        x0, x1, y0, y1 = self._ranges()
        xticks = nice_ticks(x0, x1, 6)
        yticks = nice_ticks(y0, y1, 5)
        ylines = _wrap(ylabel, 34)[:2]
        ytick_width = max((len(tick_label(t)) for t in yticks), default=1) * CHAR
        left = 8 + FONT * 1.3 * len(ylines) + ytick_width + TICK + 4
        image = next((i for i in self.items if i.kind == "image"), None)
        right = 70.0 if image is not None else 12.0
        entries = [i for i in self.items if i.label] if legend else []
        widest = max((len(i.label or "") for i in entries), default=0) * CHAR + 26
        columns = max(1, min(3, len(entries), int((self.width - 16) // max(widest, 1))))
        rows = -(-len(entries) // columns) if entries else 0
        top, bottom = 10.0, 8 + FONT + TICK + 4 + FONT * 1.4 + rows * 15
        height = self.height + rows * 15
        plot_w, plot_h = self.width - left - right, height - top - bottom

        def px(x: float) -> float:
            return left + (x - x0) / (x1 - x0) * plot_w

        def py(y: float) -> float:
            return top + (y1 - y) / (y1 - y0) * plot_h

        clip = f"c{next(_ids)}"
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {self.width} {height:.0f}" '
            f'font-family="system-ui,-apple-system,Segoe UI,Roboto,sans-serif" '
            f'font-size="{FONT}">',
            f'<defs><clipPath id="{clip}"><rect x="{left:.1f}" y="{top:.1f}" '
            f'width="{plot_w:.1f}" height="{plot_h:.1f}"/></clipPath></defs>',
            f'<rect class="plot-area" x="{left:.1f}" y="{top:.1f}" width="{plot_w:.1f}" '
            f'height="{plot_h:.1f}" fill="#fff"/>',
        ]
        for t in yticks:  # grid
            out.append(
                f'<line x1="{left:.1f}" x2="{left + plot_w:.1f}" y1="{py(t):.1f}" '
                f'y2="{py(t):.1f}" stroke="#e6e6e6" stroke-width="0.6"/>'
            )
        for t in xticks:
            out.append(
                f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{top:.1f}" '
                f'y2="{top + plot_h:.1f}" stroke="#e6e6e6" stroke-width="0.6"/>'
            )
        body: list[str] = []
        for item in self.items:
            body += self._draw(item, px, py, (y0, y1), (left, top, plot_w, plot_h))
        out.append(f'<g clip-path="url(#{clip})">' + "".join(body) + "</g>")
        base = top + plot_h
        out.append(
            f'<path d="M{left:.1f},{top:.1f} V{base:.1f} H{left + plot_w:.1f}" fill="none" '
            'stroke="#444" stroke-width="0.8"/>'
        )
        for t in xticks:
            out.append(
                f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{base:.1f}" '
                f'y2="{base + TICK:.1f}" stroke="#444"/>'
                f'<text x="{px(t):.1f}" y="{base + TICK + FONT:.1f}" text-anchor="middle" '
                f'fill="#333">{escape(tick_label(t))}</text>'
            )
        for t in yticks:
            out.append(
                f'<line x1="{left - TICK:.1f}" x2="{left:.1f}" y1="{py(t):.1f}" '
                f'y2="{py(t):.1f}" stroke="#444"/>'
                f'<text x="{left - TICK - 2:.1f}" y="{py(t) + FONT * 0.35:.1f}" '
                f'text-anchor="end" fill="#333">{escape(tick_label(t))}</text>'
            )
        label_y = base + TICK + FONT + 4 + FONT
        out.append(
            f'<text x="{left + plot_w / 2:.1f}" y="{label_y:.1f}" text-anchor="middle" '
            f'fill="#222">{escape(xlabel)}</text>'
        )
        for n, line in enumerate(ylines):
            x = 8 + FONT + n * FONT * 1.3
            out.append(
                f'<text transform="translate({x:.1f},{top + plot_h / 2:.1f}) rotate(-90)" '
                f'text-anchor="middle" fill="#222">{escape(line)}</text>'
            )
        if image is not None:
            out += self._colorbar(image, left + plot_w + 10, top, plot_h)
        if entries:
            out.append('<g class="legend">')
            cell = (self.width - 16) / columns
            for n, item in enumerate(entries):
                row, col = divmod(n, columns)
                x = 8 + col * cell
                y = label_y + 10 + row * 15
                out.append(
                    _swatch(item, x, y) + f'<text x="{x + 24:.1f}" y="{y + 4:.1f}" '
                    f'fill="#333">{escape(item.label)}</text>'
                )
            out.append("</g>")
        out.append("</svg>")
        return "".join(out)

    def _draw(
        self,
        item: _Item,
        px: Callable[[float], float],
        py: Callable[[float], float],
        yrange: tuple[float, float],
        area: tuple[float, float, float, float],
    ) -> list[str]:
        y0, y1 = yrange
        left, top, plot_w, plot_h = area
        if item.kind == "band":
            low = item.extra["low"]
            high = item.extra["high"]
            a = py(min(max(high, y0), y1)) if high is not None else top
            b = py(min(max(low, y0), y1)) if low is not None else top + plot_h
            return [
                f'<rect x="{left:.1f}" y="{a:.1f}" width="{plot_w:.1f}" '
                f'height="{max(b - a, 0):.1f}" fill="{item.color}" fill-opacity="0.09"/>'
            ]
        if item.kind == "span":
            a, b = px(item.xs[0]), px(item.xs[1])
            return [
                f'<rect x="{a:.1f}" y="{top:.1f}" width="{max(b - a, 1):.1f}" '
                f'height="{plot_h:.1f}" fill="{item.color}" fill-opacity="0.14"/>'
            ]
        if item.kind == "vline":
            x = px(item.xs[0])
            return [
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top:.1f}" y2="{top + plot_h:.1f}" '
                f'stroke="{item.color}" stroke-width="1" stroke-dasharray="4,3"/>'
            ]
        if item.kind == "line":
            out = []
            dash = f' stroke-dasharray="{item.extra["dash"]}"' if item.extra["dash"] else ""
            for segment in _segments(item.xs, item.ys):
                points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in segment)
                out.append(
                    f'<polyline points="{points}" fill="none" stroke="{item.color}" '
                    f'stroke-width="{item.extra["width"]}" stroke-opacity="{item.extra["opacity"]}"'
                    f' stroke-linejoin="round"{dash}/>'
                )
                if item.extra["markers"]:
                    out += [
                        f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.2" fill="{item.color}"/>'
                        for x, y in segment
                    ]
            return out
        if item.kind == "errorbar":
            out = []
            for x, y, lo, hi in zip(
                item.xs, item.ys, item.extra["lows"], item.extra["highs"], strict=True
            ):
                cx = px(x)
                out.append(
                    f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{py(y - lo):.1f}" '
                    f'y2="{py(y + hi):.1f}" stroke="{item.color}" stroke-width="1"/>'
                    f'<line x1="{cx - 2.5:.1f}" x2="{cx + 2.5:.1f}" y1="{py(y - lo):.1f}" '
                    f'y2="{py(y - lo):.1f}" stroke="{item.color}"/>'
                    f'<line x1="{cx - 2.5:.1f}" x2="{cx + 2.5:.1f}" y1="{py(y + hi):.1f}" '
                    f'y2="{py(y + hi):.1f}" stroke="{item.color}"/>'
                )
            return out + self._draw(
                _Item(
                    "line",
                    item.color,
                    None,
                    item.xs,
                    item.ys,
                    {"width": 1.2, "opacity": 1.0, "dash": None, "markers": True},
                ),
                px,
                py,
                yrange,
                area,
            )
        if item.kind == "image":
            grid = item.extra["grid"]
            vmax = item.extra["vmax"] or 1.0
            rows = [[viridis(v / vmax) for v in row] for row in reversed(grid)]  # top row first
            data = base64.b64encode(png(rows)).decode()
            ex0, ex1, ey0, ey1 = item.extra["extent"]
            a, b = px(ex0), px(ex1)
            c, d = py(ey1), py(ey0)
            return [
                f'<image x="{a:.1f}" y="{c:.1f}" width="{b - a:.1f}" height="{d - c:.1f}" '
                f'preserveAspectRatio="none" style="image-rendering:pixelated" '
                f'href="data:image/png;base64,{data}"/>'
            ]
        return []

    def _colorbar(self, item: _Item, x: float, top: float, height: float) -> list[str]:
        steps = 32
        rows = [[viridis(1 - i / (steps - 1))] for i in range(steps)]
        data = base64.b64encode(png(rows)).decode()
        vmax = item.extra["vmax"] or 1.0
        out = [
            f'<image x="{x:.1f}" y="{top:.1f}" width="10" height="{height:.1f}" '
            f'preserveAspectRatio="none" href="data:image/png;base64,{data}"/>'
        ]
        for t in nice_ticks(0.0, vmax, 4):
            y = top + height * (1 - t / vmax)
            out.append(
                f'<text x="{x + 13:.1f}" y="{y + FONT * 0.35:.1f}" font-size="{FONT - 1}" '
                f'fill="#333">{escape(tick_label(t))}</text>'
            )
        out.append(
            f'<text transform="translate({x + 50:.1f},{top + height / 2:.1f}) rotate(-90)" '
            f'text-anchor="middle" font-size="{FONT - 1}" fill="#222">'
            f"{escape(item.extra['bar'])}</text>"
        )
        return out


def _swatch(item: _Item, x: float, y: float) -> str:
    if item.kind in ("band", "span"):
        opacity = 0.35 if item.kind == "span" else 0.25
        return (
            f'<rect x="{x:.1f}" y="{y - 4:.1f}" width="18" height="8" fill="{item.color}" '
            f'fill-opacity="{opacity}"/>'
        )
    dash = (
        ' stroke-dasharray="4,3"'
        if item.kind == "vline"
        else (f' stroke-dasharray="{item.extra["dash"]}"' if item.extra.get("dash") else "")
    )
    return (
        f'<line x1="{x:.1f}" x2="{x + 18:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="{item.color}" '
        f'stroke-width="1.6"{dash}/>'
    )


def _segments(xs: Sequence[float], ys: Sequence[float]) -> list[list[tuple[float, float]]]:
    """The runs of finite points (a gap where a value is missing)."""
    out: list[list[tuple[float, float]]] = [[]]
    for x, y in zip(xs, ys, strict=True):
        if math.isfinite(x) and math.isfinite(y):
            out[-1].append((x, y))
        elif out[-1]:
            out.append([])
    return [s for s in out if s]


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    lines = textwrap.wrap(text, width) or [""]
    if len(lines) > 2:
        lines = [lines[0], textwrap.shorten(" ".join(lines[1:]), width, placeholder="…")]
    return lines
