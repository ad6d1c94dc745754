"""The HTML report: one self-contained file of inline SVG charts (matplotlib), no script at all.

Untrusted text (run ids, paths, finding messages quoting prompt ids) is `html.escape`d in the
page; in the charts matplotlib escapes it as SVG text (`svg.fonttype = none`, mathtext off so a
`$` is literal), and chart comments (which repeat the text) are dropped. A Content-Security-Policy
forbids scripts and every network fetch, so nothing from the data can run or call home.
"""

from __future__ import annotations

import html
import io
import itertools
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlscope._version import __version__
from rlscope.config import Config
from rlscope.errors import RlscopeError
from rlscope.plots import PlotData, plot_data
from rlscope.render.sanitize import safe_text
from rlscope.report import MetricResult, Report, run_provenance
from rlscope.spec import LAYERS, Finding

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
SEVERITY_COLORS = {"critical": "#c62828", "warn": "#ef6c00", "info": "#0277bd"}
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; font-src data:; "
    "script-src 'none'; base-uri 'none'; form-action 'none'"
)
_COMMENT = re.compile(r"<!--.*?-->|<metadata>.*?</metadata>", re.DOTALL)
_LABEL_MAX = 40


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RlscopeError(
            "the HTML report needs matplotlib",
            hint='pip install matplotlib  (from a clone of rlscope: pip install ".[report]")',
        ) from None
    return matplotlib


def _label(text: object) -> str:
    """Untrusted text for a chart label: controls made visible, shortened."""
    value = safe_text(text)
    return value if len(value) <= _LABEL_MAX else value[: _LABEL_MAX - 1] + "…"


class _Charts:
    """Makes matplotlib figures and turns them into inline SVG (unique ids per figure)."""

    def __init__(self) -> None:
        self.mpl = _matplotlib()
        from matplotlib.figure import Figure

        self.Figure = Figure
        self.count = itertools.count()

    def figure(self, width: float = 5.0, height: float = 2.4) -> Any:
        # Fixed margins: a constrained layout doubles the time per chart.
        fig = self.Figure(figsize=(width, height))
        fig.subplots_adjust(left=0.11, right=0.97, top=0.93, bottom=0.17)
        return fig

    def svg(self, fig: Any) -> str:
        settings = {
            "svg.fonttype": "none",
            "svg.hashsalt": f"rlscope-{next(self.count)}",
            "text.parse_math": False,
            "text.usetex": False,
        }
        buffer = io.StringIO()
        with self.mpl.rc_context(settings):
            fig.savefig(buffer, format="svg", metadata={"Date": None})
        text = buffer.getvalue()
        text = text[text.index("<svg") :]
        return _COMMENT.sub("", text)


def _style(ax: Any) -> None:
    ax.grid(True, color="#e0e0e0", linewidth=0.5)
    ax.tick_params(labelsize=7)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _x(report: Report, steps: Sequence[int | float], align: str) -> list[float]:
    if align == "step":
        return [float(s) for s in steps]
    first, last = report.run.first_step, report.run.last_step
    if first is None or last is None or last == first:
        return [0.0 for _ in steps]
    return [(s - first) / (last - first) for s in steps]


def _xlabel(align: str) -> str:
    return "step" if align == "step" else "fraction of training"


