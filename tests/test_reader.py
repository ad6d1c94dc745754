"""open_run: layout and schema validation errors, and what is read (types, drift, filters)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlscope.engine import compute
from rlscope.errors import RlscopeError
from rlscope.reader import open_run

WriteRun = Callable[..., Path]
META = {"schema_version": 1, "run_id": "r1", "algorithm": "GRPO"}


def rollouts(n: int = 4, start: int = 0, **overrides: Any) -> pa.Table:
    cols: dict[str, Any] = {
        "rollout_id": pa.array(range(start, start + n), pa.int64()),
        "step": pa.array([1 + i // 2 for i in range(start, start + n)], pa.int64()),
        "prompt_id": pa.array([f"p{i % 2}" for i in range(start, start + n)], pa.string()),
        "reward": pa.array([float(i % 2) for i in range(start, start + n)], pa.float64()),
        "response_len": pa.array([10 + i for i in range(start, start + n)], pa.int32()),
    }
    for name, value in overrides.items():
        if value is None:
            cols.pop(name)
        else:
            cols[name] = value
    return pa.table(cols)


def make_run(root: Path, meta: dict[str, Any] | None = None, **files: pa.Table | bytes) -> Path:
    """A run directory by hand: run.json and files named by relative path (`__` = `/`);
    a table is written as Parquet, `.parquet` appended to its name when missing."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "run.json").write_text(json.dumps(META if meta is None else meta))
    for rel, content in files.items():
        path = root / rel.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            pq.write_table(
                content,
                path if path.suffix == ".parquet" else path.with_name(path.name + ".parquet"),
            )
    return root


def error(path: Path, **kw: Any) -> RlscopeError:
    with pytest.raises(RlscopeError) as info:
        open_run(path, **kw)
    return info.value


# ---------------------------------------------------------------- errors


def test_missing_directory(tmp_path: Path) -> None:
    exc = error(tmp_path / "nope")
    assert "nope" in exc.message and "no such run directory" in exc.message


