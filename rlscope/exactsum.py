"""Float sums whose bits depend on the values alone, not on threads, batching or row order."""

from __future__ import annotations

import os
from typing import Literal

import polars as pl

# Polars splits a group-by of few groups across threads and adds the threads' partial sums in
# the order they finish; with this set (Polars reads it at every group-by) each group is summed
# in row order. A CI gate must not flip on which thread finished first.
os.environ.setdefault("POLARS_NO_PARTITION", "1")

#: The engine of every query whose float aggregations reach a result: the streaming engine
#: adds its morsels' partial sums in the order its threads finish them.
ENGINE: Literal["in-memory"] = "in-memory"


def ordered_sum(values: pl.Expr) -> pl.Expr:
    """The sum of `values` (nulls skipped; 0 when there are none) in sorted order: rows that
    come in any order (files, workers, a warm or cold cache, a group-by's output) give the
    same bits. `sort().sum()` would not do: Polars drops a sort before an aggregation that
    ignores order."""
    return _sorted_total(values).fill_null(0.0)


def ordered_mean(values: pl.Expr) -> pl.Expr:
    """The mean of `values` (nulls skipped; null when there are none) summed in sorted order
    (see `ordered_sum`): one run gave 0.8251953125 and the next 0.8251953125000001 on the same
    data with `mean()`."""
    return _sorted_total(values) / values.count()


def _sorted_total(values: pl.Expr) -> pl.Expr:
    return values.sort().cum_sum().last()
