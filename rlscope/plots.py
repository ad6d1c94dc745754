"""The report's extra data: length bins, σ_G histograms, pass@k, the findings' example rollouts."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from rlscope.metrics._common import pass_at_k
from rlscope.reader import open_run, scan_error, valid_rollout
from rlscope.windows import window_size

LENGTH_BINS = 12
SIGMA_BINS = 16


@dataclass(frozen=True)
class LengthBins:
    """Train rollouts by response length: equal-width bins, their counts and accuracy."""

    edges: tuple[float, ...]
    counts: tuple[int, ...]
    accuracy: tuple[float | None, ...]


@dataclass(frozen=True)
class SigmaHistogram:
    """Per step, the number of prompt groups (size >= 2) in each σ_G bin."""

    steps: tuple[int, ...]
    edges: tuple[float, ...]
    counts: tuple[tuple[int, ...], ...]  # counts[step index][bin]


@dataclass(frozen=True)
class PassCurve:
    """Unbiased pass@k for k = 1…N over the groups of a window of steps (groups of size >= k)."""

    ks: tuple[int, ...]
    early: tuple[float | None, ...]
    final: tuple[float | None, ...]
    early_steps: tuple[int, int]
    final_steps: tuple[int, int]


#: Characters of an example rollout's response shown in the report (the rest: `rlscope show`).
EXAMPLE_CHARS = 1200
EXAMPLE_COLUMNS = ("rollout_id", "step", "split", "prompt_id", "reward", "correct", "response")


@dataclass(frozen=True)
class PlotData:
    """What the report plots besides the metric series; None where the run lacks the inputs.
    `examples`: the rollouts the findings name, rollout_id -> their row (response cut to
    EXAMPLE_CHARS characters)."""

    length: LengthBins | None
    sigma: SigmaHistogram | None
    pass_k: PassCurve | None
    examples: dict[int, dict[str, Any]] = field(default_factory=dict)


def plot_data(
    path: str | os.PathLike[str],
    *,
    steps: tuple[int | None, int | None] = (None, None),
    examples: Iterable[int] = (),
) -> PlotData:
    """Scan the run's train rollouts (streaming) into the report's extra plot data, and read
    the rollouts `examples` names."""
    run = open_run(path, steps=steps)
    if "rollouts" not in run.tables:  # step metrics only: no rollout plots
        return PlotData(None, None, None)
    wanted = sorted(set(examples))
    shown: dict[int, dict[str, Any]] = {}
    if wanted:
        columns = [c for c in EXAMPLE_COLUMNS if run.has("rollouts", c)]
        text = pl.col("response").str.slice(0, EXAMPLE_CHARS) if "response" in columns else None
        rows = (
            run.scan("rollouts")
            .filter(pl.col("rollout_id").is_in(wanted))
            .select([text if c == "response" and text is not None else pl.col(c) for c in columns])
        )
        try:
            found = rows.collect(engine="streaming")
        except (pl.exceptions.PolarsError, OSError) as exc:
            raise scan_error(run, ["rollouts"], "reading example rollouts", exc) from None
        shown = {int(r["rollout_id"]): r for r in found.to_dicts()}
    rollouts = run.scan("rollouts").filter(valid_rollout() & (pl.col("split") == "train"))
    groups_query = rollouts.group_by("step", "prompt_id").agg(
        pl.len().cast(pl.Int64).alias("n"),
        pl.col("correct").cast(pl.Int64).sum().alias("n_correct"),
        pl.col("reward").cast(pl.Float64).std(ddof=1).alias("r_std"),
    )
    length = pl.col("response_len").cast(pl.Float64)
    span_query = rollouts.select(length.max().alias("max"), length.count().alias("n"))
    try:
        groups, span = pl.collect_all([groups_query, span_query], engine="streaming")
        longest = span["max"][0]
        lengths = None
        if longest is not None and span["n"][0]:
            width = max(float(longest), 1.0) / LENGTH_BINS
            binned = (
                rollouts.filter(pl.col("response_len").is_not_null())
                .group_by(
                    (length / width).floor().clip(0, LENGTH_BINS - 1).cast(pl.Int32).alias("bin")
                )
                .agg(pl.len().alias("n"), pl.col("correct").cast(pl.Float64).mean().alias("acc"))
                .collect(engine="streaming")
            )
            lengths = _length_bins(binned, width)
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise scan_error(run, ["rollouts"], "reading rollouts for the report", exc) from None
    group_size = run.meta.get("group_size")
    return PlotData(lengths, _sigma(groups), _pass_curve(groups, group_size), shown)


def _length_bins(binned: pl.DataFrame, width: float) -> LengthBins:
    by_bin = {int(b): (int(n), a) for b, n, a in binned.iter_rows()}
    counts = tuple(by_bin.get(b, (0, None))[0] for b in range(LENGTH_BINS))
    accuracy = tuple(by_bin.get(b, (0, None))[1] for b in range(LENGTH_BINS))
    edges = tuple(width * b for b in range(LENGTH_BINS + 1))
    return LengthBins(edges, counts, accuracy)


def _sigma(groups: pl.DataFrame) -> SigmaHistogram | None:
    valid = groups.filter((pl.col("n") >= 2) & pl.col("r_std").is_not_nan()).drop_nulls("r_std")
    if valid.height == 0:
        return None
    top = float(valid["r_std"].max())  # type: ignore[arg-type]
    width = (top if top > 0 else 1.0) / SIGMA_BINS
    counted = (
        valid.with_columns(
            (pl.col("r_std") / width).floor().clip(0, SIGMA_BINS - 1).cast(pl.Int32).alias("bin")
        )
        .group_by("step", "bin")
        .len()
    )
    steps = sorted(int(s) for s in counted["step"].unique().to_list())
    index = {s: i for i, s in enumerate(steps)}
    grid = np.zeros((len(steps), SIGMA_BINS), dtype=np.int64)
    for step, b, n in counted.iter_rows():
        grid[index[int(step)], int(b)] = int(n)
    edges = tuple(width * b for b in range(SIGMA_BINS + 1))
    return SigmaHistogram(tuple(steps), edges, tuple(tuple(int(v) for v in row) for row in grid))


def _pass_curve(groups: pl.DataFrame, group_size: object) -> PassCurve | None:
    if groups.height == 0:
        return None
    sizes = groups["n"]
    n_max = int(group_size) if isinstance(group_size, int) and group_size > 0 else None
    if n_max is None:
        n_max = int(sizes.mode().sort().item(-1))
    steps = sorted(int(s) for s in groups["step"].unique().to_list())
    window = window_size(len(steps))
    early_steps, final_steps = steps[:window], steps[-window:]
    ks = tuple(range(1, n_max + 1))

    def curve(chosen: list[int]) -> tuple[float | None, ...]:
        rows = groups.filter(pl.col("step").is_in(chosen)).select("n", "n_correct").rows()
        out = []
        for k in ks:
            values = [pass_at_k(n, c, k) for n, c in rows if n >= k]
            out.append(sum(values) / len(values) if values else None)
        return tuple(out)

    return PassCurve(
        ks,
        curve(early_steps),
        curve(final_steps),
        (early_steps[0], early_steps[-1]),
        (final_steps[0], final_steps[-1]),
    )
