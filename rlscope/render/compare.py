"""A Comparison in the terminal: per layer, values, deltas with intervals, overlaid sparklines."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rlscope.comparison import (
    CONFIDENCE,
    MIN_WINDOW_POINTS,
    Comparison,
    MetricComparison,
    leading,
)
from rlscope.render.sanitize import safe_text
from rlscope.render.terminal import (
    BLOCKS,
    MIN_SPARK,
    PANEL_CHROME,
    SEVERITY_STYLE,
    format_value,
)
from rlscope.report import PART_HEADINGS, policy_first
from rlscope.spec import LAYERS

SPARK_WIDTH = 20
VERDICT_STYLE = {"better": "green", "worse": "red", "differs": "magenta", "noise": "dim"}
VERDICT_MARK = {"better": "▲ better", "worse": "▼ worse", "differs": "≠ differs", "noise": "≈"}


def aligned_sparklines(
    series: Sequence[tuple[Sequence[float], Sequence[float | None]] | None], width: int
) -> list[str]:
    """One sparkline per (x, values) series on a shared x range and a shared y scale: bucket b
    of every line covers the same stretch of x (steps or progress); empty buckets are blank."""
    points = [
        [(x, v) for x, v in zip(xs, vs, strict=True) if v is not None and math.isfinite(v)]
        if s is not None
        else []
        for s in series
        for xs, vs in [s or ((), ())]
    ]
    flat = [p for line in points for p in line]
    if not flat:
        return ["" for _ in series]
    x_lo, x_hi = min(x for x, _ in flat), max(x for x, _ in flat)
    buckets: list[list[float | None]] = []
    for line in points:
        sums = [0.0] * width
        counts = [0] * width
        for x, v in line:
            b = 0 if x_hi == x_lo else min(width - 1, int((x - x_lo) / (x_hi - x_lo) * width))
            sums[b] += v
            counts[b] += 1
        buckets.append([s / c if c else None for s, c in zip(sums, counts, strict=True)])
    means = [v for line in buckets for v in line if v is not None]
    y_lo, y_hi = min(means), max(means)
    flat_line = y_hi - y_lo <= 1e-12 * max(1.0, abs(y_hi))
    scale = 0.0 if flat_line else (len(BLOCKS) - 1) / (y_hi - y_lo)
    out = []
    for row in buckets:
        chars = [
            " " if v is None else BLOCKS[3] if flat_line else BLOCKS[round((v - y_lo) * scale)]
            for v in row
        ]
        out.append("".join(chars).rstrip() if any(v is not None for v in row) else "")
    return out


def _run_cell(metric: MetricComparison, index: int, curve: str) -> Text:
    """Value and verdict; the delta to the baseline with its interval; the curve."""
    run = metric.runs[index]
    if run is None:
        return Text(safe_text(f"— ({metric.missing[index]})"), style="dim")
    text = Text(format_value(run.value))
    if run.verdict:
        text.append(" " + VERDICT_MARK[run.verdict], style=VERDICT_STYLE[run.verdict])
    elif run.unlike:
        text.append(" not compared", style="dim")
    if index > 0 and run.delta is not None:
        text.append(f"\nΔ {run.delta:+.3g}")
        if run.interval is not None:
            low, high = run.interval
            text.append(f" [{low:+.3g}, {high:+.3g}]")
    text.append("\n" + curve, style="blue")
    return text


def _healthier(metric: MetricComparison) -> Text:
    arrow = {"up": "↑", "down": "↓"}.get(metric.better, "band" if metric.band else "")
    if not arrow:
        return Text("— (no direction)", style="dim")
    if metric.healthiest is None:
        short = "≈ noise" if metric.summary == "within run-to-run noise" else "n/a"
        if metric.summary.startswith("not comparable"):
            short = "other scale"
        return Text(f"{short} {arrow}", style="dim")
    who = "baseline" if metric.healthiest == 0 else f"run {metric.healthiest + 1}"
    return Text(f"{who} {arrow}", style="bold")


def _cell_width(metric: MetricComparison, index: int) -> int:
    return max(len(line) for line in _run_cell(metric, index, "").plain.split("\n"))


def _metrics_panel(
    comparison: Comparison, metrics: Sequence[MetricComparison], title: str, width: int
) -> Panel | None:
    """A table with a column per run; when the metric ids, the cells and the verdicts do not
    fit side by side, each metric is a line (id and which run is healthier) over its cells, so
    that nothing is ever cut."""
    if not metrics:
        return None
    runs = range(len(comparison.reports))
    cells = max(max(SPARK_WIDTH, *(_cell_width(m, i) for m in metrics)) for i in runs)
    id_width = max(len(m.id) for m in metrics)
    verdict_width = max(len(_healthier(m).plain) for m in metrics)
    wide = id_width + len(runs) * (cells + 2) + 2 + verdict_width <= width - PANEL_CHROME
    room = (width - PANEL_CHROME) // len(runs) - 2
    spark = SPARK_WIDTH if wide else max(MIN_SPARK, min(SPARK_WIDTH, room))
    body: list = []
    table = Table(box=None, pad_edge=False, padding=(0, 1), show_lines=False)
    if wide:
        table.add_column("metric", no_wrap=True)
    for i in runs:
        table.add_column("baseline" if i == 0 else f"run {i + 1}", min_width=spark)
    if wide:
        table.add_column("healthier", no_wrap=True)
    part = ""
    for metric in policy_first(metrics):
        if metric.part != part:
            part = metric.part
            heading = Text(PART_HEADINGS[part], style="italic")
            if wide:
                table.add_row(heading)
            else:
                body.append(heading)
        curves = aligned_sparklines(
            [(r.x, r.values) if r is not None else None for r in metric.runs], spark
        )
        row = [_run_cell(metric, i, curves[i]) for i in runs]
        if wide:
            table.add_row(Text(safe_text(metric.id), style="bold"), *row, _healthier(metric))
            continue
        head = Text(safe_text(metric.id), style="bold")
        head.append("  healthier: ").append_text(_healthier(metric))
        body.append(head)
        grid = Table(box=None, pad_edge=False, padding=(0, 1), show_header=False)
        for _ in runs:
            grid.add_column(min_width=spark)
        grid.add_row(*row)
        body.append(grid)
    if wide:
        body = [table]
    else:
        names = "  ".join("baseline" if i == 0 else f"run {i + 1}" for i in runs)
        body.insert(0, Text(f"columns: {names}", style="dim"))
    return Panel(Group(*body), title=title, title_align="left")


def _findings_panel(comparison: Comparison) -> Panel:
    if not comparison.findings:
        return Panel(Text("No findings in any run.", style="green"), title="Findings")
    table = Table(box=None, pad_edge=False, padding=(0, 2))
    table.add_column("finding", no_wrap=True)
    for label in comparison.labels:
        table.add_column(Text(safe_text(label)), no_wrap=True)
    table.add_column("")
    for row in comparison.findings:
        cells = [
            Text(s.upper(), style=SEVERITY_STYLE.get(s, "")) if s else Text("—", style="dim")
            for s in row.severities
        ]
        only = row.only_in
        note = (
            Text(safe_text(f"only {comparison.labels[only]}"), style="bold")
            if only is not None
            else Text("")
        )
        table.add_row(Text(safe_text(f"{row.id} ({row.layer})"), style="bold"), *cells, note)
    return Panel(table, title="Findings", title_align="left")


def verdict_lines(comparison: Comparison) -> list[Text]:
    """Each run against the baseline in one line, first: worse, better, new findings."""
    lines = []
    for verdict in comparison.verdicts():
        style = "bold red" if verdict.regressed else "bold green" if verdict.better else "bold"
        lines.append(Text(safe_text("verdict: " + verdict.line()), style=style))
    return lines


def render_comparison(comparison: Comparison, console: Console) -> None:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for i, (label, report) in enumerate(zip(comparison.labels, comparison.reports, strict=True)):
        run = report.run
        span = f"{run.first_step}–{run.last_step}" if run.first_step is not None else "no steps"
        role = "baseline" if i == 0 else f"run {i + 1}"
        grid.add_row(role, Text(safe_text(f"{label}  {run.path}  steps {span}")))
    grid.add_row("aligned by", "step" if comparison.align == "step" else "fraction of training")
    parts: list = [
        *verdict_lines(comparison),
        Panel(grid, title="rlscope compare", title_align="left"),
    ]
    ordered = leading(comparison.metrics.values())
    task = [m for m in ordered if m.task]
    panels = [_metrics_panel(comparison, task, "Task outcome", console.width)]
    for layer, name in LAYERS.items():
        metrics = [m for m in ordered if m.layer == layer and not m.task]
        panels.append(_metrics_panel(comparison, metrics, f"{layer} {name}", console.width))
    parts.extend(p for p in panels if p is not None)
    parts.append(_findings_panel(comparison))
    parts.append(
        Text(
            f"Δ = value − baseline value (final-window means); [a, b] = {CONFIDENCE:.0%} bootstrap "
            "interval of the difference over each run's final-window steps (last 10%, at least "
            f"{MIN_WINDOW_POINTS}); ▲/▼ only when it excludes 0, by the metric's direction "
            "(task outcomes, error rates) or its distance to a healthy band; ≠ where neither "
            "says; not compared where run.json puts the runs on other scales (the reward's "
            "weights). Curves share each metric's x range and y scale.",
            style="dim",
        )
    )
    console.print(Group(*parts))


def render_comparison_json(comparison: Comparison) -> str:
    return json.dumps(comparison.to_dict(), indent=2, ensure_ascii=True, allow_nan=False)
