"""`compare`: alignment, deltas, bootstrap intervals, healthier-by, findings per run, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli as rlscope

from rlscope.analysis import analyze
from rlscope.comparison import (
    MIN_WINDOW_POINTS,
    bootstrap_difference,
    compare,
    compare_reports,
    final_window,
)
from rlscope.errors import RlscopeError
from rlscope.render.compare import aligned_sparklines

ROOT = Path(__file__).resolve().parent.parent
HEALTHY = ROOT / "sample_logs" / "healthy"
COLLAPSE = ROOT / "sample_logs" / "entropy-collapse"


@pytest.fixture(scope="module")
def reports() -> tuple:
    return analyze(HEALTHY), analyze(COLLAPSE)


def test_bootstrap_interval_is_deterministic_and_calls_only_real_differences() -> None:
    base = [0.50, 0.52, 0.48, 0.51, 0.49, 0.50]
    same = [0.51, 0.49, 0.50, 0.52, 0.48, 0.50]
    higher = [0.70, 0.72, 0.69, 0.71, 0.70, 0.73]
    low, high = bootstrap_difference(base, same)
    assert low < 0 < high
    low, high = bootstrap_difference(base, higher)
    assert 0.15 < low < high < 0.25
    assert bootstrap_difference(base, higher) == bootstrap_difference(base, higher)
    assert bootstrap_difference(base[:2], higher) is None


def test_equal_series_up_to_float_noise_are_not_a_difference() -> None:
    """Two runs with the same constant learning rate, summed in another order, differ by 1e-22:
    not `differs` (found by looking at the HTML report's comparison table)."""
    from rlscope.comparison import RunMetric, _versus

    base = [1e-6] * 10
    noisy = [1e-6 + 2e-22] * 10
    run = RunMetric(noisy[0], tuple(range(10)), tuple(range(10)), tuple(noisy))
    assert _versus(run, base, noisy, base[0], "").verdict == "noise"
    assert _versus(run, base, noisy, base[0], "up").verdict == "noise"
    apart = [1.01e-6] * 10
    run = RunMetric(apart[0], tuple(range(10)), tuple(range(10)), tuple(apart))
    assert _versus(run, base, apart, base[0], "").verdict == "differs"


def test_final_window_takes_the_last_tenth_but_at_least_three_points() -> None:
    assert final_window([1.0, None, 2.0, 3.0, 4.0]) == [2.0, 3.0, 4.0]
    assert final_window([float(i) for i in range(50)]) == [45.0, 46.0, 47.0, 48.0, 49.0]
    assert len(final_window([1.0, 2.0])) == 2 < MIN_WINDOW_POINTS


def test_delta_interval_and_healthier_run_follow_the_metric_direction(reports: tuple) -> None:
    healthy, collapse = reports
    comparison = compare_reports([healthy, collapse])
    entropy = comparison.metrics["behavior.entropy"]
    assert entropy.better == "up"
    run = entropy.runs[1]
    assert run is not None and run.interval is not None
    assert run.delta == pytest.approx(
        collapse.metrics["behavior.entropy"].value - healthy.metrics["behavior.entropy"].value
    )
    assert run.interval[1] < 0 and run.verdict == "worse"
    assert entropy.healthiest == 0
    # Reversed, the collapsed run is the baseline and the healthy one is better.
    reverse = compare_reports([collapse, healthy]).metrics["behavior.entropy"]
    assert reverse.runs[1].verdict == "better" and reverse.healthiest == 1
    # No preferred direction: a difference is called "differs", never healthier.
    loss = comparison.metrics["stability.loss"]
    assert loss.better == "" and loss.healthiest is None
    assert loss.summary == "no preferred direction"
    # Within noise: the interval holds 0 and no run is called.
    grad = comparison.metrics["stability.grad_norm"]
    assert grad.runs[1].verdict == "noise" and grad.healthiest is None


def test_missing_metrics_and_findings_only_one_run_has(reports: tuple) -> None:
    healthy, collapse = reports
    comparison = compare_reports([healthy, collapse])
    p80 = comparison.metrics["behavior.entropy_p80"]  # the collapse run has no tokens table
    assert p80.runs[1] is None and "tokens" in (p80.missing[1] or "")
    (row,) = [f for f in comparison.findings if f.id == "entropy-collapse"]
    assert row.severities == (None, "critical") and row.only_in == 1


def test_progress_alignment_maps_each_run_to_zero_one(reports: tuple) -> None:
    comparison = compare_reports(list(reports), align="progress")
    for run in comparison.metrics["signal.reward"].runs:
        assert run is not None and run.x[0] == 0.0 and run.x[-1] == 1.0
    with pytest.raises(RlscopeError, match="align"):
        compare_reports(list(reports), align="wall")


def test_to_dict_is_strict_json_with_the_analyze_metric_ids(reports: tuple) -> None:
    comparison = compare_reports(list(reports))
    document = json.loads(json.dumps(comparison.to_dict(), allow_nan=False))
    assert set(document["metrics"]) == set(reports[0].metrics) | set(reports[1].metrics)
    entry = document["metrics"]["behavior.entropy"]["runs"][1]
    assert {"value", "delta", "interval", "verdict", "series"} <= set(entry)


def test_sparklines_share_the_x_range_so_a_shorter_run_draws_shorter() -> None:
    long = ([float(s) for s in range(100)], [float(s) for s in range(100)])
    short = ([float(s) for s in range(50)], [float(s) for s in range(50)])
    lines = aligned_sparklines([long, short, None], 20)
    assert len(lines[0]) == 20 and len(lines[1]) == 10 and lines[2] == ""
    assert lines[0][-1] == "█" and lines[1][-1] != "█"  # one y scale for both


def test_compare_needs_two_runs() -> None:
    with pytest.raises(RlscopeError, match="at least two"):
        compare([HEALTHY])


def test_cli_compare_text_and_json() -> None:
    done = rlscope("compare", str(HEALTHY), str(COLLAPSE))
    assert done.returncode == 0, done.stderr
    assert "behavior.entropy" in done.stdout and "▼ worse" in done.stdout
    assert "only synth-entropy-collapse" in done.stdout
    assert "bootstrap" in done.stdout
    done = rlscope(
        "compare", str(HEALTHY), str(COLLAPSE), "--format", "json", "--metrics",
        "signal.pass_at_1,behavior.entropy", "--align", "progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert set(document["metrics"]) == {"signal.pass_at_1", "behavior.entropy"}
    assert document["align"] == "progress"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compare", str(HEALTHY)], "at least two"),
        (["compare", str(HEALTHY), str(COLLAPSE), "--align", "wall"], "--align"),
        (["compare", str(HEALTHY), "/nonexistent/run"], "/nonexistent/run"),
        (["compare", str(HEALTHY), str(COLLAPSE), "--metrics", "nope.x"], "nope.x"),
    ],
)
def test_cli_compare_usage_errors_exit_2(args: list[str], message: str) -> None:
    done = rlscope(*args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
