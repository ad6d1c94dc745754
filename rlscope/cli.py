"""The `rlscope` command: parses options, calls the library, renders; no computation here."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from rlscope.errors import RlscopeError
from rlscope.render.sanitize import safe_text

app = typer.Typer(
    name="rlscope",
    help="Is this RL post-training run healthy? Layered metrics and diagnoses from Parquet "
    "logs.\n\n"
    "Examples:\n\n"
    "  rlscope analyze runs/grpo-7b\n\n"
    "  rlscope analyze runs/grpo-7b --format json --fail-on warn\n\n"
    "  rlscope explain entropy-collapse",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)

FAIL_LEVELS = ("info", "warn", "critical", "never")


def _stdout() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal:  # pipes and CI logs: wide enough for one metric per line
        console = Console(highlight=False, width=110)
    return console


def _stderr() -> Console:
    return Console(stderr=True, highlight=False)


def _say(console: Console, text: object, *, multiline: bool = False, **options: object) -> None:
    """Print untrusted text: controls escaped (`safe_text`), no markup, emoji or highlighting."""
    from rich.text import Text

    console.print(Text(safe_text(text, multiline=multiline)), **options)  # type: ignore[arg-type]


def _markup_safe(text: object) -> str:
    """Untrusted text for a Rich markup context (progress and status descriptions)."""
    from rich.markup import escape

    return escape(safe_text(text))


def _fail(exc: RlscopeError) -> None:
    # The message may span lines (a quoted parser error, the hint); controls are escaped.
    message = f"error: {safe_text(exc.message, multiline=True)}"
    if exc.hint:
        message += f"\n  hint: {safe_text(exc.hint, multiline=True)}"
    _say(Console(stderr=True, highlight=False, soft_wrap=True), message, multiline=True)
    raise typer.Exit(2)


def parse_steps(text: str | None) -> tuple[int | None, int | None]:
    """`A:B`, `A:` or `:B` (inclusive) into a step range."""
    if not text:
        return (None, None)
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        raise RlscopeError(f"--steps {text!r}: expected A:B, A: or :B with integer steps") from None
    if bounds[0] is not None and bounds[1] is not None and bounds[0] > bounds[1]:
        raise RlscopeError(f"--steps {text!r}: the start is after the end")
    return bounds


def parse_pairs(values: list[str], flag: str) -> dict[str, str]:
    """`KEY=VALUE` strings (repeated flags, or comma-separated) into a dict."""
    pairs: dict[str, str] = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key.strip():
            raise RlscopeError(f"{flag} {value!r}: expected KEY=VALUE")
        pairs[key.strip().replace("-", "_")] = rest.strip()
    return pairs


@contextmanager
def _progress(what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar on stderr when it is a terminal; the callback gets (done, total)."""
    err = _stderr()
    if not err.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task(_markup_safe(what), total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@app.command()
def analyze(
    run: Annotated[Path, typer.Argument(help="Run directory (run.json + Parquet tables).")],
    format: Annotated[str, typer.Option("--format", "-f", help="text or json.")] = "text",
    steps: Annotated[str | None, typer.Option(help="Step range A:B (inclusive), A: or :B.")] = None,
    fail_on: Annotated[
        str, typer.Option(help="Exit 1 on a finding at or above: info, warn, critical, never.")
    ] = "critical",
    metrics: Annotated[
        str | None, typer.Option(help="Comma-separated metric ids to compute (default: all).")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(help="TOML with [findings.ID] overrides (default: ./rlscope.toml)."),
    ] = None,
    from_format: Annotated[
        str | None,
        typer.Option(
            "--from", help="RUN is a trainer's output in this format (verl, trl, ...): import it."
        ),
    ] = None,
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-o", help="Import option KEY=VALUE (with --from); repeatable."),
    ] = None,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Where --from imports go (default: the user cache dir).")
    ] = None,
) -> None:
    """Compute every metric layer by layer, diagnose, and print the report.

    Examples:

      rlscope analyze sample_logs/healthy

      rlscope analyze runs/r1 --format json --steps 100:500 > r1.json

      rlscope analyze runs/r1 --fail-on warn   # exit 1 on any warning (CI)

      rlscope analyze verl_dumps/ --from verl   # a trainer's own output, imported to the cache

    Exit codes: 0 nothing at or above --fail-on, 1 there is, 2 usage or input error.
    """
    from rlscope.analysis import analyze as run_analysis
    from rlscope.config import load_config
    from rlscope.render.json import render_json
    from rlscope.render.terminal import render_terminal

    try:
        if format not in ("text", "json"):
            raise RlscopeError(f"--format {format!r}: choose text or json")
        if fail_on not in FAIL_LEVELS:
            raise RlscopeError(f"--fail-on {fail_on!r}: choose one of {', '.join(FAIL_LEVELS)}")
        step_range = parse_steps(steps)
        metric_ids = [m.strip() for m in metrics.split(",") if m.strip()] if metrics else None
        settings = load_config(config)
        if option and from_format is None:
            raise RlscopeError("--option is for imports: use it with --from FORMAT")
        options = parse_pairs(option or [], "--option")
        with _progress(f"analysing {run}") as progress:
            report = run_analysis(
                run,
                steps=step_range,
                metrics=metric_ids,
                config=settings,
                from_format=from_format,
                import_options=options,
                cache_dir=cache_dir,
                progress=progress,
            )
    except RlscopeError as exc:
        _fail(exc)
    if format == "json":
        sys.stdout.write(render_json(report) + "\n")
    else:
        render_terminal(report, _stdout())
    if report.breaches(fail_on):
        raise typer.Exit(1)


