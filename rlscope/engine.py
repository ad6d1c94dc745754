"""Plans registered metrics so each table is scanned once, then collects every series."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import polars as pl
import pyarrow as pa

from rlscope.catalog import Catalog, default_catalog
from rlscope.context import MetricContext
from rlscope.errors import RlscopeError
from rlscope.exactsum import ENGINE
from rlscope.reader import (
    FILE_INDEX,
    INVALID_PREFIX,
    Run,
    check_from_index,
    invalid_warnings,
    scan_error,
    valid_rollout,
)
from rlscope.report import Logged, MetricResult, Skipped
from rlscope.spec import Metric, Variant, split_column
from rlscope.steplocal import (
    FileIndex,
    TableRead,
    TableStore,
    file_index,
    read_probes,
    read_step_local,
)
from rlscope.steplocal import fingerprint as steplocal_fingerprint
from rlscope.text import MINHASH_PREFIX, TextSettings
from rlscope.tokenscan import ROWS, Mapper, PartialStore, ScanStats, TokenPlan, scan_tokens
from rlscope.trajectory import decline_shape
from rlscope.windows import final_window, window_size

GROUP_KEYS = ("split", "step", "prompt_id")
ROLLOUT_KEYS = (*GROUP_KEYS, "rollout_id")
#: The rollouts in a group (the same partial as the metrics' `n`).
GROUP_SIZE = {"n": pl.len().cast(pl.Int64)}
PROBE_KEYS = ("rollout_id", "step", "split", "intervention", "fraction")
#: Why a metric is skipped in a run with a steps table and no rollouts table.
STEPS_ONLY = "no rollouts table: the trainer logged step metrics only"
#: The rollouts table's two levels: a row per prompt group, and a row per rollout.
GROUP_LEVEL = ("rollouts", "")
ROLLOUT_LEVEL = ("rollouts", "rollout")
LEVELS = (GROUP_LEVEL, ROLLOUT_LEVEL)
#: Computed.aggregates' key of the groups of each size per split and step (`group_sizes`).
SIZES_LEVEL = ("rollouts", "sizes")
SIZES_SCHEMA = {"split": pl.String, "step": pl.Int64, "n": pl.Int64, "groups": pl.Int64}
#: A series with no step.
EMPTY_SERIES = pl.DataFrame(schema={"step": pl.Int64, "value": pl.Float64})
#: Rollouts per range of steps of the per-rollout level (text features are computed and
#: reduced one range at a time; 250k-rollout ranges held 0.2 GiB more at the same speed).
ROLLOUT_CHUNK = 100_000
#: Rollouts per range of steps of the per-group level (its per-group extremes keep the query
#: off the streaming engine: ~400 bytes a rollout; 5M rollouts in 100k ranges took 2.2 s,
#: in 250k ranges 1.4 s and 0.09 GiB, in 500k 1.2 s and 0.2 GiB).
GROUP_CHUNK = 250_000
#: Rollouts per range of steps whose group sizes are counted at once (keys only: the
#: group-by of 5M rollouts' keys in one query held 0.12 GiB).
SIZES_CHUNK = 1_000_000
#: Train rollouts of the final window's latest steps that findings pick example rollouts from
#: (a handful each): they are read again on every analysis, so they are capped.
RECENT_ROLLOUTS = 20_000
#: Rows per streaming morsel of the per-rollout text query (Polars' default is ~100k rows:
#: with long responses and their word lists, that is what sets the peak memory; 10k rows held
#: 0.1 GiB more than 2k for one range, at the same speed).
TEXT_MORSEL_ROWS = 2_000


@dataclass(frozen=True)
class Computed:
    """The engine's output: results for the report, per-step frames for rules, what was skipped."""

    results: dict[str, MetricResult]
    frames: dict[str, pl.DataFrame]
    skipped: tuple[Skipped, ...]
    # (table, level) -> partial aggregates: the tokens', steps' and probes' levels, the
    # rollouts' SIZES_LEVEL and the final window's per-rollout rows (ROLLOUT_LEVEL).
    aggregates: dict[tuple[str, str], pl.DataFrame]
    context: MetricContext
    # Data problems met while scanning (NaN/inf counts, tokens without a rollout).
    warnings: tuple[str, ...] = ()
    tokens: ScanStats = field(default_factory=ScanStats)  # what the token scan read
    tables: dict[str, TableRead] = field(default_factory=dict)  # steps, rollouts: files read


def choose_variant(metric: Metric, run: Run, first: int = 0) -> Variant | str:
    """The first variant (from index `first` on) the run can feed, or the reason none can."""
    reasons = []
    for variant in metric.variants[first:]:
        columns = [split_column(variant.table, c) for c in variant.requires]
        missing = [(t, c) for t, c in columns if not run.has(t, c)]
        missing_meta = [m for m in variant.needs_meta if run.meta.get(m) is None]
        if not missing and not missing_meta:
            return variant
        if variant.table not in run.tables and "rollouts" not in run.tables:
            reasons.append(STEPS_ONLY)
        elif variant.table not in run.tables:
            reasons.append(f"no {variant.table} table")
        else:
            parts = [f"{t}.{c}" for t, c in missing]
            parts += [f"run.json {m}" for m in missing_meta]
            why = run.meta.get("correct_unknown") if ("rollouts", "correct") in missing else None
            reasons.append("needs " + ", ".join(parts) + (f" ({why})" if why else ""))
    return "; or ".join(dict.fromkeys(reasons))


