"""The README's metric and findings tables, generated from the catalog (`make docs`)."""

from __future__ import annotations

from pathlib import Path

from rlscope.catalog import default_catalog

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


if __name__ == "__main__":
    print("README.md updated" if write_readme() else "README.md already current")