@app.command()
def validate(
    run: Annotated[Path, typer.Argument(help="Run directory to check.")],
) -> None:
    """Check a run directory's layout, run.json and every file's schema.

    Examples:

      rlscope validate runs/r1

    Exit codes: 0 valid, 2 a problem (named with its file and column).
    """
    from rlscope.reader import open_run

    try:
        checked = open_run(run)
    except RlscopeError as exc:
        _fail(exc)
    out = _stdout()
    _say(out, f"{run}: valid format-v1 run `{checked.meta.get('run_id')}`")
    for name, table in checked.tables.items():
        _say(
            out,
            f"  {name}: {table.n_rows:,} rows in {len(table.files)} file(s); columns: "
            + ", ".join(table.schema),
        )
        for column, how in checked.derived_columns(name).items():
            _say(out, f"    derived {column}: {how}")
    for warning in checked.warnings:
        _say(_stderr(), f"warning: {warning}")


@app.command("metrics")
def list_metrics() -> None:
    """List every metric and finding id (stable ids: gate CI on them).

    Examples:

      rlscope metrics
    """
    from rich.table import Table

    from rlscope.registry import METRICS, RULES, load_all

    load_all()
    table = Table(title="Metrics", title_justify="left")
    for column in ("id", "layer", "what"):
        table.add_column(column)
    for metric in METRICS.values():
        table.add_row(metric.id, metric.layer, metric.title)
    findings = Table(title="Findings", title_justify="left")
    for column in ("id", "layer", "severity", "what"):
        findings.add_column(column)
    for rule in RULES.values():
        findings.add_row(rule.id, rule.layer, rule.severity, rule.title)
    out = _stdout()
    out.print(table)
    out.print(findings)
    out.print("`rlscope explain ID` prints the full doc.", markup=False)


@app.command()
def explain(
    id: Annotated[
        str, typer.Argument(help="A metric id (stability.kl) or finding id (kl-runaway).")
    ],
) -> None:
    """Print what a metric or finding measures, why it matters, its healthy range, what to try.

    Examples:

      rlscope explain signal.pass_at_k

      rlscope explain entropy-collapse
    """
    from rlscope.registry import METRICS, RULES, lookup

    item = lookup(id)
    if item is None:
        close = [i for i in [*METRICS, *RULES] if id.lower() in i.lower()]
        hint = f"did you mean {', '.join(close[:5])}?" if close else "`rlscope metrics` lists ids"
        _fail(RlscopeError(f"unknown id {id!r}", hint=hint))
    _stdout().print(item.explain(), markup=False, highlight=False)