def plan(
    metrics: Iterable[Metric], run: Run, first: Mapping[str, int] | None = None
) -> tuple[dict[str, Variant], list[Skipped]]:
    """Each metric's variant (the first the run can feed, from index `first[id]` on)."""
    chosen: dict[str, Variant] = {}
    skipped: list[Skipped] = []
    for metric in metrics:
        variant = choose_variant(metric, run, (first or {}).get(metric.id, 0))
        if isinstance(variant, str):
            skipped.append(Skipped(metric.id, variant, metric.layer))
        else:
            chosen[metric.id] = variant
    return chosen, skipped


def _merged_partials(
    variants: Iterable[Variant], ctx: MetricContext, *, prelude: bool = False
) -> dict[str, pl.Expr]:
    """Every variant's partials (or preludes) by name; one name means one expression."""
    merged: dict[str, pl.Expr] = {}
    for variant in variants:
        found = variant.resolve_prelude(ctx) if prelude else variant.resolve_partials(ctx)
        for name, expr in found.items():
            if name in merged and not merged[name].meta.eq(expr):
                raise ValueError(f"partial {name!r} is declared with two different expressions")
            merged[name] = expr
    return merged


def aggregate_query(
    run: Run,
    table: str,
    level: str,
    partials: dict[str, pl.Expr],
    count_invalid: Iterable[str] | None = None,
    prelude: dict[str, pl.Expr] | None = None,
    steps: tuple[int, int] | None = None,
) -> pl.LazyFrame:
    """One scan of `table` (steps, rollouts or probes; tokens go through `tokenscan`),
    aggregated to `level` with every requested partial, plus the number of NaN/inf values of
    each `count_invalid` column (partials named `__invalid__<column>`) and the row count
    (`__rows__`) when given (the steps table); rollouts only of `steps` (first, last) when
    given.

    Two levels are not aggregations: rollouts' "rollout" level (one row per rollout: the
    partials are elementwise features, e.g. of the text, which is dropped once they are
    computed) and probes (one row per probe, with its rollout's step, split and answer, and
    the probes file's FILE_INDEX)."""
    exprs = [expr.alias(name) for name, expr in partials.items()]
    if table == "probes":
        return probes_query(run, file_index=True).select(FILE_INDEX, *PROBE_KEYS, *exprs)
    if table == "rollouts" and level == "rollout":
        lf = run.scan("rollouts").filter(valid_rollout())
        if steps is not None:
            lf = lf.filter(pl.col("step").is_between(*steps))
        for name, expr in (prelude or {}).items():
            lf = lf.with_columns(expr.alias(name))
        return lf.select(*ROLLOUT_KEYS, *exprs)
    flags = [INVALID_PREFIX + c for c in count_invalid or ()]
    lf = run.scan(table, invalid_flags=bool(flags))
    exprs += [pl.col(f).cast(pl.Int64).sum().alias(f) for f in flags]
    if table == "rollouts":
        # What is left out is counted in the reader's warnings.
        lf = lf.filter(valid_rollout())
        if steps is not None:
            lf = lf.filter(pl.col("step").is_between(*steps))
        # Sorted: a group-by's order is its threads', and the series sum over these rows.
        return lf.group_by(GROUP_KEYS).agg(exprs).sort(GROUP_KEYS, nulls_last=True)
    if count_invalid is not None:
        exprs.append(pl.len().alias(ROWS))  # for the count of rows with a null step
    return lf.group_by("step").agg(exprs).sort("step", nulls_last=True)


def token_plan(
    run: Run, text: TextSettings | None = None, catalog: Catalog | None = None
) -> TokenPlan:
    """The token scan's plan for every metric of the catalog the run can feed (what `compute`
    reads of the tokens table), e.g. to map its files on other workers."""
    ctx = MetricContext(run, text=text or TextSettings())
    chosen, _ = plan((catalog or default_catalog()).for_run(run).values(), run)
    by_level: dict[str, list[Variant]] = {"": []}
    for variant in chosen.values():
        if variant.table == "tokens":
            by_level.setdefault(variant.level, []).append(variant)
    return _token_plan(run, by_level, ctx)


def _token_plan(run: Run, by_level: dict[str, list[Variant]], ctx: MetricContext) -> TokenPlan:
    """The token scan's plan: every level's partials, the step level's prelude, the float
    columns whose NaN/inf values are counted, and the rollout ids when there are rollouts."""
    partials = {level: _merged_partials(variants, ctx) for level, variants in by_level.items()}
    every = {f"{level}:{n}": e for level, exprs in partials.items() for n, e in exprs.items()}
    prelude = _merged_partials(by_level.get("", []), ctx, prelude=True)
    invalid = _float_columns_used(run, "tokens", every)
    return TokenPlan(partials, prelude, tuple(invalid), ids="rollouts" in run.tables)


