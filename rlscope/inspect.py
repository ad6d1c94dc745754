"""Open single rollouts (`rlscope show`) and list rollouts by finding or filter (`rollouts`)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from rlscope.catalog import Catalog, default_catalog
from rlscope.config import Config, load_config
from rlscope.errors import RlscopeError
from rlscope.filterlang import compile_filter, parse_filter
from rlscope.reader import Run, open_run, scan_error
from rlscope.report import json_safe
from rlscope.text import TagSet, parse_segments

#: Token columns a rollout view carries (those the tokens table has), sorted by `pos`.
TOKEN_COLUMNS = ("pos", "entropy", "segment", "logprob", "advantage")
#: Columns of a rollout list, in order (those the rollouts table has).
LIST_COLUMNS = (
    "rollout_id",
    "step",
    "prompt_id",
    "split",
    "reward",
    "correct",
    "response_len",
    "answer",
)
#: A word of the response, for the entropy heat strip.
WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class Segment:
    """One part of a response: `think`, `answer`, `tool_call`, `tool_response` or `text`."""

    name: str
    text: str


@dataclass(frozen=True)
class ToolCall:
    """One tool call as logged (or as written in the response's tags), with its name and
    arguments when the call is JSON `{"name": ..., "arguments": ...}`."""

    text: str
    name: str | None = None
    arguments: Any = None


@dataclass(frozen=True)
class Probe:
    """One probe of the rollout (all its columns) and whether its answer equals the rollout's
    (lower-cased, whitespace collapsed; a probe without an answer counts as changed; None when
    the rollout has no answer)."""

    row: dict[str, Any]
    unchanged: bool | None


@dataclass(frozen=True)
class WordHeat:
    """A word of the response (character span) and the mean entropy of the tokens aligned to
    it (None when they have none)."""

    start: int
    end: int
    entropy: float | None
    n_tokens: int


@dataclass(frozen=True)
class RolloutView:
    """Everything the run holds about one rollout."""

    run_path: str
    run_id: str
    rollout_id: int
    row: dict[str, Any]
    segments: tuple[Segment, ...]
    tool_calls: tuple[ToolCall, ...]
    #: Where the tool calls come from: `tool_calls` (the column), `response` (its tags) or None.
    tool_calls_source: str | None
    #: Token columns (pos, entropy, segment, logprob, advantage as present), sorted by pos.
    tokens: dict[str, list[Any]]
    #: Why there are no tokens (no tokens table, no rows for this rollout), else None.
    tokens_note: str | None
    probes: tuple[Probe, ...]
    #: Why there are no probes (no probes table), else None.
    probes_note: str | None = None

    @property
    def response(self) -> str | None:
        value = self.row.get("response")
        return value if isinstance(value, str) else None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens.get("pos", []))

    def word_entropy(self) -> tuple[WordHeat, ...]:
        """The response's words coloured by token entropy (see `word_entropy`); () without a
        response, tokens or an entropy column."""
        if self.response is None or "entropy" not in self.tokens:
            return ()
        return word_entropy(self.response, self.tokens["entropy"])

    def to_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "run": {"path": self.run_path, "run_id": self.run_id},
                "rollout_id": self.rollout_id,
                "rollout": self.row,
                "segments": [{"segment": s.name, "text": s.text} for s in self.segments],
                "tool_calls": [
                    {"text": c.text, "name": c.name, "arguments": c.arguments}
                    for c in self.tool_calls
                ],
                "tool_calls_source": self.tool_calls_source,
                "tokens": self.tokens,
                "tokens_note": self.tokens_note,
                "probes": [{**p.row, "unchanged": p.unchanged} for p in self.probes],
                "probes_note": self.probes_note,
            }
        )


@dataclass(frozen=True)
class RolloutList:
    """Rollouts matching a finding and/or a filter, sorted by step and rollout_id."""

    run_path: str
    columns: tuple[str, ...]
    rows: tuple[dict[str, Any], ...]
    #: How many rollouts matched in total (`rows` holds at most `limit`).
    total: int
    limit: int
    finding: str | None = None
    where: str | None = None
    #: Why the list is empty for a reason other than the filter (a finding that did not fire).
    message: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "run": {"path": self.run_path},
                "finding": self.finding,
                "filter": self.where,
                "total": self.total,
                "shown": len(self.rows),
                "limit": self.limit,
                "message": self.message,
                "notes": list(self.notes),
                "rollouts": list(self.rows),
            }
        )


# --- one rollout ------------------------------------------------------------------------------


def rollout(
    path: str | os.PathLike[str], rollout_id: int, *, tags: TagSet | None = None
) -> RolloutView:
    """The rollout `rollout_id` of the run at `path`: its row, segments, tool calls, tokens
    (filtered by rollout_id and step, lazily) and probes. Read-only."""
    run = open_run(path)
    run_id = str(run.meta.get("run_id", run.path.name))
    rid = int(rollout_id)
    try:
        found = run.scan("rollouts").filter(pl.col("rollout_id") == rid).collect()
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise scan_error(run, ["rollouts"], f"reading rollout {rid}", exc) from None
    if found.height == 0:
        raise RlscopeError(
            f"{run.path}: run `{run_id}` has no rollout with rollout_id {rid}",
            hint=f"`rlscope rollouts {run.path}` lists rollout ids",
        )
    row = found.row(0, named=True)
    response = row.get("response")
    segments = (
        tuple(Segment(name, text) for name, text in parse_segments(response, tags))
        if isinstance(response, str)
        else ()
    )
    calls, source = _tool_calls(row, segments)
    tokens, tokens_note = _tokens(run, rid, row.get("step"))
    probes, probes_note = _probes(run, rid, row.get("answer"))
    run.check_unchanged()
    return RolloutView(
        run_path=str(run.path),
        run_id=run_id,
        rollout_id=rid,
        row=row,
        segments=segments,
        tool_calls=calls,
        tool_calls_source=source,
        tokens=tokens,
        tokens_note=tokens_note,
        probes=probes,
        probes_note=probes_note,
    )


def parse_tool_call(text: str) -> ToolCall:
    """A serialized call; `name` and `arguments` filled when it is JSON with them."""
    body = text.strip()
    try:
        value = json.loads(body)
    except ValueError:
        return ToolCall(body)
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return ToolCall(body, value["name"], value.get("arguments"))
    return ToolCall(body, None, value)


def _tool_calls(
    row: Mapping[str, Any], segments: Sequence[Segment]
) -> tuple[tuple[ToolCall, ...], str | None]:
    logged = row.get("tool_calls")
    if logged is not None:
        return tuple(parse_tool_call(c) for c in logged if c is not None), "tool_calls"
    parsed = tuple(parse_tool_call(s.text) for s in segments if s.name == "tool_call")
    return parsed, "response" if parsed else None


def _tokens(run: Run, rid: int, step: int | None) -> tuple[dict[str, list[Any]], str | None]:
    if "tokens" not in run.tables:
        return {}, "the run has no tokens table"
    columns = [c for c in TOKEN_COLUMNS if c in run.tables["tokens"].schema]
    # The step first: Parquet statistics let whole files and row groups of other steps be skipped.
    where = pl.col("rollout_id") == rid
    if step is not None:
        where = (pl.col("step") == step) & where
    try:
        frame = (
            run.scan("tokens")
            .filter(where)
            .select(columns)
            .sort("pos", nulls_last=True, maintain_order=True)
            .collect(engine="streaming")
        )
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise scan_error(run, ["tokens"], f"reading the tokens of rollout {rid}", exc) from None
    if frame.height == 0:
        at = f" at step {step}" if step is not None else ""
        return {}, f"the tokens table has no rows for rollout {rid}{at}"
    return {c: frame[c].to_list() for c in columns}, None


def _normalized(text: str) -> str:
    return " ".join(text.lower().split())


def _probes(run: Run, rid: int, answer: object) -> tuple[tuple[Probe, ...], str | None]:
    if "probes" not in run.tables:
        return (), "the run has no probes table"
    schema = run.tables["probes"].schema
    order = [c for c in ("intervention", "fraction") if c in schema]
    try:
        frame = (
            run.scan("probes")
            .filter(pl.col("rollout_id") == rid)
            .sort(order, nulls_last=True, maintain_order=True)
            .collect()
        )
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise scan_error(run, ["probes"], f"reading the probes of rollout {rid}", exc) from None
    original = _normalized(answer) if isinstance(answer, str) and answer.strip() else None
    probes = []
    for row in frame.iter_rows(named=True):
        probe_answer = row.get("answer")
        if original is None:
            unchanged = None
        else:
            unchanged = isinstance(probe_answer, str) and _normalized(probe_answer) == original
        probes.append(Probe(row, unchanged))
    return tuple(probes), None


def word_entropy(text: str, entropy: Sequence[float | None]) -> tuple[WordHeat, ...]:
    """Tokens aligned to the text's words by position (the tokens table has no token strings):
    with T tokens and W words, word i covers the tokens j with i·T/W <= j < (i+1)·T/W, i.e.
    j = ceil(i·T/W) … ceil((i+1)·T/W) - 1; a word that covers none (T < W) takes the token
    floor(i·T/W). Each word gets the mean of its tokens' finite entropies."""
    words = list(WORD.finditer(text))
    n_words, n_tokens = len(words), len(entropy)
    if not n_words or not n_tokens:
        return ()
    out = []
    for i, match in enumerate(words):
        lo = -(-i * n_tokens // n_words)
        hi = -(-(i + 1) * n_tokens // n_words)
        if hi <= lo:
            lo = i * n_tokens // n_words
            hi = lo + 1
        values = [float(v) for v in entropy[lo:hi] if v is not None and math.isfinite(float(v))]
        mean = sum(values) / len(values) if values else None
        out.append(WordHeat(match.start(), match.end(), mean, hi - lo))
    return tuple(out)


# --- lists of rollouts ------------------------------------------------------------------------


def rollouts(
    path: str | os.PathLike[str],
    *,
    finding: str | None = None,
    where: str | None = None,
    limit: int = 20,
    config: Config | None = None,
) -> RolloutList:
    """The run's rollouts named by a finding's evidence (`finding`, analysing the run) and/or
    matching a filter expression (`where`, see `parse_filter`), sorted by step and rollout_id;
    at most `limit` rows, with the total count. Read-only."""
    if limit < 0:
        raise RlscopeError(f"--limit {limit}: must be 0 or more")
    node = parse_filter(where) if where is not None else None
    run = open_run(path)
    scan = run.scan("rollouts")
    schema = scan.collect_schema()
    predicate = compile_filter(node, schema, where or "") if node is not None else None
    columns = tuple(c for c in LIST_COLUMNS if c in schema)

    def empty(message: str) -> RolloutList:
        return RolloutList(str(run.path), columns, (), 0, limit, finding, where, message)

    notes: list[str] = []
    if finding is not None:
        ids, message = finding_rollouts(path, finding, config)
        if ids is None:
            return empty(message or "")
        if message:
            notes.append(message)
        scan = scan.filter(pl.col("rollout_id").is_in(ids))
    if predicate is not None:
        scan = scan.filter(predicate)
    scan = scan.select(columns)
    try:
        counted, rows = pl.collect_all(
            [
                scan.select(pl.len()),
                scan.sort(["step", "rollout_id"], nulls_last=True).head(limit),
            ],
            engine="streaming",
        )
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise scan_error(run, ["rollouts"], "listing rollouts", exc) from None
    run.check_unchanged()
    return RolloutList(
        str(run.path),
        columns,
        tuple(rows.iter_rows(named=True)),
        int(counted.item()),
        limit,
        finding,
        where,
        None,
        tuple(notes),
    )


def finding_rollouts(
    path: str | os.PathLike[str],
    finding: str,
    config: Config | None = None,
    catalog: Catalog | None = None,
) -> tuple[list[int] | None, str | None]:
    """Analyse the run for one finding: (the rollout ids its evidence names, a note) when it
    fired and names some; (None, why) when it is disabled, could not be checked, did not fire or
    names no rollouts. An unknown finding id is an RlscopeError."""
    from rlscope.analysis import analyze

    catalog = catalog or default_catalog()
    rule = catalog.rules.get(finding)
    if rule is None:
        known = finding in catalog.metrics
        what = "a metric id, not a finding id" if known else "unknown finding id"
        raise RlscopeError(
            f"--finding {finding!r}: {what}", hint=catalog.hint(finding, metrics=False)
        )
    config = config if config is not None else load_config()
    if config.findings.get(finding, {}).get("enabled", True) is False:
        return None, f"finding `{finding}` is disabled in {config.source}"
    # Only the metrics the rule reads: the same finding as a full analysis, computed faster.
    report = analyze(path, metrics=rule.computes, config=config, catalog=catalog)
    fired = [f for f in report.findings if f.id == finding]
    if not fired:
        skipped = [s.reason for s in report.skipped if s.metric == finding]
        if skipped:
            return None, f"finding `{finding}` could not be checked on this run: {skipped[0]}"
        return None, f"finding `{finding}` did not fire on this run"
    ids = sorted({i for f in fired for i in f.rollout_ids})
    if not ids:
        steps = sorted({s for f in fired for s in f.steps})
        at = f" (its evidence points at steps {', '.join(map(str, steps))})" if steps else ""
        return None, f"finding `{finding}` fired but names no rollouts{at}"
    return ids, f"finding `{finding}` names {len(ids)} rollout(s)"
