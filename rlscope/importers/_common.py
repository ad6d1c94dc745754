"""Rules shared by the importers: correctness, reserved names, step filtering, step rows."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import polars as pl

from rlscope.importers._jsonl import LINE
from rlscope.importers.session import MAX_STEP, Session
from rlscope.schema import TABLES

#: Columns importers add beside the format-v1 ones.
OWN_EXTRAS = ("prompt", "n_env_steps")
RESERVED_ROLLOUTS = frozenset(c.name for c in TABLES["rollouts"].columns) | set(OWN_EXTRAS)
#: `reward` is left out: trainers that log it unmapped (TRL's log_history) mean the mean
#: sequence reward, which is the steps column's meaning.
RESERVED_STEPS = frozenset(c.name for c in TABLES["steps"].columns) - {"reward"}


def correct_from_reward(reward: pl.Expr, threshold: float | None) -> pl.Expr:
    """correct = reward >= correct_threshold when given, else reward > 0."""
    return reward >= threshold if threshold is not None else reward > 0


def correct_rule(threshold: float | None, name: str = "reward") -> str:
    return f"{name} >= {threshold} (correct_threshold)" if threshold is not None else f"{name} > 0"


#: Words in a reward function's name that say it scores correctness, best first (rank 0 beats
#: rank 1 ...). `accuracy_reward` (TRL's trl/rewards/accuracy_rewards.py, open-r1), `acc`
#: (verl's math reward extras), `correct`, `exact_match` / `em`, `verifier` / `verify`, `math`,
#: `pass`, `solved`, `success`.
ACCURACY_WORDS = (
    frozenset({"accuracy", "acc", "correct", "correctness"}),
    frozenset({"exact", "em", "exactmatch"}),
    frozenset({"verifier", "verify", "verified", "verifiable"}),
    frozenset({"math", "pass", "solved", "solve", "success"}),
)
#: Words that make a name a shaping term, never correctness (`math_format_reward`).
NOT_ACCURACY_WORDS = frozenset(
    {"format", "tag", "tags", "xml", "think", "len", "length", "repetition", "penalty",
     "overlong", "cosine", "style", "count", "steps", "soft"}
)  # fmt: skip


def name_words(name: str) -> list[str]:
    """`AccuracyReward`, `accuracy-reward`, `accuracy_reward` -> ['accuracy', 'reward']."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return [w for w in re.split(r"[^a-z0-9]+", spaced.lower()) if w]


def accuracy_like(names: Iterable[str]) -> tuple[str | None, str]:
    """The one reward function whose name says it scores correctness, and why; (None, why
    not) when none does or when several tie at the best rank (never a guess)."""
    names = list(names)
    ranked: dict[int, list[tuple[str, str]]] = {}
    for name in names:
        words = name_words(name)
        if NOT_ACCURACY_WORDS & set(words):
            continue
        for rank, vocabulary in enumerate(ACCURACY_WORDS):
            hit = next((w for w in words if w in vocabulary), None)
            if hit is not None:
                ranked.setdefault(rank, []).append((name, hit))
                break
    if not ranked:
        return (
            None,
            "no reward function is named like accuracy/acc/correct/exact_match/verifier/math",
        )
    best = ranked[min(ranked)]
    if len(best) > 1:
        shown = ", ".join(f"`{n}`" for n, _ in best)
        return None, f"several reward functions are named like accuracy ({shown})"
    name, word = best[0]
    return name, f"the only reward function named like accuracy (word `{word}`)"


def rename_reserved(
    frame: pl.DataFrame, extras: Iterable[str], session: Session, what: str
) -> tuple[pl.DataFrame, list[str]]:
    """Extra source keys carrying a format-v1 name (or one the importers add) are kept as
    `raw_<key>`, so they never pass for the format's own column. Returns the frame and the
    extra columns' new names."""
    extras = list(extras)
    clash = {c: f"raw_{c}" for c in extras if c in RESERVED_ROLLOUTS}
    if not clash:
        return frame, extras
    session.notes.append(
        f"{what} key(s) {', '.join(f'`{c}`' for c in clash)} kept as "
        f"{', '.join(f'`{n}`' for n in clash.values())} (format-v1 names)"
    )
    return frame.rename(clash), [clash.get(c, c) for c in extras]


