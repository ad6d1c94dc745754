"""Importer options: typed `-X key=value` parsing and the options every importer shares."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlscope.errors import RlscopeError


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError("expected an integer")


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        return float(value)
    raise ValueError("expected a number")


def _str(value: Any) -> str:
    if isinstance(value, str) and value:
        return value
    raise ValueError("expected a non-empty string")


def _str_list(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, list | tuple) and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise ValueError("expected a list of names (or `a,b,c`)")


def _pairs(value: Any) -> dict[str, str]:
    if isinstance(value, str):
        items = [p.split("=", 1) for p in value.split(",") if p.strip()]
        if any(len(p) != 2 for p in items):
            raise ValueError("expected `key=value,key=value`")
        value = {k.strip(): v.strip() for k, v in items}
    if isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) and k and v for k, v in value.items()
    ):
        return dict(value)
    raise ValueError("expected a mapping of names (or `key=value,key=value`)")


def _weights(value: Any) -> dict[str, float]:
    pairs = _pairs(value) if isinstance(value, str) else value
    if isinstance(pairs, Mapping):
        try:
            return {str(k): _float(v) for k, v in pairs.items()}
        except ValueError:
            pass
    raise ValueError("expected a mapping of column name to number (or `a=1,b=0.5`)")


KINDS: dict[str, Callable[[Any], Any]] = {
    "bool": _bool,
    "int": _int,
    "float": _float,
    "str": _str,
    "list[str]": _str_list,
    "dict[str,str]": _pairs,
    "dict[str,float]": _weights,
}


@dataclass(frozen=True)
class Option:
    """One importer option: name, kind (a key of KINDS), default and what it does. Strings are
    accepted for every kind (`true`, `3`, `a,b`, `k=v,k2=v2`) so a CLI can pass them through."""

    name: str
    kind: str
    default: Any
    doc: str
    choices: Callable[[Any], str | None] | None = None  # returns an error message or None
    compared: bool = True  # part of the manifest check (`strict` is not: same data either way)

    def coerce(self, value: Any) -> Any:
        if value is None:
            return None
        try:
            out = KINDS[self.kind](value)
        except (ValueError, TypeError) as exc:
            raise RlscopeError(f"option `{self.name}`: {exc}, got {value!r}") from None
        problem = self.choices(out) if self.choices else None
        if problem:
            raise RlscopeError(f"option `{self.name}`: {problem}, got {value!r}")
        return out


def _check_split(split: str) -> str | None:
    if split == "train" or split.startswith("eval_"):
        return None
    return "must be `train` or start with `eval_` (eval_id, eval_ood, ...)"


COMMON_OPTIONS: tuple[Option, ...] = (
    Option("algorithm", "str", None, "run.json algorithm (default: the importer's)"),
    Option("run_id", "str", None, "run.json run_id (default: the source folder's name)"),
    Option(
        "strict",
        "bool",
        False,
        "stop at the first malformed line with an error naming file and line",
        compared=False,
    ),
)
ROLLOUT_OPTIONS: tuple[Option, ...] = (
    Option(
        "correct_threshold",
        "float",
        None,
        "correct = reward >= this where the source has no correctness field "
        "(default reward > 0); also written to run.json",
    ),
    Option("max_response_len", "int", None, "run.json max_response_len (truncation = len >= cap)"),
)
SPLIT_OPTION = Option(
    "split",
    "str",
    "train",
    "split of every imported rollout: `train`, or an eval split (`eval_id`, `eval_ood`, any "
    "`eval_*`) for validation dumps",
    choices=_check_split,
)


OOD_SETS_OPTION = Option(
    "ood_sets",
    "list[str]",
    None,
    "eval sets (TRL: the names of a dict of eval datasets; verl: data sources) that are out "
    "of distribution (default: those whose name has the word `ood`); the others are in "
    "distribution",
)
