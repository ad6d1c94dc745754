"""L4 exploration: how different a prompt's rollouts are from each other, and how that evolves."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from rlscope import text
from rlscope.context import MetricContext
from rlscope.exactsum import ordered_mean
from rlscope.metrics._common import train
from rlscope.spec import Declarations, Metric, Variant
from rlscope.windows import window_size

#: This layer's metrics, in order (collected by rlscope.catalog).
DECLARED = Declarations()

GROUP = ("step", "prompt_id")  # train groups only: split is constant
#: Pairs per chunk of the vectorised edit-distance DP (bounds its memory).
PAIR_CHUNK = 20_000
_BY_ACTIONS = "rollouts.actions: the action sequence"
_BY_TEXT = "rollouts.response: the normalised text (with the actions and tool-call arguments)"


def _trajectory_key(ctx: MetricContext) -> dict[str, pl.Expr]:
    """A trajectory is everything the rollout did: its normalised text and, when logged, its
    action sequence and each tool call's arguments. Two rollouts whose texts differ are never
    one trajectory, whatever their (coarse) action names."""
    parts = [pl.col(text.PLAIN).hash()]
    if ctx.run.has("rollouts", "actions"):
        parts.append(text.sequence_key(pl.col("actions")).fill_null(0))
    if ctx.run.has("rollouts", "tool_calls"):
        parts.append(text.sequence_key(pl.col("tool_calls")).fill_null(0))
    key = parts[0] if len(parts) == 1 else pl.struct(*parts).hash()
    # A response that is null has no trajectory to compare (left out, as before).
    keys: dict[str, pl.Expr] = {
        "trajectory_key": pl.when(pl.col(text.PLAIN).is_not_null()).then(key)
    }
    if ctx.run.has("rollouts", "correct"):  # diversity-collapse tells solved groups apart
        keys["correct"] = pl.col("correct")
    return keys


_TEXT_SIGNATURE = {e.meta.output_name(): e for e in text.minhash(pl.col(text.PLAIN_SHINGLES))}


def _plain(ctx: MetricContext) -> dict[str, pl.Expr]:
    return text.plain_prelude(ctx.text.tags)


_ACTION_KEY = {"action_key": text.sequence_key(pl.col("actions"))}
_ACTION_SEQ = {
    "action_seq": pl.col("actions").list.eval(pl.element().str.strip_chars().hash()),
}


def _keyed(frame: pl.LazyFrame, key: str) -> pl.LazyFrame:
    return train(frame).filter(pl.col(key).is_not_null())


def _clusters(frame: pl.LazyFrame, key: str) -> pl.LazyFrame:
    """Per train group: its size and the sizes of its clusters of identical trajectories."""
    sizes = _keyed(frame, key).group_by(*GROUP, key).agg(pl.len().alias("size"))
    return (
        sizes.group_by(GROUP)
        .agg(pl.col("size").sum().alias("n"), pl.col("size").alias("sizes"))
        .filter(pl.col("n") >= 2)
    )


def _unique_frac(key: str):
    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        groups = _clusters(frame, key).with_columns(
            (pl.col("sizes").list.len() / pl.col("n")).alias("unique")
        )
        return groups.group_by("step").agg(ordered_mean(pl.col("unique")).alias("value"))

    return series


def _unique_variant(key: str, partials: Any, requires: str, source: str) -> Variant:
    return Variant(
        "rollouts",
        (requires,),
        _unique_frac(key),
        partials,
        source,
        empty_reason="no train group with 2 or more rollouts",
        level="rollout",
        prelude=_plain if requires == "response" else {},
    )


DECLARED.metric(
    Metric(
        id="exploration.unique_frac",
        brief=(
            "distinct trajectories (action sequence, else normalised text) / group size; "
            "`decline` smooth or cliff"
        ),
        unit="share",
        layer="L4",
        title="Distinct trajectories per group",
        doc="Per train group (>= 2 rollouts): distinct trajectories / group size, averaged over "
        "the step's groups. A trajectory is everything the rollout did: the response text "
        "(lower-cased, whitespace collapsed, tags removed) together with its action sequence "
        "(`actions`) and tool-call arguments (`tool_calls`) when logged; the action sequence "
        "alone only when there is no text. Coarse actions (tool names without arguments) never "
        "make two rollouts with different texts identical. 1 = every rollout different; "
        "1/N = all N identical, and GRPO gets no signal from a group of copies.",
        healthy="near 1 for free-text reasoning; a slow decline is normal, a fall to 1/N is not",
        trajectory=True,
        references="seed §5 (L4); Feng et al. 2025, GiGPO (Fig. 5)",
        variants=(
            _unique_variant("trajectory_key", _trajectory_key, "response", _BY_TEXT),
            _unique_variant("action_key", _ACTION_KEY, "actions", _BY_ACTIONS),
        ),
    )
)


#: A group is collapsed when its largest identical cluster holds at least this share of it.
COLLAPSED_SHARE = 0.5


def _largest_cluster(key: str):
    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        groups = _clusters(frame, key).with_columns(
            (pl.col("sizes").list.max() / pl.col("n")).alias("largest")
        )
        steps = groups.group_by("step").agg(
            ordered_mean(pl.col("largest")).alias("value"),
            pl.col("sizes").list.explode(keep_nulls=False, empty_as_null=False).alias("sizes"),
            pl.col("n").alias("group_sizes"),
        )
        if "correct" not in frame.collect_schema():
            return steps
        return steps.join(_collapsed(frame, key), on="step", how="left")

    return series


def _collapsed(frame: pl.LazyFrame, key: str) -> pl.LazyFrame:
    """Per step, the train groups whose largest identical cluster is at least COLLAPSED_SHARE
    of the group (`extra_collapsed`), and of them those whose largest cluster is a correct
    answer (`extra_collapsed_correct`; on a tie of sizes, a correct one): a group converged on
    the answer of a prompt it has learnt, or stuck on a wrong one."""
    clusters = (
        _keyed(frame, key)
        .group_by(*GROUP, key)
        .agg(pl.len().alias("size"), pl.col("correct").cast(pl.Float64).mean().alias("right"))
        .sort("size", "right", descending=True, nulls_last=True)
    )
    groups = clusters.group_by(GROUP).agg(
        pl.col("size").first().alias("largest"),
        pl.col("size").sum().alias("n"),
        pl.col("right").first().alias("mode_right"),
    )
    collapsed = (pl.col("n") >= 2) & (pl.col("largest") >= COLLAPSED_SHARE * pl.col("n"))
    known = collapsed & pl.col("mode_right").is_not_null()
    return groups.group_by("step").agg(
        known.cast(pl.Float64).sum().alias("extra_collapsed"),
        (known & (pl.col("mode_right") > 0.5))
        .cast(pl.Float64)
        .sum()
        .alias("extra_collapsed_correct"),
    )


def _cluster_histogram(frame: pl.DataFrame, ctx: MetricContext) -> dict[str, Any]:
    """Cluster-size counts over the run and over the final 10% of its steps (GiGPO Fig. 5)."""
    if frame.height == 0:
        return {}
    frame = frame.sort("step")
    tail = frame.tail(window_size(frame.height))

    def counts(column: pl.Series) -> pl.DataFrame:
        """How often each value of a list column occurs, by value."""
        values = column.explode(empty_as_null=False).drop_nulls().cast(pl.Int64)
        return values.value_counts(name="n").sort(values.name)

    def histogram(part: pl.DataFrame) -> dict[str, int]:
        return {str(size): int(n) for size, n in counts(part["sizes"]).iter_rows()}

    sizes = counts(frame["group_sizes"])
    modal = sizes.sort("n", "group_sizes", descending=True)  # the larger size on a tie
    return {
        "cluster_sizes": {"run": histogram(frame), "final_window": histogram(tail)},
        "group_size": int(modal["group_sizes"][0]) if modal.height else None,
    }


DECLARED.metric(
    Metric(
        id="exploration.cluster_sizes",
        brief=(
            "share of a group in its largest identical cluster; the cluster-size distribution "
            "(GiGPO Fig. 5) in the JSON"
        ),
        unit="share",
        layer="L4",
        title="Largest identical-trajectory cluster",
        doc="Rollouts of a train group with identical trajectories (normalised text with its "
        "actions and tool-call arguments, see exploration.unique_frac; actions alone only "
        "without text) form a cluster. Per step: the mean share of a group taken by its "
        "largest cluster (1/N = all distinct, 1 = one mode). The JSON's `cluster_sizes` holds "
        "the distribution of cluster sizes over the run and the final window (GiGPO's Fig. 5: "
        "step-level groups concentrating at size N means exploration is lost). With "
        "correctness, per step: `collapsed`, the groups whose largest cluster is at least half "
        "of them, and `collapsed_correct`, those whose largest cluster is a correct answer "
        "(diversity-collapse tells a policy converged on answers it learnt from one stuck on "
        "wrong ones, at every prefix from the steps' own groups).",
        healthy="close to 1/N; mass at size 1 in the cluster-size distribution",
        summary=_cluster_histogram,
        references="Feng et al. 2025, GiGPO (Fig. 5)",
        variants=(
            Variant(
                "rollouts",
                ("response",),
                _largest_cluster("trajectory_key"),
                _trajectory_key,
                _BY_TEXT,
                level="rollout",
                prelude=_plain,
            ),
            Variant(
                "rollouts",
                ("actions",),
                _largest_cluster("action_key"),
                _ACTION_KEY,
                _BY_ACTIONS,
                level="rollout",
            ),
        ),
    )
)


def _minhash_diversity(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    """1 - mean pairwise Jaccard estimate per group. Pairs that agree at signature position j
    are counted from the value counts at j (Σ c(c-1)/2), so the cost is linear in rollouts;
    groups are keyed by one integer so that each position's counts stay small."""
    k = text.MINHASH_K
    signed = _keyed(frame, "minhash_0").select(
        pl.struct(GROUP).hash().alias("group"), *(f"minhash_{j}" for j in range(k))
    )
    agreeing = (
        pl.concat(
            [
                signed.group_by("group", f"minhash_{j}")
                .agg(pl.len().cast(pl.Float64).alias("c"))
                .group_by("group")
                .agg((pl.col("c") * (pl.col("c") - 1) / 2).sum().alias("agree"))
                for j in range(k)
            ]
        )
        .group_by("group")
        .agg(pl.col("agree").sum())
    )
    sizes = (
        _keyed(frame, "minhash_0")
        .group_by(GROUP)
        .agg(pl.len().cast(pl.Float64).alias("n"))
        .with_columns(pl.struct(GROUP).hash().alias("group"))
    )
    pairs = pl.col("n") * (pl.col("n") - 1) / 2
    groups = sizes.filter(pl.col("n") >= 2).join(agreeing, on="group", how="left")
    diversity = ordered_mean(1.0 - pl.col("agree") / (k * pairs))
    return groups.group_by("step").agg(diversity.alias("value"))


