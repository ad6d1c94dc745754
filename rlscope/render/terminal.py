"""The Report as a Rich terminal report: header, one panel per layer, findings by severity.

Every string from the data (run.json fields, paths, column names, prompt ids and rollout text
in messages) goes through `safe_text` and into `Text(...)`, never into a markup string: data can
neither send terminal escapes nor style the report.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rlscope.render.sanitize import safe_text
from rlscope.report import PART_HEADINGS, MetricResult, Report, policy_first, run_provenance
from rlscope.spec import LAYERS

BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 24
SEVERITY_STYLE = {"critical": "bold red", "warn": "yellow", "info": "cyan"}
SEVERITY_ORDER = ("critical", "warn", "info")
STATUS_STYLE = {"ok": "green", "outside": "magenta"}


def sparkline(values: Sequence[float | None], width: int = 24) -> str:
    """Values resampled to `width` buckets (bucket means) and drawn with block characters."""
    points = [v for v in values if v is not None and math.isfinite(v)]
    if not points:
        return ""
    if len(points) > width:
        edges = [round(i * len(points) / width) for i in range(width + 1)]
        points = [sum(points[a:b]) / (b - a) for a, b in itertools.pairwise(edges) if b > a]
    lo, hi = min(points), max(points)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return BLOCKS[3] * len(points)
    scale = (len(BLOCKS) - 1) / (hi - lo)
    return "".join(BLOCKS[round((v - lo) * scale)] for v in points)


def format_value(value: float | None) -> str:
    if value is None:
        return "—"
    magnitude = abs(value)
    if magnitude != 0 and (magnitude < 1e-3 or magnitude >= 1e5):
        return f"{value:.3e}"
    if magnitude >= 100:
        return f"{value:,.1f}"
    return f"{value:.4f}"


def _files_read(files: int, read: int) -> str:
    """How many of a table's files were read, when some came from the cache."""
    cached = files - read
    if not cached:
        return ""
    return f" ({read:,} of {files:,} files read; {cached:,} cached)"


def _header(report: Report) -> Panel:
    run = report.run
    steps = (
        f"{run.n_steps} ({run.first_step}–{run.last_step})" if run.first_step is not None else "0"
    )
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for label, value in (
        ("run", f"{run.run_id}  [{run.algorithm}]"),
        ("path", run.path),
        ("steps", steps),
        (
            "rollouts",
            f"{run.n_rollouts - run.n_eval_rollouts:,} train in {run.n_groups:,} groups"
            + (f", {run.n_eval_rollouts:,} eval" if run.n_eval_rollouts else "")
            + _files_read(*run.table_files.get("rollouts", (0, 0)))
            if "rollouts" in run.tables
            else "none: the trainer logged step metrics only",
        ),
        *(
            [("tokens", f"{run.n_tokens:,}" + _files_read(run.token_files, run.token_files_read))]
            if "rollouts" in run.tables or "tokens" in run.tables
            else []
        ),
        ("tables", ", ".join(run.tables)),
        *provenance_rows(run.meta),
        *([("config", config_line(report.config))] if report.config else []),
    ):
        grid.add_row(label, Text(safe_text(value)))
    return Panel(grid, title="rlscope analyze", title_align="left")


def config_line(config: dict) -> str:
    """The override file in use and what it changes (a file can silence a finding)."""
    changes = [*config["overrides"], *(f"[{t}]" for t in config["text"])]
    return f"{config['source']}: " + (", ".join(changes) if changes else "no overrides")


def provenance_rows(meta: dict, width: int = 200) -> list[tuple[str, str]]:
    """run.json `provenance` (how the importer derived fields), one row per topic, each
    sentence cut to `width` characters (`--format json` has them whole)."""
    rows = []
    for topic, text in run_provenance(meta).items():
        rows.append((f"how: {topic}", text if len(text) <= width else text[: width - 1] + "…"))
    return rows


#: A panel's border and padding take this many columns of the console's width.
PANEL_CHROME = 4
GAP = 2  # between table columns
VALUE_WIDTH = 10
MIN_SPARK = 8