def _float_columns_used(run: Run, table: str, partials: dict[str, pl.Expr]) -> list[str]:
    """Float columns the partials read: the ones whose NaN/inf count costs no extra I/O."""
    used: set[str] = set()
    for expr in partials.values():
        used.update(expr.meta.root_names())
    schema = run.tables[table].schema
    return [c for c, t in schema.items() if c in used and isinstance(t, pl.Float32 | pl.Float64)]


def probes_query(run: Run, *, file_index: bool = False) -> pl.LazyFrame:
    """Probes joined with their rollout's step, split and answer (`original_answer`, null when
    the rollouts table has no answer column). Probes carry no step: the step range applies
    through their rollout. Probes of unknown rollouts are counted in the reader's warnings.
    With `file_index`, the probes file's FILE_INDEX.

    The probed ids are read first, and the rollouts filtered to them as they stream: the
    join's table is the probed rollouts', not every rollout's (5M responses: 0.34 -> 0.06 GiB)."""
    answer = pl.col("answer") if run.has("rollouts", "answer") else pl.lit(None, pl.String)
    probes = replace(run, step_range=(None, None)).scan("probes", file_index=file_index)
    try:
        probed = probes.select(pl.col("rollout_id").unique()).collect()["rollout_id"]
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise scan_error(run, ["probes"], "reading probes", exc) from None
    rollouts = (
        run.scan("rollouts")
        .filter(valid_rollout() & pl.col("rollout_id").is_in(probed.implode()))
        .select("rollout_id", "step", "split", answer.alias("original_answer"))
    )
    return probes.join(rollouts, on="rollout_id", how="inner")


def orphan_warning(run: Run, ids: pl.DataFrame, rollouts: FileIndex | None = None) -> str | None:
    """The warning for token rows whose rollout_id is not in the rollouts table, given the
    token rows per (step, rollout_id) (the token scan's "ids" level); the rollouts' ids from
    their `rollouts` index when given, else read."""
    if rollouts is not None:
        known = rollouts.files_of_ids(ids.select("rollout_id").unique()).lazy()
    else:
        unranged = replace(run, step_range=(None, None))
        known = unranged.scan("rollouts").select("rollout_id").unique()
    orphans = (
        ids.lazy()
        .join(known.select("rollout_id"), on="rollout_id", how="anti", nulls_equal=False)
        .select(pl.col("rollout_id").n_unique().alias("ids"), pl.col("len").sum().alias("rows"))
        .collect()
    )
    rows, n_ids = orphans["rows"][0] or 0, orphans["ids"][0]
    if not rows:
        return None
    return (
        f"tokens: {rows:,} row(s) with {n_ids:,} rollout_id value(s) that are not in the "
        "rollouts table (still used in the token metrics)"
    )


def resolve_pass_k(run: Run, sizes: pl.DataFrame | None) -> int | None:
    """k for pass@k: run.json group_size, else the modal train group size (the larger of a
    tie) of the `group_sizes`."""
    if run.meta.get("group_size"):
        return int(run.meta["group_size"])
    if sizes is None:
        return None
    counts = sizes.filter(pl.col("split") == "train").group_by("n").agg(pl.col("groups").sum())
    if counts.height == 0:
        return None
    return int(counts.filter(pl.col("groups") == pl.col("groups").max()).select(pl.max("n")).item())


