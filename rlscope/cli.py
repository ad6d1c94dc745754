"""The `rlscope` command: parses options, calls the library, renders; no computation here."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from rlscope.errors import RlscopeError
from rlscope.render.sanitize import safe_text

app = typer.Typer(
    name="rlscope",
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Is this RL post-training run healthy? Layered metrics and diagnoses from Parquet "
    "logs.\n\n"
    "Examples:\n\n"
    "  rlscope analyze runs/grpo-7b\n\n"
    "  rlscope analyze runs/grpo-7b --format json --fail-on warn\n\n"
    "  rlscope explain entropy-collapse",
    no_args_is_help=True,
    add_completion=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from rlscope._version import __version__

        typer.echo(f"rlscope {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Is this RL post-training run healthy? Layered metrics and diagnoses from Parquet logs."""


FAIL_LEVELS = ("info", "warn", "critical", "never")
# Options several commands share.
METRICS_HELP = (
    "Metrics to {}: comma-separated ids, layers (L3) or globs ('signal.*'); default: all."
)
StepsOption = Annotated[
    str | None, typer.Option(help="Step range A:B (inclusive), A: or :B.", metavar="A:B")
]
FromOption = Annotated[
    str | None,
    typer.Option(
        "--from",
        help="RUN is a trainer's output in this format (verl, trl, ...): import it.",
        metavar="FORMAT",
    ),
]
ImportOption = Annotated[
    list[str] | None,
    typer.Option(
        "--option",
        "-X",
        help="Import option KEY=VALUE (with --from); repeatable.",
        metavar="KEY=VALUE",
    ),
]
#: `-o` meant --option in analyze and import before it meant --output everywhere: still read
#: there, with a warning, for one more release.
SchedulerOption = Annotated[
    str | None,
    typer.Option(
        help="Run the token map on this cluster: a Dask scheduler (tcp://HOST:8786) or a Ray "
        "head's client server (ray://HOST:10001); default: $RLSCOPE_SCHEDULER, else in process. "
        "Workers must see the run's files at the same paths, or read its URL themselves.",
        metavar="ADDRESS",
    ),
]
#: `rlscope probe --kinds` by default: every intervention (rlscope.probe.interventions.KINDS).
PROBE_KINDS = "truncate,mistake,paraphrase,filler,bias"
LegacyOption = Annotated[list[str] | None, typer.Option("-o", hidden=True, metavar="KEY=VALUE")]
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        help="TOML with [findings.ID] overrides (default: ./rlscope.toml).", metavar="FILE"
    ),
]


def _stdout() -> Console:
    """The data console: the terminal's width; piped, `COLUMNS` when set, else 110 (CI logs
    are wide enough for one metric per line)."""
    import os

    console = Console(highlight=False)
    if not console.is_terminal and not os.environ.get("COLUMNS", "").strip().isdigit():
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


def _mapper(address: str | None) -> Callable[..., Any] | None:
    """The token map's engine for --scheduler (rlscope.cluster), imported only when asked."""
    from rlscope.cluster import scheduler_mapper

    return scheduler_mapper(address)


def _fail(exc: RlscopeError) -> NoReturn:
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


def parse_ids(text: str | None) -> list[str] | None:
    """`--metrics a,b` into ids (None: all)."""
    return [m.strip() for m in text.split(",") if m.strip()] if text else None


def import_options(from_format: str | None, option: list[str] | None) -> dict[str, str]:
    """`--option KEY=VALUE` pairs, only with `--from`."""
    if option and from_format is None:
        raise RlscopeError("--option is for imports: use it with --from FORMAT")
    return parse_pairs(option or [], "--option")


def with_legacy(option: list[str] | None, legacy: list[str] | None) -> list[str] | None:
    """--option values plus those given with the old `-o` spelling (warned about on stderr)."""
    if not legacy:
        return option
    _say(_stderr(), "warning: -o KEY=VALUE is deprecated (-o will mean --output); use -X KEY=VALUE")
    return [*(option or []), *legacy]


