"""Judging a run while it is written: each finding announced once, the stop decision, stop.json."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlscope._version import __version__
from rlscope.analysis import analyze
from rlscope.atomic import atomic_write
from rlscope.catalog import Catalog, default_catalog
from rlscope.config import Config, load_config
from rlscope.errors import RlscopeError, did_you_mean
from rlscope.report import Report, Skipped, finding_dict
from rlscope.spec import SEVERITIES, Finding, severity_rank

#: Written into the run directory when a judgement stops the run.
STOP_FILE = "stop.json"
#: `stop_on` value that never stops (the default).
NEVER = "never"
#: Prefix of rlscope's metrics in a trainer's logged metrics (W&B, TensorBoard).
METRIC_PREFIX = "rlscope/"
#: Sources of metrics that are the trainer's own logged values: not logged back to it.
_TRAINER_SOURCES = ("steps.", "steps:")

log = logging.getLogger("rlscope")

StopOn = str | Sequence[str]


@dataclass(frozen=True)
class StopPolicy:
    """What stops a run: findings at `level` or above, or findings of these `ids`; neither:
    never."""

    level: str | None = None
    ids: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, stop_on: StopOn, catalog: Catalog) -> StopPolicy:
        """`never`, a severity (`critical`: stop on a critical finding), a finding id, or a
        list of finding ids; anything else is an RlscopeError that says what would do."""
        if isinstance(stop_on, str):
            if stop_on == NEVER:
                return cls()
            if stop_on in SEVERITIES:
                return cls(level=stop_on)
            stop_on = [stop_on]
        ids = list(stop_on)
        for name in ids:
            if name not in catalog.rules:
                raise RlscopeError(
                    f"stop_on: {name!r} is neither {NEVER!r}, a severity "
                    f"({', '.join(SEVERITIES)}) nor a finding id",
                    hint=did_you_mean(
                        name,
                        [NEVER, *SEVERITIES, *catalog.rules],
                        "`rlscope explain` lists the findings",
                    ),
                )
        return cls(ids=frozenset(ids))

    def stops(self, finding: Finding) -> bool:
        if self.level is not None:
            return severity_rank(finding.severity) >= severity_rank(self.level)
        return finding.id in self.ids

    def describe(self) -> str:
        if self.level is not None:
            return f"a {self.level} finding" + (" or worse" if self.level != SEVERITIES[-1] else "")
        return " or ".join(sorted(self.ids)) if self.ids else NEVER


@dataclass(frozen=True)
class Judgement:
    """One judgement of a run in progress, as `rlscope analyze` of the files written so far
    gives it (the same findings, onsets and causes)."""

    step: int | None  # the last step judged; None when the run could not be judged
    findings: tuple[Finding, ...] = ()  # every finding raised now, root causes first
    new: tuple[Finding, ...] = ()  # raised for the first time, or at a higher severity
    cleared: tuple[str, ...] = ()  # announced earlier, no longer raised
    stop: Finding | None = None  # the finding the run is stopped for (once decided, kept)
    last_good: int | None = None  # with `stop`: the last step no finding that stops was raised
    waiting: tuple[Skipped, ...] = ()  # rules that judge from more steps than the run has
    metrics: dict[str, float] = field(default_factory=dict)  # rlscope/<id> -> latest value
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # table -> (files, read)
    seconds: float = 0.0  # what the judgement cost
    error: str | None = None  # why the run could not be judged (judging goes on next time)


class LiveJudge:
    """Judges a run directory that a training loop is writing, as often as it is asked.

    Each `judge()` analyses the files written so far; the per-file caches make that cost the
    new files only. Findings are announced (returned in `new` and logged to the `rlscope`
    logger) once each: again only at a higher severity, and once when they clear. With a
    `stop_on` other than `never`, the first judgement with a finding it names decides the stop:
    `stop.json` is written into the run directory (the finding, its evidence, the step, and the
    last good step) and `stop` is set from then on. `judge()` never raises: an error becomes the
    judgement's `error`, logged once, and the next judgement tries again.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        stop_on: StopOn = NEVER,
        config: Config | None = None,
        catalog: Catalog | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.catalog = catalog or default_catalog()
        self.config = config if config is not None else load_config(catalog=self.catalog)
        self.policy = StopPolicy.parse(stop_on, self.catalog)
        self.cache_dir = cache_dir
        self.stop: Finding | None = None
        self.last_good: int | None = None
        self.last: Judgement | None = None
        self._announced: dict[str, int] = {}  # finding id -> highest severity rank announced
        self._present: set[str] = set()  # announced and not since reported cleared
        self._errors: set[str] = set()

    def judge(self) -> Judgement:
        """Analyse what the run directory holds now; see the class."""
        started = time.perf_counter()
        try:
            report = analyze(
                self.run_dir, config=self.config, catalog=self.catalog, cache_dir=self.cache_dir
            )
            judgement = self._judged(report, started)
        except Exception as exc:  # judging must never end the training it watches
            error = f"{type(exc).__name__}: {exc}".strip()
            if error not in self._errors:
                self._errors.add(error)
                log.warning("rlscope: could not judge %s yet (%s)", self.run_dir, error)
            seconds = time.perf_counter() - started
            judgement = Judgement(
                None, stop=self.stop, last_good=self.last_good, error=error, seconds=seconds
            )
        self.last = judgement
        return judgement

    def _judged(self, report: Report, started: float) -> Judgement:
        step = report.run.last_step
        raised = {f.id: f for f in report.findings}
        new = tuple(
            f for f in report.findings if severity_rank(f.severity) > self._announced.get(f.id, -1)
        )
        cleared = tuple(sorted(self._present - set(raised)))
        for finding in new:
            self._announced[finding.id] = severity_rank(finding.severity)
            since = f" since step {finding.began}" if finding.began is not None else ""
            log.log(
                _LOG_LEVEL[finding.severity],
                "rlscope: %s %s at step %s%s: %s",
                finding.severity,
                finding.id,
                step,
                since,
                finding.message,
            )
        for finding_id in cleared:
            log.info("rlscope: %s is no longer raised at step %s", finding_id, step)
        self._present = (self._present - set(cleared)) | {f.id for f in new}
        if self.stop is None:
            stopping = [f for f in report.findings if self.policy.stops(f)]
            if stopping:
                self._decide_stop(stopping, step)
        return Judgement(
            step,
            report.findings,
            new,
            cleared,
            self.stop,
            self.last_good,
            tuple(s for s in report.skipped if s.needs_steps is not None),
            latest_metrics(report),
            {"tokens": (report.run.token_files, report.run.token_files_read)}
            | dict(report.run.table_files),
            time.perf_counter() - started,
        )

    def _decide_stop(self, stopping: list[Finding], step: int | None) -> None:
        """Stop for the first of `stopping` (root causes lead); the last good step is the one
        before the earliest onset among them (judging up to it raises none of them)."""
        self.stop = stopping[0]
        onsets = [f.onset for f in stopping]
        if all(o is not None for o in onsets):
            earliest = min(o for o in onsets if o is not None)
            self.last_good = next(f.last_good for f in stopping if f.onset == earliest)
        doc = {
            "rlscope_version": __version__,
            "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "run_dir": str(self.run_dir),
            "step": step,
            "stop_on": self.policy.describe(),
            "finding": finding_dict(self.stop),
            "last_good_step": self.last_good,
            "findings": [finding_dict(f) for f in stopping],
        }
        atomic_write(self.run_dir / STOP_FILE, json.dumps(doc, indent=2, allow_nan=False) + "\n")
        log.error(
            "rlscope: stopping the run at step %s: %s %s%s; last good step %s (%s)",
            step,
            self.stop.severity,
            self.stop.id,
            f" since step {self.stop.began}" if self.stop.began is not None else "",
            self.last_good if self.last_good is not None else "none",
            self.run_dir / STOP_FILE,
        )


_LOG_LEVEL = {"info": logging.INFO, "warn": logging.WARNING, "critical": logging.ERROR}


def latest_metrics(report: Report) -> dict[str, float]:
    """rlscope's metrics at the run's last step, as `rlscope/<metric id>` (the trainer's own
    logged values left out), and the count of findings at each severity."""
    values: dict[str, float] = {}
    for metric in report.metrics.values():
        if metric.source.startswith(_TRAINER_SOURCES) or not metric.steps:
            continue
        value = metric.values[-1]
        if metric.steps[-1] == report.run.last_step and value is not None and math.isfinite(value):
            values[METRIC_PREFIX + metric.id] = float(value)
    for severity in SEVERITIES:
        count = sum(f.severity == severity for f in report.findings)
        values[f"{METRIC_PREFIX}findings.{severity}"] = float(count)
    return values


def stop_record(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run directory's stop.json, None when the run was not stopped."""
    path = Path(run_dir) / STOP_FILE
    if not path.is_file():
        return None
    record: dict[str, Any] = json.loads(path.read_text())
    return record
