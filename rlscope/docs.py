"""Generated from the catalog (`make docs`): the README's metric and findings tables and the
shipped reference (rlscope/reference.json, what `explain` and `metrics` read)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlscope import reference
from rlscope.catalog import default_catalog
from rlscope.importers import IMPORTERS

#: (marker name, table function): the README holds each table between its two markers.
BEGIN = "<!-- {} table: generated from the catalog by `make docs`; edit the source -->"
END = "<!-- end {} table -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _ids(ids: list[str]) -> str:
    return ", ".join(f"`{i[:-1]}<name>`" if i.endswith(".*") else f"`{i}`" for i in ids)


def metric_table() -> str:
    """One row per metric in catalog order (layer order); consecutive metrics with the same brief
    (a segment's length for each segment, ...) share one row."""
    rows: list[tuple[str, list[str], str]] = []
    for metric in default_catalog().metrics.values():
        if rows and rows[-1][2] == metric.brief and rows[-1][0] == metric.layer:
            rows[-1][1].append(metric.id)
        else:
            rows.append((metric.layer, [metric.id], metric.brief))
    lines = ["| layer | id | what |", "|---|---|---|"]
    lines += [f"| {layer} | {_ids(ids)} | {_cell(brief)} |" for layer, ids, brief in rows]
    return "\n".join(lines)


def finding_table() -> str:
    """One row per finding in catalog order."""
    lines = ["| id | layer | fires when |", "|---|---|---|"]
    rules = default_catalog().rules.values()
    lines += [f"| `{r.id}` | {r.layer} | {_cell(r.brief)} |" for r in rules]
    return "\n".join(lines)


TABLES = {"metrics": metric_table, "findings": finding_table}


def update_readme(text: str) -> str:
    """`text` with each generated table replaced by the catalog's current one."""
    for name, table in TABLES.items():
        begin, end = BEGIN.format(name), END.format(name)
        if begin not in text or end not in text:
            raise ValueError(f"README has no {name} table markers: {begin} ... {end}")
        start, stop = text.index(begin), text.index(end, text.index(begin))
        text = f"{text[:start]}{begin}\n{table()}\n{text[stop:]}"
    return text


def write_readme(path: str | Path = "README.md") -> bool:
    """Rewrite the tables of the README at `path`; True when it changed."""
    readme = Path(path)
    old = readme.read_text()
    new = update_readme(old)
    if new != old:
        readme.write_text(new)
    return new != old


def reference_document() -> dict[str, Any]:
    """Every metric and finding of the catalog (its JSON documentation and explain text) and
    every import format (`rlscope formats`)."""
    catalog = default_catalog()
    return {
        "metrics": [{**m.to_dict(), "text": m.explain()} for m in catalog.metrics.values()],
        "findings": [{**r.to_dict(), "text": r.explain()} for r in catalog.rules.values()],
        "formats": [
            {"name": i.name, "summary": i.summary, "doc": i.doc} for i in IMPORTERS.values()
        ],
    }


def reference_text() -> str:
    return json.dumps(reference_document(), indent=1, ensure_ascii=True) + "\n"


def write_reference(path: str | Path = reference.PATH) -> bool:
    """Rewrite the shipped reference; True when it changed."""
    file = Path(path)
    new = reference_text()
    changed = not file.is_file() or file.read_text(encoding="utf-8") != new
    if changed:
        file.write_text(new, encoding="utf-8")
    return changed


if __name__ == "__main__":
    print("README.md updated" if write_readme() else "README.md already current")
    print(
        f"{reference.PATH.name} updated"
        if write_reference()
        else f"{reference.PATH.name} already current"
    )
