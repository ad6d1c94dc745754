"""RunWriter: what a training loop calls to log format-v1 Parquet, crash-safely, and to judge it."""

from __future__ import annotations

import os
from typing import Any

from rlscope.catalog import Catalog
from rlscope.config import Config
from rlscope.live import NEVER, Judgement, LiveJudge, StopOn
from rlscope.spec import Finding
from rlscope.tablewriter import TableWriter


class RunWriter(TableWriter):
    """Buffers rows per table and writes zstd Parquet files under temporary names, then renames
    (see TableWriter); `judge()` judges what was written so far (see LiveJudge).

    In a training loop::

        writer = RunWriter("runs/x", algorithm="GRPO", group_size=8, stop_on="critical")
        for step in range(steps):
            ...
            writer.log_step(step, loss=loss, grad_norm=grad_norm, kl=kl)
            writer.log_rollouts(rollouts)
            if step % 10 == 0:
                for finding in writer.judge():       # the findings raised since the last call
                    print(finding.severity, finding.id, finding.message)
                if writer.stop is not None:          # stop.json is in runs/x
                    break
        writer.close()

    `stop_on` (`never`, a severity, or finding ids), `config`, `catalog` and `cache_dir` are
    the judge's; every other keyword is a run.json field.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        stop_on: StopOn = NEVER,
        config: Config | None = None,
        catalog: Catalog | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        **meta: Any,
    ) -> None:
        super().__init__(run_dir, **meta)
        self._judge_options: dict[str, Any] = {
            "stop_on": stop_on,
            "config": config,
            "catalog": catalog,
            "cache_dir": cache_dir,
        }
        self._judge: LiveJudge | None = None
        if stop_on != NEVER:  # a wrong stop_on fails here, not at the first judgement
            self._judge = LiveJudge(self.run_dir, **self._judge_options)

    def judge(self) -> list[Finding]:
        """Flush, judge the run written so far, and return the findings raised since the last
        call (each once; again only at a higher severity). Never raises for the run's sake: a
        judgement that fails is logged and `judgement.error` says why."""
        self.flush()
        if self._judge is None:
            self._judge = LiveJudge(self.run_dir, **self._judge_options)
        return list(self._judge.judge().new)

    @property
    def judgement(self) -> Judgement | None:
        """The last judgement (all findings, what cleared, rlscope's metrics, its cost)."""
        return self._judge.last if self._judge is not None else None

    @property
    def stop(self) -> Finding | None:
        """The finding `stop_on` stops the run for, once a judgement raised one (stop.json is
        then in the run directory)."""
        return self._judge.stop if self._judge is not None else None
