"""The HTML report: one self-contained file of inline SVG charts, no script at all.

Charts are written by rlscope.render.svg (no plotting library): every text in them is escaped
like the page's own (html.escape), so untrusted run ids, paths and prompt ids quoted in finding
messages stay text. A Content-Security-Policy forbids scripts and every network fetch, so
nothing from the data can run or call home.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlscope._version import __version__
from rlscope.comparison import Comparison, compare_reports, leading, run_labels
from rlscope.config import Config
from rlscope.errors import RlscopeError
from rlscope.plots import PlotData, plot_data
from rlscope.render.sanitize import safe_text
from rlscope.render.svg import Chart
from rlscope.render.svg import escape as _e
from rlscope.render.terminal import format_value, summary_line
from rlscope.report import PART_HEADINGS, MetricResult, Report, policy_first, run_provenance
from rlscope.spec import LAYERS, Finding
from rlscope.store import is_url
from rlscope.tokenscan import Mapper

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
SEVERITY_COLORS = {"critical": "#c62828", "warn": "#ef6c00", "info": "#0277bd"}
BAND_COLOR = "#2e7d32"
LOGGED_COLOR = "#616161"
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; font-src data:; "
    "script-src 'none'; base-uri 'none'; form-action 'none'"
)
_LABEL_MAX = 40
#: Chart sizes in SVG px (the page scales them to their box): a layer's grid, a finding card.
SMALL = (500, 250)
LARGE = (720, 270)


def _label(text: object) -> str:
    """Untrusted text for a chart label: controls made visible, shortened."""
    value = safe_text(text)
    return value if len(value) <= _LABEL_MAX else value[: _LABEL_MAX - 1] + "…"


def _x(report: Report, steps: Sequence[int | float], align: str) -> list[float]:
    if align == "step":
        return [float(s) for s in steps]
    first, last = report.run.first_step, report.run.last_step
    if first is None or last is None or last == first:
        return [0.0 for _ in steps]
    return [(s - first) / (last - first) for s in steps]


def _xlabel(align: str) -> str:
    return "step" if align == "step" else "fraction of training"


def _ylabel(metric: MetricResult) -> str:
    """The metric's title and its unit (the chart wraps it beside the axis)."""
    return f"{metric.title} (share)" if metric.unit == "share" else metric.title


def smoothing_window(n: int, smooth: int | None) -> int:
    """The rolling-mean window for a series of `n` steps: `smooth` when given (0 or 1: none),
    else ~5% of the steps (odd, at least 3), none for fewer than 12 steps."""
    if smooth is not None:
        return max(smooth, 1)
    return 1 if n < 12 else max(3, round(n / 20)) | 1


