"""`compare`: alignment, deltas, bootstrap intervals, healthier-by, findings per run, the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import GENUINE
from conftest import run_cli as rlscope

from rlscope.analysis import analyze
from rlscope.comparison import (
    MIN_WINDOW_POINTS,
    bootstrap_difference,
    compare,
    compare_reports,
    final_window,
    leading,
)
from rlscope.errors import RlscopeError
from rlscope.render.compare import aligned_sparklines
from rlscope.report import Report

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
    assert "task outcome worse (pass@1" in done.stdout
    # The task outcome's panel comes before the layers', its rows out of L3's.
    task_panel, layers = done.stdout.split("─ Task outcome ─", 1)[1].split("─ L1 ", 1)
    assert "signal.pass_at_1" in task_panel and "signal.reward " in task_panel
    assert "signal.pass_at_1" not in layers and "signal.group_std" in layers
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
    # Across the band: 0.1 below (0.2, 0.4) is nearer than the baseline's 0.2 above it.
    assert versus([0.1, 0.11, 0.09, 0.1, 0.1, 0.1], bounds=(0.2, 0.4)) == "better"
    assert versus([0.1, 0.11, 0.09, 0.1, 0.1, 0.1], bounds=(0.35, 0.55)) == "worse"
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
    metrics follow as `other metrics`; the differing ones are said to have no direction or
    band that tells; JSON has the task entries."""
    from rlscope.comparison import RunVerdict, TaskOutcome

    verdict = RunVerdict(
        1,
        "lr",
        ("signal.pass_at_1", "signal.zero_std_frac"),
        ("behavior.format_ok", "signal.reward"),
        ("behavior.entropy",),
        (("kl-high", "critical"),),
        (
            TaskOutcome("signal.pass_at_1", 0.93, 0.09, "worse", "pass@1"),
            TaskOutcome("signal.pass_at_k", 0.99, 0.98, "noise", "pass@k"),
            TaskOutcome("signal.reward", 1.0, 1.2, "better", "reward"),
        ),
    )
    assert verdict.line() == (
        "run 2 (lr) vs baseline: task outcome worse (pass@1 0.93 → 0.09); task outcome better "
        "(reward 1 → 1.2); 1 other metrics worse (signal.zero_std_frac), 1 better "
        "(behavior.format_ok), 1 differ (no direction or band says which is healthier); new "
        "findings: kl-high (critical)"
    )
    assert verdict.regressed
    assert verdict.to_dict()["task"][0] == {
        "metric": "signal.pass_at_1",
        "name": "pass@1",
        "baseline": 0.93,
        "value": 0.09,
        "verdict": "worse",
        "unlike": [],
    }
    quiet = RunVerdict(
        1, "b", (), (), (), (), (TaskOutcome("signal.pass_at_1", 0.5, 0.5, "noise", "pass@1"),)
    )
    assert quiet.line() == "run 2 (b) vs baseline: task outcome within noise; 0 other metrics worse"


def _run(
    run_id: str, meta: dict[str, Any] | None = None, **series: tuple[list[float], dict]
) -> Report:
    """A hand-made report: per metric id, its per-step values and MetricResult fields."""
    from rlscope.report import MetricResult, Report, RunInfo

    metrics = {}
    for key, (values, fields) in series.items():
        metric_id = key.replace("__", ".")
        window = final_window(values)
        steps = tuple(range(1, len(values) + 1))
        value = sum(window) / len(window)
        metrics[metric_id] = MetricResult(metric_id, "L3", metric_id, value, steps, tuple(values))
        metrics[metric_id] = MetricResult(**{**vars(metrics[metric_id]), **fields})
    info = RunInfo("p", run_id, "GRPO", 6, 1, 6, 48, 6, 0, ("rollouts",), meta=meta or {})
    return Report(info, metrics, (), ())


def _flat(level: float) -> list[float]:
    return [level + d for d in (0.01, -0.01, 0.0, 0.01, -0.01, 0.0)]


PASS = {"better": "up", "task": "pass@1"}
REWARD = {"better": "up", "task": "reward", "scale_from": ("reward_components", "reward_weights")}
WEIGHTS = {"reward_components": ["acc", "fmt"], "reward_weights": {"acc": 1.0, "fmt": 1.0}}


def test_task_outcomes_lead_the_verdict_pass_at_1_before_the_reward() -> None:
    """A collapsed task with a higher entropy, a lower truncation rate and a zero-σ share back
    inside its band: the task outcome comes first (pass@1 before the reward, whose scale is
    the run's own, although the catalog declares the reward first); truncation (an error rate)
    and the band metric are better, entropy (neither) only differs; a regression."""
    base = _run(
        "base",
        WEIGHTS,
        signal__reward=(_flat(1.2), REWARD),
        signal__pass_at_1=(_flat(0.9), PASS),
        signal__zero_std_frac=(_flat(0.6), {"band": (0.0, 0.5)}),
        behavior__entropy=(_flat(0.3), {}),
        behavior__truncation_rate=(_flat(0.04), {"better": "down", "band": (0.0, 0.05)}),
    )
    broken = _run(
        "broken",
        WEIGHTS,
        signal__reward=(_flat(0.3), REWARD),
        signal__pass_at_1=(_flat(0.1), PASS),
        signal__zero_std_frac=(_flat(0.45), {"band": (0.0, 0.5)}),
        behavior__entropy=(_flat(0.7), {}),
        behavior__truncation_rate=(_flat(0.02), {"better": "down", "band": (0.0, 0.05)}),
    )
    comparison = compare_reports([base, broken])
    (verdict,) = comparison.verdicts()
    assert verdict.worse == ("signal.pass_at_1", "signal.reward")
    assert verdict.better == ("behavior.truncation_rate", "signal.zero_std_frac")
    assert verdict.differs == ("behavior.entropy",)
    assert verdict.line() == (
        "run 2 (broken) vs baseline: task outcome worse (pass@1 0.9 → 0.1, reward 1.2 → 0.3); 0 "
        "other metrics worse, 2 better (behavior.truncation_rate, signal.zero_std_frac), 1 differ "
        "(no direction or band says which is healthier)"
    )
    assert verdict.regressed
    assert [m.id for m in leading(comparison.metrics.values())][:2] == [
        "signal.pass_at_1",
        "signal.reward",
    ]
    # The same runs the other way round: the task outcome better leads, nothing worse.
    (back,) = compare_reports([broken, base]).verdicts()
    assert back.line().startswith(
        "run 2 (base) vs baseline: task outcome better (pass@1 0.1 → 0.9, reward 0.3 → 1.2); 2 "
        "other metrics worse (behavior.truncation_rate, signal.zero_std_frac)"
    )