def _metric_chart(
    charts: _Charts,
    metric_id: str,
    reports: Sequence[Report],
    labels: Sequence[str],
    align: str,
) -> str:
    fig = charts.figure()
    ax = fig.subplots()
    _style(ax)
    band = next(r.metrics[metric_id] for r in reports if metric_id in r.metrics).band
    if band is not None:
        low, high = band
        ax.axhspan(
            low if low is not None else -1e300,
            high if high is not None else 1e300,
            color="#2e7d32",
            alpha=0.08,
            label="healthy band",
        )
    lows, highs = [], []
    for i, report in enumerate(reports):
        metric = report.metrics.get(metric_id)
        if metric is None:
            continue
        color = COLORS[i % len(COLORS)]
        xs = _x(report, metric.steps, align)
        ys = [float("nan") if v is None else v for v in metric.values]
        ax.plot(xs, ys, color=color, linewidth=1.2, label=_label(labels[i]))
        defined = [v for v in metric.values if v is not None]
        lows.append(min(defined))
        highs.append(max(defined))
        if metric.logged is not None and len(reports) == 1:
            logged = [float("nan") if v is None else v for v in metric.logged.values]
            ax.plot(
                _x(report, metric.logged.steps, align),
                logged,
                color=color,
                linestyle=":",
                linewidth=1,
                label=_label(f"logged {metric.logged.column}"),
            )
        for finding in report.findings:
            if not finding.names(metric_id):
                continue
            marks = list(finding.steps)
            for x in _x(report, marks, align):
                ax.axvline(
                    x, color=SEVERITY_COLORS.get(finding.severity, "#555"), linestyle="--", lw=1
                )
            if marks:
                ax.annotate(
                    finding.id,
                    xy=(_x(report, marks[:1], align)[0], 1.0),
                    xycoords=("data", "axes fraction"),
                    fontsize=7,
                    color=SEVERITY_COLORS.get(finding.severity, "#555"),
                    va="top",
                )
    if lows and band is not None:  # keep the data in view, not the open end of the band
        span = max(highs) - min(lows)
        pad = span * 0.1 if span > 0 else max(abs(max(highs)), 1.0) * 0.1
        ax.set_ylim(min(lows) - pad, max(highs) + pad)
    ax.set_xlabel(_xlabel(align), fontsize=7)
    if len(reports) > 1 or band is not None:
        ax.legend(fontsize=6, loc="upper right", framealpha=0.6)
    return charts.svg(fig)


def _length_charts(
    charts: _Charts,
    reports: Sequence[Report],
    data: Sequence[PlotData],
    labels: Sequence[str],
    align: str,
) -> list[tuple[str, str]]:
    out = []
    if any(d.length is not None for d in data):
        fig = charts.figure()
        ax = fig.subplots()
        _style(ax)
        for i, d in enumerate(data):
            if d.length is None:
                continue
            mids = [(a + b) / 2 for a, b in itertools.pairwise(d.length.edges)]
            acc = [float("nan") if v is None else v for v in d.length.accuracy]
            ax.plot(
                mids, acc, marker="o", ms=3, color=COLORS[i % len(COLORS)], label=_label(labels[i])
            )
        ax.set_xlabel("response length (tokens, bin centre)", fontsize=7)
        ax.set_ylabel("accuracy", fontsize=7)
        ax.legend(fontsize=6, loc="upper right", framealpha=0.6)
        out.append(
            ("Accuracy by response length (train rollouts, equal-width bins)", charts.svg(fig))
        )
    pairs = ("behavior.response_len_correct", "behavior.response_len_incorrect")
    if any(m in r.metrics for r in reports for m in pairs):
        fig = charts.figure()
        ax = fig.subplots()
        _style(ax)
        for i, report in enumerate(reports):
            for metric_id, style, word in zip(
                pairs, ("-", "--"), ("correct", "incorrect"), strict=True
            ):
                metric = report.metrics.get(metric_id)
                if metric is None:
                    continue
                ys = [float("nan") if v is None else v for v in metric.values]
                ax.plot(
                    _x(report, metric.steps, align),
                    ys,
                    linestyle=style,
                    lw=1.2,
                    color=COLORS[i % len(COLORS)],
                    label=_label(f"{labels[i]} {word}"),
                )
        ax.set_xlabel(_xlabel(align), fontsize=7)
        ax.set_ylabel("mean length", fontsize=7)
        ax.legend(fontsize=6, loc="upper right", framealpha=0.6)
        out.append(("Length of correct (solid) vs incorrect (dashed) responses", charts.svg(fig)))
    return out