def compute(
    run: Run,
    metric_ids: Iterable[str] | None = None,
    *,
    text: TextSettings | None = None,
    cache: PartialStore | None = None,
    progress: Callable[[int, int], None] | None = None,
    mapper: Mapper | None = None,
    first_variant: Mapping[str, int] | None = None,
    catalog: Catalog | None = None,
) -> Computed:
    """Compute the requested metrics (all of the catalog's, rlscope's own by default, that the
    run can feed) over a run. With `cache`,
    token files' partial aggregates are reused where the file is unchanged (and stored);
    `progress` gets (token files done, token files) as the token scan goes; `mapper` maps the
    per-file token reduction over the files to read (see `tokenscan.Mapper`).

    A metric whose variant gives no value at any step falls back to its next variant the run
    can feed (e.g. tool-response length from the text tags when the tokens table has no
    tool_response tokens because they are loss-masked), computed in one more pass over only
    those metrics; `first_variant` (id -> variant index) is how that pass is asked."""
    context = MetricContext(run, text=text or TextSettings())
    catalog = catalog or default_catalog()
    available = catalog.for_run(run)
    metrics = (
        list(available.values()) if metric_ids is None else catalog.select(metric_ids, available)
    )
    chosen, skipped = plan(metrics, run, first_variant)
    logged = _logged_columns(chosen, run, available)

    by_level: dict[tuple[str, str], list[Variant]] = {}
    for variant in chosen.values():
        by_level.setdefault((variant.table, variant.level), []).append(variant)
    if logged:
        partials = {
            f"logged:{c}": pl.col(c).cast(pl.Float64).mean() for c in dict.fromkeys(logged.values())
        }
        by_level.setdefault(("steps", ""), []).append(Variant("steps", (), _no_series, partials))
    token_levels = [level for table, level in sorted(by_level) if table == "tokens"]
    if token_levels and "" not in token_levels:
        token_levels.insert(0, "")  # the token scan always counts rows and NaN/inf per step
    counted: dict[tuple[str, str], list[str]] = {}
    warnings: list[str] = []
    # What is known of each rollouts and probes file (see rlscope.steplocal; cached with a
    # store), read once for the rollouts check, the orphan checks, the probes and the final
    # window's files; the rollouts check when the run was opened without it.
    store = cache if isinstance(cache, TableStore) else None
    unchecked = not run.rollouts_checked and "rollouts" in run.tables
    index: dict[str, FileIndex] = {}
    if store is not None or unchecked:
        index = {t: file_index(run, t, store) for t in ("rollouts", "probes") if t in run.tables}
    if unchecked:
        probes = index["probes"].frames if "probes" in index else None
        warnings += check_from_index(run, index["rollouts"].frames, probes)
    scan_stats = ScanStats()
    token_frames: dict[str, pl.DataFrame] = {}
    # Tokens first: the scan hands its decode buffers back when done, so the peak is the larger
    # of the two phases, not their sum (1B tokens: 0.96 -> 0.75 GiB).
    if token_levels:
        token_plan = _token_plan(
            run, {lvl: by_level.get(("tokens", lvl), []) for lvl in token_levels}, context
        )
        try:
            token_frames, scan_stats = scan_tokens(
                run, token_plan, cache=cache, progress=progress, mapper=mapper
            )
            token_ids = token_frames.pop("ids", None)
            orphans = (
                orphan_warning(run, token_ids, index.get("rollouts"))
                if token_ids is not None
                else None
            )
        except (pl.exceptions.PolarsError, pa.ArrowException, OSError) as exc:
            raise scan_error(run, ["tokens"], "reading tokens", exc) from None
        counted["tokens", ""] = list(token_plan.count_invalid)
        warnings += [orphans] if orphans else []
    # The steps, rollouts and probes tables, each file's results cached (see rlscope.steplocal).
    levels: list[tuple[str, str]] = []
    collected: list[pl.DataFrame] = []
    table_reads: dict[str, TableRead] = {}
    if ("probes", "") in by_level and "probes" in run.tables:
        partials = _merged_partials(by_level["probes", ""], context)
        rows, table_reads["probes"] = read_probes(
            run,
            lambda part: aggregate_query(part, "probes", "", partials),
            store=store,
            fingerprint=steplocal_fingerprint(
                run, "probes", [partials, probes_query, _schema(run, "rollouts")]
            ),
            probes=index.get("probes"),
            rollouts=index.get("rollouts"),
        )
        levels.append(("probes", ""))
        collected.append(rows)
    for level in token_levels:
        levels.append(("tokens", level))
        collected.append(token_frames[level])
    if ("steps", "") in by_level and "steps" in run.tables:
        read = _steps_reader(run, by_level["steps", ""], context)
        counted["steps", ""] = read.counted
        frames, table_reads["steps"] = read_step_local(
            run, "steps", read.names, read.frames_of, store=store, fingerprint=read.fingerprint
        )
        levels.append(("steps", ""))
        collected.append(frames["level"])
    # The rollouts table: the group sizes first (pass@k's k is the modal one), then the series.
    rollout_series: RolloutSeries | None = None
    series_frames: dict[str, pl.DataFrame] = {}
    sizes = pl.DataFrame(schema=SIZES_SCHEMA)
    if "rollouts" in run.tables and any(level in by_level for level in LEVELS):
        read_sizes, sizes_read = read_step_local(
            run,
            "rollouts",
            ["sizes"],
            lambda part: {"sizes": group_sizes(part)},
            store=store,
            fingerprint=steplocal_fingerprint(run, "rollouts", [group_sizes, valid_rollout()]),
            index=index.get("rollouts"),
        )
        sizes = read_sizes.get("sizes", sizes)
        context.pass_k = resolve_pass_k(run, sizes)
        rollout_series = RolloutSeries.of(run, chosen, by_level, available, context)
        series_frames, table_reads["rollouts"] = read_step_local(
            run,
            "rollouts",
            list(rollout_series.series),
            partial(rollout_series.frames, ctx=context),
            store=store,
            fingerprint=rollout_series.fingerprint(run, context),
            index=index.get("rollouts"),
        )
        if sizes_read.files_read > table_reads["rollouts"].files_read:  # its cache was damaged
            table_reads["rollouts"] = sizes_read
    run.check_unchanged()  # every file read is the one listed at open
    aggregates = {}
    for key, frame in zip(levels, collected, strict=True):
        if key in counted:
            columns = counted[key]
            if columns:
                sums = frame.select(pl.col(INVALID_PREFIX + c).sum() for c in columns).row(0)
                warnings += invalid_warnings(key[0], dict(zip(columns, sums, strict=True)))
            no_step = int(frame.filter(pl.col("step").is_null())[ROWS].sum())
            if no_step:
                warnings.append(
                    f"{key[0]}: {no_step:,} row(s) with a null step are left out of the metrics"
                )
            frame = frame.drop(ROWS, *(INVALID_PREFIX + c for c in columns))
        aggregates[key] = frame.filter(pl.col("step").is_not_null())
    if rollout_series is not None:
        aggregates[SIZES_LEVEL] = sizes

    context.aggregates = aggregates
    ids = [i for i in chosen if (chosen[i].table, chosen[i].level) not in LEVELS]
    series_queries = [
        chosen[i].series(aggregates[chosen[i].table, chosen[i].level].lazy(), context) for i in ids
    ]
    frames = dict(zip(ids, _collect(series_queries, "computing metrics"), strict=True))
    alternates: dict[str, pl.DataFrame] = {}
    if rollout_series is not None:
        for name in rollout_series.series:
            kind, metric_id = name.split(":", 1)
            frame = series_frames.get(name, EMPTY_SERIES)
            if kind == "series":
                frames[metric_id] = frame
            else:
                alternates[metric_id] = frame.sort("step")
        recent = rollout_series.recent(run, _train_steps(sizes), index.get("rollouts"))
        if recent is not None:
            aggregates[ROLLOUT_LEVEL] = recent
        ids = list(chosen)

    results: dict[str, MetricResult] = {}
    fallback: dict[str, int] = {}
    for metric_id in ids:
        metric, variant = available[metric_id], chosen[metric_id]
        frame = frames[metric_id].sort("step")
        frames[metric_id] = frame
        values = _floats(frame["value"])
        steps = [int(s) for s in frame["step"].to_list()]
        if not any(v is not None for v in values):
            reason = _empty_reason(frame, variant, sizes)
            after = metric.variants.index(variant) + 1
            nxt = choose_variant(metric, run, after)
            found = (
                None
                if isinstance(nxt, str)
                else alternates.get(metric_id)
                if (nxt.table, nxt.level) in LEVELS
                else _from_aggregates(nxt, aggregates, context)
            )
            if isinstance(nxt, str):
                skipped.append(Skipped(metric_id, reason, metric.layer))
                continue
            if found is None:  # its partials were not computed in this pass: one more pass
                skipped.append(Skipped(metric_id, reason, metric.layer))
                fallback[metric_id] = metric.variants.index(nxt)
                continue
            variant, frame = nxt, found
            frames[metric_id] = frame
            values = _floats(frame["value"])
            steps = [int(s) for s in frame["step"].to_list()]
            if not any(v is not None for v in values):
                reason = _empty_reason(frame, variant, sizes)
                skipped.append(Skipped(metric_id, reason, metric.layer))
                continue
        notes = tuple(
            note
            for column, note in run.derived_columns(variant.table).items()
            if column in variant.requires
        )
        results[metric_id] = MetricResult(
            id=metric_id,
            layer=metric.layer,
            title=metric.title,
            value=final_window_mean(values),
            steps=tuple(steps),
            values=tuple(values),
            source=variant.source or ", ".join(f"{variant.table}.{c}" for c in variant.requires),
            notes=notes,
            extra=_extra(metric, frame, context),
            logged=_logged_result(logged.get(metric_id), aggregates.get(("steps", ""))),
            band=metric.band,
            better=metric.better,
            unit=metric.unit,
            task=metric.task,
            scale_from=metric.scale_from,
            part=metric.part,
        )
    computed = Computed(
        results,
        frames,
        tuple(skipped),
        aggregates,
        context,
        tuple(warnings),
        scan_stats,
        table_reads,
    )
    if fallback:
        again = compute(
            run, list(fallback), text=text, cache=cache, first_variant=fallback, catalog=catalog
        )
        computed = _merged(computed, again, list(available))
    return computed


