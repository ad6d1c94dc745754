"""The report's SVG chart writer: ticks, gaps, escaping, the heatmap PNG, against direct checks."""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from xml.etree import ElementTree

import pytest

from rlscope.render.svg import VIRIDIS, Chart, nice_ticks, png, tick_label, viridis


@pytest.mark.parametrize(
    ("low", "high"),
    [(-0.2, 3.9), (0.0, 1.0), (1e-5, 8e-5), (1.0, 200.0), (-0.1, 0.15), (3, 3.0001)],
)
def test_ticks_are_round_evenly_spaced_and_inside(low: float, high: float) -> None:
    ticks = nice_ticks(low, high, 5)
    assert 2 <= len(ticks) <= 11
    steps = {round(b - a, 12) for a, b in itertools.pairwise(ticks)}
    assert len({f"{s:.6g}" for s in steps}) == 1
    step = next(iter(steps))
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5, 10))
    assert all(low - step * 1e-6 <= t <= high + step * 1e-6 for t in ticks)


def test_tick_labels_read_as_themselves() -> None:
    assert [tick_label(v) for v in (8e-05, 0.6000000000000001, 250.0, 0.0)] == [
        "8e-05",
        "0.6",
        "250",
        "0",
    ]


def test_png_decodes_to_the_pixels_given() -> None:
    rows = [[(255, 0, 0), (0, 255, 0)], [(0, 0, 255), (7, 8, 9)]]
    data = png(rows)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (2, 2)
    length = struct.unpack(">I", data[33:37])[0]
    assert data[37:41] == b"IDAT"
    raw = zlib.decompress(data[41 : 41 + length])
    assert raw == b"\0" + bytes([255, 0, 0, 0, 255, 0]) + b"\0" + bytes([0, 0, 255, 7, 8, 9])


def test_viridis_runs_from_its_first_to_its_last_stop() -> None:
    assert viridis(0.0) == VIRIDIS[0] and viridis(1.0) == VIRIDIS[-1]
    assert viridis(-3) == VIRIDIS[0] and viridis(7) == VIRIDIS[-1]
    assert viridis(0.5) == VIRIDIS[4]


def test_a_chart_is_well_formed_escaped_svg_with_gaps_where_values_are_missing() -> None:
    chart = Chart()
    hostile = "</svg><script>alert(1)</script>&"
    chart.band(0.2, None, "#2e7d32", "healthy band")
    chart.line([0, 1, 2, 3, 4], [0.1, None, 0.3, float("nan"), 0.5], "#1f77b4", label=hostile)
    chart.span(1, 3, "#c62828", "finding")
    chart.vline(2, "#ef6c00", "spike")
    text = chart.svg("step", hostile)
    root = ElementTree.fromstring(text)  # well-formed: the label is text, not markup
    assert "<script" not in text and "&lt;/svg&gt;&lt;script&gt;" in text
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert [len(e.get("points", "").split()) for e in lines] == [1, 1, 1]  # three runs of one
    legend = [e for e in root.iter() if e.get("class") == "legend"]
    assert len(legend) == 1
    assert {t.text for t in legend[0].iter() if t.tag.endswith("text")} == {
        "healthy band",
        hostile,
        "finding",
        "spike",
    }


def test_a_flat_series_is_drawn_at_its_own_scale() -> None:
    """A constant learning rate of 1e-6 reads as 1e-6, not as 0 on a ±0.1 axis."""
    chart = Chart()
    chart.line([0, 1, 2], [1e-6, 1e-6, 1e-6], "#1f77b4")
    labels = [e.text for e in ElementTree.fromstring(chart.svg("step", "lr")).iter()]
    ticks = [float(t) for t in labels if t and t[0].isdigit() and "e-" in t]
    assert ticks and min(ticks) >= 0.85e-6 and max(ticks) <= 1.15e-6