def _sigma_chart(charts: _Charts, d: PlotData, label: str) -> str | None:
    if d.sigma is None:
        return None
    import numpy as np

    fig = charts.figure()
    ax = fig.subplots()
    counts = np.array(d.sigma.counts, dtype=float).T  # bins x steps
    totals = counts.sum(axis=0, keepdims=True)
    shares = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    steps = list(d.sigma.steps)
    extent = (steps[0], steps[-1] + 1, d.sigma.edges[0], d.sigma.edges[-1])
    # A raster (embedded PNG) keeps the file small however many steps there are.
    mesh = ax.imshow(
        shares,
        origin="lower",
        aspect="auto",
        extent=extent,
        cmap="viridis",
        interpolation="nearest",
    )
    fig.colorbar(mesh, ax=ax, label="share of groups")
    ax.set_xlabel("step", fontsize=7)
    ax.set_ylabel("σ_G", fontsize=7)
    ax.set_title(_label(label), fontsize=8)
    ax.tick_params(labelsize=7)
    return charts.svg(fig)


def _pass_chart(charts: _Charts, data: Sequence[PlotData], labels: Sequence[str]) -> str | None:
    if all(d.pass_k is None for d in data):
        return None
    fig = charts.figure()
    ax = fig.subplots()
    _style(ax)
    for i, d in enumerate(data):
        if d.pass_k is None:
            continue
        color = COLORS[i % len(COLORS)]
        curve = d.pass_k
        for values, style, (a, b) in (
            (curve.early, "--", curve.early_steps),
            (curve.final, "-", curve.final_steps),
        ):
            ys = [float("nan") if v is None else v for v in values]
            ax.plot(
                curve.ks,
                ys,
                linestyle=style,
                marker="o",
                ms=3,
                color=color,
                label=_label(f"{labels[i]} steps {a}–{b}"),
            )
    ax.set_xlabel("k", fontsize=7)
    ax.set_ylabel("pass@k", fontsize=7)
    ax.legend(fontsize=6, loc="lower right", framealpha=0.6)
    return charts.svg(fig)


def _entropy_chart(
    charts: _Charts, reports: Sequence[Report], labels: Sequence[str], align: str
) -> str | None:
    if not any("behavior.entropy" in r.metrics for r in reports):
        return None
    fig = charts.figure()
    ax = fig.subplots()
    _style(ax)
    for i, report in enumerate(reports):
        metric = report.metrics.get("behavior.entropy")
        if metric is None:
            continue
        color = COLORS[i % len(COLORS)]
        xs = _x(report, metric.steps, align)
        ys = [float("nan") if v is None else v for v in metric.values]
        ax.plot(xs, ys, color=color, lw=1.2, label=_label(labels[i]))
        collapse = [f.steps for f in report.findings if f.id == "entropy-collapse" and f.steps]
        if collapse:  # where the finding saw the entropy go
            first, last = _x(report, [min(collapse[0]), max(collapse[0])], align)
            ax.axvspan(first, last, color=color, alpha=0.12)
    ax.set_xlabel(_xlabel(align), fontsize=7)
    ax.set_ylabel("entropy (nats)", fontsize=7)
    ax.legend(fontsize=6, loc="upper right", framealpha=0.6)
    return charts.svg(fig)


def _faithfulness_chart(
    charts: _Charts, reports: Sequence[Report], labels: Sequence[str]
) -> str | None:
    curves = []
    for i, report in enumerate(reports):
        metric = report.metrics.get("reasoning.early_answer_aoc")
        curve = metric.extra.get("curve") if metric is not None else None
        if isinstance(curve, dict) and curve.get("fraction") and curve.get("unchanged"):
            curves.append((i, curve))
    if not curves:
        return None
    fig = charts.figure()
    ax = fig.subplots()
    _style(ax)
    for i, curve in curves:
        xs = [float(v) for v in curve["fraction"]]
        ys = [float("nan") if v is None else float(v) for v in curve["unchanged"]]
        ax.plot(xs, ys, marker="o", ms=3, color=COLORS[i % len(COLORS)], label=_label(labels[i]))
    ax.set_xlabel("share of the chain of thought kept", fontsize=7)
    ax.set_ylabel("answers unchanged", fontsize=7)
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=6, loc="upper right", framealpha=0.6)
    return charts.svg(fig)