def upto(
    computed: Computed,
    last_step: int,
    metric_ids: Iterable[str],
    available: Mapping[str, Metric],
) -> Computed:
    """`computed` as `--steps :last_step` gives it, for the metrics `metric_ids` (of
    `available`, the catalog's metrics for the run): their series and frames cut after
    `last_step`, their summaries and extras recomputed; the aggregates cut too. Every series is
    a function of its own step's rows, so this is what a fresh analysis of the prefix computes,
    without reading the run again (tests/test_prefix.py holds it to that)."""
    results: dict[str, MetricResult] = {}
    frames: dict[str, pl.DataFrame] = {}
    for metric_id in metric_ids:
        result, frame = computed.results.get(metric_id), computed.frames.get(metric_id)
        if result is None or frame is None or metric_id not in available:
            continue
        frame = frame.filter(pl.col("step") <= last_step)
        values = _floats(frame["value"])
        if not any(v is not None for v in values):
            continue
        logged = result.logged
        if logged is not None:
            kept = [i for i, s in enumerate(logged.steps) if s <= last_step]
            cut = tuple(logged.values[i] for i in kept)
            logged = Logged(
                logged.column,
                final_window_mean(list(cut)),
                tuple(logged.steps[i] for i in kept),
                cut,
            )
        results[metric_id] = replace(
            result,
            value=final_window_mean(values),
            steps=tuple(int(s) for s in frame["step"].to_list()),
            values=tuple(values),
            extra=_extra(available[metric_id], frame, computed.context),
            logged=logged,
        )
        frames[metric_id] = frame
    aggregates = {
        key: frame.filter(pl.col("step") <= last_step) if "step" in frame.columns else frame
        for key, frame in computed.aggregates.items()
    }
    return replace(computed, results=results, frames=frames, aggregates=aggregates)