def test_file_instead_of_directory(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.parquet"
    pq.write_table(rollouts(), path)
    exc = error(path)
    assert str(path) in exc.message and "not a directory" in exc.message


def test_no_run_json(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", rollouts__a=rollouts())
    (run / "run.json").unlink()
    exc = error(run)
    assert "run.json" in exc.message and "missing" in exc.message
    assert exc.hint and "schema_version" in exc.hint


@pytest.mark.parametrize("text", ["{not json", '{"schema_version": 1,', "\xff\xfe"])
def test_invalid_json(tmp_path: Path, text: str) -> None:
    run = make_run(tmp_path / "r", rollouts=rollouts())
    (run / "run.json").write_bytes(text.encode("latin-1"))
    exc = error(run)
    assert "run.json" in exc.message and "not valid JSON" in exc.message


def test_run_json_not_an_object(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", rollouts=rollouts())
    (run / "run.json").write_text("[1, 2]")
    assert "JSON object" in error(run).message


@pytest.mark.parametrize("version", [2, 0, "1", True, 1.0, None])
def test_unknown_schema_version(tmp_path: Path, version: Any) -> None:
    meta = {**META, "schema_version": version}
    if version is None:
        del meta["schema_version"]
    exc = error(make_run(tmp_path / "r", meta, rollouts=rollouts()))
    assert "run.json" in exc.message and "schema_version" in exc.message


@pytest.mark.parametrize("field", ["run_id", "algorithm"])
def test_missing_required_field(tmp_path: Path, field: str) -> None:
    meta = {k: v for k, v in META.items() if k != field}
    exc = error(make_run(tmp_path / "r", meta, rollouts=rollouts()))
    assert "run.json" in exc.message and f"`{field}`" in exc.message


@pytest.mark.parametrize(
    ("field", "value"),
    [("group_size", "8"), ("group_size", True), ("clip_ratio_low", -0.1), ("run_id", 3)],
)
def test_wrong_run_json_field_type(tmp_path: Path, field: str, value: Any) -> None:
    exc = error(make_run(tmp_path / "r", {**META, field: value}, rollouts=rollouts()))
    assert f"`{field}`" in exc.message


def test_no_rollouts_table(tmp_path: Path) -> None:
    tokens = pa.table({"rollout_id": [0], "step": [1], "pos": pa.array([0], pa.int32())})
    exc = error(make_run(tmp_path / "r", tokens=tokens))
    assert "rollouts" in exc.message
    # An empty rollouts/ folder (or one with only hidden files) is no table either.
    run = make_run(tmp_path / "r2", **{"rollouts__.hidden.parquet": rollouts()})
    assert "rollouts" in error(run).message


def test_required_column_missing_in_one_of_several_files(tmp_path: Path) -> None:
    run = make_run(
        tmp_path / "r",
        rollouts__a=rollouts(),
        rollouts__b=rollouts(start=4, prompt_id=None),
        rollouts__c=rollouts(start=8),
    )
    exc = error(run)
    assert str(run / "rollouts" / "b") in exc.message
    assert "`prompt_id`" in exc.message


def test_tokens_required_column_missing(tmp_path: Path) -> None:
    tokens = pa.table({"rollout_id": [0], "step": [1]})
    exc = error(make_run(tmp_path / "r", rollouts=rollouts(), tokens=tokens))
    assert "tokens.parquet" in exc.message and "`pos`" in exc.message


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("reward", pa.array(["1.0", "0", "1", "0"])),
        ("response_len", pa.array([1.5, 2.0, 3.0, 4.0])),
        ("step", pa.array(["1", "1", "2", "2"])),
        ("correct", pa.array([1, 0, 1, 0], pa.int8())),
    ],
)
def test_wrong_column_type(tmp_path: Path, column: str, value: pa.Array) -> None:
    run = make_run(
        tmp_path / "r", rollouts__a=rollouts(), rollouts__b=rollouts(4, 4, **{column: value})
    )
    exc = error(run)
    assert str(run / "rollouts" / "b") in exc.message
    assert f"`{column}`" in exc.message and "type" in exc.message


def test_zero_byte_parquet(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", rollouts__a=rollouts(), **{"rollouts__b.parquet": b""})
    exc = error(run)
    assert "b.parquet" in exc.message and "0 bytes" in exc.message


@pytest.mark.parametrize("content", [b"not parquet at all", b"PAR1" + b"\0" * 64])
def test_not_a_parquet_file(tmp_path: Path, content: bytes) -> None:
    run = make_run(tmp_path / "r", **{"rollouts.parquet": content})
    exc = error(run)
    assert "rollouts.parquet" in exc.message and "not a readable Parquet file" in exc.message


def test_truncated_parquet(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", rollouts__a=rollouts())
    whole = (run / "rollouts" / "a.parquet").read_bytes()
    (run / "rollouts" / "b.parquet").write_bytes(whole[: len(whole) // 2])  # no footer
    exc = error(run)
    assert "b.parquet" in exc.message and "not a readable Parquet file" in exc.message


def test_duplicate_rollout_ids(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", rollouts__a=rollouts(4), rollouts__b=rollouts(4, start=2))
    exc = error(run)
    assert "duplicate rollout_id" in exc.message and "2, 3" in exc.message


def test_duplicate_rollout_ids_across_splits_and_int_types(tmp_path: Path) -> None:
    other = rollouts(
        2, rollout_id=pa.array([0, 1], pa.int32()), split=pa.array(["eval_id", "eval_id"])
    )
    run = make_run(tmp_path / "r", rollouts__a=rollouts(), rollouts__b=other)
    assert "duplicate rollout_id" in error(run).message


def test_both_single_file_and_folder(tmp_path: Path) -> None:
    run = make_run(
        tmp_path / "r",
        rollouts=rollouts(),
        **{"steps.parquet": pa.table({"step": [1]}), "steps__a.parquet": pa.table({"step": [2]})},
    )
    exc = error(run)
    assert "steps.parquet" in exc.message and "steps/" in exc.message


# ---------------------------------------------------------------- what is read


def scan(run: Path, table: str = "rollouts", **kw: Any) -> pl.DataFrame:
    return open_run(run, **kw).scan(table).collect().sort("rollout_id")


def test_int32_step_and_int_reward_are_widened(tmp_path: Path) -> None:
    table = rollouts(
        step=pa.array([1, 1, 2, 2], pa.int32()),
        reward=pa.array([1, 0, 2, 0], pa.int64()),
        rollout_id=pa.array([0, 1, 2, 3], pa.int32()),
    )
    run = make_run(tmp_path / "r", **{"rollouts.parquet": table})
    frame = scan(run)
    assert frame.schema["step"] == pl.Int64
    assert frame.schema["rollout_id"] == pl.Int64
    assert frame.schema["reward"] == pl.Float64
    assert frame["reward"].to_list() == [1.0, 0.0, 2.0, 0.0]
    assert frame["step"].to_list() == [1, 1, 2, 2]


def test_mixed_int_widths_across_files(tmp_path: Path) -> None:
    wide = rollouts(
        4,
        4,
        response_len=pa.array([2**40, 5, 6, 7], pa.int64()),
        step=pa.array([3, 3, 4, 4], pa.int32()),
    )
    run = make_run(tmp_path / "r", rollouts__a=rollouts(), rollouts__b=wide)
    frame = scan(run)
    assert frame.schema["response_len"] == pl.Int64  # widened, not wrapped
    assert frame["response_len"].to_list() == [10, 11, 12, 13, 2**40, 5, 6, 7]
    assert frame["step"].to_list() == [1, 1, 2, 2, 3, 3, 4, 4]


def test_schema_drift_fills_nulls(tmp_path: Path) -> None:
    later = rollouts(
        4,
        4,
        advantage=pa.array([0.5, -0.5, 1.0, -1.0]),
        correct=pa.array([True, False, True, False]),
    )
    run = make_run(tmp_path / "r", rollouts__a=rollouts(), rollouts__b=later)
    frame = scan(run)
    assert frame["advantage"].to_list() == [None] * 4 + [0.5, -0.5, 1.0, -1.0]
    # `correct` is derived (reward > 0) in the file that lacks it, and the report says so.
    derived = [r > 0 for r in frame["reward"].to_list()[:4]]
    assert frame["correct"].to_list() == [*derived, True, False, True, False]
    assert "file(s) without `correct`" in open_run(run).derived_columns("rollouts")["correct"]
    assert open_run(run).tables["rollouts"].n_rows == 8


def test_extra_columns_carried_through(tmp_path: Path) -> None:
    first = rollouts(my_note=pa.array(["a", "b", "c", "d"]), my_score=pa.array([1, 2, 3, 4]))
    second = rollouts(
        4,
        4,
        my_score=pa.array([5, 6, 7, 8]),
        my_list=pa.array([[1], [], None, [2, 3]], pa.list_(pa.int64())),
    )
    run = open_run(make_run(tmp_path / "r", rollouts__a=first, rollouts__b=second))
    frame = run.scan("rollouts").collect().sort("rollout_id")
    assert frame["my_note"].to_list() == ["a", "b", "c", "d", None, None, None, None]
    assert frame["my_score"].to_list() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert frame["my_list"].to_list() == [None] * 4 + [[1], [], None, [2, 3]]
    assert run.warnings == ()


@pytest.mark.parametrize(
    ("later", "dtype", "values"),
    [
        (pa.array([1.5, 2.5, 3.5, 4.5]), pl.Float64, [1.0, 2.0, 3.0, 4.0, 1.5, 2.5, 3.5, 4.5]),
        (pa.array(["x", "y", "z", "w"]), pl.String, ["1", "2", "3", "4", "x", "y", "z", "w"]),
    ],
    ids=["float", "string"],
)
def test_extra_column_with_conflicting_types_is_widened(
    tmp_path: Path, later: pa.Array, dtype: pl.DataType, values: list
) -> None:
    first = rollouts(my_score=pa.array([1, 2, 3, 4]))
    second = rollouts(4, 4, my_score=later)
    run = open_run(make_run(tmp_path / "r", rollouts__a=first, rollouts__b=second))
    assert any("my_score" in w for w in run.warnings)
    frame = run.scan("rollouts").collect().sort("rollout_id")
    assert frame.schema["my_score"] == dtype
    assert frame["my_score"].to_list() == values


def test_float_nan_and_inf_read_as_null(tmp_path: Path) -> None:
    table = rollouts(reward=pa.array([1.0, np.nan, np.inf, -np.inf]))
    frame = scan(make_run(tmp_path / "r", rollouts=table))
    assert frame["reward"].to_list() == [1.0, None, None, None]


def test_hidden_underscore_and_tmp_files_ignored(tmp_path: Path) -> None:
    garbage = b"definitely not parquet"
    run = make_run(
        tmp_path / "r",
        **{
            "rollouts__r000-000001.parquet": rollouts(),
            "rollouts__.r000-000002.parquet.123.tmp": garbage,
            "rollouts__.hidden.parquet": garbage,
            "rollouts___SUCCESS": garbage,
            "rollouts___meta.parquet": garbage,
            "rollouts__part.parquet.tmp": garbage,
            "rollouts__notes.txt": garbage,
            "rollouts__.cache__x.parquet": garbage,
            "rollouts___tmp__y.parquet": garbage,
        },
    )
    opened = open_run(run)
    assert [p.name for p in opened.tables["rollouts"].files] == ["r000-000001.parquet"]
    assert opened.scan("rollouts").collect().height == 4


def test_hive_style_folders(tmp_path: Path) -> None:
    def tokens(step: int, n: int) -> pa.Table:
        return pa.table(
            {
                "rollout_id": pa.array([step] * n, pa.int64()),
                "step": pa.array([step] * n, pa.int64()),
                "pos": pa.array(range(n), pa.int32()),
                "logprob": pa.array([-0.5] * n, pa.float32()),
            }
        )

    run = make_run(
        tmp_path / "r",
        rollouts=rollouts(),
        **{
            "tokens__step=000001__part-0.parquet": tokens(1, 3),
            "tokens__step=000002__part-0.parquet": tokens(2, 5),
            "tokens__step=000002__part-1.parquet": tokens(2, 2),
        },
    )
    opened = open_run(run)
    assert len(opened.tables["tokens"].files) == 3
    frame = opened.scan("tokens").collect()
    assert frame.group_by("step").len().sort("step").rows() == [(1, 3), (2, 7)]
    assert opened.row_count("tokens") == 10
    entropy = compute(opened, ["behavior.entropy"]).results["behavior.entropy"]
    assert entropy.values == pytest.approx((0.5, 0.5))


def test_symlinked_file_outside_run_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.parquet"
    pq.write_table(rollouts(4, 4), outside)
    run = make_run(tmp_path / "r", rollouts__a=rollouts())
    os.symlink(outside, run / "rollouts" / "b.parquet")
    opened = open_run(run)
    assert [p.name for p in opened.tables["rollouts"].files] == ["a.parquet"]
    assert opened.scan("rollouts").collect().height == 4
    assert any("b.parquet" in w and "symlink" in w for w in opened.warnings)


def test_symlinked_file_inside_run_is_read(tmp_path: Path) -> None:
    run = make_run(
        tmp_path / "r", rollouts__a=rollouts(), **{"archive__old.parquet": rollouts(4, 4)}
    )
    os.symlink(run / "archive" / "old.parquet", run / "rollouts" / "b.parquet")
    opened = open_run(run)
    assert opened.scan("rollouts").collect().height == 8
    assert opened.warnings == ()


def test_symlinked_table_folder_outside_run_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    tokens = pa.table({"rollout_id": [0], "step": [1], "pos": pa.array([0], pa.int32())})
    pq.write_table(tokens, outside / "t.parquet")
    run = make_run(tmp_path / "r", rollouts=rollouts())
    os.symlink(outside, run / "tokens")
    opened = open_run(run)
    assert "tokens" not in opened.tables
    assert any("symlink" in w for w in opened.warnings)


def test_symlinked_subfolder_outside_run_warns(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    pq.write_table(rollouts(4, 4), outside / "b.parquet")
    run = make_run(tmp_path / "r", rollouts__a=rollouts())
    os.symlink(outside, run / "rollouts" / "more")
    opened = open_run(run)
    assert opened.scan("rollouts").collect().height == 4  # not followed
    assert any("more" in w and "symlink" in w for w in opened.warnings)


def test_step_range_filter(tmp_path: Path) -> None:
    table = rollouts(12)  # steps 1..6, two rollouts each
    steps = pa.table(
        {
            "step": pa.array(range(1, 7), pa.int64()),
            "loss": pa.array([float(s) for s in range(1, 7)]),
        }
    )
    run = make_run(tmp_path / "r", rollouts=table, steps=steps)
    for lo, hi, want in [
        (2, 4, [2, 3, 4]),
        (None, 2, [1, 2]),
        (5, None, [5, 6]),
        (None, None, [1, 2, 3, 4, 5, 6]),
        (7, 9, []),
    ]:
        opened = open_run(run, steps=(lo, hi))
        frame = opened.scan("rollouts").collect()
        assert sorted(set(frame["step"].to_list())) == want
        assert opened.row_count("rollouts") == 2 * len(want)
        assert opened.row_count("steps") == len(want)
        computed = compute(opened, ["stability.loss", "signal.reward"])
        if want:
            assert computed.results["stability.loss"].steps == tuple(want)
            assert computed.results["stability.loss"].values == tuple(float(s) for s in want)
            assert computed.results["signal.reward"].steps == tuple(want)
        else:
            assert computed.results == {}
            assert {s.metric for s in computed.skipped} == {"stability.loss", "signal.reward"}


def test_derived_columns(tmp_path: Path) -> None:
    table = rollouts(
        tool_calls=pa.array([["a"], [], ["a", "b"], None], pa.list_(pa.string())),
        reward=pa.array([0.0, 0.4, 0.6, 1.0]),
    )
    meta = {**META, "correct_threshold": 0.5, "max_response_len": 12}
    opened = open_run(make_run(tmp_path / "r", meta, rollouts=table))
    assert set(opened.derived_columns("rollouts")) == {
        "split",
        "correct",
        "truncated",
        "n_tool_calls",
    }
    frame = opened.scan("rollouts").collect().sort("rollout_id")
    assert frame["split"].to_list() == ["train"] * 4
    assert frame["correct"].to_list() == [False, False, True, True]
    assert frame["truncated"].to_list() == [False, False, True, True]
    assert frame["n_tool_calls"].to_list() == [1, 0, 2, None]
    assert opened.has("rollouts", "correct", "truncated", "n_tool_calls")
    assert not opened.has("rollouts", "advantage")
    assert not opened.has("tokens")


def test_open_run_does_not_write(tmp_path: Path, write_run: WriteRun) -> None:
    run = write_run(
        {
            "rollouts": {
                "rollout_id": [0, 1],
                "step": [1, 1],
                "prompt_id": ["p", "p"],
                "reward": [1.0, 0.0],
                "response_len": [3, 4],
            }
        }
    )
    before = sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*"))
    compute(open_run(run))
    assert sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*")) == before