@app.command()
def synth(
    out: Annotated[Path, typer.Argument(help="New run directory to create.")],
    scenario: Annotated[str, typer.Option(help="healthy, or a finding's name.")] = "healthy",
    steps: Annotated[int, typer.Option(min=10, help="Optimizer steps.")] = 200,
    prompts: Annotated[int, typer.Option(min=1, help="Prompts per step.")] = 32,
    group_size: Annotated[int, typer.Option(min=1, help="Rollouts per prompt (N).")] = 8,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    tokens: Annotated[bool, typer.Option(help="Write the per-token table.")] = True,
) -> None:
    """Generate a synthetic run from the documented latent model, healthy or with one pathology.

    Examples:

      rlscope synth /tmp/healthy

      rlscope synth /tmp/collapse --scenario entropy-collapse --steps 300

      rlscope synth --help   # lists scenarios
    """
    from rlscope.synth import SCENARIOS, generate

    try:
        if scenario not in SCENARIOS:
            raise RlscopeError(
                f"unknown scenario {scenario!r}", hint="choose one of " + ", ".join(SCENARIOS)
            )
        if out.exists() and any(out.iterdir()):
            raise RlscopeError(f"{out}: exists and is not empty", hint="pick a new directory")
        err = _stderr()
        with err.status(_markup_safe(f"writing {scenario} run to {out} …")):
            path = generate(
                out,
                scenario,
                steps=steps,
                prompts_per_step=prompts,
                group_size=group_size,
                seed=seed,
                tokens=tokens,
            )
    except RlscopeError as exc:
        _fail(exc)
    _say(_stdout(), f"wrote {path}")


@app.command("import")
def import_command(
    format: Annotated[str, typer.Argument(help="verl, verl-metrics, trl or jsonl.")],
    source: Annotated[Path, typer.Argument(help="The trainer's output (read, never written).")],
    out: Annotated[Path, typer.Argument(help="The format-v1 run directory to write or extend.")],
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-o", help="Importer option KEY=VALUE; repeatable."),
    ] = None,
    reward_column: Annotated[
        list[str] | None, typer.Option(help="trl: reward column(s) to sum (default: all).")
    ] = None,
    map: Annotated[
        str | None, typer.Option(help="jsonl: format-v1 name=source key, comma-separated.")
    ] = None,
    split: Annotated[
        str | None, typer.Option(help="verl/jsonl: train (default), eval_id, eval_ood, eval_*.")
    ] = None,
    strict: Annotated[bool, typer.Option(help="Stop at the first malformed line.")] = False,
) -> None:
    """Convert a trainer's own logs into a format-v1 run directory (incremental).

    Re-running on a grown source appends only the new steps. `rlscope formats FORMAT` lists
    each format's mapping and options.

    Examples:

      rlscope import verl /path/rollout_dumps runs/x

      rlscope import verl /path/val_dumps runs/x --split eval_id

      rlscope import verl-metrics /path/metrics.jsonl runs/x

      rlscope import trl outputs/grpo runs/y -o correct_column=accuracy_reward

      rlscope import jsonl logs.jsonl runs/z --map step=iter,prompt_id=uid,reward=score

    Exit codes: 0 imported, 2 a usage or input error (file and line named).
    """
    from rlscope.importers import import_run

    try:
        options: dict[str, object] = dict(parse_pairs(option or [], "--option"))
        if reward_column:
            options["reward_columns"] = ",".join(reward_column)
        if map:
            options["mapping"] = map
        if split:
            options["split"] = split
        if strict:
            options["strict"] = True
        with _progress(f"importing {source}") as progress:
            result = import_run(format, source, out, progress=progress, **options)
    except RlscopeError as exc:
        _fail(exc)
    _say(_stdout(), result.summary(), multiline=True, soft_wrap=True)


@app.command()
def formats(
    name: Annotated[str | None, typer.Argument(help="One format to describe in full.")] = None,
) -> None:
    """List the formats `rlscope import` and `analyze --from` read, or describe one.

    Examples:

      rlscope formats

      rlscope formats trl
    """
    from rlscope.importers import IMPORTERS

    out = _stdout()
    if name is None:
        for importer in IMPORTERS.values():
            out.print(f"{importer.name:14} {importer.summary}", markup=False)
        out.print("`rlscope formats NAME` shows the mapping and options.", markup=False)
        return
    importer = IMPORTERS.get(name)
    if importer is None:
        _fail(RlscopeError(f"unknown format {name!r}", hint="formats: " + ", ".join(IMPORTERS)))
    out.print(importer.doc, markup=False)


def main() -> None:
    try:
        app(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