def test_the_reward_is_not_compared_between_runs_with_other_reward_weights() -> None:
    """The mean reward's scale is the run's reward functions and weights: another weighting is
    not compared (no verdict, not a regression), the same functions listed in another order
    are; pass@1 is compared either way."""
    weighted = {**WEIGHTS, "reward_weights": {"acc": 0.125, "fmt": 4.0}}
    base = _run(
        "base", WEIGHTS, signal__reward=(_flat(1.2), REWARD), signal__pass_at_1=(_flat(0.9), PASS)
    )
    other = _run(
        "weighted",
        weighted,
        signal__reward=(_flat(1.1), REWARD),
        signal__pass_at_1=(_flat(0.9), PASS),
    )
    comparison = compare_reports([base, other])
    reward = comparison.metrics["signal.reward"]
    run = reward.runs[1]
    assert run is not None and run.verdict == "" and run.unlike == ("reward_weights",)
    assert run.delta == pytest.approx(-0.1) and run.interval is not None
    assert reward.healthiest is None
    assert reward.summary == "not comparable: run.json reward_weights differ from the baseline's"
    (verdict,) = comparison.verdicts()
    assert not verdict.regressed and "signal.reward" not in verdict.differs
    assert verdict.line() == (
        "run 2 (weighted) vs baseline: task outcome within noise; reward not compared "
        "(reward_weights differ); 0 other metrics worse"
    )
    assert verdict.to_dict()["task"][1]["verdict"] == "unlike"
    assert json.loads(json.dumps(comparison.to_dict()))["metrics"]["signal.reward"]["runs"][1][
        "unlike"
    ] == ["reward_weights"]
    reordered = {**WEIGHTS, "reward_components": ["fmt", "acc"]}
    same = _run("same", reordered, signal__reward=(_flat(1.1), REWARD))
    assert compare_reports([base, same]).metrics["signal.reward"].runs[1].verdict == "worse"


FIXTURES = GENUINE / "trl-real"


def test_compare_on_genuine_trl_runs_leads_with_the_task(tmp_path: Path) -> None:
    """lr-too-high against healthy (genuine TRL runs, imported as `--from trl` does): the
    verdict leads with the collapse of the task (pass@1, pass@k, reward worse), and higher
    entropy, diversity or a lower grad norm are never called better. format-weighted-groupnorm
    against healthy: pass@1 a little worse at the end (0.926 → 0.895, the fixture README's last
    10%), better formatted, and its reward not compared: TRL's reward_weights [0.125, 4.0]
    against [1, 1] put the mean reward on another scale."""

    def imported(name: str) -> Report:
        return analyze(FIXTURES / name, from_format="trl", cache_dir=tmp_path)

    healthy = imported("healthy")

    def against_healthy(name: str) -> Any:
        (verdict,) = compare_reports([healthy, imported(name)]).verdicts()
        return verdict

    broken = against_healthy("lr-too-high")
    assert broken.line() == (
        "run 2 (lr-too-high) vs baseline: task outcome worse (pass@1 0.926 → 0.0938, pass@k 1 → "
        "0.25, reward 1.17 → 0.343); 3 other metrics worse (signal.zero_std_frac, "
        "signal.effective_prompt_frac, reasoning.maj_at_n_first), 3 better "
        "(behavior.truncation_rate, behavior.len_correct_corr, behavior.format_ok), 22 differ (no "
        "direction or band says which is healthier); new findings: performance-regression "
        "(critical), kl-high (critical), dead-prompts (warn), grad-spike (info)"
    )
    assert broken.worse[:3] == ("signal.pass_at_1", "signal.pass_at_k", "signal.reward")
    for band_like in ("behavior.entropy", "exploration.pairwise_diversity", "stability.grad_norm"):
        assert band_like not in broken.better and band_like in broken.differs
    assert broken.regressed
    weighted = against_healthy("format-weighted-groupnorm")
    assert weighted.line() == (
        "run 2 (format-weighted-groupnorm) vs baseline: task outcome worse (pass@1 0.926 → "
        "0.895); reward not compared (reward_weights differ); 0 other metrics worse, 1 better "
        "(behavior.format_ok), 5 differ (no direction or band says which is healthier)"
    )
    assert [(t.metric, t.verdict, t.unlike) for t in weighted.task] == [
        ("signal.pass_at_1", "worse", ()),
        ("signal.pass_at_k", "noise", ()),
        ("signal.reward", "unlike", ("reward_weights",)),
    ]
    assert weighted.worse == ("signal.pass_at_1",) and weighted.better == ("behavior.format_ok",)