def edit_distances(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """Levenshtein distance of each pair (a[i], b[i]) of integer sequences."""
    seqs, lengths = _pad(a + b)
    n = len(a)
    return _pair_distances(seqs, lengths, np.arange(n), np.arange(n, 2 * n))


def _pad(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Sequences as rows of one matrix (padding never matches: -1) and their lengths."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    padded = np.full((len(seqs), max(1, int(lengths.max(initial=0)))), -1, dtype=np.int64)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    return padded, lengths


def _pair_distances(
    seqs: np.ndarray, lengths: np.ndarray, left: np.ndarray, right: np.ndarray
) -> np.ndarray:
    """Levenshtein distances of the pairs (left[p], right[p]) of rows of `seqs`, vectorised over
    pairs (one numpy step per DP cell of the longest pair, not per pair), in chunks."""
    out = np.zeros(len(left), dtype=np.float64)
    for lo in range(0, len(left), PAIR_CHUNK):
        a, b = left[lo : lo + PAIR_CHUNK], right[lo : lo + PAIR_CHUNK]
        out[lo : lo + len(a)] = _edit_chunk(seqs[a], lengths[a], seqs[b], lengths[b])
    return out


def _edit_chunk(
    left: np.ndarray, len_a: np.ndarray, right: np.ndarray, len_b: np.ndarray
) -> np.ndarray:
    n = len(left)
    width = int(len_b.max(initial=0))
    rows = np.arange(n)
    prev = np.tile(np.arange(width + 1, dtype=np.int64), (n, 1))
    result = len_b.astype(np.float64)  # len_a == 0: distance = len_b
    for i in range(1, int(len_a.max(initial=0)) + 1):
        cur = np.empty_like(prev)
        cur[:, 0] = i
        # Padding (-1) on both sides would "match": a cell past len_b is never read, and
        # one past len_a is never stored, so it does not matter.
        cost = (left[:, i - 1 : i] != right[:, :width]).astype(np.int64)
        for j in range(1, width + 1):
            cur[:, j] = np.minimum(
                np.minimum(prev[:, j] + 1, cur[:, j - 1] + 1), prev[:, j - 1] + cost[:, j - 1]
            )
        done = len_a == i
        result[done] = cur[rows[done], len_b[done]]
        prev = cur
    return result


def _edit_diversity(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    """Mean normalised edit distance (distance / longer length) over a group's pairs."""
    rows = (
        _keyed(frame, "action_seq")
        .select(*GROUP, pl.col("action_seq").cast(pl.List(pl.UInt64)))
        .sort(*GROUP)
        .collect()
    )
    group = rows.select(pl.struct(GROUP).rank("dense")).to_series().to_numpy().astype(np.int64)
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]]) if len(group) else group
    sizes = np.diff(np.r_[starts, len(group)])
    left, right, owner = [], [], []
    for size in np.unique(sizes[sizes >= 2]):
        first = starts[sizes == size]
        i, j = np.triu_indices(int(size), 1)
        left.append((first[:, None] + i).ravel())
        right.append((first[:, None] + j).ravel())
        owner.append(np.repeat(first, len(i)))
    if not owner:
        return pl.LazyFrame(schema={"step": pl.Int64, "value": pl.Float64})
    a, b, g = np.concatenate(left), np.concatenate(right), np.concatenate(owner)
    seqs, lengths = _pad(
        [np.asarray(s, dtype=np.uint64).view(np.int64) for s in rows["action_seq"].to_list()]
    )
    longest = np.maximum(np.maximum(lengths[a], lengths[b]), 1)
    distance = _pair_distances(seqs, lengths, a, b) / longest
    pairs = pl.DataFrame({"row": g, "d": distance})
    per_group = pairs.group_by("row").agg(ordered_mean(pl.col("d")))
    keys = rows.select(GROUP).with_row_index("row").with_columns(pl.col("row").cast(pl.Int64))
    return (
        keys.join(per_group, on="row")
        .lazy()
        .group_by("step")
        .agg(ordered_mean(pl.col("d")).alias("value"))
    )