@dataclass(frozen=True)
class RolloutSeries:
    """The series of the rollouts table's two levels, per group (GROUP_LEVEL) and per rollout
    (ROLLOUT_LEVEL), and of the later variants they can fall back to from the same partials:
    computed over ranges of whole steps, so neither level is ever held whole."""

    group_partials: dict[str, pl.Expr]
    partials: dict[str, pl.Expr]  # per rollout
    prelude: dict[str, pl.Expr]  # per rollout, dropped once the partials are computed
    # Frame name ("series:<id>", or "fallback:<id>" for the next variant) -> variant.
    series: dict[str, Variant]

    @classmethod
    def of(
        cls,
        run: Run,
        chosen: Mapping[str, Variant],
        by_level: Mapping[tuple[str, str], list[Variant]],
        available: Mapping[str, Metric],
        ctx: MetricContext,
    ) -> RolloutSeries:
        computed = {level: _merged_partials(by_level.get(level, []), ctx) for level in LEVELS}
        series = {f"series:{i}": v for i, v in chosen.items() if (v.table, v.level) in LEVELS}
        for metric_id, variant in chosen.items():
            metric = available[metric_id]
            nxt = choose_variant(metric, run, metric.variants.index(variant) + 1)
            if (
                not isinstance(nxt, str)
                and (nxt.table, nxt.level) in LEVELS
                and set(nxt.resolve_partials(ctx)) <= set(computed[nxt.table, nxt.level])
            ):
                series[f"fallback:{metric_id}"] = nxt
        prelude = _merged_partials(by_level.get(ROLLOUT_LEVEL, []), ctx, prelude=True)
        return cls(computed[GROUP_LEVEL], computed[ROLLOUT_LEVEL], prelude, series)

    def frames(self, run: Run, ctx: MetricContext) -> dict[str, pl.DataFrame]:
        """Every series' per-step frame, over ranges of whole steps of at most GROUP_CHUNK
        (per-group series) or ROLLOUT_CHUNK (per-rollout) rollouts: a range's groups or
        rollouts are computed, every series of that level (all are per step) is run on them,
        and they are dropped, so the memory is one range's whatever the number of responses."""
        parts: dict[str, list[pl.DataFrame]] = {name: [] for name in self.series}
        for level, limit in ((GROUP_LEVEL, GROUP_CHUNK), (ROLLOUT_LEVEL, ROLLOUT_CHUNK)):
            names = [n for n, v in self.series.items() if (v.table, v.level) == level]
            for lo_hi in rollout_step_ranges(run, limit) if names else []:
                if level == GROUP_LEVEL:
                    query = aggregate_query(run, "rollouts", "", self.group_partials, steps=lo_hi)
                    source = _collect([query], "reading rollouts", run, ["rollouts"])[0]
                else:
                    source = self._rows(run, lo_hi, self.partials)
                series = [self.series[n].series(source.lazy(), ctx) for n in names]
                for name, frame in zip(names, _collect(series, "computing metrics"), strict=True):
                    parts[name].append(frame)
        return {
            n: pl.concat(p, how="diagonal_relaxed") if p else EMPTY_SERIES for n, p in parts.items()
        }

    def fingerprint(self, run: Run, ctx: MetricContext) -> str:
        """What a rollouts file's cached series depend on (pass@k's k among them)."""
        described: list[Any] = [self.group_partials, self.partials, self.prelude, ctx.text]
        described += [ctx.pass_k, [(n, v.series) for n, v in self.series.items()]]
        return steplocal_fingerprint(run, "rollouts", described)

    def recent(
        self, run: Run, train_steps: pl.DataFrame, index: FileIndex | None = None
    ) -> pl.DataFrame | None:
        """The rows of the final window's train steps that findings name example rollouts
        from (the latest RECENT_ROLLOUTS at most), without the MinHash signature; `train_steps`
        holds the train rollouts per step (`step`, `len`); with the rollouts' `index`, only
        the files holding those steps are read. None without per-rollout partials."""
        steps = train_steps.sort("step")
        if steps.height == 0 or not self.partials:
            return None
        window = steps.tail(window_size(steps.height))
        latest = window.filter(pl.col("len").reverse().cum_sum().reverse() <= RECENT_ROLLOUTS)
        first = int((latest if latest.height else window.tail(1))["step"][0])
        partials = {n: e for n, e in self.partials.items() if not n.startswith(MINHASH_PREFIX)}
        last = int(steps["step"][-1])
        if index is not None:
            run = run.only("rollouts", index.files_with_steps(first, last) or [0])
        rows = self._rows(run, (first, last), partials)
        return rows.filter(pl.col("split") == "train")

    def _rows(
        self, run: Run, steps: tuple[int, int] | None, partials: dict[str, pl.Expr]
    ) -> pl.DataFrame:
        query = aggregate_query(
            run, "rollouts", "rollout", partials, prelude=self.prelude, steps=steps
        )
        collected = _collect(
            [query], "reading rollouts", run, ["rollouts"], TEXT_MORSEL_ROWS, streaming=True
        )
        return collected[0].sort(ROLLOUT_KEYS, nulls_last=True)  # the series sum in this order


