"""Format-v1 schema: the committed JSON description must match the code, and be complete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from rlscope.schema import (
    RUN_FIELDS,
    SCHEMA_VERSION,
    TABLES,
    render_json_schema,
    schema_file,
    to_json_schema,
    type_name,
)

SCHEMAS_DIR = Path(__file__).resolve().parent.parent / "schemas"


@pytest.fixture(scope="module")
def committed() -> dict[str, Any]:
    return json.loads(schema_file().read_text())


def test_schema_file_lives_in_repo_schemas_dir() -> None:
    assert schema_file() == SCHEMAS_DIR / "run-format-v1.json"
    assert schema_file().is_file(), (
        "schemas/run-format-v1.json missing: run `python -m rlscope.schema`"
    )


def test_committed_schema_matches_code() -> None:
    assert schema_file().read_text() == render_json_schema(), (
        "schemas/run-format-v1.json is out of date with rlscope/schema.py: "
        "run `python -m rlscope.schema` and commit the result"
    )


def test_render_is_to_json_schema() -> None:
    assert json.loads(render_json_schema()) == to_json_schema()
    assert render_json_schema().endswith("}\n")


@pytest.mark.parametrize("path", sorted(SCHEMAS_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_schemas_file_is_valid_json(path: Path) -> None:
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict)


def test_run_json_required_fields(committed: dict[str, Any]) -> None:
    run_json = committed["run_json"]
    assert run_json["type"] == "object"
    assert {"schema_version", "run_id", "algorithm"} <= set(run_json["required"])
    for name in ("schema_version", "run_id", "algorithm"):
        assert name in run_json["properties"]
    assert run_json["properties"]["schema_version"]["const"] == SCHEMA_VERSION == 1
    assert run_json["properties"]["schema_version"]["type"] == "integer"
    assert committed["schema_version"] == SCHEMA_VERSION


def test_run_json_documents_every_meta_field(committed: dict[str, Any]) -> None:
    props = committed["run_json"]["properties"]
    assert list(props) == [f.name for f in RUN_FIELDS]
    for field in RUN_FIELDS:
        assert props[field.name]["type"] == field.json_type
        assert props[field.name]["description"]
    assert committed["run_json"]["required"] == [f.name for f in RUN_FIELDS if f.required]


def test_every_table_documented(committed: dict[str, Any]) -> None:
    assert set(committed["tables"]) == set(TABLES)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_table_columns_documented(committed: dict[str, Any], name: str) -> None:
    table = TABLES[name]
    doc = committed["tables"][name]
    assert doc["description"]
    assert doc["layout"] == [f"{name}.parquet", f"{name}/**/*.parquet"]
    assert table.required_columns, f"{name} has no required columns"
    columns = doc["columns"]
    for col in table.required_columns:
        assert col in columns, f"required column {name}.{col} not documented"
        assert columns[col]["required"] is True
    assert list(columns) == [c.name for c in table.columns]
    for col in table.columns:
        entry = columns[col.name]
        assert entry["type"] == type_name(col.dtype)
        assert entry["required"] is col.required
        assert entry["description"]


def test_rollouts_is_the_only_required_table(committed: dict[str, Any]) -> None:
    assert [t.name for t in TABLES.values() if t.required] == ["rollouts"]
    assert [n for n, t in committed["tables"].items() if t["required"]] == ["rollouts"]


def test_required_columns_property() -> None:
    assert TABLES["rollouts"].required_columns == (
        "rollout_id",
        "step",
        "prompt_id",
        "reward",
        "response_len",
    )
    assert TABLES["steps"].required_columns == ("step",)
    assert TABLES["tokens"].column("logprob") is not None
    assert TABLES["tokens"].column("nope") is None


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (pl.Int64(), "int64"),
        (pl.Int32(), "int32"),
        (pl.Float64(), "float64"),
        (pl.Float32(), "float32"),
        (pl.String(), "string"),
        (pl.Boolean(), "bool"),
        (pl.Categorical(), "string (dictionary)"),
        (pl.List(pl.String()), "list<string>"),
        (pl.List(pl.Int32()), "list<int32>"),
        (pl.List(pl.List(pl.Float64())), "list<list<float64>>"),
    ],
)
def test_type_name(dtype: pl.DataType, expected: str) -> None:
    assert type_name(dtype) == expected


def test_known_column_types_in_json(committed: dict[str, Any]) -> None:
    tables = committed["tables"]
    assert tables["rollouts"]["columns"]["tool_calls"]["type"] == "list<string>"
    assert tables["rollouts"]["columns"]["response_len"]["type"] == "int32"
    assert tables["tokens"]["columns"]["logprob"]["type"] == "float32"
    assert tables["tokens"]["columns"]["segment"]["type"] == "string (dictionary)"
    assert tables["steps"]["columns"]["step"]["type"] == "int64"
