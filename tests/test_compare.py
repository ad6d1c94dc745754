"""`compare`: alignment, deltas, bootstrap intervals, healthier-by, findings per run, the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    accuracy = comparison.metrics["signal.pass_at_1"]
    assert accuracy.better == "up" and accuracy.task
    run = accuracy.runs[1]
    assert run is not None and run.interval is not None
    assert run.delta == pytest.approx(
        collapse.metrics["signal.pass_at_1"].value - healthy.metrics["signal.pass_at_1"].value
    )
    assert run.interval[1] < 0 and run.verdict == "worse"
    assert accuracy.healthiest == 0
    # Reversed, the collapsed run is the baseline and the healthy one is better.
    reverse = compare_reports([collapse, healthy]).metrics["signal.pass_at_1"]
    assert reverse.runs[1].verdict == "better" and reverse.healthiest == 1
    # Entropy is healthy in a band, not in a direction: a difference "differs", never
    # healthier (the collapse is entropy-collapse's to say, and it does).
    entropy = comparison.metrics["behavior.entropy"]
    assert entropy.better == "" and entropy.runs[1].verdict == "differs"
    assert entropy.healthiest is None and entropy.summary == "no preferred direction"
    loss = comparison.metrics["stability.loss"]
    assert loss.better == "" and loss.healthiest is None


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
    assert "task outcome worse (reward" in done.stdout
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


def test_a_band_judges_by_distance_and_neither_direction_nor_band_only_differs() -> None:
    """A significant difference of a metric with a healthy band: the run closer to it is the
    healthier one; both inside (or equally far) differ; without a band nor a direction, it
    only differs. An error rate with a band keeps its direction."""
    from rlscope.comparison import RunMetric, _healthiest, _versus

    base = [0.6, 0.62, 0.61, 0.6, 0.59, 0.6]
    band = (0.0, 0.5)

    def versus(values: list[float], better: str = "", bounds: tuple | None = band) -> str:
        run = RunMetric(sum(values) / 6, tuple(range(6)), tuple(range(6)), tuple(values))
        return _versus(run, base, values, sum(base) / 6, better, bounds).verdict

    assert versus([0.45, 0.46, 0.44, 0.45, 0.46, 0.45]) == "better"  # inside the band
    assert versus([0.8, 0.81, 0.79, 0.8, 0.8, 0.8]) == "worse"  # further out
    assert versus([0.8, 0.81, 0.79, 0.8, 0.8, 0.8], bounds=None) == "differs"
    assert versus([0.45, 0.46, 0.44, 0.45, 0.46, 0.45], bounds=(0.0, 1.0)) == "differs"
    assert versus([0.45, 0.46, 0.44, 0.45, 0.46, 0.45], "down", (0.0, 1.0)) == "better"
    closer = RunMetric(0.45, (0,), (0.0,), (0.45,), -0.15, (-0.17, -0.13), "better")
    further = RunMetric(0.8, (0,), (0.0,), (0.8,), 0.2, (0.18, 0.22), "worse")
    baseline = RunMetric(0.6, (0,), (0.0,), (0.6,))
    assert _healthiest([baseline, further, closer], "", band) == (
        2,
        "run 3 (closer to its healthy band)",
    )
    assert _healthiest([baseline, further], "", band) == (
        0,
        "the baseline (closer to its healthy band)",
    )


def test_the_verdict_line_leads_with_the_task_outcome() -> None:
    """Whatever else is better, a worse task outcome comes first, with its values; the other
    metrics follow as `other metrics`; JSON has the task entries."""
    from rlscope.comparison import RunVerdict, TaskOutcome

    verdict = RunVerdict(
        1,
        "lr",
        ("signal.pass_at_1", "signal.zero_std_frac"),
        ("behavior.format_ok", "signal.reward"),
        ("behavior.entropy",),
        (("kl-high", "critical"),),
        (
            TaskOutcome("signal.pass_at_1", 0.93, 0.09, "worse"),
            TaskOutcome("signal.reward", 1.0, 1.2, "better"),
            TaskOutcome("signal.pass_at_k", 0.99, 0.98, "noise"),
        ),
    )
    assert verdict.line() == (
        "run 2 (lr) vs baseline: task outcome worse (pass@1 0.93 → 0.09); task outcome better "
        "(reward 1 → 1.2); 1 other metrics worse (signal.zero_std_frac), 1 better "
        "(behavior.format_ok), 1 differ without a direction; new findings: kl-high (critical)"
    )
    assert verdict.regressed
    assert verdict.to_dict()["task"][0] == {
        "metric": "signal.pass_at_1",
        "baseline": 0.93,
        "value": 0.09,
        "verdict": "worse",
    }
    quiet = RunVerdict(
        1, "b", (), (), (), (), (TaskOutcome("signal.pass_at_1", 0.5, 0.5, "noise"),)
    )
    assert quiet.line() == "run 2 (b) vs baseline: task outcome within noise; 0 other metrics worse"


FIXTURES = ROOT.parent / "shared" / "fixtures" / "trl-real"


@pytest.mark.skipif(not FIXTURES.is_dir(), reason="../shared/fixtures/trl-real is absent")
def test_compare_on_genuine_trl_runs_leads_with_the_task(tmp_path: Path) -> None:
    """lr-too-high against healthy (genuine TRL runs): the verdict leads with the collapse of
    the task (reward, pass@1, pass@k worse), and higher entropy, diversity or a lower grad
    norm are never called better. format-weighted-groupnorm against healthy: the task outcome
    a little worse at the end (pass@1 0.926 → 0.895), better formatted."""
    options = {"correct_column": "accuracy_reward"}

    def against_healthy(name: str) -> Any:
        return compare(
            [FIXTURES / "healthy", FIXTURES / name],
            from_format="trl",
            import_options=options,
        ).verdicts()[0]

    broken = against_healthy("lr-too-high")
    assert broken.line().startswith(
        "run 2 (lr-too-high) vs baseline: task outcome worse (reward 1.17 → 0.343, pass@1 "
        "0.926 → 0.0938, pass@k 1 → 0.25)"
    )
    assert broken.worse[:3] == ("signal.reward", "signal.pass_at_1", "signal.pass_at_k")
    for band_like in ("behavior.entropy", "exploration.pairwise_diversity", "stability.grad_norm"):
        assert band_like not in broken.better and band_like in broken.differs
    assert broken.better == (
        "behavior.truncation_rate",
        "behavior.len_correct_corr",
        "behavior.format_ok",
    )
    weighted = against_healthy("format-weighted-groupnorm")
    assert [(t.metric, t.verdict) for t in weighted.task] == [
        ("signal.reward", "worse"),
        ("signal.pass_at_1", "worse"),
        ("signal.pass_at_k", "noise"),
    ]
    assert weighted.better == ("behavior.format_ok",)