@dataclass(frozen=True)
class _TableReader:
    """What `compute` reads of the steps table, per file (rlscope.steplocal): frame "level"
    (its aggregates), and the float columns whose NaN/inf are counted along."""

    names: list[str]
    frames_of: Callable[[Run], dict[str, pl.DataFrame]]
    fingerprint: str
    counted: list[str]


def _steps_reader(run: Run, variants: list[Variant], ctx: MetricContext) -> _TableReader:
    """The steps table's per-file aggregates, with the NaN/inf counts of the float columns
    the partials read (they ride along the scan)."""
    partials = _merged_partials(variants, ctx)
    prelude = _merged_partials(variants, ctx, prelude=True)
    counted = _float_columns_used(run, "steps", partials)

    def frames_of(part: Run) -> dict[str, pl.DataFrame]:
        query = aggregate_query(part, "steps", "", partials, counted, prelude)
        return {"level": _collect([query], "reading steps", part, ["steps"])[0]}

    described: list[Any] = [partials, prelude, counted]
    return _TableReader(
        ["level"], frames_of, steplocal_fingerprint(run, "steps", described), counted
    )


def group_sizes(run: Run) -> pl.DataFrame:
    """The groups of each size per split and step (`split`, `step`, `n`, `groups`), valid
    rollouts only: what the header counts, pass@k's k and the train rollouts per step come
    from, without keeping a row per group (counted in ranges of whole steps of at most
    SIZES_CHUNK rollouts: the group-by's table is a range's groups)."""
    parts = []
    for steps in rollout_step_ranges(run, SIZES_CHUNK):
        rows = run.scan("rollouts").filter(valid_rollout())
        query = (
            (rows if steps is None else rows.filter(pl.col("step").is_between(*steps)))
            .group_by(GROUP_KEYS)
            .agg(**GROUP_SIZE)
            .group_by("split", "step", "n")
            .agg(pl.len().cast(pl.Int64).alias("groups"))
        )
        parts += _collect([query], "reading rollouts", run, ["rollouts"], streaming=True)
    return pl.concat(parts) if parts else pl.DataFrame(schema=SIZES_SCHEMA)


def _train_steps(sizes: pl.DataFrame) -> pl.DataFrame:
    """Train rollouts per step (`step`, `len`) from the `group_sizes`."""
    return (
        sizes.filter(pl.col("split") == "train")
        .group_by("step")
        .agg((pl.col("n") * pl.col("groups")).sum().alias("len"))
    )


def rollout_step_ranges(run: Run, limit: int) -> list[tuple[int, int] | None]:
    """Ranges (first, last step) of whole steps of at most `limit` valid rollouts each, that the
    rollouts' levels are computed in one at a time, so their memory is a range's whatever the
    run's size; [None] (every step at once, the rollouts per step not counted) when the files
    hold at most `limit` rows."""
    known = run.tables["rollouts"].file_rows  # from the footers read at open, if any
    if known and sum(known) <= limit:
        return [None]
    counts = _collect(
        [run.scan("rollouts").filter(valid_rollout()).group_by("step").len().sort("step")],
        "reading rollouts",
        run,
        ["rollouts"],
        streaming=True,
    )[0]
    return [*_step_ranges(counts["step"].to_list(), counts["len"].to_list(), limit)]


