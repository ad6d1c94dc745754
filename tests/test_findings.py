"""Every finding fires on the synthetic run built to show it and stays silent on healthy runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlscope.analysis import analyze
from rlscope.catalog import default_catalog
from rlscope.config import Config
from rlscope.report import Report
from rlscope.synth import SCENARIOS, generate

METRICS = default_catalog().metrics
RULES = default_catalog().rules

# Scenario -> the finding it is built to show (scenarios are named after their finding).
EXPECTED = {name: name.removesuffix("-hard") for name in SCENARIOS if name != "healthy"}

# Sizes that differ in run length, batch and group size: thresholds must hold at all of them.
SIZES = {
    "short-small": dict(steps=30, prompts_per_step=8, group_size=8),
    "long-wide": dict(steps=160, prompts_per_step=48, group_size=16),
}
# Healthy runs are also checked at the extremes: few long steps, and very wide short ones with a
# large group (pass@k near its ceiling).
HEALTHY_SIZES = {
    **SIZES,
    "long-narrow": dict(steps=400, prompts_per_step=4, group_size=8),
    "short-wide": dict(steps=12, prompts_per_step=64, group_size=32),
}
TOKEN_FINDINGS = {
    "entropy-collapse",
    "entropy-clip-conflict",
    "kl-stalled",
    "kl-runaway",
    "logged-metric-mismatch",
}


def _needs_text(rule_id: str) -> bool:
    """Whether one of the rule's metrics can be computed from text (responses or probes, which
    synth writes only with text=True; its runs have no other source, such as `actions`)."""
    return any(
        v.table == "probes" or "response" in v.requires
        for m in RULES[rule_id].metrics
        if m in METRICS
        for v in METRICS[m].variants
    )


def _run(
    tmp: Path, scenario: str, size: str, seed: int, tokens: bool, only: str | None = None
) -> Report:
    """Analyse a synth run of `scenario`: every metric, or only those the rule `only` reads (and
    text only if it needs it): end to end, at a fraction of the cost."""
    path = generate(
        tmp / f"{scenario}-{size}-{seed}",
        scenario,
        seed=seed,
        tokens=tokens,
        text=only is None or _needs_text(only),
        **HEALTHY_SIZES[size],
    )
    metrics = list(RULES[only].computes) if only else None
    return analyze(path, config=Config(), metrics=metrics, use_cache=False)


def _alarms(report: Report) -> list[str]:
    return [f"{f.id}: {f.message}" for f in report.findings if f.severity in ("warn", "critical")]


def _all(report: Report) -> list[str]:
    return [f"{f.id} ({f.severity}): {f.message}" for f in report.findings]


#: Rules tested on hand-made series (and the real fixtures) rather than a synth scenario.
HAND_MADE = [
    Path(__file__).parent / name
    for name in (
        "test_rules_verdicts.py",
        "test_mismatch.py",
        "test_critic.py",
        "test_sequential.py",
    )
]


def test_every_finding_has_a_scenario_or_a_hand_made_test() -> None:
    assert set(EXPECTED.values()) <= set(RULES)
    hand_made = "".join(path.read_text() for path in HAND_MADE)
    untested = [r for r in set(RULES) - set(EXPECTED.values()) if f'"{r}"' not in hand_made]
    assert untested == []


# Two healthy runs in the fast suite; the size x seed matrix in the slow one.
FAST_HEALTHY = {("short-small", 0), ("short-wide", 1)}


@pytest.mark.parametrize(
    ("size", "seed"),
    [
        pytest.param(size, seed, marks=() if (size, seed) in FAST_HEALTHY else pytest.mark.slow)
        for size in HEALTHY_SIZES
        for seed in (0, 1, 2)
    ],
)
def test_healthy_run_raises_no_alarm(tmp_path: Path, size: str, seed: int) -> None:
    report = _run(tmp_path, "healthy", size, seed, tokens=seed == 0)
    assert _all(report) == []  # not even an info finding


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_finding_fires_on_its_scenario(tmp_path: Path, scenario: str) -> None:
    """End to end on a small run, computing only the metrics the rule reads."""
    expected = EXPECTED[scenario]
    only = _run(tmp_path, scenario, "short-small", 3, expected in TOKEN_FINDINGS, only=expected)
    _assert_fires(only, expected)


@pytest.mark.slow
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_finding_fires_in_the_full_report(tmp_path: Path, scenario: str, size: str) -> None:
    expected = EXPECTED[scenario]
    _assert_fires(_run(tmp_path, scenario, size, 3, tokens=expected in TOKEN_FINDINGS), expected)


def _assert_fires(report: Report, expected: str) -> None:
    fired = {f.id: f for f in report.findings}
    assert expected in fired, f"{expected} did not fire; got {_alarms(report)}"
    finding = fired[expected]
    # A too-easy curriculum is information (the policy solved its prompts), not an alarm,
    # until most of the batch is wasted (from critical_at: a warning, never critical).
    too_easy = finding.evidence.get("side") == "too easy"
    assert (
        finding.severity in ("warn", "critical")
        or finding.severity == RULES[expected].severity
        or too_easy
    )
    if too_easy:
        wasted = finding.evidence["zero_std_frac"] >= RULES[expected].params["critical_at"].default
        assert finding.severity == ("warn" if wasted else "info")
    assert finding.message and finding.evidence.get("steps")


def test_dead_prompts_says_which_side(tmp_path: Path) -> None:
    easy = _run(tmp_path, "dead-prompts", "short-small", 0, tokens=False, only="dead-prompts")
    hard = _run(tmp_path, "dead-prompts-hard", "short-small", 0, tokens=False, only="dead-prompts")
    easy_f = next(f for f in easy.findings if f.id == "dead-prompts")
    hard_f = next(f for f in hard.findings if f.id == "dead-prompts")
    assert easy_f.evidence["side"] == "too easy" and "too easy" in easy_f.message
    assert hard_f.evidence["side"] == "too hard" and "too hard" in hard_f.message


def test_grad_spike_names_the_extreme_rollouts(tmp_path: Path) -> None:
    report = _run(tmp_path, "grad-spike", "short-small", 0, tokens=False, only="grad-spike")
    spike = next(f for f in report.findings if f.id == "grad-spike")
    rollouts = spike.evidence["rollouts"]
    assert set(rollouts) == set(spike.evidence["steps"])
    # The synthetic spike steps each hold one rollout of extreme reward: it must be named first.
    assert all(entries[0]["reward"] >= 20 for entries in rollouts.values())


def test_config_overrides_thresholds_and_disables(tmp_path: Path) -> None:
    path = generate(tmp_path / "trunc", "truncation", steps=30, prompts_per_step=8, tokens=False)
    assert any(f.id == "truncation" for f in analyze(path, config=Config()).findings)
    off = Config(findings={"truncation": {"enabled": False}})
    assert not any(f.id == "truncation" for f in analyze(path, config=off).findings)
    lenient = Config(findings={"truncation": {"warn_at": 0.99, "critical_at": 0.999}})
    assert not any(f.id == "truncation" for f in analyze(path, config=lenient).findings)
    info = Config(findings={"truncation": {"severity": "info", "critical_at": 2.0}})
    found = [f for f in analyze(path, config=info).findings if f.id == "truncation"]
    assert [f.severity for f in found] == ["info"]


ROLLOUT_FINDINGS = (
    "format-violations",
    "repetition",
    "redundant-tool-calls",
    "diversity-collapse",
    "ood-gap",
    "unfaithful-cot",
    "encoded-reasoning",
    "bias-following",
    "self-consistency-headroom",
    "step-errors",
)


@pytest.mark.parametrize("scenario", ROLLOUT_FINDINGS)
def test_finding_names_rollouts_of_the_run(tmp_path: Path, scenario: str) -> None:
    """The evidence names example rollouts that exist, so a person can open them."""
    import polars as pl

    report = _run(tmp_path, scenario, "short-small", 5, tokens=False, only=scenario)
    finding = next(f for f in report.findings if f.id == scenario)
    ids = finding.evidence["rollout_ids"]
    assert ids and len(ids) == len(set(ids))
    path = tmp_path / f"{scenario}-short-small-5"
    known = pl.scan_parquet(path / "rollouts" / "*.parquet").select("rollout_id").collect()
    assert set(ids) <= set(known["rollout_id"].to_list())