def check_align(align: str) -> None:
    if align not in ("step", "progress"):
        raise RlscopeError(f"--align {align!r}: choose step or progress")


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
    run: Annotated[
        str,
        typer.Argument(
            help="Run directory (run.json + Parquet tables), or its URL (s3://, gs://, az://, "
            "hf://).",
            metavar="RUN",
        ),
    ],
    format: Annotated[
        str, typer.Option("--format", "-f", help="text or json.", metavar="FORMAT")
    ] = "text",
    steps: StepsOption = None,
    fail_on: Annotated[
        str,
        typer.Option(
            help="Exit 1 on a finding at or above: info, warn, critical, never.", metavar="LEVEL"
        ),
    ] = "critical",
    metrics: Annotated[
        str | None, typer.Option(help=METRICS_HELP.format("compute"), metavar="IDS")
    ] = None,
    config: ConfigOption = None,
    from_format: FromOption = None,
    scheduler: SchedulerOption = None,
    option: ImportOption = None,
    legacy_option: LegacyOption = None,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where --from imports and files' partial results are kept (default: the "
            "user cache dir).",
            metavar="DIR",
        ),
    ] = None,
    cache: Annotated[
        bool,
        typer.Option(
            help="Reuse (and keep) each file's partial results, so re-analysing a growing run "
            "reads only its new files."
        ),
    ] = True,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Text: the verdict and the findings only.")
    ] = False,
) -> None:
    """Compute every metric layer by layer, diagnose, and print the report.

    Examples:

      rlscope analyze sample_logs/healthy

      rlscope analyze runs/r1 --format json --steps 100:500 > r1.json

      rlscope analyze s3://bucket/runs/r1   # read in place (AWS_* credentials, ~/.aws)

      rlscope analyze runs/r1 --fail-on warn   # exit 1 on any warning (CI)

      rlscope analyze verl_dumps/ --from verl   # a trainer's own output, imported to the cache

      rlscope analyze runs/r1 --no-cache   # read every token file, keep no partials

      rlscope analyze runs/r1 -q   # the verdict line and the findings only

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
        metric_ids = parse_ids(metrics)
        settings = load_config(config)
        options = import_options(from_format, with_legacy(option, legacy_option))
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
                use_cache=cache,
                mapper=_mapper(scheduler),
            )
    except RlscopeError as exc:
        _fail(exc)
    if format == "json":
        sys.stdout.write(render_json(report) + "\n")
    else:
        render_terminal(report, _stdout(), quiet=quiet)
    if report.breaches(fail_on):
        raise typer.Exit(1)


@app.command()
def validate(
    run: Annotated[str, typer.Argument(help="Run directory or URL to check.", metavar="RUN")],
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
def list_metrics(
    format: Annotated[
        str, typer.Option("--format", "-f", help="text or json.", metavar="FORMAT")
    ] = "text",
) -> None:
    """List every metric and finding id (stable ids: gate CI on them).

    Examples:

      rlscope metrics

      rlscope metrics --format json | jq '.findings[].id'
    """
    import json

    from rich.table import Table

    from rlscope import reference

    if format not in ("text", "json"):
        _fail(RlscopeError(f"--format {format!r}: choose text or json"))
    ref = reference.load()
    if format == "json":
        doc = {
            "metrics": [reference.as_json(m) for m in ref.metrics],
            "findings": [reference.as_json(r) for r in ref.findings],
        }
        sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=True) + "\n")
        return
    table = Table(title="Metrics", title_justify="left")
    for column in ("id", "layer", "what"):
        table.add_column(column)
    for metric in ref.metrics:
        table.add_row(metric["id"], metric["layer"], metric["title"])
    findings = Table(title="Findings", title_justify="left")
    for column in ("id", "layer", "severity", "what"):
        findings.add_column(column)
    for rule in ref.findings:
        findings.add_row(rule["id"], rule["layer"], rule["severity"], rule["title"])
    out = _stdout()
    out.print(table)
    out.print(findings)
    out.print("`rlscope explain ID` prints the full doc.", markup=False)


@app.command()
def explain(
    id: Annotated[
        str,
        typer.Argument(help="A metric id (stability.kl) or finding id (kl-runaway).", metavar="ID"),
    ],
    format: Annotated[
        str, typer.Option("--format", "-f", help="text or json.", metavar="FORMAT")
    ] = "text",
) -> None:
    """Print what a metric or finding measures, why it matters, its healthy range, what to try.

    Examples:

      rlscope explain signal.pass_at_k

      rlscope explain entropy-collapse --format json
    """
    from rlscope import reference

    ref = reference.load()
    item = ref.lookup(id)
    if item is None:
        _fail(RlscopeError(f"unknown id {id!r}", hint=ref.hint(id)))
    if format not in ("text", "json"):
        _fail(RlscopeError(f"--format {format!r}: choose text or json"))
    if format == "json":
        import json

        doc = reference.as_json(item)
        sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=True) + "\n")
        return
    _stdout().print(item["text"], markup=False, highlight=False)


@app.command()
def show(
    run: Annotated[str, typer.Argument(help="Run directory or URL.", metavar="RUN")],
    rollout_id: Annotated[
        int, typer.Argument(help="The rollout_id to open.", metavar="ROLLOUT_ID")
    ],
    format: Annotated[
        str, typer.Option("--format", "-f", help="text or json.", metavar="FORMAT")
    ] = "text",
    config: Annotated[
        Path | None,
        typer.Option(
            help="TOML with [tags] for parsing the response (default: ./rlscope.toml).",
            metavar="FILE",
        ),
    ] = None,
) -> None:
    """Open one rollout: its row, the response segment by segment, tool calls, token entropy
    as a heat strip over the text, and its probes.

    The tokens table has no token strings, so tokens are aligned to the response's words by
    position (approximate).

    Examples:

      rlscope show sample_logs/healthy 42

      rlscope show runs/r1 1234 --format json | jq .tokens.entropy

      rlscope rollouts runs/r1 --finding format-violations   # ids to open

    Exit codes: 0 shown, 2 unknown rollout id, usage or input error.
    """
    from rlscope.config import load_config
    from rlscope.inspect import rollout
    from rlscope.render.rollout import render_rollout, render_rollout_json

    try:
        if format not in ("text", "json"):
            raise RlscopeError(f"--format {format!r}: choose text or json")
        _require_rollouts(run)
        view = rollout(run, rollout_id, tags=load_config(config).text.tags)
    except RlscopeError as exc:
        _fail(exc)
    if format == "json":
        sys.stdout.write(render_rollout_json(view) + "\n")
    else:
        render_rollout(view, _stdout())


def _require_rollouts(path: str) -> None:
    """A clear error for a run with step metrics only (no rollouts table)."""
    from rlscope.reader import open_run

    open_run(path).require("rollouts")


@app.command("rollouts")
def rollouts_command(
    run: Annotated[str, typer.Argument(help="Run directory or URL.", metavar="RUN")],
    finding: Annotated[
        str | None,
        typer.Option(help="A finding id: the rollouts its evidence names.", metavar="ID"),
    ] = None,
    where: Annotated[
        str | None,
        typer.Option(
            "--filter",
            help='Filter, e.g. \'reward > 0.5 and (split == "train" or answer contains "42")\'.',
            metavar="EXPR",
        ),
    ] = None,
    limit: Annotated[int, typer.Option(min=0, help="Show at most N rollouts.", metavar="N")] = 20,
    format: Annotated[
        str, typer.Option("--format", "-f", help="text or json.", metavar="FORMAT")
    ] = "text",
    config: ConfigOption = None,
) -> None:
    """List rollouts named by a finding and/or matching a filter, sorted by step and id.

    --filter takes comparisons `column OP value` (OP: == != < <= > >=; value: a number, true,
    false, null or a quoted string) and `column contains "text"`, combined with and, or, not
    and parentheses; columns are the rollouts table's (`backticks` for odd names). Rows where
    the column is null match only `== null`. --finding analyses the run and takes the rollout
    ids from that finding's evidence; given both, a rollout must match both.

    Examples:

      rlscope rollouts runs/r1 --finding format-violations

      rlscope rollouts runs/r1 --filter 'correct == false and step >= 100'

      rlscope rollouts runs/r1 --filter 'answer contains "42"' --limit 100

      rlscope rollouts runs/r1 --finding grad-spike --format json

    Exit codes: 0 listed (also when nothing matched or the finding did not fire), 2 unknown
    finding id or column, bad filter, usage or input error.
    """
    from rlscope.config import load_config
    from rlscope.inspect import rollouts
    from rlscope.render.rollout import render_rollout_list, render_rollout_list_json

    try:
        if format not in ("text", "json"):
            raise RlscopeError(f"--format {format!r}: choose text or json")
        settings = load_config(config)
        _require_rollouts(run)
        with _progress(f"listing rollouts of {run}"):
            listing = rollouts(run, finding=finding, where=where, limit=limit, config=settings)
    except RlscopeError as exc:
        _fail(exc)
    if format == "json":
        sys.stdout.write(render_rollout_list_json(listing) + "\n")
    else:
        render_rollout_list(listing, _stdout())


@app.command()
def synth(
    out: Annotated[Path, typer.Argument(help="New run directory to create.", metavar="OUT")],
    scenario: Annotated[
        str, typer.Option(help="healthy, or a finding's name.", metavar="NAME")
    ] = "healthy",
    steps: Annotated[int, typer.Option(min=10, help="Optimizer steps.", metavar="N")] = 200,
    prompts: Annotated[int, typer.Option(min=1, help="Prompts per step.", metavar="N")] = 32,
    group_size: Annotated[
        int, typer.Option(min=1, help="Rollouts per prompt (N).", metavar="N")
    ] = 8,
    seed: Annotated[int, typer.Option(help="Random seed.", metavar="N")] = 0,
    tokens: Annotated[bool, typer.Option(help="Write the per-token table.")] = True,
    text: Annotated[bool, typer.Option(help="Write response text and probes.")] = True,
    length_scale: Annotated[
        float,
        typer.Option(min=0.01, help="Multiply response lengths (and their cap).", metavar="X"),
    ] = 1.0,
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
                text=text,
                length_scale=length_scale,
            )
    except RlscopeError as exc:
        _fail(exc)
    _say(_stdout(), f"wrote {path}")


@app.command("import")
def import_command(
    format: Annotated[
        str,
        typer.Argument(
            help="verl, verl-metrics, trl, jsonl, tensorboard, wandb or mlflow.", metavar="FORMAT"
        ),
    ],
    source: Annotated[
        str,
        typer.Argument(
            help="The trainer's output, a path or a URL (read, never written).", metavar="SOURCE"
        ),
    ],
    out: Annotated[
        str,
        typer.Argument(help="The format-v1 run directory to write or extend.", metavar="OUT"),
    ],
    option: Annotated[
        list[str] | None,
        typer.Option(
            "--option", "-X", help="Importer option KEY=VALUE; repeatable.", metavar="KEY=VALUE"
        ),
    ] = None,
    legacy_option: LegacyOption = None,
    reward_column: Annotated[
        list[str] | None,
        typer.Option(help="trl: reward column(s) to sum (default: all).", metavar="COLUMN"),
    ] = None,
    map: Annotated[
        str | None,
        typer.Option(
            help="jsonl: format-v1 name=source key, comma-separated.", metavar="NAME=KEY,..."
        ),
    ] = None,
    split: Annotated[
        str | None,
        typer.Option(
            help="verl/jsonl: train (default), eval_id, eval_ood, eval_*.", metavar="SPLIT"
        ),
    ] = None,
    strict: Annotated[bool, typer.Option(help="Stop at the first malformed line.")] = False,
    run: Annotated[
        str | None,
        typer.Option(
            help="mlflow: the run's id or name (default: the store's only run).", metavar="RUN_ID"
        ),
    ] = None,
) -> None:
    """Convert a trainer's own logs into a format-v1 run directory (incremental).

    Re-running on a grown source appends only the new steps. `rlscope formats FORMAT` lists
    each format's mapping and options.

    Examples:

      rlscope import verl /path/rollout_dumps runs/x

      rlscope import verl /path/val_dumps runs/x --split eval_id

      rlscope import verl-metrics /path/metrics.jsonl runs/x

      rlscope import trl outputs/grpo runs/y -X correct_column=accuracy_reward

      rlscope import jsonl logs.jsonl runs/z --map step=iter,prompt_id=uid,reward=score

      rlscope import wandb wandb/run-20250101_120000-abc123 runs/w

      rlscope import mlflow /tmp/mlruns.db runs/m --run 1f2e3d...

    Exit codes: 0 imported, 2 a usage or input error (file and line named).
    """
    from rlscope.importers import import_run

    try:
        options: dict[str, Any] = dict(
            parse_pairs(with_legacy(option, legacy_option) or [], "--option")
        )
        if reward_column:
            options["reward_columns"] = ",".join(reward_column)
        if map:
            options["mapping"] = map
        if split:
            options["split"] = split
        if strict:
            options["strict"] = True
        if run:
            options["run"] = run
        with _progress(f"importing {source}") as progress:
            result = import_run(format, source, out, progress=progress, **options)
    except RlscopeError as exc:
        _fail(exc)
    _say(_stdout(), result.summary(), multiline=True, soft_wrap=True)


@app.command()
def formats(
    name: Annotated[
        str | None, typer.Argument(help="One format to describe in full.", metavar="NAME")
    ] = None,
) -> None:
    """List the formats `rlscope import` and `analyze --from` read, or describe one.

    Examples:

      rlscope formats

      rlscope formats trl
    """
    from rlscope import reference

    out = _stdout()
    known = {f["name"]: f for f in reference.load().formats}
    if name is None:
        for listed in known.values():
            out.print(f"{listed['name']:14} {listed['summary']}", markup=False)
        out.print("`rlscope formats NAME` shows the mapping and options.", markup=False)
        return
    if name not in known:
        _fail(RlscopeError(f"unknown format {name!r}", hint="formats: " + ", ".join(known)))
    out.print(known[name]["doc"], markup=False)


@app.command()
def compare(
    runs: Annotated[
        list[str],
        typer.Argument(
            help="Two or more run directories or URLs; the first is the baseline.",
            metavar="RUN...",
        ),
    ],
    format: Annotated[
        str, typer.Option("--format", "-f", help="text or json.", metavar="FORMAT")
    ] = "text",
    metrics: Annotated[
        str | None, typer.Option(help=METRICS_HELP.format("compare"), metavar="IDS")
    ] = None,
    align: Annotated[
        str,
        typer.Option(
            help="Align curves by `step`, or by `progress` (fraction of training).",
            metavar="step|progress",
        ),
    ] = "step",
    steps: StepsOption = None,
    config: ConfigOption = None,
    from_format: FromOption = None,
    scheduler: SchedulerOption = None,
    option: ImportOption = None,
    fail_on_regression: Annotated[
        bool,
        typer.Option(
            "--fail-on-regression",
            help="Exit 1 when a run is significantly worse than the baseline on a metric with "
            "a direction (task outcomes, error rates) or further from its healthy band (a CI "
            "gate: is the new run worse than main?).",
        ),
    ] = False,
) -> None:
    """Compare runs side by side: every metric per run, its delta to the first run with a
    bootstrap interval, which run is healthier, overlaid curves, and findings per run.

    A difference is called out (better/worse) only when the 95% bootstrap interval of the
    difference of final-window means excludes 0, and only for a metric with a direction (task
    outcomes, error rates) or a healthy band (the run closer to it); others only differ. Each
    run's verdict line leads with the task outcome (pass@1, pass@k, eval accuracy, reward).

    Examples:

      rlscope compare runs/baseline runs/new-lr

      rlscope compare runs/a runs/b runs/c --align progress --metrics signal.pass_at_1

      rlscope compare runs/a runs/b --format json > diff.json

      rlscope compare trl_out/base trl_out/new --from trl

      rlscope compare runs/main runs/pr --fail-on-regression   # CI: exit 1 if worse

    Exit codes: 0 compared (with --fail-on-regression: and no run worse), 1 a run is worse
    than the baseline (--fail-on-regression), 2 usage or input error.
    """
    from rlscope.comparison import compare as run_compare
    from rlscope.config import load_config
    from rlscope.render.compare import render_comparison, render_comparison_json

    try:
        if format not in ("text", "json"):
            raise RlscopeError(f"--format {format!r}: choose text or json")
        check_align(align)
        metric_ids = parse_ids(metrics)
        options = import_options(from_format, option)
        with _progress(f"comparing {len(runs)} runs"):
            comparison = run_compare(
                runs,
                metrics=metric_ids,
                align=align,
                steps=parse_steps(steps),
                config=load_config(config),
                from_format=from_format,
                import_options=options,
                mapper=_mapper(scheduler),
            )
    except RlscopeError as exc:
        _fail(exc)
    if format == "json":
        sys.stdout.write(render_comparison_json(comparison) + "\n")
    else:
        render_comparison(comparison, _stdout())
    if fail_on_regression and comparison.regressed:
        raise typer.Exit(1)


CHECK_FORMATS = ("text", "json", "junit", "github", "markdown")


@app.command()
def check(
    run: Annotated[
        str,
        typer.Argument(help="Run directory or URL to check (may still be written).", metavar="RUN"),
    ],
    baseline: Annotated[
        str | None,
        typer.Option(help="Baseline run for relative gates (max_drop, max_rise).", metavar="RUN"),
    ] = None,
    gates: Annotated[
        Path | None,
        typer.Option(
            help='TOML with [gates."METRIC"], fail_on and [findings.ID] (default: '
            "./rlscope.toml, else [tool.rlscope] in ./pyproject.toml).",
            metavar="FILE",
        ),
    ] = None,
    fail_on: Annotated[
        str | None,
        typer.Option(
            help="Fail on a gate or finding at or above: info, warn, critical, never "
            "(default: the gates file's fail_on, else critical).",
            metavar="LEVEL",
        ),
    ] = None,
    format: Annotated[
        str,
        typer.Option(
            "--format", "-f", help="text, json, junit, github or markdown.", metavar="FORMAT"
        ),
    ] = "text",
    steps: StepsOption = None,
    exit_zero: Annotated[
        bool, typer.Option("--exit-zero", help="Report breaches but exit 0.")
    ] = False,
    watch: Annotated[
        float | None,
        typer.Option(
            help="Re-check every SECONDS as files arrive; exit 1 at the first breach "
            "(Ctrl-C stops).",
            metavar="SECONDS",
        ),
    ] = None,
    from_format: FromOption = None,
    scheduler: SchedulerOption = None,
    option: ImportOption = None,
) -> None:
    """Gate a run in CI: evaluate metric gates and findings, exit 1 on a breach.

    Gates are data (see docs/guides/ci-gating.md): per metric id `min`/`max`, or relative to
    --baseline `max_drop`/`max_rise` (a fraction of |baseline value|) and
    `max_drop_abs`/`max_rise_abs` (in the metric's units), each with a severity. A gate on an
    unknown metric id, or on a metric the run cannot compute, is a configuration error (2).
    A run still being written is read as a snapshot of its complete files; the output names
    the last step seen.

    Examples:

      rlscope check runs/r1 --gates rlscope.toml

      rlscope check runs/new --baseline runs/main --format github

      rlscope check runs/new --format markdown >> "$GITHUB_STEP_SUMMARY"

      rlscope check runs/new --format junit > rlscope-junit.xml

      rlscope check runs/live --watch 60   # a training job's sidecar

    Exit codes: 0 pass, 1 a gate or finding breached, 2 usage, config or input error.
    """
    from rlscope.gates import CheckResult, load_gates
    from rlscope.gates import check as run_check
    from rlscope.gates import watch as run_watch
    from rlscope.render.ci import render, render_text

    try:
        if format not in CHECK_FORMATS:
            raise RlscopeError(f"--format {format!r}: choose one of {', '.join(CHECK_FORMATS)}")
        if fail_on is not None and fail_on not in FAIL_LEVELS:
            raise RlscopeError(f"--fail-on {fail_on!r}: choose one of {', '.join(FAIL_LEVELS)}")
        if watch is not None and watch <= 0:
            raise RlscopeError(f"--watch {watch}: give a positive number of seconds")
        step_range = parse_steps(steps)
        spec = load_gates(gates)
        options = import_options(from_format, option)
        mapper = _mapper(scheduler)

        took = [0.0]

        def once() -> CheckResult:
            start = time.perf_counter()
            result = run_check(
                run,
                baseline=baseline,
                gates=spec,
                fail_on=fail_on,
                steps=step_range,
                from_format=from_format,
                import_options=options,
                mapper=mapper,
            )
            took[0] = time.perf_counter() - start
            return result

        if watch is None:
            with _progress(f"checking {run}"):
                result = once()
        else:
            err = _stderr()

            def progress_line(result: CheckResult) -> None:
                state = "breach" if result.failed else "ok"
                info = result.report.run
                files = {"tokens": (info.token_files, info.token_files_read), **info.table_files}
                read = ", ".join(f"{t} {r:,} of {n:,}" for t, (n, r) in files.items() if n)
                _say(
                    err,
                    f"checked {run} in {took[0]:.1f} s (files read: {read or 'none'}): "
                    f"last step seen {result.last_step}: {state}",
                )

            try:
                result = run_watch(once, run, interval=watch, on_result=progress_line)
            except KeyboardInterrupt:
                _say(err, "stopped")
                raise typer.Exit(0) from None
    except RlscopeError as exc:
        _fail(exc)
    if format == "text":
        render_text(result, _stdout())
    else:
        sys.stdout.write(render(result, format) + "\n")
    if result.failed and not exit_zero:
        raise typer.Exit(1)


@app.command()
def probe(
    run: Annotated[
        str,
        typer.Argument(help="Run directory (or, with --from, a trainer's output).", metavar="RUN"),
    ],
    endpoint: Annotated[
        str,
        typer.Option(
            help="The server's OpenAI API root, e.g. http://127.0.0.1:8000/v1.", metavar="URL"
        ),
    ],
    model: Annotated[str, typer.Option(help="The model name the server serves.", metavar="NAME")],
    steps: StepsOption = None,
    per_step: Annotated[int, typer.Option(help="Rollouts probed per step.", metavar="N")] = 4,
    kinds: Annotated[
        str,
        typer.Option(
            help="Interventions, comma-separated: truncate, mistake, paraphrase, filler, bias.",
            metavar="KINDS",
        ),
    ] = PROBE_KINDS,
    fractions: Annotated[
        str | None,
        typer.Option(
            help="Fractions of the chain for truncate, mistake and paraphrase, comma-separated "
            "(default: truncate 0,0.25,0.5,0.75,1; mistake 0.25,0.5,0.75; paraphrase 0.5,1).",
            metavar="F,...",
        ),
    ] = None,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at most.", metavar="C")] = 4,
    max_tokens: Annotated[
        int, typer.Option(help="Tokens generated per request at most.", metavar="N")
    ] = 256,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.", metavar="T")] = 0.0,
    seed: Annotated[
        int, typer.Option(help="Which rollouts are picked, and the sampling seed.")
    ] = 0,
    checkpoint_step: Annotated[
        int | None,
        typer.Option(
            help="The training step of the weights the server serves (recorded).", metavar="S"
        ),
    ] = None,
    split: Annotated[
        str, typer.Option(help="Which rollouts: train, eval_id, ….", metavar="SPLIT")
    ] = "train",
    editor_endpoint: Annotated[
        str | None,
        typer.Option(
            help="Server of the model that writes mistakes and paraphrases (default: --endpoint).",
            metavar="URL",
        ),
    ] = None,
    editor_model: Annotated[
        str | None, typer.Option(help="That model (default: --model).", metavar="NAME")
    ] = None,
    api_key_env: Annotated[
        str,
        typer.Option(
            help="Environment variable holding the API key, if the server needs one.", metavar="VAR"
        ),
    ] = "OPENAI_API_KEY",
    retries: Annotated[
        int,
        typer.Option(
            help="Retries of a request on 429, 5xx, timeouts (backoff 0.5 s to 8 s).", metavar="N"
        ),
    ] = 4,
    timeout: Annotated[
        float, typer.Option(help="Seconds a request may take.", metavar="S")
    ] = 120.0,
    give_up_after: Annotated[
        float,
        typer.Option(
            help="Give up on a server that has completed no request for S seconds while asked "
            "(refused, timed out, 5xx, or silent): exit 2, what was answered kept.",
            metavar="S",
        ),
    ] = 60.0,
    dry_run: Annotated[
        bool, typer.Option(help="Print the plan; send nothing, write nothing.")
    ] = False,
    format: Annotated[
        str, typer.Option("--format", "-f", help="text or json.", metavar="FORMAT")
    ] = "text",
    config: ConfigOption = None,
    from_format: FromOption = None,
    option: ImportOption = None,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Where --from imports are kept.", metavar="DIR")
    ] = None,
) -> None:
    """Generate faithfulness probes (L6) through an OpenAI-compatible server, into the run.

    Picks rollouts per step (correct and incorrect, with a reasoning section and an answer),
    intervenes on their chain of thought (cut short, a mistake, paraphrased, filler, a biased
    prompt), has the served model answer, and appends the probes to the run. Interrupted, it
    resumes without duplicates. A server that completes no request for --give-up-after seconds
    (gone, or hung) is given up on: what was answered is kept, and running the same command
    again asks only the probes left. Then `rlscope analyze RUN` judges L6.

    Examples:

      rlscope probe runs/x --endpoint http://127.0.0.1:8000/v1 --model my-policy --dry-run

      rlscope probe runs/x --endpoint http://127.0.0.1:8000/v1 --model ckpt-300
      --checkpoint-step 300 --steps 250:300 --per-step 8 --kinds truncate,filler

      rlscope probe dumps/ --from verl --endpoint http://localhost:8080/v1 --model qwen

    Exit codes: 0 done (failures are counted in the summary), 2 usage or input error
    (nothing written), or a server given up on (the probes answered before it are kept).
    """
    import json as json_module

    from rlscope.config import load_config
    from rlscope.probe import ProbeSettings, probe_run
    from rlscope.render.probe import probe_summary_text

    try:
        if format not in ("text", "json"):
            raise RlscopeError(f"--format {format!r}: choose text or json")
        chosen = tuple(k.strip() for k in kinds.split(",") if k.strip())
        shared = _fractions(fractions)
        settings = ProbeSettings(
            endpoint=endpoint,
            model=model,
            kinds=chosen,
            fractions={k: shared for k in ("truncate", "mistake", "paraphrase")} if shared else {},
            per_step=per_step,
            steps=parse_steps(steps),
            split=split,
            concurrency=concurrency,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            checkpoint_step=checkpoint_step,
            editor_endpoint=editor_endpoint,
            editor_model=editor_model,
            api_key_env=api_key_env,
            retries=retries,
            timeout=timeout,
            give_up_after=give_up_after,
            tags=load_config(config).text.tags,
        )
        path: str | Path = run
        if from_format is not None:
            from rlscope.cache import import_cache_dir
            from rlscope.importers import import_run

            options: dict[str, Any] = dict(import_options(from_format, option))
            path = import_cache_dir(from_format, run, options, root=cache_dir)
            import_run(from_format, run, path, cache_dir=cache_dir, **options)
        with _progress(f"probing {run}") as progress:
            summary = probe_run(path, settings, dry_run=dry_run, progress=progress)
    except RlscopeError as exc:
        _fail(exc)
    if format == "json":
        sys.stdout.write(json_module.dumps(summary.to_dict(), indent=2) + "\n")
        return
    _say(_stdout(), probe_summary_text(summary), multiline=True, soft_wrap=True)


def _fractions(text: str | None) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        return tuple(float(f) for f in text.split(",") if f.strip())
    except ValueError:
        raise RlscopeError(f"--fractions {text!r}: numbers in [0, 1], comma-separated") from None


@app.command()
def report(
    runs: Annotated[
        list[str],
        typer.Argument(help="One or more run directories or URLs (overlaid).", metavar="RUN..."),
    ],
    output: Annotated[
        Path,
        typer.Option(
            "--output", "-o", help="The HTML file to write (not in a run dir).", metavar="FILE"
        ),
    ] = Path("report.html"),
    metrics: Annotated[
        str | None, typer.Option(help=METRICS_HELP.format("plot"), metavar="IDS")
    ] = None,
    align: Annotated[
        str,
        typer.Option(
            help="Align runs by `step`, or by `progress` (fraction of training).",
            metavar="step|progress",
        ),
    ] = "step",
    steps: StepsOption = None,
    config: ConfigOption = None,
    from_format: FromOption = None,
    scheduler: SchedulerOption = None,
    option: ImportOption = None,
    smooth: Annotated[
        int | None,
        typer.Option(
            help="Rolling-mean window (steps) drawn over each raw series; 0: raw only "
            "(default: ~5% of the steps).",
            metavar="STEPS",
        ),
    ] = None,
) -> None:
    """Write one self-contained HTML report (inline SVG, no script, opens offline).

    The verdict and the findings first, each with the chart that shows it (its window shaded)
    and links to the rollouts it names; with several runs, the comparison with the first
    (delta, interval, verdict); then each layer's curves (folded unless flagged) with healthy
    bands and rolling means; reward per function, length vs correctness, σ_G over time,
    pass@k for k = 1…N, entropy decay, faithfulness; several runs are overlaid.

    Examples:

      rlscope report sample_logs/healthy -o healthy.html

      rlscope report runs/a runs/b --align progress -o ab.html

    Exit codes: 0 written, 2 usage or input error.
    """
    from rlscope.config import load_config
    from rlscope.render.html import write_report

    try:
        check_align(align)
        metric_ids = parse_ids(metrics)
        options = import_options(from_format, option)
        with _progress(f"reporting on {len(runs)} run(s)"):
            path = write_report(
                runs,
                output,
                metrics=metric_ids,
                align=align,
                steps=parse_steps(steps),
                config=load_config(config),
                from_format=from_format,
                import_options=options,
                smooth=smooth,
                mapper=_mapper(scheduler),
            )
    except RlscopeError as exc:
        _fail(exc)
    _say(_stdout(), f"wrote {path}")


def main() -> None:
    try:
        app(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