def _step_ranges(steps: list[int], counts: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive (first, last) step ranges of sorted `steps` holding at most `limit` rows
    each (a step with more is a range of its own)."""
    ranges: list[tuple[int, int]] = []
    rows = 0
    for step, n in zip(steps, counts, strict=True):
        if ranges and rows + n <= limit:
            ranges[-1] = (ranges[-1][0], step)
            rows += n
        else:
            ranges.append((step, step))
            rows = n
    return ranges


def _from_aggregates(
    variant: Variant, aggregates: dict[tuple[str, str], pl.DataFrame], ctx: MetricContext
) -> pl.DataFrame | None:
    """A fallback variant's per-step frame from the partials this pass already computed (the
    text features are all computed together, so a text fallback usually costs no scan), or
    None when they were not."""
    source = aggregates.get((variant.table, variant.level))
    if source is None or not set(variant.resolve_partials(ctx)) <= set(source.columns):
        return None
    return variant.series(source.lazy(), ctx).collect(engine=ENGINE).sort("step")


def _merged(main: Computed, again: Computed, order: list[str]) -> Computed:
    """`main` with the metrics `again` recomputed from a later variant (in catalog order)."""
    results = {**main.results, **again.results}
    redone = set(again.results) | {s.metric for s in again.skipped}
    return replace(
        main,
        results={m: results[m] for m in order if m in results},
        frames={**main.frames, **again.frames},
        skipped=tuple(s for s in main.skipped if s.metric not in redone) + again.skipped,
        aggregates={**again.aggregates, **main.aggregates},
        warnings=tuple(dict.fromkeys(main.warnings + again.warnings)),
    )


def _empty_reason(frame: pl.DataFrame, variant: Variant, sizes: pl.DataFrame) -> str:
    """Why a variant gave no value at any step (`sizes`: the run's `group_sizes`)."""
    if variant.empty_reason:
        return variant.empty_reason
    if (variant.table, variant.level) == GROUP_LEVEL:
        train = sizes.filter(pl.col("split") == "train")["n"]
        if train.len() and train.max() == 1:
            return (
                "every train group has one rollout (e.g. PPO with a critic): this metric needs "
                "several rollouts of one prompt"
            )
    if frame.height == 0:
        return f"no {variant.table} rows (for train rollouts, in the step range)"
    return "undefined at every step (e.g. no variation to measure, or no valid values)"


def final_window_mean(values: list[float | None]) -> float | None:
    """Summary value: mean over the final window (rlscope.windows) of the non-null steps."""
    window = final_window([v for v in values if v is not None])
    return sum(window) / len(window) if window else None


def _schema(run: Run, table: str) -> dict[str, pl.DataType]:
    return dict(run.tables[table].schema) if table in run.tables else {}


def _floats(series: pl.Series) -> list[float | None]:
    """A column as Python floats, None where null, NaN or infinite."""
    return [
        None if v is None or not math.isfinite(v) else float(v)
        for v in series.cast(pl.Float64).to_list()
    ]


def _logged_columns(
    chosen: dict[str, Variant], run: Run, available: Mapping[str, Metric]
) -> dict[str, str]:
    """Metric id -> the steps-table column holding the trainer's own value of a metric that
    rlscope recomputes from rollouts or tokens."""
    if "steps" not in run.tables:
        return {}
    columns = run.tables["steps"].columns
    logged = {}
    for metric_id, variant in chosen.items():
        if variant.table == "steps":
            continue
        if run.lengths_in_words and "response_len" in variant.requires:
            continue  # word counts are not compared with a trainer's token-based lengths
        found = next((c for c in available[metric_id].logged_as if c in columns), None)
        if found is not None:
            logged[metric_id] = found
    return logged


def _no_series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    raise AssertionError("a partials-only variant has no series")


def _logged_result(column: str | None, steps: pl.DataFrame | None) -> Logged | None:
    if column is None or steps is None:
        return None
    frame = steps.select("step", pl.col(f"logged:{column}")).drop_nulls().sort("step")
    values = _floats(frame[f"logged:{column}"])
    return Logged(
        column,
        final_window_mean(values),
        tuple(int(s) for s in frame["step"].to_list()),
        tuple(values),
    )


def _extra(metric: Metric, frame: pl.DataFrame, context: MetricContext) -> dict[str, Any]:
    """Metric-specific JSON: columns prefixed `extra_` carry their final-window summaries; a
    metric's `summary` adds its own fields; `trajectory` metrics say how they declined."""
    extra: dict[str, Any] = {}
    components = {c: c.removeprefix("extra_") for c in frame.columns if c.startswith("extra_")}
    if components:
        extra["components"] = {
            name: final_window_mean(_floats(frame[col])) for col, name in components.items()
        }
    if metric.summary is not None:
        extra.update(metric.summary(frame, context))
    if metric.trajectory:
        defined = frame.filter(pl.col("value").is_finite())
        extra["decline"] = decline_shape(
            defined["step"].to_list(), defined["value"].cast(pl.Float64).to_list()
        )
    return extra


def _collect(
    queries: list[pl.LazyFrame],
    what: str,
    run: Run | None = None,
    tables: Iterable[str] = (),
    morsel_rows: int | None = None,
    *,
    streaming: bool = False,
) -> list[pl.DataFrame]:
    """The queries' frames, on the in-memory engine (its sums do not depend on which thread
    finishes first: see rlscope.exactsum), or `streaming` (in morsels of `morsel_rows` rows
    when given) where rows are many and counted or not summed (rollouts' counts, text
    features)."""
    if not queries:
        return []
    try:
        with pl.Config(streaming_chunk_size=morsel_rows):
            # No common-subplan elimination: for two queries over one table it caches the
            # shared scan in memory, i.e. it would materialise the token table.
            return pl.collect_all(
                queries,
                optimizations=pl.QueryOptFlags(comm_subplan_elim=False),
                engine="streaming" if streaming else ENGINE,
            )
    except (pl.exceptions.PolarsError, OSError) as exc:
        if run is not None:
            # Names the file removed/rewritten since the open, or the unreadable file/column.
            raise scan_error(run, tables, what, exc) from None
        raise RlscopeError(
            f"failed while {what}: {exc}",
            hint="`rlscope validate RUN` checks every file's schema; a file may be corrupt",
        ) from None