# -- page -----------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#212121}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px;border-bottom:1px solid #eee;
text-align:left}.grid{display:flex;flex-wrap:wrap;gap:16px}
figure.chart{margin:0;width:520px;border:1px solid #eee;padding:6px}
figure.chart svg{width:100%;height:auto}figcaption{font-size:12px;margin-bottom:4px}
.critical{color:#c62828;font-weight:bold}.warn{color:#ef6c00;font-weight:bold}.info{color:#0277bd}
.swatch{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:middle}
.dim{color:#757575;font-size:12px}code{font-size:12px}
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _figure(caption: str, svg: str, chart_id: str) -> str:
    return (
        f'<figure class="chart" id="{_e(chart_id)}"><figcaption>{caption}</figcaption>'
        f"{svg}</figure>"
    )


def _fmt(value: float | None) -> str:
    from rlscope.render.terminal import format_value

    return format_value(value)


def _findings_html(report: Report, label: str) -> str:
    if not report.findings:
        return f"<p>{_e(label)}: no findings.</p>"
    rows = "".join(
        f'<tr><td class="{_e(f.severity)}">{_e(f.severity)}</td><td><code>{_e(f.id)}</code>'
        f"</td><td>{_e(f.layer)}</td><td>{_e(f.message)}</td><td>{_e(_steps(f))}</td></tr>"
        for f in report.findings
    )
    return (
        f"<h3>{_e(label)}</h3><table><tr><th>severity</th><th>finding</th><th>layer</th>"
        f"<th>message</th><th>steps</th></tr>{rows}</table>"
    )


def _steps(finding: Finding) -> str:
    return ", ".join(str(s) for s in finding.steps)


def _caption(metric_id: str, reports: Sequence[Report], labels: Sequence[str]) -> str:
    first: MetricResult | None = next(
        (r.metrics[metric_id] for r in reports if metric_id in r.metrics), None
    )
    title = first.title if first is not None else ""
    values = "; ".join(
        f"{_e(label)} {_e(_fmt(r.metrics[metric_id].value))}"
        for r, label in zip(reports, labels, strict=True)
        if metric_id in r.metrics
    )
    return f"<b><code>{_e(metric_id)}</code></b> {_e(title)}<br><span class='dim'>{values}</span>"


def render_html(reports: Sequence[Report], data: Sequence[PlotData], *, align: str = "step") -> str:
    """The report page for one or more runs (several: overlaid, the first as the baseline)."""
    from rlscope.comparison import run_labels

    charts = _Charts()
    labels = run_labels(reports)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        "<title>rlscope report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>rlscope report</h1>",
        f"<p class='dim'>rlscope {_e(__version__)}; x axis: {_e(_xlabel(align))}. "
        "Curves per metric, healthy band shaded green, findings marked at their steps.</p>",
        "<table><tr><th>run</th><th>run_id</th><th>algorithm</th><th>path</th><th>steps</th>"
        "<th>rollouts</th><th>tokens</th></tr>",
    ]
    for i, report in enumerate(reports):
        run = report.run
        swatch = f'<span class="swatch" style="background:{COLORS[i % len(COLORS)]}"></span>'
        parts.append(
            f"<tr><td>{swatch}{'baseline' if i == 0 and len(reports) > 1 else i + 1}</td>"
            f"<td>{_e(run.run_id)}</td><td>{_e(run.algorithm)}</td><td>{_e(run.path)}</td>"
            f"<td>{run.n_steps} ({_e(run.first_step)}–{_e(run.last_step)})</td>"
            f"<td>{run.n_rollouts:,}</td><td>{run.n_tokens:,}</td></tr>"
        )
    parts.append("</table>")
    for report, label in zip(reports, labels, strict=True):  # how the importer derived fields
        found = run_provenance(report.run.meta)
        if found:
            items = "".join(f"<li><b>{_e(k)}</b>: {_e(v)}</li>" for k, v in found.items())
            parts.append(f"<p class='dim'>{_e(label)}: how fields were derived</p><ul>{items}</ul>")
    parts.append("<h2 id='findings'>Findings</h2>")
    parts += [_findings_html(r, label) for r, label in zip(reports, labels, strict=True)]

    ids = list(dict.fromkeys(i for r in reports for i in r.metrics))
    for layer, name in LAYERS.items():
        layer_ids = [
            i for i in ids if next(r.metrics[i] for r in reports if i in r.metrics).layer == layer
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
        parts.append(f"<h2 id='{layer}'>{layer} {_e(name)}</h2><div class='grid'>")
        for metric_id in layer_ids:
            metric_svg = _metric_chart(charts, metric_id, reports, labels, align)
            parts.append(
                _figure(_caption(metric_id, reports, labels), metric_svg, f"chart-{metric_id}")
            )
        parts.append("</div>")
        if skipped:
            items = "".join(f"<li><code>{_e(m)}</code>: {_e(r)}</li>" for m, r in skipped)
            parts.append(f"<p class='dim'>Not computed:</p><ul class='dim'>{items}</ul>")

    parts.append("<h2 id='diagnostics'>Diagnostics</h2><div class='grid'>")
    for n, (length_caption, length_svg) in enumerate(
        _length_charts(charts, reports, data, labels, align)
    ):
        parts.append(_figure(_e(length_caption), length_svg, f"chart-length-{n}"))
    for i, d in enumerate(data):
        svg = _sigma_chart(charts, d, labels[i])
        if svg is not None:
            caption = f"σ_G histogram over time (share of groups per step): {_e(labels[i])}"
            parts.append(_figure(caption, svg, f"chart-sigma-{i}"))
    svg = _pass_chart(charts, data, labels)
    if svg is not None:
        caption = "pass@k for k = 1…N: first (dashed) vs last (solid) 10% of steps"
        parts.append(_figure(_e(caption), svg, "chart-pass-k"))
    svg = _entropy_chart(charts, reports, labels, align)
    if svg is not None:
        parts.append(
            _figure(_e("Entropy decay (shaded: the early window)"), svg, "chart-entropy-decay")
        )
    svg = _faithfulness_chart(charts, reports, labels)
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
    for report, label in zip(reports, labels, strict=True):
        for note in report.notes:
            parts.append(f"<p class='dim'>{_e(label)}: note: {_e(note)}</p>")
        for warning in report.warnings:
            parts.append(f"<p class='dim'>{_e(label)}: warning: {_e(warning)}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


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
) -> Path:
    """Analyse each run and write the HTML report to `output` (never inside a run directory).
    With `from_format`, each path is a trainer's output, imported as `analyze` does."""
    from rlscope.analysis import analyze_each

    if not paths:
        raise RlscopeError("report needs at least one run")
    if align not in ("step", "progress"):
        raise RlscopeError(f"align {align!r}: choose step or progress")
    out = Path(output)
    for path in paths:
        if _inside(out, Path(path)):
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
    _matplotlib()
    reports = analyze_each(
        paths,
        steps=steps,
        metrics=metrics,
        config=config,
        from_format=from_format,
        import_options=import_options,
    )
    data = [plot_data(r.run.path, steps=steps) for r in reports]  # the imported run, if any
    page = render_html(reports, data, align=align)
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise RlscopeError(f"{out}: cannot write the report ({exc.strerror})") from None
    return out
