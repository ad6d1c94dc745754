"""Configuration: per-finding overrides and text settings from rlscope.toml, pyproject.toml or
--config FILE."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from rlscope.catalog import Catalog, default_catalog
from rlscope.errors import RlscopeError
from rlscope.spec import SEVERITIES
from rlscope.text import SEGMENTS, TagSet, TextSettings


@dataclass(frozen=True)
class Config:
    """`findings`: rule id -> {param: value, "severity": str, "enabled": bool}; `text`: the tag
    sets of `[tags]` and the cue pattern of `[probes]`."""

    findings: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str | None = None
    text: TextSettings = field(default_factory=TextSettings)

    def summary(self) -> dict[str, Any] | None:
        """What an override file changed (None when no file was used): shown in every report,
        since a file in the working directory can silence a finding."""
        if self.source is None:
            return None
        overrides = [
            f"{rule}.{key}={value}".lower() if isinstance(value, bool) else f"{rule}.{key}={value}"
            for rule, changes in sorted(self.findings.items())
            for key, value in sorted(changes.items())
        ]
        custom = [
            name
            for name, changed in (
                ("tags", self.text.tags != TextSettings().tags),
                ("probes", self.text.cue_pattern != TextSettings().cue_pattern),
            )
            if changed
        ]
        return {"source": self.source, "overrides": overrides, "text": custom}


def load_config(
    path: str | Path | None = None,
    *,
    search_from: Path | None = None,
    catalog: Catalog | None = None,
) -> Config:
    """Read `path`, else ./rlscope.toml, else [tool.rlscope] of ./pyproject.toml, else defaults;
    finding ids and thresholds are checked against `catalog` (rlscope's own by default)."""
    catalog = catalog or default_catalog()
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise RlscopeError(f"{file}: config file not found")
        return _parse(file, _read(file).get("tool", {}).get("rlscope", _read(file)), catalog)
    here = search_from or Path.cwd()
    if (here / "rlscope.toml").is_file():
        return _parse(here / "rlscope.toml", _read(here / "rlscope.toml"), catalog)
    pyproject = here / "pyproject.toml"
    if pyproject.is_file():
        table = _read(pyproject).get("tool", {}).get("rlscope")
        if table is not None:
            return _parse(pyproject, table, catalog)
    return Config()


def _read(file: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise RlscopeError(f"{file}: not valid TOML ({exc})") from None


def _parse(file: Path, table: dict[str, Any], catalog: Catalog) -> Config:
    findings = table.get("findings", {})
    if not isinstance(findings, dict):
        raise RlscopeError(f"{file}: [findings] must be a table")
    for rule_id, override in findings.items():
        rule = catalog.rules.get(rule_id)
        where = f"{file}: [findings.{rule_id}]"
        if rule is None:
            hint = catalog.hint(rule_id, metrics=False)
            raise RlscopeError(f"{where}: unknown finding id", hint=hint)
        if not isinstance(override, dict):
            raise RlscopeError(f"{where} must be a table")
        for key, value in override.items():
            if key == "enabled":
                if not isinstance(value, bool):
                    raise RlscopeError(f"{where}: enabled must be true or false")
            elif key == "severity":
                if value not in SEVERITIES:
                    raise RlscopeError(f"{where}: severity must be one of {', '.join(SEVERITIES)}")
            elif key in rule.params:
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise RlscopeError(f"{where}: {key} must be a number")
            else:
                known = ", ".join(["enabled", "severity", *rule.params])
                raise RlscopeError(f"{where}: unknown key `{key}`", hint=f"known keys: {known}")
    return Config(
        findings={k: dict(v) for k, v in findings.items()},
        source=str(file),
        text=_text_settings(file, table),
    )


def _text_settings(file: Path, table: dict[str, Any]) -> TextSettings:
    """`[tags]`: segment = [tag, ...] (think, answer, tool_call, tool_response, json_calls);
    `[probes]`: cue_pattern = regex for a biased probe's text mentioning its cue."""
    tags = table.get("tags", {})
    probes = table.get("probes", {})
    for name, value in (("tags", tags), ("probes", probes)):
        if not isinstance(value, dict):
            raise RlscopeError(f"{file}: [{name}] must be a table")
    known = (*SEGMENTS, "json_calls")
    changes: dict[str, tuple[str, ...]] = {}
    for key, value in tags.items():
        where = f"{file}: [tags] {key}"
        if key not in known:
            raise RlscopeError(f"{where}: unknown key", hint=f"known keys: {', '.join(known)}")
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise RlscopeError(f'{where}: expected a list of tag names, e.g. ["think"]')
        if not value and key != "json_calls":
            raise RlscopeError(f"{where}: needs at least one tag name")
        changes[key] = tuple(value)
    try:
        tag_set = TagSet(**changes)
    except ValueError as exc:
        raise RlscopeError(f"{file}: [tags] {exc}") from None
    cue = probes.get("cue_pattern", TextSettings().cue_pattern)
    unknown = [k for k in probes if k != "cue_pattern"]
    if unknown:
        raise RlscopeError(
            f"{file}: [probes] unknown key `{unknown[0]}`", hint="known: cue_pattern"
        )
    if not isinstance(cue, str):
        raise RlscopeError(f"{file}: [probes] cue_pattern must be a string (a regex)")
    try:
        pl.select(pl.lit("x").str.contains(cue)).item()
    except pl.exceptions.PolarsError as exc:
        raise RlscopeError(f"{file}: [probes] cue_pattern is not a valid regex ({exc})") from None
    return TextSettings(tags=tag_set, cue_pattern=cue)