def table_layout(width: int, id_width: int, status_width: int, logged: bool) -> tuple[int, bool]:
    """(sparkline width, whether the logged column fits) for a layer table `width` columns
    wide: the metric id, its value and its status are never cut; the sparkline shrinks (to
    MIN_SPARK, else 0: dropped) and the trainer's logged value moves below the table first."""
    fixed = id_width + GAP + VALUE_WIDTH + GAP + status_width
    for with_logged in (True, False) if logged else (False,):
        room = width - fixed - (VALUE_WIDTH + GAP if with_logged else 0) - GAP
        if room >= MIN_SPARK:
            return min(SPARK_WIDTH, room), with_logged
    return 0, False


def _layer_panel(report: Report, layer: str, width: int) -> Panel | None:
    metrics = policy_first([m for m in report.metrics.values() if m.layer == layer])
    skipped = [s for s in report.skipped if s.kind == "metric" and s.layer == layer]
    if not metrics and not skipped:
        return None
    verdicts = {m.id: report.status(m) for m in metrics}
    id_width = max((len(m.id) for m in metrics), default=6)
    status_width = max((len(v[0]) for v in verdicts.values() if v), default=6)
    has_logged = any(m.logged is not None for m in metrics)
    spark, show_logged = table_layout(width - PANEL_CHROME, id_width, status_width, has_logged)
    table = Table(box=None, pad_edge=False, padding=(0, GAP // 2))
    table.add_column("metric", no_wrap=True, min_width=id_width)
    table.add_column("value", justify="right", no_wrap=True, min_width=VALUE_WIDTH)
    if show_logged:  # the trainer's own value next to rlscope's recomputation
        table.add_column("logged", justify="right", no_wrap=True)
    if spark:
        table.add_column("trend", no_wrap=True, min_width=spark)
    table.add_column("status", no_wrap=True, min_width=status_width)
    part = ""
    for metric in metrics:
        if metric.part != part:
            part = metric.part
            table.add_row(Text(PART_HEADINGS[part], style="italic"))
        verdict = verdicts[metric.id]
        if verdict is None:
            state = Text("")
        else:
            label, kind = verdict
            state = Text(
                safe_text(label), style=STATUS_STYLE.get(kind) or SEVERITY_STYLE.get(kind) or ""
            )
        logged = [format_value(metric.logged.value) if metric.logged else ""] if show_logged else []
        trend = [Text(sparkline(metric.values, spark), style="blue")] if spark else []
        table.add_row(
            Text(safe_text(metric.id), style="bold"),
            Text(format_value(metric.value)),
            *(Text(v) for v in logged),
            *trend,
            state,
        )
    lines: list = [table] if metrics else []
    for metric in metrics:
        detail = metric_detail(metric)
        if metric.logged is not None and not show_logged:
            logged_text = f"logged {metric.logged.column} = {format_value(metric.logged.value)}"
            detail = "; ".join(p for p in (logged_text, detail) if p)
        if detail:
            lines.append(Text(safe_text(f"{metric.id}: {detail}"), style="dim"))
    by_reason: dict[str, list[str]] = {}
    for skip in skipped:  # one line per reason: a steps-only run lacks the same table 40 times
        by_reason.setdefault(skip.reason, []).append(skip.metric)
    for reason, ids in by_reason.items():
        lines.append(Text(safe_text(f"skipped {', '.join(ids)}: {reason}"), style="dim"))
    return Panel(Group(*lines), title=f"{layer} {LAYERS[layer]}", title_align="left")


def metric_detail(metric: MetricResult) -> str:
    """One line for the extras a sparkline cannot show: how a series declined, distributions,
    trends and curves."""
    extra = metric.extra
    parts = []
    decline = extra.get("decline") or {}
    if decline.get("shape") in ("cliff", "smooth"):
        lo, hi = decline.get("steepest_steps", [None, None])
        parts.append(
            f"{decline['shape']} decline {format_value(decline['start']).strip()} → "
            f"{format_value(decline['end']).strip()}"
            + (
                f", steepest {100 * decline['steepest_share']:.0f}% within steps {lo}–{hi}"
                if decline["shape"] == "cliff"
                else ""
            )
        )
    clusters = (extra.get("cluster_sizes") or {}).get("final_window")
    if clusters:
        shown = " ".join(f"{size}:{count}" for size, count in list(clusters.items())[:10])
        parts.append(f"cluster sizes (final window, size:count) {shown}")
    trend = extra.get("trend") or {}
    if trend.get("slope_per_100_steps") is not None:
        parts.append(
            f"gap {trend['first']:+.3f} → {trend['last']:+.3f} "
            f"({trend['slope_per_100_steps']:+.3f} per 100 steps)"
        )
    curve = extra.get("curve") or {}
    if curve.get("fraction"):
        points = zip(curve["fraction"], curve["unchanged"], strict=True)
        parts.append("unchanged by CoT kept " + " ".join(f"{x:g}:{y:.2f}" for x, y in points))
    return "; ".join(parts)


def _findings(report: Report, *, quiet: bool = False) -> Panel:
    if not report.findings:
        body: Text | Table | Group = Text(
            "No findings: nothing at info level or above.", style="green"
        )
    else:
        body = Table(expand=True, box=None, pad_edge=False, show_header=False)
        body.add_column(no_wrap=True)
        body.add_column(no_wrap=True)
        body.add_column(ratio=1)
        for root, consequences in report.causal_groups():
            for finding in (root, *consequences):
                message = Text(safe_text(finding.message))
                since = finding.when()
                if finding.caused_by:
                    message.append(
                        safe_text(f" Because of {', '.join(finding.caused_by)}; {since}."),
                        style="dim",
                    )
                elif since:
                    message.append(safe_text(f" {since[0].upper()}{since[1:]}."), style="dim")
                arrow = "↳ " if finding is not root else ""
                body.add_row(
                    Text(finding.severity.upper(), style=SEVERITY_STYLE[finding.severity]),
                    Text(safe_text(f"{arrow}{finding.id} ({finding.layer})"), style="bold"),
                    message,
                )
    if quiet:  # only what fired
        return Panel(body, title="Findings", title_align="left")
    if report.inputs_missing:
        missing = Table.grid(padding=(0, 1))
        missing.add_column(no_wrap=True)
        missing.add_column()
        for group in report.inputs_missing:
            missing.add_row("•", Text(safe_text(group.line())), style="dim")
        body = Group(body, Text("not checked, inputs missing:", style="dim"), missing)
    unchecked = [s for s in report.skipped if s.kind == "finding" and not s.failed]
    waiting = [f"{s.metric} ({s.needs_steps})" for s in unchecked if s.needs_steps is not None]
    if waiting:
        text = f"not judged yet (steps needed): {', '.join(waiting)}"
        body = Group(body, Text(safe_text(text), style="dim"))
    return Panel(body, title="Findings", title_align="left")


def summary_line(report: Report) -> Text:
    """The verdict in one line, first: the counts, then each root cause with the step it began
    and what it explains: `2 critical, 1 warn: performance-regression since step 2 (→ kl-high,
    dead-prompts), grad-spike since step 134`."""
    if not report.findings:
        return Text("verdict: no findings (nothing at info level or above)", style="bold green")
    counts = {s: sum(f.severity == s for f in report.findings) for s in SEVERITY_ORDER}
    worst = next(s for s in SEVERITY_ORDER if counts[s])
    text = Text("verdict: ", style="bold")
    text.append(", ".join(f"{n} {s}" for s, n in counts.items() if n), style=SEVERITY_STYLE[worst])
    parts = []
    for root, consequences in report.causal_groups():
        part = root.id + (f" since step {root.began}" if root.began is not None else "")
        explained = list(dict.fromkeys(f.id for f in consequences if f.id != root.id))
        parts.append(part + (f" (→ {', '.join(explained)})" if explained else ""))
    text.append(": " + ", ".join(dict.fromkeys(parts)))
    return text


def render_terminal(report: Report, console: Console, *, quiet: bool = False) -> None:
    """The report; `quiet`: the verdict line and the findings only (what fired: not the
    findings that could not be judged, nor the notes)."""
    parts: list = [summary_line(report)]
    if not quiet:
        parts.append(_header(report))
        for layer in LAYERS:
            panel = _layer_panel(report, layer, console.width)
            if panel is not None:
                parts.append(panel)
    parts.append(_findings(report, quiet=quiet))
    if not quiet:
        for note in report.notes:
            parts.append(Text(safe_text(f"note: {note}"), style="dim"))
    for warning in report.warnings:
        parts.append(Text(safe_text(f"warning: {warning}"), style="yellow"))
    if not quiet:
        parts.append(Text("`rlscope explain ID` explains any metric or finding.", style="dim"))
    console.print(Group(*parts))
