"""Fuzzing the reader and metric engine with invalid and edge-case runs (hypothesis).

Random column subsets (required columns dropped), wrong dtypes (strings, floats, ints, bools,
lists, structs, nulls), NaN/±inf, empty tables, random extra columns and random run.json
documents are written with pyarrow into a temporary run directory. Property: `rlscope.analyze`
either returns a Report whose JSON is strict and whose invariants hold, or raises RlscopeError
naming a file or field — never any other exception.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import rlscope
from rlscope.catalog import default_catalog
from rlscope.errors import RlscopeError
from rlscope.reader import MAX_RESPONSE_LEN

RATES = default_catalog().share_metrics()  # every metric declared a share in [0, 1]

KINDS = ("int64", "int32", "float64", "float32", "string", "bool", "list_str", "struct", "null")
ARROW = {
    "int64": pa.int64(),
    "int32": pa.int32(),
    "float64": pa.float64(),
    "float32": pa.float32(),
    "string": pa.string(),
    "bool": pa.bool_(),
    "list_str": pa.list_(pa.string()),
    "struct": pa.struct([("a", pa.float64())]),
    "null": pa.null(),
}
# (column, kind, required) per table, as in schemas/run-format-v1.json.
TABLE_COLUMNS: dict[str, list[tuple[str, str, bool]]] = {
    "rollouts": [
        ("rollout_id", "int64", True),
        ("step", "int64", True),
        ("prompt_id", "string", True),
        ("reward", "float64", True),
        ("response_len", "int32", True),
        ("correct", "bool", False),
        ("split", "string", False),
        ("truncated", "bool", False),
        ("n_tool_calls", "int32", False),
        ("tool_calls", "list_str", False),
        ("advantage", "float64", False),
        ("answer", "string", False),
    ],
    "steps": [
        ("step", "int64", True),
        ("loss", "float64", False),
        ("grad_norm", "float64", False),
        ("kl", "float64", False),
        ("entropy", "float64", False),
        ("clip_frac", "float64", False),
    ],
    "tokens": [
        ("rollout_id", "int64", True),
        ("step", "int64", True),
        ("pos", "int32", True),
        ("logprob", "float32", False),
        ("old_logprob", "float32", False),
        ("ref_logprob", "float32", False),
        ("entropy", "float32", False),
        ("advantage", "float32", False),
        ("clipped", "bool", False),
    ],
}
EXTRA_NAMES = st.one_of(
    st.sampled_from(
        [
            "__invalid__x",
            "__invalid__reward",
            "logged:kl",
            "entropy_bin",
            "n",
            "n_correct",
            "split",
            "len",
            "Step",
        ]
    ),
    st.text(min_size=1, max_size=8),
)
FLOATS = st.one_of(
    st.floats(-10, 10),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1.0, -0.0, 1e308]),
)
JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False),
        st.text(max_size=6),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(), inner)),
    max_leaves=5,
)
META = {
    "schema_version": 1,
    "run_id": "fuzz",
    "algorithm": "GRPO",
    "group_size": 4,
    "max_tool_calls": 3,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.28,
    "max_response_len": 40,
    "correct_threshold": 0.5,
}


def _convert(value: Any, kind: str) -> Any:
    """A base value retyped to `kind` (None stays None)."""
    if value is None or kind == "null":
        return None
    if kind in ("int64", "int32"):
        if isinstance(value, float):
            return 0 if not math.isfinite(value) else max(-(2**31), min(2**31 - 1, round(value)))
        if isinstance(value, str):
            return sum(map(ord, value)) % 1000
        return int(value)
    if kind in ("float64", "float32"):
        return float(value) if not isinstance(value, str) else float(len(value))
    if kind == "string":
        return str(value)
    if kind == "bool":
        return bool(value)
    if kind == "list_str":
        return [str(value)]
    return {"a": float(value) if not isinstance(value, str) else 0.0}


@st.composite
def columns(draw: st.DrawFn, table: str, n: int, base: dict[str, list]) -> dict[str, tuple]:
    """The table's columns as (kind, values): unless the table is left valid, each column is
    kept, dropped, retyped, poisoned with NaN/inf or with nulls; plus random extra columns."""
    out: dict[str, tuple] = {}
    mutate = draw(st.sampled_from([False, False, True]))
    for name, kind, _required in TABLE_COLUMNS[table]:
        if name not in base:
            continue
        action = draw(st.sampled_from("kkkkkkkkkdrnz")) if mutate else "k"
        values = list(base[name])
        if action == "d":
            continue
        if action == "r":
            kind = draw(st.sampled_from([k for k in KINDS if k != kind]))
        elif action == "n" and kind.startswith("float"):
            values = [draw(FLOATS) if draw(st.booleans()) else v for v in values]
        elif action == "z":
            values = [None if draw(st.booleans()) else v for v in values]
        out[name] = (kind, [_convert(v, kind) for v in values])
    for _ in range(draw(st.integers(0, 2))):
        name = draw(EXTRA_NAMES)
        kind = draw(st.sampled_from(KINDS))
        values = [draw(st.one_of(FLOATS, st.text(max_size=3))) for _ in range(n)]
        out.setdefault(name, (kind, [_convert(v, kind) for v in values]))
    return out


@st.composite
def run_specs(draw: st.DrawFn) -> dict:
    n_steps = draw(st.integers(0, 4))
    group = draw(st.integers(1, 4))
    prompts = draw(st.integers(1, 3))
    rollouts: dict[str, list] = {k: [] for k, _, _ in TABLE_COLUMNS["rollouts"]}
    rid = 0
    for step in range(n_steps):
        for p in range(prompts):
            for _ in range(group):
                reward = draw(st.sampled_from([0.0, 1.0, 0.25, -1.0]))
                rollouts["rollout_id"].append(rid)
                rollouts["step"].append(step)
                rollouts["prompt_id"].append(f"p{p}")
                rollouts["reward"].append(reward)
                rollouts["response_len"].append(draw(st.sampled_from([0, 5, 40, 41])))
                rollouts["correct"].append(reward > 0.5)
                rollouts["split"].append(draw(st.sampled_from(["train", "train", "eval_id"])))
                rollouts["truncated"].append(False)
                rollouts["n_tool_calls"].append(draw(st.integers(0, 3)))
                rollouts["tool_calls"].append("call")
                rollouts["advantage"].append(reward - 0.5)
                rollouts["answer"].append(f"a{rid % 2}")
                rid += 1
    if draw(st.booleans()):  # optional columns present or not
        for name in draw(st.sets(st.sampled_from(list(rollouts)[5:]))):
            del rollouts[name]
    n_rows = rid
    steps = {
        "step": list(range(n_steps)),
        **{c: [0.1 * (i + 1) for i in range(n_steps)] for c in ("loss", "grad_norm", "kl")},
        "entropy": [1.0] * n_steps,
        "clip_frac": [0.05] * n_steps,
    }
    n_tok = draw(st.integers(0, 3)) * max(n_rows, 1) if n_rows else draw(st.integers(0, 2))
    tokens = {
        "rollout_id": [i % max(n_rows, 1) for i in range(n_tok)],
        "step": [(i % max(n_rows, 1)) // max(group * prompts, 1) for i in range(n_tok)],
        "pos": [i // max(n_rows, 1) for i in range(n_tok)],
        **{c: [-0.5 - 0.01 * i for i in range(n_tok)] for c in ("logprob", "old_logprob")},
        "ref_logprob": [-0.6] * n_tok,
        "entropy": [0.5 + 0.1 * (i % 3) for i in range(n_tok)],
        "advantage": [0.5 - (i % 2) for i in range(n_tok)],
        "clipped": [i % 5 == 0 for i in range(n_tok)],
    }
    spec: dict[str, Any] = {"tables": {}, "layout": {}}
    for name, base, n in (("rollouts", rollouts, n_rows), ("steps", steps, n_steps)):
        if name == "rollouts" or draw(st.booleans()):
            spec["tables"][name] = draw(columns(name, n, base))
    if draw(st.booleans()):
        spec["tables"]["tokens"] = draw(columns("tokens", n_tok, tokens))
    for name in spec["tables"]:
        spec["layout"][name] = draw(st.sampled_from(["file", "folder", "two-files"]))
    meta: Any = dict(META)
    for _ in range(draw(st.sampled_from([0, 0, 0, 0, 0, 1, 2, 3]))):
        field = draw(st.sampled_from([*META, "extra"]))
        if draw(st.booleans()):
            meta.pop(field, None)
        else:
            meta[field] = draw(JSON_VALUES)
    if draw(st.sampled_from([False] * 19 + [True])):
        meta = draw(st.one_of(JSON_VALUES, st.just("{not json")))
    spec["meta"] = meta
    return spec


def write_run(spec: dict, root: Path) -> Path:
    root.mkdir()
    meta = spec["meta"]
    text = meta if meta == "{not json" else json.dumps(meta)
    (root / "run.json").write_text(text, encoding="utf-8")
    for name, cols in spec["tables"].items():
        table = pa.table({c: pa.array(v, type=ARROW[k]) for c, (k, v) in cols.items()})
        layout = spec["layout"][name]
        if layout == "file":
            pq.write_table(table, root / f"{name}.parquet")
            continue
        (root / name).mkdir()
        if layout == "two-files" and table.num_rows > 1:
            half = table.num_rows // 2
            pq.write_table(table.slice(0, half), root / name / "part-0.parquet")
            pq.write_table(table.slice(half), root / name / "part-1.parquet")
        else:
            pq.write_table(table, root / name / "part-0.parquet")
    return root


def expected_rollouts(cols: dict[str, tuple]) -> int | None:
    """Rows with a step, a finite reward and a plausible (or missing) response_len, when
    countable."""
    reward, length, step = cols.get("reward"), cols.get("response_len"), cols.get("step")
    if reward is None or not reward[0].startswith(("float", "int")):
        return None
    if length is not None and not length[0].startswith("int"):
        return None
    if step is None or not step[0].startswith("int"):
        return None
    lengths = length[1] if length is not None else [None] * len(reward[1])
    return sum(
        1
        for r, n, s in zip(reward[1], lengths, step[1], strict=True)
        if s is not None
        and r is not None
        and math.isfinite(r)
        and (n is None or 0 <= n <= MAX_RESPONSE_LEN)
    )


def check_report(report: rlscope.Report, spec: dict) -> None:
    document = report.to_dict()
    json.loads(json.dumps(document, allow_nan=False))  # strict JSON
    results = report.metrics
    for metric_id in RATES:
        if metric_id in results:
            values = [
                v for v in (*results[metric_id].values, results[metric_id].value) if v is not None
            ]
            assert all(-1e-9 <= v <= 1 + 1e-9 for v in values), (metric_id, values)
    if "stability.kl" in results:
        assert all(v >= -1e-12 for v in results["stability.kl"].values if v is not None), "k3"
    if "signal.pass_at_k" in results:
        components = results["signal.pass_at_k"].extra["components"]
        ordered = [components[k] for k in sorted(components, key=lambda k: int(k.split("@")[1]))]
        ordered = [v for v in ordered if v is not None]
        assert all(a <= b + 1e-12 for a, b in itertools.pairwise(ordered)), ordered
        # (signal.pass_at_1 itself may exceed pass@k: it also counts groups smaller than k.)
    if "signal.pass_gap" in results:
        assert all(v >= -1e-12 for v in results["signal.pass_gap"].values if v is not None)
    expected = expected_rollouts(spec["tables"]["rollouts"])
    if expected is not None:
        assert report.run.n_rollouts == expected, (report.run.n_rollouts, expected)
    assert report.run.n_groups >= 0 and report.run.n_tokens >= 0


def check_error(exc: RlscopeError, root: Path) -> None:
    first = str(exc).splitlines()[0] if str(exc).strip() else ""
    assert str(root) in first or "run.json" in first, f"names no file or field: {exc}"


def analyze_spec(spec: dict, *, record: bool = False) -> None:
    tmp = Path(tempfile.mkdtemp())
    root = tmp / "run"
    try:
        write_run(spec, root)
        try:
            report = rlscope.analyze(str(root))
        except RlscopeError as exc:
            if record:
                event("RlscopeError: " + ("run.json" if "run.json" in str(exc) else "table"))
            check_error(exc, root)
            return
        if record:
            event("report")
        check_report(report, spec)
    finally:
        shutil.rmtree(tmp)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(run_specs())
def test_invalid_and_edge_runs_fail_cleanly_or_hold_invariants(spec: dict) -> None:
    analyze_spec(spec, record=True)


def test_empty_rollouts_table_is_a_report_or_a_named_error(tmp_path: Path) -> None:
    cols = {name: (kind, []) for name, kind, _ in TABLE_COLUMNS["rollouts"]}
    spec = {"tables": {"rollouts": cols}, "layout": {"rollouts": "file"}, "meta": dict(META)}
    analyze_spec(spec)


@pytest.mark.parametrize("bad", [{"a": 1.0}, ["x"], "text", True, None])
def test_wrong_reward_type_is_a_named_error(bad: Any) -> None:
    kind = {dict: "struct", list: "list_str", str: "string", bool: "bool"}.get(type(bad), "null")
    cols = {
        "rollout_id": ("int64", [0, 1]),
        "step": ("int64", [0, 0]),
        "prompt_id": ("string", ["p", "p"]),
        "reward": (kind, [_convert(1.0, kind)] * 2),
        "response_len": ("int32", [3, 4]),
    }
    spec = {"tables": {"rollouts": cols}, "layout": {"rollouts": "file"}, "meta": dict(META)}
    tmp = Path(tempfile.mkdtemp())
    try:
        with pytest.raises(RlscopeError, match="reward"):
            rlscope.analyze(str(write_run(spec, tmp / "run")))
    finally:
        shutil.rmtree(tmp)


def _rollouts(**override: tuple) -> dict[str, tuple]:
    return {
        "rollout_id": ("int64", [0, 1, 2, 3]),
        "step": ("int64", [0, 0, 1, 1]),
        "prompt_id": ("string", ["p", "p", "p", "p"]),
        "reward": ("float64", [0.0, 1.0, 1.0, 0.0]),
        "response_len": ("int32", [3, 4, 5, 6]),
        **override,
    }


def _analyze_tables(tables: dict[str, dict[str, tuple]], tmp_path: Path) -> rlscope.Report:
    spec = {"tables": tables, "layout": dict.fromkeys(tables, "file"), "meta": dict(META)}
    return rlscope.analyze(str(write_run(spec, tmp_path / "run")))


LOSS = ("float64", [1.0, 2.0])
TOKENS = {
    "rollout_id": ("int64", [0, 1]),
    "step": ("int64", [0, 0]),
    "pos": ("int32", [0, 0]),
    "entropy": ("float32", [0.5, 0.4]),
}


@pytest.mark.parametrize(
    "tables",
    [
        {"rollouts": _rollouts(step=("int64", [0, None, 1, 1]))},
        {"rollouts": _rollouts(), "steps": {"step": ("int64", [0, None]), "loss": LOSS}},
        {"rollouts": _rollouts(), "tokens": {**TOKENS, "step": ("int64", [0, None])}},
    ],
    ids=["rollouts", "steps", "tokens"],
)
def test_null_step_rows_are_left_out_with_a_warning(tables: dict, tmp_path: Path) -> None:
    report = _analyze_tables(tables, tmp_path)
    assert any("null step" in w for w in report.warnings), report.warnings


def test_extra_column_with_the_internal_invalid_prefix(tmp_path: Path) -> None:
    tables = {"rollouts": _rollouts(__invalid__reward=("bool", [True, False, True, False]))}
    report = _analyze_tables(tables, tmp_path)
    assert report.run.n_rollouts == 4
