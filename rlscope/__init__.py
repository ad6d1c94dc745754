"""rlscope: is this RL post-training run healthy? Metrics and diagnoses from Parquet logs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlscope._version import __version__
from rlscope.errors import RlscopeError
from rlscope.report import MetricResult, Report, RunInfo, Skipped
from rlscope.spec import Finding

if TYPE_CHECKING:
    from rlscope.comparison import Comparison
    from rlscope.writer import RunWriter

__all__ = [
    "Finding",
    "MetricResult",
    "Report",
    "RlscopeError",
    "RunInfo",
    "RunWriter",
    "Skipped",
    "__version__",
    "analyze",
    "compare",
]


def analyze(path: str, **options: object) -> Report:
    """Analyse a run directory and return its Report (see `rlscope.analysis.analyze`)."""
    from rlscope.analysis import analyze as _analyze

    return _analyze(path, **options)  # type: ignore[arg-type]


def compare(paths: list[str], **options: object) -> Comparison:
    """Compare runs against the first (see `rlscope.comparison.compare`)."""
    from rlscope.comparison import compare as _compare

    return _compare(paths, **options)  # type: ignore[arg-type]


def __getattr__(name: str) -> object:
    # The writer loads Polars and pyarrow: only when asked for, so `rlscope --help` stays fast.
    if name == "RunWriter":
        from rlscope.writer import RunWriter

        return RunWriter
    raise AttributeError(f"module 'rlscope' has no attribute {name!r}")