def rolling_mean(values: Sequence[float | None], window: int) -> list[float]:
    """Centred rolling mean over the defined values (the window shrinks at the ends); NaN
    where a window holds no value."""
    import numpy as np

    y = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    if window <= 1:
        return [float(v) for v in y]
    defined = np.isfinite(y)
    sums = np.concatenate([[0.0], np.cumsum(np.where(defined, y, 0.0))])
    counts = np.concatenate([[0], np.cumsum(defined)])
    index = np.arange(len(y))
    a = np.maximum(index - window // 2, 0)
    b = np.minimum(index + window // 2 + 1, len(y))
    n = counts[b] - counts[a]
    means = np.divide(sums[b] - sums[a], n, out=np.full(len(y), np.nan), where=n > 0)
    return [float(v) for v in means]


def _series(
    chart: Chart,
    xs: Sequence[float],
    values: Sequence[float | None],
    color: str,
    label: str | None,
    smooth: int | None,
    dash: str | None = None,
) -> None:
    """The raw series, faint under its rolling mean when there is one (`label` None: no legend
    entry)."""
    window = smoothing_window(len(values), smooth)
    if window <= 1:
        chart.line(xs, values, color, label=label, dash=dash)
        return
    chart.line(xs, values, color, width=0.8, opacity=0.3, dash=dash)
    chart.line(xs, rolling_mean(values, window), color, label=label, dash=dash)


def _mark_findings(chart: Chart, report: Report, metric_id: str, align: str) -> None:
    """Each finding naming the metric: its window shaded (or its steps marked) in its colour."""
    for finding in report.findings:
        if not finding.names(metric_id) or not finding.steps:
            continue
        color = SEVERITY_COLORS.get(finding.severity, "#555")
        label = _label(f"{finding.id} ({finding.severity})")
        if finding.began is not None and not finding.caused_by:
            (began,) = _x(report, [finding.began], align)
            chart.vline(began, "#222", _label(f"{finding.id} began (step {finding.began})"))
        if finding.marks == "window" and len(set(finding.steps)) > 1:
            first, last = _x(report, [min(finding.steps), max(finding.steps)], align)
            chart.span(first, last, color, label)
            continue
        for n, x in enumerate(_x(report, sorted(set(finding.steps)), align)):
            chart.vline(x, color, None if n else label)


def _metric_chart(
    metric_id: str,
    reports: Sequence[Report],
    labels: Sequence[str],
    align: str,
    smooth: int | None,
    *,
    size: tuple[int, int] = SMALL,
) -> str:
    chart = Chart(*size)
    first = next(r.metrics[metric_id] for r in reports if metric_id in r.metrics)
    band = first.band
    if band is not None:
        chart.band(band[0], band[1], BAND_COLOR, "healthy band")
    lows, highs = [], []
    for i, report in enumerate(reports):
        metric = report.metrics.get(metric_id)
        if metric is None:
            continue
        xs = _x(report, metric.steps, align)
        name = _label(labels[i]) if len(reports) > 1 else None  # one run: the swatch says
        _series(chart, xs, metric.values, COLORS[i % len(COLORS)], name, smooth)
        defined = [v for v in metric.values if v is not None]
        if defined:
            lows.append(min(defined))
            highs.append(max(defined))
        if metric.logged is not None and len(reports) == 1:
            _series(
                chart,
                _x(report, metric.logged.steps, align),
                metric.logged.values,
                LOGGED_COLOR,
                _label(f"trainer's logged {metric.logged.column}"),
                smooth,
                dash="2,2",
            )
        _mark_findings(chart, report, metric_id, align)
    if lows and first.unit == "share":  # a share never leaves [0, 1]: no axis below 0
        span = max(highs) - min(lows)
        pad = span * 0.08 if span > 0 else 0.05
        chart.ylim = (max(min(lows) - pad, -0.02), min(max(highs) + pad, 1.02))
    return chart.svg(_xlabel(align), _ylabel(first))


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (honest for the thin bins at the length tail)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _length_charts(
    reports: Sequence[Report],
    data: Sequence[PlotData],
    labels: Sequence[str],
    align: str,
    smooth: int | None,
) -> list[tuple[str, str]]:
    out = []
    if any(d.length is not None for d in data):
        chart = Chart(*SMALL, ylim=(-0.02, 1.02))
        for i, d in enumerate(data):
            if d.length is None:
                continue
            mids, accs, lows, highs = [], [], [], []
            for (a, b), n, acc in zip(
                itertools.pairwise(d.length.edges), d.length.counts, d.length.accuracy, strict=True
            ):
                if not n or acc is None:
                    continue
                low, high = wilson(acc * n, n)
                mids.append((a + b) / 2)
                accs.append(acc)
                lows.append(max(0.0, acc - low))
                highs.append(max(0.0, high - acc))
            name = _label(labels[i]) if len(data) > 1 else None
            chart.errorbar(mids, accs, lows, highs, COLORS[i % len(COLORS)], name)
        out.append(
            (
                "Accuracy by response length (train rollouts, equal-width bins; bars: 95% "
                "interval, wide where a bin holds few rollouts)",
                chart.svg("response length (tokens, bin centre)", "accuracy"),
            )
        )
    pairs = ("behavior.response_len_correct", "behavior.response_len_incorrect")
    if any(m in r.metrics for r in reports for m in pairs):
        chart = Chart(*SMALL)
        for i, report in enumerate(reports):
            for metric_id, dash, word in zip(
                pairs, (None, "5,3"), ("correct", "incorrect"), strict=True
            ):
                metric = report.metrics.get(metric_id)
                if metric is None:
                    continue
                name = f"{labels[i]} {word}" if len(reports) > 1 else word
                xs = _x(report, metric.steps, align)
                _series(
                    chart, xs, metric.values, COLORS[i % len(COLORS)], _label(name), smooth, dash
                )
        out.append(
            (
                "Length of correct (solid) vs incorrect (dashed) responses",
                chart.svg(_xlabel(align), "mean length (tokens)"),
            )
        )
    return out


def _sigma_charts(data: Sequence[PlotData]) -> list[str]:
    """One heatmap per run on one colour scale (one σ range too when the runs' rewards are on
    one scale: one reward outlier of 25 would squash a 0/1 run into a strip)."""
    found = [d.sigma for d in data if d.sigma is not None]
    if not found:
        return []
    grids = []
    for sigma in found:  # shares of groups: grid[bin][step]
        totals = [sum(row) for row in sigma.counts]
        grids.append(
            [
                [row[b] / t if t else 0.0 for row, t in zip(sigma.counts, totals, strict=True)]
                for b in range(len(sigma.edges) - 1)
            ]
        )
    top = max(max(max(row) for row in g) for g in grids) or 1.0
    tops = [sigma.edges[-1] for sigma in found]
    shared = max(tops) if max(tops) <= 2 * min(tops) else None
    out = []
    for sigma, grid in zip(found, grids, strict=True):
        steps = list(sigma.steps)
        chart = Chart(*SMALL)
        chart.image(
            grid, (steps[0], steps[-1] + 1, sigma.edges[0], sigma.edges[-1]), top, "share of groups"
        )
        chart.xlim = (steps[0], steps[-1] + 1)
        chart.ylim = (0.0, shared if shared is not None else sigma.edges[-1])
        out.append(chart.svg("step", "σ_G (reward std in a group)", legend=False))
    return out


def _pass_chart(data: Sequence[PlotData], labels: Sequence[str]) -> str | None:
    if all(d.pass_k is None for d in data):
        return None
    chart = Chart(*SMALL)
    for i, d in enumerate(data):
        if d.pass_k is None:
            continue
        curve = d.pass_k
        prefix = f"{labels[i]} " if len(data) > 1 else ""
        for values, dash, (a, b) in (
            (curve.early, "5,3", curve.early_steps),
            (curve.final, None, curve.final_steps),
        ):
            chart.line(
                [float(k) for k in curve.ks],
                values,
                COLORS[i % len(COLORS)],
                label=_label(f"{prefix}steps {a}–{b}"),
                dash=dash,
                markers=True,
            )
    return chart.svg("k (samples per prompt)", "pass@k")


def _reward_chart(
    reports: Sequence[Report], labels: Sequence[str], align: str, smooth: int | None
) -> str | None:
    """Each reward function's mean (signal.reward.<name>): the curves TRL and W&B users look at
    first (a format reward saturating while accuracy stalls is visible here)."""
    terms = [
        (i, m)
        for i, r in enumerate(reports)
        for m in r.metrics.values()
        if m.id.startswith("signal.reward.")
    ]
    if not terms:
        return None
    chart = Chart(*SMALL)
    names = list(dict.fromkeys(m.id.removeprefix("signal.reward.") for _, m in terms))
    dashes = [None, "5,3", "2,2", "6,2,2,2"]
    for i, metric in terms:
        name = metric.id.removeprefix("signal.reward.")
        who = f"{labels[i]} " if len(reports) > 1 else ""
        color = COLORS[(names.index(name) if len(reports) == 1 else i) % len(COLORS)]
        dash = dashes[names.index(name) % len(dashes)] if len(reports) > 1 else None
        xs = _x(reports[i], metric.steps, align)
        _series(chart, xs, metric.values, color, _label(f"{who}{name}"), smooth, dash)
    return chart.svg(_xlabel(align), "mean reward of the function")


def _early_answer_chart(reports: Sequence[Report], labels: Sequence[str]) -> str | None:
    """Lanham et al.'s figure: the share of answers unchanged against the share of the chain
    kept, a line per probed step (reasoning.early_answer_aoc's `curves_by_step`)."""
    found = [
        (i, curve)
        for i, r in enumerate(reports)
        if (m := r.metrics.get("reasoning.early_answer_aoc")) is not None
        for curve in m.extra.get("curves_by_step") or ()
    ]
    if not found:
        return None
    chart = Chart(*SMALL)
    dashes = [None, "5,3", "2,2", "6,2,2,2"]
    for n, (i, curve) in enumerate(found):
        prefix = f"{labels[i]} " if len(reports) > 1 else ""
        chart.line(
            [float(x) for x in curve["fraction"]],
            [float(y) for y in curve["unchanged"]],
            COLORS[n % len(COLORS)],
            label=_label(f"{prefix}step {curve['step']}"),
            dash=dashes[i % len(dashes)],
            markers=True,
        )
    return chart.svg("share of the chain of thought kept", "answers unchanged")


def _entropy_chart(
    reports: Sequence[Report], labels: Sequence[str], align: str, smooth: int | None
) -> str | None:
    if not any("behavior.entropy" in r.metrics for r in reports):
        return None
    chart = Chart(*SMALL)
    for i, report in enumerate(reports):
        metric = report.metrics.get("behavior.entropy")
        if metric is None:
            continue
        xs = _x(report, metric.steps, align)
        name = _label(labels[i]) if len(reports) > 1 else None
        _series(chart, xs, metric.values, COLORS[i % len(COLORS)], name, smooth)
        _mark_findings(chart, report, "behavior.entropy", align)
    return chart.svg(_xlabel(align), "entropy (nats per token)")


def _faithfulness_chart(reports: Sequence[Report], labels: Sequence[str]) -> str | None:
    curves = []
    for i, report in enumerate(reports):
        metric = report.metrics.get("reasoning.early_answer_aoc")
        curve = metric.extra.get("curve") if metric is not None else None
        if isinstance(curve, dict) and curve.get("fraction") and curve.get("unchanged"):
            curves.append((i, curve))
    if not curves:
        return None
    chart = Chart(*SMALL, ylim=(-0.02, 1.02))
    for i, curve in curves:
        xs = [float(v) for v in curve["fraction"]]
        ys = [None if v is None else float(v) for v in curve["unchanged"]]
        name = _label(labels[i]) if len(reports) > 1 else None
        chart.line(xs, ys, COLORS[i % len(COLORS)], label=name, markers=True)
    return chart.svg("share of the chain of thought kept", "answers unchanged (share)")


# -- page -----------------------------------------------------------------------------------

_CSS = """
*{box-sizing:border-box}p,li,summary,figcaption{overflow-wrap:anywhere}
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#212121;
background:#fafafa}
main{max-width:1400px;margin:0 auto;padding:16px}
h1{font-size:22px;margin:4px 0 8px}h2{font-size:18px;margin:28px 0 8px}
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 8px;border-bottom:1px solid #eee;
text-align:left;vertical-align:top}.scroll{overflow-x:auto;max-width:100%}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,430px),1fr));gap:12px}
figure.chart{margin:0;background:#fff;border:1px solid #e6e6e6;border-radius:6px;padding:8px;
min-width:0}
figure.chart svg{width:100%;height:auto;display:block}figcaption{font-size:12px;margin-bottom:4px}
.card{display:flex;flex-wrap:wrap;gap:12px;background:#fff;border:1px solid #e6e6e6;
border-left:6px solid #999;border-radius:6px;padding:10px;margin:0 0 12px}
.card.critical{border-left-color:#c62828}.card.warn{border-left-color:#ef6c00}
.card.info{border-left-color:#0277bd}.card .text{flex:1 1 320px;min-width:0}
.card .plot{flex:2 1 460px;min-width:0}.card .plot svg{width:100%;height:auto;display:block}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-size:12px;
font-weight:bold;margin-right:6px}.badge.critical{background:#c62828}
.badge.warn{background:#ef6c00}.badge.info{background:#0277bd}
.verdict{font-size:15px;font-weight:bold;margin:6px 0}.verdict.bad{color:#c62828}
.verdict.good{color:#2e7d32}
td.worse{color:#c62828;font-weight:bold}td.better{color:#2e7d32;font-weight:bold}
td.differs{color:#8e24aa}table.runs td{white-space:nowrap}
table.runs code{overflow-wrap:normal}.scroll td code{overflow-wrap:normal;white-space:nowrap}
.swatch{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:middle}
.dim{color:#6b6b6b;font-size:12px}code{font-size:12px;overflow-wrap:anywhere}
details{background:#fff;border:1px solid #e6e6e6;border-radius:6px;padding:6px 10px;
margin:0 0 10px}summary{cursor:pointer;font-weight:bold;font-size:16px;padding:4px 0}
pre{white-space:pre-wrap;overflow-wrap:anywhere;font-size:12px;background:#f5f5f5;padding:8px;
border-radius:4px;max-height:320px;overflow-y:auto}
article.rollout{background:#fff;border:1px solid #e6e6e6;border-radius:6px;padding:8px;
margin:0 0 10px}
@media (max-width:600px){main{padding:8px}h1{font-size:19px}}
"""


def _figure(caption: str, svg: str, chart_id: str) -> str:
    return (
        f'<figure class="chart" id="{_e(chart_id)}"><figcaption>{caption}</figcaption>'
        f"{svg}</figure>"
    )


def _md(text: str) -> str:
    """Escaped text with `code` spans shown as code (reasons and messages quote ids)."""
    parts = _e(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def _verdict(report: Report) -> str:
    line = summary_line(report).plain
    kind = "bad" if report.findings and report.worst_severity() != "info" else "good"
    return f"<p class='verdict {kind}'>{_e(line)}</p>"


def _anchor(run: int, rollout_id: int) -> str:
    return f"rollout-{run}-{rollout_id}"


def _card(
    finding: Finding,
    report: Report,
    run: int,
    label: str,
    multi: bool,
    align: str,
    smooth: int | None,
) -> str:
    shown = next((m for m in finding.metrics if m in report.metrics), None)
    plot = ""
    if shown is not None:
        svg = _metric_chart(shown, [report], [label], align, smooth, size=LARGE)
        plot = f"<div class='plot' id='card-chart-{run}-{_e(finding.id)}'>{svg}</div>"
    steps = sorted(set(finding.steps))
    if len(steps) > 1 and finding.marks == "window":
        where = f"steps {steps[0]}–{steps[-1]}"
    elif len(steps) > 1:
        where = "steps " + ", ".join(map(str, steps[:8])) + (", …" if len(steps) > 8 else "")
    else:
        where = f"step {steps[0]}" if steps else ""
    marked = "its window shaded" if finding.marks == "window" else "its steps marked"
    ids = finding.rollout_ids
    examples = (
        "<p>Example rollouts: "
        + ", ".join(f"<a href='#{_anchor(run, i)}'>{i}</a>" for i in ids)
        + "</p>"
        if ids
        else ""
    )
    who = f"<span class='dim'>{_e(label)}</span> " if multi else ""
    return (
        f"<div class='card {_e(finding.severity)}' id='finding-{run}-{_e(finding.id)}'>"
        f"<div class='text'><p>{who}<span class='badge {_e(finding.severity)}'>"
        f"{_e(finding.severity)}</span><b><code>{_e(finding.id)}</code></b> "
        f"<span class='dim'>{_e(finding.layer)} {_e(LAYERS.get(finding.layer, ''))}"
        f"{' · ' + _e(where) if where else ''}</span></p>"
        f"<p>{_md(finding.message)}</p>"
        + (
            f"<p><b>Because of</b> {', '.join(f'<code>{_e(c)}</code>' for c in finding.caused_by)}"
            " (began first; see its card).</p>"
            if finding.caused_by
            else ""
        )
        + (f"<p class='dim'>{_e(finding.when().capitalize())}.</p>" if finding.onset else "")
        + (f"<p><b>What to try:</b> {_md(finding.remedy)}</p>" if finding.remedy else "")
        + examples
        + f"<p class='dim'>Why and thresholds: <code>rlscope explain {_e(finding.id)}</code>"
        + (f"; the chart is <code>{_e(shown)}</code>, {marked}" if shown else "")
        + "</p></div>"
        + plot
        + "</div>"
    )


def _compare_table(comparison: Comparison) -> str:
    """Per metric: each run's value, its delta to the baseline with the interval and the
    verdict; significant differences first, the rest folded."""
    labels = comparison.labels
    head = (
        "<tr><th>metric</th>"
        + "".join(
            f"<th>{_e('baseline' if i == 0 else f'run {i + 1}')} {_e(label)}</th>"
            for i, label in enumerate(labels)
        )
        + "</tr>"
    )

    def row(metric: Any) -> str:
        cells = []
        for i, run in enumerate(metric.runs):
            if run is None:
                cells.append(f"<td class='dim'>— ({_e(metric.missing[i])})</td>")
                continue
            text = _e(format_value(run.value))
            if i > 0 and run.delta is not None:
                text += f"<br>Δ {run.delta:+.3g}"
                if run.interval is not None:
                    text += f" [{run.interval[0]:+.3g}, {run.interval[1]:+.3g}]"
                if run.verdict:
                    text += f" {_e(run.verdict)}"
                elif run.unlike:
                    text += f" not compared ({_e(', '.join(run.unlike))} differ)"
            cells.append(f"<td class='{_e(run.verdict)}'>{text}</td>")
        return f"<tr><td><code>{_e(metric.id)}</code></td>{''.join(cells)}</tr>"

    ordered = leading(comparison.metrics.values())  # task outcomes first
    called = [
        m
        for m in ordered
        if m.task
        or any(r is not None and r.verdict in ("worse", "better", "differs") for r in m.runs)
    ]
    rest = [m for m in ordered if m not in called]
    lines = "".join(
        f"<p class='verdict {'bad' if v.regressed else 'good'}'>{_e(v.line())}</p>"
        for v in comparison.verdicts()
    )
    out = (
        lines + "<div class='scroll'><table>" + head + "".join(map(row, called)) + "</table></div>"
    )
    if rest:
        out += (
            f"<details><summary>{len(rest)} metrics within run-to-run noise or not comparable"
            "</summary><div class='scroll'><table>"
            + head
            + "".join(map(row, rest))
            + "</table></div></details>"
        )
    return out + (
        "<p class='dim'>Δ = value − baseline (final-window means); [a, b] = 95% bootstrap interval "
        "of the difference; worse/better only when it excludes 0, by the metric's direction "
        "(task outcomes, first; error rates) or its distance to a healthy band; not compared "
        "where run.json puts the runs on other scales (the reward's weights).</p>"
    )


def _examples_section(
    reports: Sequence[Report], data: Sequence[PlotData], labels: Sequence[str]
) -> str:
    parts = []
    for run, (report, d) in enumerate(zip(reports, data, strict=True)):
        named = sorted({i for f in report.findings for i in f.rollout_ids})
        for rollout_id in named:
            row = d.examples.get(rollout_id)
            if row is None:
                continue
            meta = ", ".join(
                f"{k} {_e(safe_text(v))}"
                for k, v in row.items()
                if k not in ("response", "rollout_id")
            )
            text = row.get("response")
            body = (
                f"<pre>{_e(safe_text(text, multiline=True))}</pre>"
                if text
                else ("<p class='dim'>no response text in this run</p>")
            )
            who = f"{_e(labels[run])}: " if len(reports) > 1 else ""
            parts.append(
                f"<article class='rollout' id='{_anchor(run, rollout_id)}'><p><b>{who}rollout "
                f"{rollout_id}</b> <span class='dim'>{meta}</span></p>{body}"
                f"<p class='dim'>whole: <code>rlscope show {_e(report.run.path)} {rollout_id}"
                "</code></p></article>"
            )
    if not parts:
        return ""
    return "<h2 id='examples'>Example rollouts named by the findings</h2>" + "".join(parts)


def render_html(
    reports: Sequence[Report],
    data: Sequence[PlotData],
    *,
    align: str = "step",
    comparison: Comparison | None = None,
    smooth: int | None = None,
) -> str:
    """The report page for one or more runs (several: overlaid, the first as the baseline):
    the verdict and the findings first, each with the chart that shows it; for several runs
    the comparison; then each layer's charts (folded unless something there is flagged), the
    diagnostics and the example rollouts. `smooth`: the rolling-mean window (None: ~5% of the
    steps; 0: raw only)."""
    labels = run_labels(reports)
    multi = len(reports) > 1
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        "<title>rlscope report</title>",
        f"<style>{_CSS}</style></head><body><main>",
        "<h1>rlscope report</h1>",
    ]
    parts += [
        (f"<p class='dim'>{_e(label)}</p>" if multi else "") + _verdict(report)
        for report, label in zip(reports, labels, strict=True)
    ]
    parts.append(
        "<div class='scroll'><table class='runs'><tr><th>run</th><th>run_id</th><th>algorithm</th>"
        "<th>path</th><th>steps</th><th>rollouts</th><th>tokens</th></tr>"
    )
    for i, report in enumerate(reports):
        run = report.run
        swatch = f'<span class="swatch" style="background:{COLORS[i % len(COLORS)]}"></span>'
        parts.append(
            f"<tr><td>{swatch}{'baseline' if i == 0 and multi else i + 1}</td>"
            f"<td>{_e(run.run_id)}</td><td>{_e(run.algorithm)}</td><td><code>{_e(run.path)}"
            f"</code></td><td>{run.n_steps} ({_e(run.first_step)}–{_e(run.last_step)})</td>"
            f"<td>{run.n_rollouts:,}</td><td>{run.n_tokens:,}</td></tr>"
        )
    parts.append("</table></div>")

    parts.append("<section id='findings'><h2>Findings</h2>")
    for index, (report, label) in enumerate(zip(reports, labels, strict=True)):
        if not report.findings:
            parts.append(f"<p>{_e(label)}: no findings.</p>" if multi else "<p>No findings.</p>")
        for finding in report.findings:
            parts.append(_card(finding, report, index, label, multi, align, smooth))
    unchecked = [s for r in reports for s in r.skipped if s.kind == "finding" and not s.failed]
    missing = sorted({s.metric for s in unchecked if s.needs_steps is None})
    waiting = sorted({(s.metric, s.needs_steps) for s in unchecked if s.needs_steps is not None})
    for heading, names in (
        ("Not checked (inputs missing)", [f"<code>{_e(m)}</code>" for m in missing]),
        ("Not judged yet (steps needed)", [f"<code>{_e(m)}</code> ({n})" for m, n in waiting]),
    ):
        if names:
            parts.append(f"<p class='dim'>{heading}: " + ", ".join(names) + "</p>")
    parts.append("</section>")

    if comparison is not None:
        parts.append("<section id='compare'><h2>Comparison with the baseline</h2>")
        parts.append(_compare_table(comparison))
        parts.append("</section>")

    ids = list(dict.fromkeys(i for r in reports for i in r.metrics))
    for layer, name in LAYERS.items():
        layer_ids = [
            m.id
            for m in policy_first(
                [next(r.metrics[i] for r in reports if i in r.metrics) for i in ids]
            )
            if m.layer == layer
        ]
        skipped = sorted(
            {
                (s.metric, s.reason)
                for r in reports
                for s in r.skipped
                if s.kind == "metric" and s.layer == layer
            }
        )
        if not layer_ids and not skipped:
            continue
        flagged = [
            i
            for i in layer_ids
            for r in reports
            if i in r.metrics
            and (r.status(r.metrics[i]) or ("", "ok"))[1] not in ("ok",)
            and r.status(r.metrics[i]) is not None
        ]
        state = " open" if flagged else ""
        summary = (
            f"{layer} {_e(name)} <span class='dim'>{len(layer_ids)} metrics"
            + (f", flagged: {', '.join(_e(f) for f in dict.fromkeys(flagged))}" if flagged else "")
            + "</span>"
        )
        parts.append(f"<details id='{layer}'{state}><summary>{summary}</summary><div class='grid'>")
        for metric_id in layer_ids:
            metric_svg = _metric_chart(metric_id, reports, labels, align, smooth)
            parts.append(
                _figure(_caption(metric_id, reports, labels), metric_svg, f"chart-{metric_id}")
            )
        parts.append("</div>")
        if skipped:
            items = "".join(f"<li><code>{_e(m)}</code>: {_md(r)}</li>" for m, r in skipped)
            parts.append(f"<p class='dim'>Not computed:</p><ul class='dim'>{items}</ul>")
        parts.append("</details>")

    parts.append("<h2 id='diagnostics'>Diagnostics</h2><div class='grid'>")
    svg = _reward_chart(reports, labels, align, smooth)
    if svg is not None:
        parts.append(_figure(_e("Reward per reward function"), svg, "chart-reward-functions"))
    for n, (length_caption, length_svg) in enumerate(
        _length_charts(reports, data, labels, align, smooth)
    ):
        parts.append(_figure(_e(length_caption), length_svg, f"chart-length-{n}"))
    sigma_runs = [i for i, d in enumerate(data) if d.sigma is not None]
    for i, svg in zip(sigma_runs, _sigma_charts(data), strict=True):
        caption = (
            f"σ_G histogram over time (share of groups per step; one colour scale for all "
            f"runs, one σ range when their rewards share a scale): {_e(labels[i])}"
        )
        parts.append(_figure(caption, svg, f"chart-sigma-{i}"))
    svg = _pass_chart(data, labels)
    if svg is not None:
        caption = "pass@k for k = 1…N: first (dashed) vs last (solid) 10% of steps"
        parts.append(_figure(_e(caption), svg, "chart-pass-k"))
    svg = _early_answer_chart(reports, labels)
    if svg is not None:
        caption = (
            "Early answering (Lanham et al. 2023): answers unchanged when the chain of thought "
            "is cut to a share of its steps, per probed step; a flat line at 1 is a chain the "
            "answer does not depend on"
        )
        parts.append(_figure(_e(caption), svg, "chart-early-answering"))
    svg = _entropy_chart(reports, labels, align, smooth)
    if svg is not None:
        parts.append(
            _figure(
                _e("Entropy decay (shaded: where entropy-collapse saw it go)"),
                svg,
                "chart-entropy-decay",
            )
        )
    svg = _faithfulness_chart(reports, labels)
    if svg is not None:
        caption = "Faithfulness: answers unchanged vs share of the chain of thought kept"
        parts.append(_figure(_e(caption), svg, "chart-faithfulness"))
    else:
        parts.append(
            "<figure class='chart' id='chart-faithfulness'><figcaption>Faithfulness"
            "</figcaption><p class='dim'>no probes (no <code>reasoning.early_answer_aoc</code> "
            "curve in any run)</p></figure>"
        )
    parts.append("</div>")
    parts.append(_examples_section(reports, data, labels))
    for report, label in zip(reports, labels, strict=True):  # how the importer derived fields
        found = run_provenance(report.run.meta)
        if found:
            items = "".join(f"<li><b>{_e(k)}</b>: {_e(v)}</li>" for k, v in found.items())
            how = f"<p class='dim'>{_e(label)}: how fields were derived</p>"
            parts.append(f"{how}<ul class='dim'>{items}</ul>")
        for note in report.notes:
            parts.append(f"<p class='dim'>{_e(label)}: note: {_md(note)}</p>")
        for warning in report.warnings:
            parts.append(f"<p class='dim'>{_e(label)}: warning: {_md(warning)}</p>")
    window = "~5% of the steps" if smooth is None else f"{smooth} steps"
    parts.append(
        f"<p class='dim'>rlscope {_e(__version__)}. Each chart: the raw series faint, its "
        f"centred rolling mean ({_e(window)}) bold; the healthy band green; a finding's window "
        "shaded in its severity's colour; the number under a title is the final-window mean "
        "(last 10% of steps, at least 3).</p>"
    )
    parts.append("</main></body></html>")
    return "\n".join(parts)


def _caption(metric_id: str, reports: Sequence[Report], labels: Sequence[str]) -> str:
    first: MetricResult | None = next(
        (r.metrics[metric_id] for r in reports if metric_id in r.metrics), None
    )
    title = first.title if first is not None else ""
    if first is not None and first.part:
        title = f"{PART_HEADINGS[first.part]}: {title}"
    values = "; ".join(
        f"{_e(label)} {_e(format_value(r.metrics[metric_id].value))}"
        for r, label in zip(reports, labels, strict=True)
        if metric_id in r.metrics
    )
    return (
        f"<b><code>{_e(metric_id)}</code></b> {_e(title)}<br><span class='dim'>final-window mean: "
        f"{values}</span>"
    )


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def write_report(
    paths: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    metrics: Sequence[str] | None = None,
    align: str = "step",
    steps: tuple[int | None, int | None] = (None, None),
    config: Config | None = None,
    from_format: str | None = None,
    import_options: Mapping[str, Any] | None = None,
    smooth: int | None = None,
    mapper: Mapper | None = None,
) -> Path:
    """Analyse each run and write the HTML report to `output` (never inside a run directory).
    With `from_format`, each path is a trainer's output, imported as `analyze` does; `smooth`
    the charts' rolling-mean window in steps (None: ~5% of the steps, 0: none)."""
    from rlscope.analysis import analyze_each

    if not paths:
        raise RlscopeError("report needs at least one run")
    if align not in ("step", "progress"):
        raise RlscopeError(f"align {align!r}: choose step or progress")
    if smooth is not None and smooth < 0:
        raise RlscopeError(f"--smooth {smooth}: a window of 0 (none) or more steps")
    out = Path(output)
    for path in paths:
        if not is_url(path) and _inside(out, Path(path)):
            raise RlscopeError(
                f"{out}: inside the run directory {path}", hint="rlscope never writes into a run"
            )
    # Argument errors before any work: analysing the runs can take minutes.
    if out.is_dir():
        raise RlscopeError(f"{out}: is a directory", hint="give a file name, e.g. -o report.html")
    if not out.parent.is_dir():
        raise RlscopeError(f"{out}: no such folder {out.parent}")
    if not os.access(out.parent, os.W_OK):
        raise RlscopeError(f"{out}: cannot write the report (folder not writable)")
    reports = analyze_each(
        paths,
        steps=steps,
        metrics=metrics,
        config=config,
        from_format=from_format,
        import_options=import_options,
        mapper=mapper,
    )
    data = [  # from the imported run, if any
        plot_data(r.run.path, steps=steps, examples={i for f in r.findings for i in f.rollout_ids})
        for r in reports
    ]
    comparison = compare_reports(reports, align=align) if len(reports) > 1 else None
    page = render_html(reports, data, align=align, comparison=comparison, smooth=smooth)
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise RlscopeError(f"{out}: cannot write the report ({exc.strerror})") from None
    return out
