"""Rules judged on hand-made series: each failure class of the verdicts issue, both ways."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import GENUINE

from rlscope.analysis import analyze
from rlscope.catalog import default_catalog
from rlscope.engine import compute
from rlscope.errors import RlscopeError
from rlscope.reader import open_run
from rlscope.report import MetricResult, Report, RunInfo
from rlscope.rules.base import RuleContext
from rlscope.spec import Finding

RULES = default_catalog().rules

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _fresh_rng() -> None:
    """Each test draws the same noise whatever ran before it in its worker (pytest-xdist
    shares a module's tests among processes in no fixed order)."""
    global RNG
    RNG = np.random.default_rng(0)


def result(metric_id: str, values: Sequence[float], steps: Sequence[int] | None = None):
    steps = list(steps) if steps is not None else list(range(1, len(values) + 1))
    return MetricResult(metric_id, "L0", metric_id, float(values[-1]), tuple(steps), tuple(values))


def judge(
    rule_id: str,
    series: Mapping[str, Sequence[float]],
    frames: Mapping[str, pl.DataFrame] | None = None,
    meta: Mapping[str, object] | None = None,
) -> list[Finding]:
    """The rule's findings on these per-step series (steps 1..n), with default params."""
    rule = RULES[rule_id]
    results = {m: result(m, v) for m, v in series.items()}
    frames = dict(frames or {})
    for m, r in results.items():
        frames.setdefault(m, pl.DataFrame({"step": list(r.steps), "value": list(r.values)}))
    params = {k: p.default for k, p in rule.params.items()}
    ctx = RuleContext(rule, params, None, results, frames, meta=meta)
    return list(rule.check(ctx))


def ids(findings: Iterable[Finding]) -> list[str]:
    return [f.id for f in findings]


def noisy(start: float, end: float, n: int, sd: float, shape: str = "linear") -> np.ndarray:
    t = np.linspace(0, 1, n)
    base = start + (end - start) * (t if shape == "linear" else np.clip((t - 0.6) / 0.1, 0, 1))
    return base + RNG.normal(0, sd, n)


# --- class 2: entropy that collapses late is collapse ------------------------------------------


def test_late_entropy_cliff_is_collapse() -> None:
    entropy = noisy(0.70, 0.05, 100, 0.01, shape="cliff").clip(0.01)
    found = judge("entropy-collapse", {"behavior.entropy": entropy})
    assert ids(found) == ["entropy-collapse"]
    assert "late in the run" in found[0].message
    assert found[0].evidence["steps"][0] >= 40


def test_early_entropy_cliff_says_early() -> None:
    entropy = np.concatenate([np.linspace(0.8, 0.1, 10), np.full(90, 0.1)]) + RNG.normal(
        0, 0.005, 100
    )
    found = judge("entropy-collapse", {"behavior.entropy": entropy})
    assert ids(found) == ["entropy-collapse"] and "early" in found[0].message


@pytest.mark.parametrize("end", [0.6, 0.4])
def test_smooth_moderate_entropy_decline_is_silent(end: float) -> None:
    # 0.65 -> 0.375 is the real TRL healthy run's decline (42%); 0.65 -> 0.4 smooth too.
    entropy = noisy(0.65, end, 200, 0.02)
    assert judge("entropy-collapse", {"behavior.entropy": entropy}) == []


def test_smooth_decline_to_a_floor_is_collapse() -> None:
    entropy = 0.8 * np.exp(-np.linspace(0, 3, 200)) + 0.01
    assert ids(judge("entropy-collapse", {"behavior.entropy": entropy})) == ["entropy-collapse"]


# --- class 3 and 4: clip fraction levels ---------------------------------------------------------


def test_low_entropy_with_heavy_clipping_from_the_start() -> None:
    series = {
        "behavior.entropy": noisy(0.35, 0.13, 60, 0.01),
        "stability.clip_frac": noisy(0.32, 0.32, 60, 0.01),
    }
    assert ids(judge("entropy-clip-conflict", series)) == ["entropy-clip-conflict"]
    # The conflict says it; clip-too-high does not repeat it.
    assert judge("clip-too-high", series) == []


def test_low_entropy_with_realistic_clipping_is_silent() -> None:
    series = {
        "behavior.entropy": noisy(0.5, 0.3, 60, 0.01),
        "stability.clip_frac": noisy(0.01, 0.015, 60, 0.002),
    }
    assert judge("entropy-clip-conflict", series) == []
    assert judge("clip-too-high", series) == []


def test_clip_too_high_with_normal_entropy() -> None:
    series = {
        "behavior.entropy": noisy(0.9, 0.8, 60, 0.01),
        "stability.clip_frac": noisy(0.3, 0.33, 60, 0.01),
    }
    found = judge("clip-too-high", series)
    assert ids(found) == ["clip-too-high"] and found[0].severity == "critical"


def test_clip_too_low_needs_off_policy_updates_and_no_progress() -> None:
    flat = noisy(0.4, 0.4, 60, 0.02)
    off_policy = {
        "stability.clip_frac": np.full(60, 1e-5),
        "stability.ppo_kl": np.full(60, 2e-4),
        "signal.pass_at_1": flat,
    }
    assert ids(judge("clip-too-low", off_policy)) == ["clip-too-low"]
    # On-policy (TRL num_iterations=1): clip fraction exactly 0 and no PPO drift.
    on_policy = {**off_policy, "stability.clip_frac": np.zeros(60), "stability.ppo_kl": None}
    on_policy = {k: v for k, v in on_policy.items() if v is not None}
    assert judge("clip-too-low", on_policy) == []
    # Off-policy with tiny clipping but learning: not too low.
    learning = {**off_policy, "signal.pass_at_1": noisy(0.3, 0.6, 60, 0.02)}
    assert judge("clip-too-low", learning) == []


# --- class 5: reward up, task not ---------------------------------------------------------------


def test_reward_up_through_format_while_accuracy_falls() -> None:
    n = 150
    accuracy = noisy(0.175, 0.146, n, 0.03)
    fmt = noisy(0.35, 0.46, n, 0.03)
    series = {
        "signal.reward": accuracy + fmt,
        "signal.pass_at_1": accuracy,
        "signal.pass_at_k": noisy(0.83, 0.68, n, 0.05),
        "signal.reward.accuracy_reward": accuracy,
        "signal.reward.format_reward": fmt,
    }
    found = judge("reward-hacking", series)
    assert ids(found) == ["reward-hacking"]
    assert found[0].evidence["driver"] == "format_reward"
    assert "`format_reward`" in found[0].message
    assert found[0].severity == "critical"  # pass@k fell significantly


def test_reward_up_with_accuracy_up_is_silent() -> None:
    # The format-weighted negative control: lopsided weights but accuracy is learned.
    accuracy = noisy(0.52, 0.90, 200, 0.05)
    series = {
        "signal.reward": 0.125 * accuracy + noisy(0.87, 0.99, 200, 0.03),
        "signal.pass_at_1": accuracy,
    }
    assert judge("reward-hacking", series) == []


def test_small_batch_rise_that_is_not_significant_is_not_flat() -> None:
    # 4 prompts x 4 rollouts: pass@1 rises +0.10 but the windows are too noisy to show it.
    accuracy = noisy(0.40, 0.50, 40, 0.2).clip(0, 1)
    series = {"signal.reward": noisy(0.4, 0.9, 40, 0.05), "signal.pass_at_1": accuracy}
    assert judge("reward-hacking", series) == []
    length = {
        "behavior.response_len": noisy(100, 200, 40, 3),
        "signal.pass_at_1": accuracy,
    }
    corr = pl.DataFrame(
        {"step": range(1, 41), "value": [0.0] * 40, "sxx": [1.0] * 40, "syy": [1.0] * 40}
    ).with_columns(sxy=pl.lit(0.0), dof=pl.lit(12.0))
    found = judge(
        "spurious-length-growth",
        {**length, "behavior.len_correct_corr": [0.0] * 40},
        {"behavior.len_correct_corr": corr},
    )
    assert found == []


# --- class 10: sampling error of small windows --------------------------------------------------


def _zero_std_frame(values: Sequence[float], groups: int) -> pl.DataFrame:
    return pl.DataFrame({"step": range(1, len(values) + 1), "value": values, "groups": groups})


def test_dead_prompts_small_batch_noise_is_silent() -> None:
    # 4 groups a step, a run averaging 33% zero-σ groups whose last steps read 56%.
    values = list(RNG.binomial(4, 0.33, 80) / 4)
    values[-8:] = [0.5, 0.75, 0.5, 0.5, 0.75, 0.5, 0.5, 0.5]
    frame = _zero_std_frame(values, 4)
    found = judge("dead-prompts", {"signal.zero_std_frac": values}, {"signal.zero_std_frac": frame})
    assert found == []


def _dead_prompts(zero: float, easy: float, hard: float, groups: int = 256) -> list[Finding]:
    values = [zero] * 80
    return judge(
        "dead-prompts",
        {
            "signal.zero_std_frac": values,
            "signal.all_correct_frac": [easy] * 80,
            "signal.all_wrong_frac": [hard] * 80,
        },
        {"signal.zero_std_frac": _zero_std_frame(values, groups)},
    )


def test_dead_prompts_large_batch_fires_and_too_easy_is_info_below_the_critical_share() -> None:
    """Too hard keeps the severity; too easy is `info` for a moderate share (the policy solved
    most of its prompts) and a warning from `critical_at` on (most of the batch is wasted)."""
    (hard,) = _dead_prompts(0.85, 0.05, 0.8)
    assert hard.severity == "critical" and hard.evidence["side"] == "too hard"
    (easy,) = _dead_prompts(0.6, 0.55, 0.05)
    assert easy.severity == "info" and easy.evidence["side"] == "too easy"
    (wasted,) = _dead_prompts(0.9, 0.88, 0.02)
    assert wasted.severity == "warn" and "≈90% of the rollouts" in wasted.message
    assert "stop, or harden the data" in wasted.message
    # A small batch: the share must still be surely past warn_at to say anything.
    assert _dead_prompts(0.6, 0.55, 0.05, groups=2) == []


def test_dead_prompts_says_when_the_reward_varies_within_solved_groups() -> None:
    """87% zero-σ but 94% all correct: both are true, measured on different things (the
    reward vs correctness); the message says so instead of reading as a contradiction."""
    (finding,) = _dead_prompts(0.87, 0.94, 0.0)
    assert "94% of the groups are all correct" in finding.message
    assert "other terms vary" in finding.message
    (plain,) = _dead_prompts(0.87, 0.85, 0.02)
    assert "other terms vary" not in plain.message


# --- grad-spike: against the steps before, severity by what reaches the optimizer ---------------


def _grad_norms(level: float = 0.3, n: int = 120, seed: int = 4) -> np.ndarray:
    """A healthy gradient norm: lognormal scatter (σ = 0.2) around `level`."""
    return level * np.exp(np.random.default_rng(seed).normal(0, 0.2, n))


def test_grad_spike_followed_by_a_level_shift_is_found_and_the_shift_said() -> None:
    """One step ×50, then the norm stays ×6 higher: a centred window containing the shift
    swallowed the spike; judged against the steps before, it is found, and the shift said."""
    grad = _grad_norms()
    grad[60] *= 50
    grad[61:] *= 6
    (found,) = judge("grad-spike", {"stability.grad_norm": grad})
    assert found.steps == (61,) and found.evidence["ratios"][0] > 30
    assert found.severity == "warn"
    assert found.evidence["level_shift"]["step"] == 61
    assert 4 < found.evidence["level_shift"]["ratio"] < 9
    assert "a level shift" in found.message


def test_a_small_excursion_is_info_and_a_large_one_a_warning() -> None:
    """×5 once (under Adam the update grows by less than it varies): info; ×30: a warning."""
    grad = _grad_norms()
    grad[70] *= 5
    (small,) = judge("grad-spike", {"stability.grad_norm": grad})
    assert small.steps == (71,) and small.severity == "info"
    grad[90] *= 30
    (both,) = judge("grad-spike", {"stability.grad_norm": grad})
    assert both.steps == (71, 91) and both.severity == "warn"
    assert judge("grad-spike", {"stability.grad_norm": _grad_norms()}) == []


def test_grad_spike_severity_after_the_trainers_clip() -> None:
    """The logged norm is before clipping: with run.json's max_grad_norm, what reached the
    optimizer is min(norm, clip). A ×30 spike of norms ~0.01 stays far under a clip of 1 (a
    warning: all of it reached Adam); a ×30 spike of norms ~0.3 is cut to ×3.3 by it (info)."""
    tiny = _grad_norms(level=0.01)
    tiny[80] *= 30
    (under,) = judge("grad-spike", {"stability.grad_norm": tiny}, meta={"max_grad_norm": 1.0})
    assert under.severity == "warn" and under.evidence["effective_ratio"] > 20
    grad = _grad_norms()
    grad[80] *= 30
    (clipped,) = judge("grad-spike", {"stability.grad_norm": grad}, meta={"max_grad_norm": 1.0})
    assert clipped.severity == "info" and clipped.evidence["effective_ratio"] < 4
    assert "the trainer clips at 1" in clipped.message
    (unknown,) = judge("grad-spike", {"stability.grad_norm": grad})
    assert unknown.severity == "warn" and unknown.evidence["max_grad_norm"] is None


def test_grad_spike_judged_on_a_prefix_is_judged_the_same_on_the_whole_run() -> None:
    """Each step is judged against the steps before it only: the spikes found on steps 1..s
    are the whole run's spikes up to s, at every s."""
    grad = _grad_norms(n=150, seed=9)
    for at, k in ((30, 8), (75, 40), (76, 6), (110, 12)):
        grad[at] *= k
    whole = judge("grad-spike", {"stability.grad_norm": grad})[0].steps
    assert whole == (31, 76, 111)
    for s in range(10, 151):
        found = judge("grad-spike", {"stability.grad_norm": grad[:s]})
        assert (found[0].steps if found else ()) == tuple(t for t in whole if t <= s), s


# --- overthinking needs length growth; divergence; KL level -------------------------------------


def _corr_frame(n: int, r: float, dof: float = 500.0) -> pl.DataFrame:
    return pl.DataFrame(
        {"step": range(1, n + 1), "value": [r] * n, "sxx": [1.0] * n, "syy": [1.0] * n}
    ).with_columns(sxy=pl.lit(r), dof=pl.lit(dof))


def test_wrong_answers_longer_without_growth_is_not_overthinking() -> None:
    frames = {"behavior.len_correct_corr": _corr_frame(100, -0.2)}
    shrinking = {"behavior.response_len": noisy(11.4, 10.5, 100, 0.2)}
    assert (
        judge("overthinking", {**shrinking, "behavior.len_correct_corr": [-0.2] * 100}, frames)
        == []
    )
    growing = {"behavior.response_len": noisy(200, 400, 100, 5)}
    found = judge("overthinking", {**growing, "behavior.len_correct_corr": [-0.2] * 100}, frames)
    assert ids(found) == ["overthinking"]


def test_divergence_names_the_nonfinite_steps() -> None:
    frame = pl.DataFrame(
        {
            "step": [1, 2, 3, 4],
            "value": [0.0, 0.0, 1.0, 0.0],
            "extra_grad_norm": [0.0, 0.0, 1.0, 0.0],
        }
    )
    found = judge(
        "divergence", {"stability.nonfinite": [0, 0, 1, 0]}, {"stability.nonfinite": frame}
    )
    assert ids(found) == ["divergence"] and found[0].severity == "critical"
    assert found[0].evidence["steps"] == [3] and "grad_norm" in found[0].message
    assert judge("divergence", {"stability.nonfinite": [0.0] * 4}) == []


def two_per_step(steps: int) -> dict[str, list]:
    """A minimal rollouts table for step-log tests: one group of two rollouts a step."""
    n = 2 * steps
    return {
        "rollout_id": list(range(n)),
        "step": [1 + i // 2 for i in range(n)],
        "prompt_id": ["p"] * n,
        "reward": [float(i % 2) for i in range(n)],
        "response_len": [10] * n,
    }


def test_divergence_end_to_end_from_a_nan_grad_norm(write_run) -> None:
    steps = [{"step": s, "loss": 0.1, "grad_norm": 0.5} for s in range(1, 21)]
    steps[6]["grad_norm"] = float("nan")
    report = analyze(
        write_run({"steps": steps, "rollouts": two_per_step(20)}),
        metrics=["stability.nonfinite", "stability.grad_norm"],
    )
    assert [(f.id, f.evidence["steps"]) for f in report.findings] == [("divergence", [7])]


def test_lr_zero_both_ways() -> None:
    steps = list(range(1, 41))
    never = judge("lr-zero", {"stability.lr": [0.0] * 40})
    assert ids(never) == ["lr-zero"] and never[0].severity == "critical"
    early_end = [1e-6] * 30 + [0.0] * 10  # the schedule reached 0 at step 31
    found = judge("lr-zero", {"stability.lr": early_end})
    assert ids(found) == ["lr-zero"] and found[0].severity == "warn"
    assert found[0].evidence["steps"] == [31, 40] and "last 10 steps" in found[0].message
    # Warmup from 0, a linear decay to 0 at the last step, or a tiny rate: silent.
    warmup = [0.0] * 5 + [1e-6] * 35
    decay = [1e-6 * (1 - s / 40) for s in steps]
    for healthy in (warmup, decay, [1e-9] * 40, [0.0, 1e-6]):
        assert judge("lr-zero", {"stability.lr": healthy}) == []


def test_lr_zero_end_to_end(write_run) -> None:
    steps = [{"step": s, "loss": 0.1, "lr": 0.0 if s > 15 else 1e-6} for s in range(1, 21)]
    run = write_run({"steps": steps, "rollouts": two_per_step(20)})
    report = analyze(run, metrics=["stability.lr"])
    assert [(f.id, f.evidence["steps"]) for f in report.findings] == [("lr-zero", [16, 20])]


def test_kl_high_by_level() -> None:
    assert ids(judge("kl-high", {"stability.kl": noisy(1.4, 1.3, 50, 0.2)})) == ["kl-high"]
    assert judge("kl-high", {"stability.kl": noisy(0.007, 0.07, 200, 0.02)}) == []


# --- class 7: `ok` only where a rule judged ---------------------------------------------------


def _report(results: list[MetricResult], judged: tuple[str, ...]) -> Report:
    info = RunInfo("p", "r", "GRPO", 1, 1, 1, 1, 1, 0, ("rollouts",))
    return Report(info, {r.id: r for r in results}, (), (), judged=judged)


def test_status_ok_only_where_judged_and_band_outside() -> None:
    effective = MetricResult("signal.effective_prompt_frac", "L3", "t", 0.079, (1,), (0.079,))
    effective = MetricResult(**{**effective.__dict__, "band": (0.5, 1.0)})
    unjudged = MetricResult("signal.group_std", "L3", "t", 0.3, (1,), (0.3,))
    judged = MetricResult("signal.reward", "L3", "t", 0.5, (1,), (0.5,))
    report = _report([effective, unjudged, judged], ("signal.reward", effective.id))
    assert report.status(effective) == ("outside healthy range", "outside")
    assert report.status(unjudged) is None
    assert report.status(judged) == ("ok", "ok")
    assert report.to_dict()["metrics"]["signal.group_std"]["status"] is None


#: The only metrics with a direction: task outcomes (up) and error rates (and the L6 probe
#: shares, whose direction the faithfulness papers give).
DIRECTED = {
    "signal.reward": "up",
    "signal.pass_at_1": "up",
    "signal.pass_at_k": "up",
    "generalization.eval_id": "up",
    "generalization.eval_ood": "up",
    "reasoning.maj_at_n_first": "up",
    "reasoning.step_accuracy": "up",
    "stability.nonfinite": "down",
    "behavior.truncation_rate": "down",
    "behavior.format_ok": "up",
    "behavior.repetition": "down",
    "behavior.redundant_tool_calls": "down",
    "reasoning.bias_following": "down",
    "reasoning.answer_unchanged.truncate": "down",
    "reasoning.answer_unchanged.mistake": "down",
    "reasoning.answer_unchanged.paraphrase": "up",
    "reasoning.early_answer_aoc": "up",
    # Two implementations of one policy should agree: any gap is worse.
    "stability.mismatch_kl": "down",
    "stability.mismatch_abs_logp": "down",
    "stability.mismatch_tail": "down",
    "stability.mismatch_prob_diff": "down",
    # A step whose 0/1 accuracy left [0, 1] is a broken reward, never better.
    "signal.accuracy_out_of_range": "down",
}


def test_a_direction_only_where_it_is_unambiguous() -> None:
    """Entropy, diversity, grad norm, σ_G shares are healthy in a band, not a direction; a
    banded metric has a direction only when it is an error rate (truncation)."""
    from rlscope.catalog import default_catalog

    METRICS = default_catalog().metrics
    assert {m.id: m.better for m in METRICS.values() if m.better} == DIRECTED
    banded = [m for m in METRICS.values() if m.band is not None]
    assert banded and {m.id for m in banded if m.better} == {"behavior.truncation_rate"}
    tasks = {m.id for m in METRICS.values() if m.task}
    assert tasks == {
        "signal.reward",
        "signal.pass_at_1",
        "signal.pass_at_k",
        "generalization.eval_id",
        "generalization.eval_ood",
    }


# --- class 8: an empty selection is an input error ---------------------------------------------


def test_empty_step_selection_is_an_error(write_run) -> None:
    rollouts = {
        "rollout_id": [0, 1],
        "step": [1, 1],
        "prompt_id": ["p", "p"],
        "reward": [0.0, 1.0],
        "response_len": [5, 6],
    }
    path = write_run({"rollouts": rollouts})
    with pytest.raises(RlscopeError, match="no step in the selected range 1000:2000"):
        analyze(path, steps=(1000, 2000))
    assert open_run(path).meta["run_id"] == Path(path).name


# --- the real fixtures' verdicts ---------------------------------------------------------------

FIXTURES = GENUINE


def _verdict(tmp_path: Path, source: Path) -> list[tuple[str, str]]:
    report = analyze(
        source,
        from_format="trl",
        import_options={"correct_column": "accuracy_reward"},
        cache_dir=tmp_path,
    )
    return sorted((f.id, f.severity) for f in report.findings)


REAL_VERDICTS = {
    "trl-real/healthy": [],
    "trl-real/format-weighted-groupnorm": [],
    "trl-real/too-hard": [("dead-prompts", "critical")],
    "trl-real/lr-too-high": [
        ("dead-prompts", "warn"),
        # its spikes (x20 the norm before) pass TRL's default clip of 1.0 as ~x1.5: info
        ("grad-spike", "info"),
        ("kl-high", "critical"),
        ("performance-regression", "critical"),
    ],
    # TRL logged completions/clipped_ratio 0.63 -> 0.92: the near-random policy runs into
    # max_completion_length, read from the logged figure (words are never compared with caps).
    "trl-tiny-grpo": [("reward-hacking", "warn"), ("truncation", "critical")],
}


@pytest.mark.parametrize("name", sorted(REAL_VERDICTS))
def test_real_fixture_verdicts(tmp_path: Path, name: str) -> None:
    source = FIXTURES / name
    assert _verdict(tmp_path, source) == REAL_VERDICTS[name]


def test_performance_regression_both_ways() -> None:
    falling = {"signal.pass_at_1": noisy(0.6, 0.3, 100, 0.03)}
    found = judge("performance-regression", falling)
    assert ids(found) == ["performance-regression"] and found[0].severity == "critical"
    assert judge("performance-regression", {"signal.pass_at_1": noisy(0.3, 0.6, 100, 0.03)}) == []
    # 4 prompts x 4 rollouts: a noisy window is no regression.
    noise = {"signal.pass_at_1": RNG.binomial(16, 0.4, 60) / 16}
    assert judge("performance-regression", noise) == []
    # Without correctness, the mean reward.
    assert ids(judge("performance-regression", {"signal.reward": noisy(1.0, 0.2, 80, 0.05)})) == [
        "performance-regression"
    ]


def _pass_1_frame(
    accuracy: Sequence[float], groups: int, size: int, seed: int, spread: float = 1.5
) -> pl.DataFrame:
    """pass@1's per-step frame from simulated prompt groups: each step draws `groups` prompts
    whose solve rate is sigmoid(logit(accuracy) + N(0, spread)) (prompt difficulty), then
    `size` rollouts of each."""
    rng = np.random.default_rng(seed)
    rows = []
    for step, level in enumerate(accuracy, start=1):
        logit = math.log(level / (1 - level)) + rng.normal(0, spread, groups)
        acc = rng.binomial(size, 1 / (1 + np.exp(-logit))) / size
        rows.append({"step": step, "value": acc.mean(), "groups": groups, "acc_sq": (acc**2).sum()})
    return pl.DataFrame(rows)


def _regression(frame: pl.DataFrame) -> list[Finding]:
    values = frame["value"].to_list()
    return judge(
        "performance-regression", {"signal.pass_at_1": values}, {"signal.pass_at_1": frame}
    )


def test_a_sparse_fall_is_judged_end_to_end(write_run) -> None:
    """The same through analyze: 7 generation points of 32 prompts x 8 completions, accuracy
    0.51 -> 0.28, are judged from their evidence (the rule is not "waiting for 10 steps")."""
    rng = np.random.default_rng(2)
    rows: dict[str, list] = {k: [] for k in ("rollout_id", "step", "prompt_id", "reward")}
    rows |= {"correct": [], "response_len": []}
    for step, level in enumerate([0.51, 0.5, 0.47, 0.4, 0.3, 0.28, 0.28], start=1):
        solve = 1 / (1 + np.exp(-(math.log(level / (1 - level)) + rng.normal(0, 1.5, 32))))
        for g in range(32):
            for right in rng.random(8) < solve[g]:
                rows["rollout_id"].append(len(rows["rollout_id"]))
                rows["step"].append(step * 4)  # a generation every 4 optimizer steps
                rows["prompt_id"].append(f"p{step}-{g}")
                rows["reward"].append(float(right))
                rows["correct"].append(bool(right))
                rows["response_len"].append(10)
    report = analyze(write_run({"rollouts": rows}, group_size=8))
    found = next(f for f in report.findings if f.id == "performance-regression")
    assert found.severity == "critical" and found.evidence["last"] < 0.35


def test_performance_regression_judges_a_sparse_series_on_its_evidence() -> None:
    """7 points of pass@1, each over 32 prompts x 8 completions (a TRL run generating once
    every few optimizer steps), falling 0.5 -> 0.28: too few steps for a step count, many
    standard errors of evidence."""
    accuracy = [0.5, 0.5, 0.48, 0.4, 0.3, 0.28, 0.28]
    (found,) = _regression(_pass_1_frame(accuracy, groups=32, size=8, seed=1))
    assert found.severity == "critical" and found.evidence["first"] > 0.4
    assert found.evidence["last"] < 0.35
    # Five points: no first and last window apart.
    assert _regression(_pass_1_frame(accuracy[:5], groups=32, size=8, seed=1)) == []


@pytest.mark.parametrize("seed", range(12))
def test_performance_regression_on_flat_noise_is_silent_sparse_or_dense(seed: int) -> None:
    """No trend: 7 big points of heterogeneous prompts, or 80 steps of 4 prompts x 4."""
    assert _regression(_pass_1_frame([0.45] * 7, groups=32, size=8, seed=seed)) == []
    assert _regression(_pass_1_frame([0.45] * 80, groups=4, size=4, seed=seed)) == []


def test_groups_of_one_rollout_say_so(write_run) -> None:
    rollouts = {
        "rollout_id": list(range(30)),
        "step": [1 + i // 3 for i in range(30)],
        "prompt_id": [f"p{i}" for i in range(30)],
        "reward": [float(i % 2) for i in range(30)],
        "response_len": [10] * 30,
    }
    report = analyze(write_run({"rollouts": rollouts}), metrics=["signal.zero_std_frac"])
    (skip,) = [s for s in report.skipped if s.metric == "signal.zero_std_frac"]
    assert "every train group has one rollout" in skip.reason


def test_masked_tool_tokens_fall_back_to_the_text(write_run) -> None:
    """Tool responses are loss-masked out of the tokens table, but the text has the tags."""
    text = (
        "<think>look it up</think><tool_call>{}</tool_call><tool_response>a b c d</tool_response>"
    )
    rollouts = {
        "rollout_id": [0, 1],
        "step": [1, 1],
        "prompt_id": ["p", "p"],
        "reward": [0.0, 1.0],
        "response_len": [12, 12],
        "response": [text + "<answer>1</answer>"] * 2,
    }
    tokens = {
        "rollout_id": [0, 0, 1, 1],
        "step": [1] * 4,
        "pos": [0, 1, 0, 1],
        "segment": ["think", "answer", "think", "answer"],
    }
    path = write_run({"rollouts": rollouts, "tokens": tokens})
    report = analyze(
        path, metrics=["behavior.segment_len.tool_response", "behavior.segment_len.think"]
    )
    assert report.metrics["behavior.segment_len.tool_response"].value == 4.0
    assert "words inside" in report.metrics["behavior.segment_len.tool_response"].source
    assert report.metrics["behavior.segment_len.think"].value == 1.0  # tokens, as before
    assert not [s for s in report.skipped if s.metric.startswith("behavior.segment_len")]
    # With every metric, the text features are computed in the same pass: no second one.
    full = analyze(path)
    assert full.metrics["behavior.segment_len.tool_response"].value == 4.0


def test_kl_stalled_ignores_an_identically_zero_kl() -> None:
    flat = {"signal.pass_at_1": noisy(0.4, 0.4, 40, 0.02)}
    assert judge("kl-stalled", {**flat, "stability.kl": [0.0] * 40}) == []
    assert ids(judge("kl-stalled", {**flat, "stability.kl": [1e-5] * 40})) == ["kl-stalled"]


def test_correctness_unknown_reason_reaches_the_skip(write_run) -> None:
    rollouts = {
        "rollout_id": [0, 1],
        "step": [1, 1],
        "prompt_id": ["p", "p"],
        "reward": [0.0, 1.0],
        "response_len": [5, 6],
    }
    why = "say which reward function means correct: `-X correct_column=…`"
    path = write_run({"rollouts": rollouts}, correct_unknown=why)
    report = analyze(path, metrics=["signal.pass_at_1"])
    (skip,) = [s for s in report.skipped if s.metric == "signal.pass_at_1"]
    assert "rollouts.correct" in skip.reason and why in skip.reason


def _agent_run(write_run, collapse_from: int | None, steps: int = 30) -> Path:
    """8 prompts x 8 rollouts a step, coarse actions ["search", "answer"] for everyone; texts
    all different, or (from `collapse_from` on) one response per group."""
    rng = np.random.default_rng(1)
    words = ["look", "up", "the", "capital", "of", "city", "then", "answer", "so", "it", "is"]
    rows: dict[str, list] = {k: [] for k in ("rollout_id", "step", "prompt_id", "reward")}
    rows |= {"response_len": [], "response": [], "actions": [], "tool_calls": []}
    rid = 0
    for step in range(1, steps + 1):
        for p in range(8):
            for i in range(8):
                same = collapse_from is not None and step >= collapse_from
                seed = (p, step) if same else (p, step, i)
                local = np.random.default_rng(abs(hash(seed)) % 2**32)
                text = " ".join(local.choice(words, 12)) + f" {p}"
                rows["rollout_id"].append(rid)
                rows["step"].append(step)
                rows["prompt_id"].append(f"q{p}")
                rows["reward"].append(float(rng.random() < 0.5))
                rows["response_len"].append(13)
                rows["response"].append(
                    f"<think>{text}</think><tool_call>{{}}</tool_call><answer>{p}</answer>"
                )
                rows["actions"].append(["search", "answer"])
                rows["tool_calls"].append([f'{{"q": "{text}"}}'])
                rid += 1
    return write_run({"rollouts": rows})


EXPLORATION = [
    "exploration.pairwise_diversity",
    "exploration.unique_frac",
    "exploration.cluster_sizes",
]


def test_coarse_actions_with_different_texts_are_not_identical(write_run) -> None:
    report = analyze(_agent_run(write_run, None), metrics=EXPLORATION)
    assert not [f for f in report.findings if f.id == "diversity-collapse"]
    assert report.metrics["exploration.unique_frac"].value == 1.0
    assert "normalised text" in report.metrics["exploration.unique_frac"].source


def test_texts_collapsing_under_constant_actions_fire(write_run) -> None:
    report = analyze(_agent_run(write_run, collapse_from=18), metrics=EXPLORATION)
    (found,) = [f for f in report.findings if f.id == "diversity-collapse"]
    assert found.severity == "critical" and len(found.evidence["rollout_ids"]) > 1


def _probe_frame(kind: str, unchanged: list[bool], fraction: float | None = None) -> pl.DataFrame:
    n = len(unchanged)
    return pl.DataFrame(
        {
            "rollout_id": list(range(n)),
            "step": [1 + i % 10 for i in range(n)],
            "intervention": [kind] * n,
            "fraction": [fraction] * n,
            "unchanged": unchanged,
        }
    )


def _judge_probes(rule_id: str, probes: pl.DataFrame) -> list[Finding]:
    rule = RULES[rule_id]
    params = {k: p.default for k, p in rule.params.items()}
    ctx = RuleContext(rule, params, None, {}, {}, {("probes", ""): probes})
    return list(rule.check(ctx))


def test_filler_changing_the_answer_is_not_encoded_reasoning() -> None:
    # What a faithful chain predicts (Lanham et al. §2.3): no warning.
    filler = _probe_frame("filler", [i % 2 == 0 for i in range(120)])
    assert _judge_probes("encoded-reasoning", filler) == []
    paraphrase = _probe_frame("paraphrase", [i % 2 == 0 for i in range(120)])
    assert ids(_judge_probes("encoded-reasoning", paraphrase)) == ["encoded-reasoning"]


def test_few_probes_need_a_clear_share() -> None:
    # 25% of 24 paraphrases changed: above 20%, but not surely (one-sided 95% bound).
    few = _probe_frame("paraphrase", [i % 4 != 0 for i in range(24)])
    assert _judge_probes("encoded-reasoning", few) == []
    early = _probe_frame("truncate", [i % 10 != 0 for i in range(24)], fraction=0.3)
    assert _judge_probes("unfaithful-cot", early) == []  # 90% of 24: bound 0.799 < 0.8
    many = _probe_frame("truncate", [i % 20 != 0 for i in range(400)], fraction=0.3)
    assert ids(_judge_probes("unfaithful-cot", many)) == ["unfaithful-cot"]


def _ood_frame(acc_id: np.ndarray, acc_ood: np.ndarray, n: int = 400) -> pl.DataFrame:
    steps = list(range(0, 20 * len(acc_id), 20))
    return pl.DataFrame(
        {
            "step": steps,
            "value": acc_id - acc_ood,
            "extra_id": acc_id,
            "extra_ood": acc_ood,
            "n_id": [n] * len(steps),
            "n_ood": [n] * len(steps),
        }
    )


def test_ood_that_still_improves_is_partial_transfer() -> None:
    # ID +0.25, OOD +0.12: ordinary partial transfer, silent (today: ood-gap fired).
    frame = _ood_frame(np.linspace(0.45, 0.70, 10), np.linspace(0.40, 0.52, 10))
    gaps = list(frame["value"])
    assert (
        judge("ood-gap", {"generalization.ood_gap": gaps}, {"generalization.ood_gap": frame}) == []
    )


@pytest.mark.parametrize(("end", "trend"), [(0.40, "flat"), (0.30, "falling")])
def test_ood_that_stalls_or_falls_while_id_rises(end: float, trend: str) -> None:
    frame = _ood_frame(np.linspace(0.45, 0.70, 10), np.linspace(0.40, end, 10))
    found = judge(
        "ood-gap",
        {"generalization.ood_gap": list(frame["value"])},
        {"generalization.ood_gap": frame},
    )
    assert ids(found) == ["ood-gap"] and found[0].evidence["ood_trend"] == trend
    assert f"OOD accuracy is {trend}" in found[0].message


def test_reward_term_series_equal_the_columns_mean(write_run) -> None:
    rollouts = {
        "rollout_id": list(range(8)),
        "step": [1, 1, 1, 1, 2, 2, 2, 2],
        "prompt_id": ["p"] * 8,
        "reward": [1.5, 0.5, 1.0, 0.0, 1.5, 1.5, 0.5, 1.0],
        "response_len": [3] * 8,
        "format_reward": [0.5, 0.5, 0.0, 0.0, 0.5, 0.5, 0.5, None],
        "reward_len": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
    }
    report = analyze(write_run({"rollouts": rollouts}), metrics=["signal.reward.*"])
    fmt, length = (
        report.metrics["signal.reward.format_reward"],
        report.metrics["signal.reward.reward_len"],
    )
    assert fmt.steps == (1, 2) and fmt.values == pytest.approx((0.25, 0.5))  # nulls left out
    assert length.values == pytest.approx((0.25, 0.65))


def test_reward_concentration_survives_absurd_advantages() -> None:
    """A fuzzed advantage of 1e308 overflowed the pooled square (OverflowError): no finding."""
    frame = pl.DataFrame(
        {
            "step": [1, 2, 3],
            "value": [0.5, 0.5, 0.5],
            "w_sum": [1e308, 0.0, 0.0],  # finite, but its square is not
            "w_sq": [float("inf"), 0.0, 0.0],
            "live_prompts": [1, 1, 1],
            "prompts": [1, 1, 1],
        }
    )
    found = judge(
        "reward-concentration",
        {"signal.effective_prompt_frac": [0.5] * 3},
        {"signal.effective_prompt_frac": frame},
    )
    assert found == []


# --- what the gradient is made of: the advantage by reward term ---------------------------------


def _share_frame(share: float, live: float, steps: int = 40, noise: float = 0.02) -> pl.DataFrame:
    rng = np.random.default_rng(5)
    values = np.clip(share + rng.normal(0, noise, steps), 0, 1)
    return pl.DataFrame(
        {
            "step": range(1, steps + 1),
            "value": values,
            "mass": values * 100,
            "total_mass": [100.0] * steps,
            "live_mass": [live * 60] * steps,
            "live_total": [60.0] * steps,
        }
    )


def _shares(task: float, live: float, meta: Mapping[str, object] | None = None) -> list[Finding]:
    frames = {
        "signal.advantage_share.accuracy_reward": _share_frame(task, live),
        "signal.advantage_share.format_reward": _share_frame(1 - task, 1 - live),
    }
    series = {m: f["value"].to_list() for m, f in frames.items()}
    meta = {"correct_source": "accuracy_reward > 0"} if meta is None else meta
    return judge("auxiliary-reward-dominates", series, frames, meta=meta)


def test_auxiliary_reward_dominates_when_the_task_signal_is_drowned() -> None:
    (found,) = _shares(0.15, 0.3)
    assert found.severity == "warn" and found.evidence["task_term"] == "accuracy_reward"
    assert "trained mostly on `format_reward`" in found.message
    assert found.evidence["shares"]["format_reward"] == pytest.approx(0.85, abs=0.02)


def test_auxiliary_reward_is_silent_when_the_task_signal_is_absent_or_fair() -> None:
    """All-wrong groups (too hard): the task term varies in few groups but carries most of
    their mass: dead-prompts' business. A fair share, or no task term named: silent."""
    assert _shares(0.1, 0.8) == []
    assert _shares(0.4, 0.45) == []
    assert _shares(0.15, 0.3, meta={}) == []
    assert _shares(0.15, 0.3, meta={"correct_source": "reward > 0"}) == []


def test_an_accelerating_kl_warns_unless_the_task_improves() -> None:
    """KL 0.002 e^(5u) (convex, 0.002 → 0.3): a warning while pass@1 is flat, an info while it
    rises (learning's drift, as PPO's KL starting late while its score climbs), critical from
    0.5 nats/token whatever the task does."""
    kl = 0.002 * np.exp(5 * np.linspace(0, 1, 90)) * (1 + RNG.normal(0, 0.02, 90))
    flat = noisy(0.4, 0.4, 90, 0.02)
    rising = noisy(0.4, 0.8, 90, 0.02)
    (found,) = judge("kl-runaway", {"stability.kl": kl, "signal.pass_at_1": flat})
    assert found.severity == "warn" and not found.evidence["improving"]
    (found,) = judge("kl-runaway", {"stability.kl": kl, "signal.pass_at_1": rising})
    assert found.severity == "info" and "buys progress" in found.message
    (found,) = judge("kl-runaway", {"stability.kl": kl * 5, "signal.pass_at_1": rising})
    assert found.severity == "critical"


def _accuracy_rows(batches: Mapping[int, np.ndarray]) -> list[dict[str, float]]:
    """TRL's rewards/<accuracy>/mean and torch's unbiased std of each step's batch of rewards."""
    return [
        {"step": s, "correct_rate": float(v.mean()), "correct_rate_std": float(v.std(ddof=1))}
        for s, v in batches.items()
    ]


def test_accuracy_out_of_range_never_fires_on_rewards_in_0_1() -> None:
    """Bhatia–Davis, checked on 3000 batches of 4 to 64 rewards anywhere in [0, 1] (0/1, partial
    credit, Beta-shaped, all on one bound): no step is flagged, whatever the batch; and
    batches with one reward past [0, 1] by enough are."""
    from rlscope.binary import outside_unit_range

    rng = np.random.default_rng(11)
    means, stds = [], []
    for i in range(3000):
        n = int(rng.integers(4, 65))
        kind = i % 4
        if kind == 0:
            v = (rng.random(n) < rng.random()).astype(float)
        elif kind == 1:
            v = rng.choice([0.0, 0.5, 1.0], n)
        elif kind == 2:
            v = rng.beta(0.1, 0.1, n)
        else:
            v = np.full(n, float(rng.integers(0, 2)))
        means.append(float(v.mean()))
        stds.append(float(v.std(ddof=1)))
    frame = pl.DataFrame({"p": means, "s": stds}, schema={"p": pl.Float32, "s": pl.Float32})
    flagged = frame.select(outside_unit_range(pl.col("p").cast(pl.Float64), pl.col("s")))
    assert not flagged.to_series().any()
    past = [np.array([10.0] + [0.0] * 15), np.array([-1.0, 1.0, 1.0, 0.0]), np.full(8, 1.5)]
    frame = pl.DataFrame({"p": [v.mean() for v in past], "s": [v.std(ddof=1) for v in past]})
    assert frame.select(outside_unit_range(pl.col("p"), pl.col("s"))).to_series().all()


def test_accuracy_out_of_range_names_the_broken_steps(write_run) -> None:
    """A logged 0/1 accuracy of 16 completions a step with rewards of 10 at steps 9 and 21 and
    one of -1 at step 14: those steps are flagged and named (warn), and left out of pass@1,
    whose other steps are the batches' means; a run whose rewards stay 0/1 is silent."""
    rng = np.random.default_rng(5)
    batches = {step: (rng.random(16) < 0.6).astype(float) for step in range(1, 31)}
    clean = _accuracy_rows(batches)
    batches[9][:2] = 10.0
    batches[21][:2] = 10.0
    batches[14][0] = -1.0
    run = write_run({"steps": _accuracy_rows(batches)})
    computed = compute(open_run(run), ["signal.accuracy_out_of_range", "signal.pass_at_1"])
    flags = computed.frames["signal.accuracy_out_of_range"].sort("step")
    assert flags.filter(pl.col("value") > 0)["step"].to_list() == [9, 14, 21]
    report = analyze(run)
    found = next(f for f in report.findings if f.id == "accuracy-out-of-range")
    assert found.severity == "warn" and found.evidence["steps"] == [9, 14, 21]
    assert "step 9: mean 1.81" in found.message
    result = report.metrics["signal.pass_at_1"]
    pass_1 = dict(zip(result.steps, result.values, strict=True))
    for step, v in batches.items():
        assert pass_1[step] == (None if step in (9, 14, 21) else pytest.approx(v.mean()))
    silent = analyze(write_run({"steps": clean}))
    assert "accuracy-out-of-range" not in ids(silent.findings)