def keep_new_steps(
    frame: pl.DataFrame, path: Path, session: Session, status: str, *, this_call: bool = True
) -> pl.DataFrame:
    """Drop rows of steps out of range (skipped lines) and of steps already imported (counted;
    a warning when they come from a new or changed file)."""
    bad = frame.filter((pl.col("step") < 0) | (pl.col("step") > MAX_STEP))
    for line, step in bad.select(LINE, "step").iter_rows():
        session.skips.add(path, line, "step out of range", f"{step}, expected 0..{MAX_STEP:,}")
    frame = frame.filter(pl.col("step").is_between(0, MAX_STEP))
    steps = frame["step"].unique().sort().to_list()
    old = [s for s in steps if session.already("rollouts", s, this_call=this_call)]
    if not old:
        return frame
    for step in old:
        session.skip_step("rollouts", step)
    if status in ("new", "changed", "grown"):
        shown = ", ".join(map(str, old[:5])) + (" ..." if len(old) > 5 else "")
        session.warnings.append(
            f"{path}: step(s) {shown} already imported; not re-imported"
            + (" (the file changed after it was imported)" if status == "changed" else "")
        )
    return frame.filter(~pl.col("step").is_in(old))


def index_within_step(frame: pl.DataFrame, order: str = LINE) -> pl.DataFrame:
    """`_index`: 0-based position of each row within its step, in source order."""
    return frame.sort(order).with_columns(
        pl.int_range(pl.len(), dtype=pl.Int64).over("step").alias("_index")
    )


class StepRows:
    """Per-step metric dicts from a trainer log: mapped names, other numeric keys under their
    own name (format-v1 names not mapped become `raw_<key>`), non-numeric values dropped and
    counted; several records of one step merge, later keys winning."""

    def __init__(self, mapping: Mapping[str, str]) -> None:
        self.mapping = dict(mapping)
        self.rows: dict[int, dict[str, float]] = {}
        self.dropped: Counter[str] = Counter()

    def add(self, step: int, data: Mapping[str, Any]) -> None:
        row = self.rows.setdefault(step, {})
        for key, value in data.items():
            if key == "step":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                self.dropped[key] += 1
                continue
            name = self.mapping.get(key, key)
            if key not in self.mapping and key in RESERVED_STEPS:
                name = f"raw_{key}"
            row[name] = float(value) if math.isfinite(value) else math.nan

    def note(self, session: Session, what: str) -> None:
        if self.dropped:
            keys = ", ".join(f"`{k}`" for k, _ in self.dropped.most_common(5))
            session.notes.append(
                f"{what}: {sum(self.dropped.values()):,} non-numeric value(s) dropped "
                f"(keys {keys}{' ...' if len(self.dropped) > 5 else ''})"
            )

    def sorted_rows(self) -> list[dict[str, Any]]:
        return [{"step": s, **self.rows[s]} for s in sorted(self.rows)]


class EvalPoints:
    """A trainer's logged eval accuracies of named eval sets, as the steps table's L5 columns.

    Each set is an ID or OOD split (`ood_sets`, else a set whose name has the word `ood`). Per
    step and split: the accuracy (the sets' accuracies weighted by their completions; the
    plain mean where a size is unknown) and the completions it was measured on, written as
    `eval_id_accuracy`, `eval_id_completions`, `eval_ood_accuracy`, `eval_ood_completions`
    (completions absent where a set's size is not logged: its sampling error is unknown);
    rlscope's generalization metrics read them when the run has no eval rollouts."""

    def __init__(self, ood_sets: list[str] | None) -> None:
        self.ood_sets = ood_sets
        self.sets: dict[str, str] = {}  # name -> split
        self.points: dict[tuple[int, str], list[tuple[float, int | None]]] = {}

    def split_of(self, name: str) -> str:
        """The split of eval set `name` (remembered for the note)."""
        if name not in self.sets:
            if self.ood_sets is not None:
                ood = name in self.ood_sets
            else:
                ood = "ood" in re.split(r"[^a-z0-9]+", name.lower())
            self.sets[name] = "eval_ood" if ood else "eval_id"
        return self.sets[name]

    def add(self, step: int, name: str, accuracy: float, completions: int | None) -> None:
        self.points.setdefault((step, self.split_of(name)), []).append((accuracy, completions))

    def columns(self) -> dict[int, dict[str, float]]:
        """Per step, the pooled accuracy (and completions, where known) of each split."""
        out: dict[int, dict[str, float]] = {}
        for (step, split), points in self.points.items():
            row = out.setdefault(step, {})
            sizes = [n for _, n in points]
            if all(sizes):
                total = float(sum(n or 0 for n in sizes))
                row[f"{split}_accuracy"] = sum(a * (n or 0) for a, n in points) / total
                row[f"{split}_completions"] = total
            else:
                row[f"{split}_accuracy"] = sum(a for a, _ in points) / len(points)
        return out

    def note(self, what: str) -> list[str]:
        """One line: which set is which split, and how it was decided."""
        if not self.sets:
            return []
        named = ", ".join(f"`{n or 'eval'}` → {split}" for n, split in sorted(self.sets.items()))
        how = "ood_sets option" if self.ood_sets is not None else "by name: `ood` in it is OOD"
        return [f"{what}: {named} ({how})"]