DECLARED.metric(
    Metric(
        id="exploration.pairwise_diversity",
        brief=(
            "mean pairwise distance in a group: normalised edit distance of `actions`, else 1 − "
            "MinHash Jaccard of word 3-grams; `decline`"
        ),
        unit="share",
        layer="L4",
        title="Within-group pairwise diversity",
        doc="Mean distance between two rollouts of the same train group, averaged over the "
        "step's groups (>= 2 rollouts). Text first (it holds what the rollout did, arguments "
        "included): 1 - Jaccard similarity of "
        "the sets of word 3-grams, estimated with a 32-value MinHash signature per rollout. "
        "MinHash rather than cosine of hashed n-gram vectors because a fixed-size signature "
        "makes the cost linear in tokens (one hash per word, 32 per 3-gram) and the group mean "
        "linear in rollouts (agreeing pairs are counted from value counts, never pair by pair), "
        "and the estimate is unbiased with a known error: standard error sqrt(J(1-J)/32) <= "
        "0.09 for one pair, less for a group's mean over its pairs. Without text, action "
        "sequences (`actions`): Levenshtein distance over actions / the longer length "
        "(ALFWorld/WebShop style). 0 = all identical.",
        healthy="high and slowly declining; a fall towards 0 means the group collapsed to one mode",
        trajectory=True,
        references="seed §5 (L4); Broder 1997 (MinHash); Feng et al. 2025, GiGPO",
        variants=(
            Variant(
                "rollouts",
                ("response",),
                _minhash_diversity,
                _TEXT_SIGNATURE,
                "rollouts.response: 1 - MinHash Jaccard of word 3-grams",
                level="rollout",
                prelude=_plain,
            ),
            Variant(
                "rollouts",
                ("actions",),
                _edit_diversity,
                _ACTION_SEQ,
                "rollouts.actions: normalised edit distance",
                level="rollout",
            ),
        ),
    )
)
