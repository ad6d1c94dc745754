"""`analyze`: read a run, compute every metric, run the rules, return a Report."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import polars as pl

from rlscope.cache import FooterCache, PartialCache, import_cache_dir
from rlscope.catalog import Catalog
from rlscope.config import Config, load_config
from rlscope.engine import SIZES_LEVEL, Computed, compute
from rlscope.errors import RlscopeError
from rlscope.evaluation import evaluate, missing_inputs
from rlscope.reader import Run, open_run
from rlscope.report import Report, RunInfo
from rlscope.tokenscan import Mapper

if TYPE_CHECKING:
    from rlscope.importers.session import Progress


def analyze(
    path: str | os.PathLike[str],
    *,
    steps: tuple[int | None, int | None] = (None, None),
    metrics: Iterable[str] | None = None,
    config: Config | None = None,
    from_format: str | None = None,
    import_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    use_cache: bool = True,
    mapper: Mapper | None = None,
    catalog: Catalog | None = None,
) -> Report:
    """Analyse the run directory at `path` (read-only) and return its Report.

    With `from_format` (`verl`, `trl`, ...), `path` is a trainer's own output: it is imported
    (incrementally) into the user cache dir, never next to the source, and that run analysed.
    Token files' partial aggregates are cached there too (`use_cache=False`: neither read nor
    written), so re-analysing a growing run reads only its new token files. `mapper` runs the
    per-file token reduction on another engine (docs/guides/scaling-out.md); `catalog` the
    metrics and rules to use (rlscope's own by default).
    """
    import_notes: list[str] = []
    if from_format is not None:
        from rlscope.importers import import_run

        options = dict(import_options or {})
        out = import_cache_dir(from_format, path, options, root=cache_dir)
        imported = import_run(
            from_format, path, out, progress=progress, cache_dir=cache_dir, **options
        )
        import_notes = [f"imported from {from_format} {path} into {out}", *imported.notes]
        import_notes += [f"import warning: {w}" for w in imported.warnings]
        path = out
    # The rollouts are checked by `compute`, from the index it reads (or caches) of each file.
    run = open_run(
        path,
        steps=steps,
        check_rollouts=False,
        memo=FooterCache(cache_dir) if use_cache else None,
    )
    config = config if config is not None else load_config()
    cache = PartialCache(cache_dir) if use_cache else None
    computed = compute(
        run,
        metrics,
        text=config.text,
        cache=cache,
        progress=progress,
        mapper=mapper,
        catalog=catalog,
    )
    run.check_unchanged()  # what was scanned is still the snapshot taken at open
    evaluation = evaluate(computed, config, catalog)

    sizes = computed.aggregates.get(SIZES_LEVEL)
    rollouts = pl.col("n") * pl.col("groups")
    counts = (
        sizes.select(
            rollouts.sum().alias("rollouts"),
            pl.col("groups").filter(pl.col("split") == "train").sum().alias("train_groups"),
            rollouts.filter(pl.col("split") != "train").sum().alias("eval_rollouts"),
        ).row(0, named=True)
        if sizes is not None
        else None
    )
    step_values: set[int] = set()
    for result in computed.results.values():
        step_values.update(result.steps)
    if not step_values and steps != (None, None):
        lo, hi = steps
        raise RlscopeError(
            f"{run.path}: no step in the selected range "
            f"{'' if lo is None else lo}:{'' if hi is None else hi}",
            hint="choose a --steps range that overlaps the run's steps (`rlscope analyze RUN` "
            "without --steps shows them)",
        )
    notes = import_notes + sorted({note for r in computed.results.values() for note in r.notes})
    info = RunInfo(
        path=str(run.path),
        run_id=str(run.meta.get("run_id", run.path.name)),
        algorithm=str(run.meta.get("algorithm", "")),
        n_steps=len(step_values),
        first_step=min(step_values) if step_values else None,
        last_step=max(step_values) if step_values else None,
        n_rollouts=int(counts["rollouts"]) if counts else run.row_count("rollouts"),
        n_groups=int(counts["train_groups"]) if counts else 0,
        n_eval_rollouts=int(counts["eval_rollouts"]) if counts else 0,
        n_tokens=_token_rows(run, computed),
        token_files=computed.tokens.files,
        token_files_read=computed.tokens.files_read,
        table_files={t: (r.files, r.files_read) for t, r in computed.tables.items()},
        tables=tuple(run.tables),
        meta=dict(run.meta),
    )
    return Report(
        run=info,
        metrics=computed.results,
        findings=tuple(evaluation.findings),
        skipped=computed.skipped + tuple(evaluation.skipped),
        warnings=run.warnings + computed.warnings + tuple(evaluation.warnings),
        notes=tuple(notes),
        judged=evaluation.judged,
        config=config.summary(),
        inputs_missing=missing_inputs(evaluation.skipped, computed, catalog),
    )


def analyze_each(paths: Iterable[str | os.PathLike[str]], **options: Any) -> list[Report]:
    """Every run analysed with the same `analyze` options (compare, check, report)."""
    return [analyze(path, **options) for path in paths]


def _token_rows(run: Run, computed: Computed) -> int:
    """Token rows in the step range: from the token scan when it ran (no second pass)."""
    if computed.tokens.files and ("tokens", "") in computed.aggregates:
        return computed.tokens.rows
    return run.row_count("tokens")
