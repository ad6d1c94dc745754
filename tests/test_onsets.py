"""Root cause first: every finding's onset is where judging the run's prefix first raises it,
consequences are filed under the cause that began first, and healthy runs raise nothing at
any prefix (issue "Root cause first")."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import GENUINE, run_trainer, trainer_constant

from rlscope.analysis import analyze
from rlscope.catalog import default_catalog
from rlscope.config import Config
from rlscope.engine import Computed, compute
from rlscope.evaluation import evaluate_prefix, file_causes
from rlscope.importers import import_run
from rlscope.plots import plot_data
from rlscope.reader import open_run
from rlscope.render.html import render_html
from rlscope.render.terminal import summary_line
from rlscope.report import Report
from rlscope.rules.base import Series, changed_at, halfway_step
from rlscope.spec import Finding

RULES = default_catalog().rules
FIXTURES = GENUINE
TRL = {"correct_column": "accuracy_reward"}


def _fixture(name: str) -> Path:
    return FIXTURES / name


# --- causes and consequences: hand-made findings ----------------------------------------------


def _finding(rule_id: str, onset: int, severity: str = "critical", **evidence: object) -> Finding:
    rule = RULES[rule_id]
    return Finding(rule_id, severity, rule.layer, "m", evidence, onset=onset)  # type: ignore[arg-type]


def test_a_consequence_is_filed_under_the_cause_that_began_first() -> None:
    collapse = _finding("performance-regression", 35, began=2)
    kl = _finding("kl-high", 6)
    dead = _finding("dead-prompts", 102, "warn", side="too hard")
    spike = _finding("grad-spike", 134, "warn")
    ordered = file_causes([kl, spike, dead, collapse], RULES)
    assert [f.id for f in ordered] == [
        "performance-regression",
        "kl-high",
        "dead-prompts",
        "grad-spike",
    ]
    caused = {f.id: f.caused_by for f in ordered}
    assert caused == {
        "performance-regression": (),
        "kl-high": ("performance-regression",),
        "dead-prompts": ("performance-regression",),
        "grad-spike": (),
    }


def test_a_cause_must_come_first_and_its_condition_hold() -> None:
    # The KL ran high before the task outcome fell: the drift explains the fall, not the reverse.
    collapse = _finding("performance-regression", 80, began=60)
    kl = _finding("kl-high", 30)
    ordered = file_causes([collapse, kl], RULES)
    assert [(f.id, f.caused_by) for f in ordered] == [
        ("kl-high", ()),
        ("performance-regression", ("kl-high",)),
    ]
    # Dead groups that are all correct are not explained by a collapse.
    easy = _finding("dead-prompts", 90, "warn", side="too easy")
    assert file_causes([_finding("performance-regression", 10), easy], RULES)[1].caused_by == ()
    # Each explains the other and both began at one step: neither is the other's cause; the
    # one that accounts for more leads.
    both = file_causes(
        [
            _finding("kl-high", 28),
            _finding("performance-regression", 29, began=28),
            _finding("truncation", 37),
        ],
        RULES,
    )
    assert [(f.id, f.caused_by) for f in both] == [
        ("performance-regression", ()),
        ("truncation", ("performance-regression",)),
        ("kl-high", ()),
    ]


def test_explains_is_declared_with_its_mechanism_and_names_real_findings() -> None:
    for rule in RULES.values():
        for other, how in rule.explains.items():
            assert other in RULES, (rule.id, other)
            assert len(how.mechanism) > 30, (rule.id, other)
            assert other in rule.explain()


# --- the step a fall began and what changed there -----------------------------------------------


def test_halfway_step_finds_a_collapse_not_one_noisy_step() -> None:
    steps = np.arange(1, 41)
    values = np.r_[np.full(20, 0.8), np.full(20, 0.1)]
    values[5] = 0.2  # one bad step does not count
    assert halfway_step(Series(steps, values), 0.8, 0.1) == 21
    # A collapse at the first update: the step after the start.
    assert halfway_step(Series(steps, np.r_[0.8, np.full(39, 0.05)]), 0.8, 0.05) == 2


def test_changed_at_names_a_learning_rate_jump_and_not_steady_drivers() -> None:
    from rlscope.report import MetricResult
    from rlscope.rules.base import RuleContext

    steps = list(range(1, 41))
    lr = [5e-4] * 24 + [2e-2] * 16
    grad = list(1.0 + 0.05 * np.sin(np.arange(40)))

    def result(metric_id: str, values: list[float]) -> MetricResult:
        return MetricResult(metric_id, "L1", metric_id, None, tuple(steps), tuple(values))

    results = {
        "stability.lr": result("stability.lr", lr),
        "stability.grad_norm": result("stability.grad_norm", grad),
    }
    rule = RULES["performance-regression"]
    ctx = RuleContext(rule, {}, None, results, {})
    changed = changed_at(ctx, 27)
    assert list(changed) == ["stability.lr"] and changed["stability.lr"][0] == 5e-4
    assert changed["stability.lr"][1] > 1e-2
    assert changed_at(ctx, 12) == {}


# --- onsets: the prefix judgement --------------------------------------------------------------


def _computed(tmp_path: Path, name: str, **options: Any) -> tuple[Path, Computed]:
    out = tmp_path / name.replace("/", "-")
    source = _fixture(name)
    import_run("trl" if not name.endswith(".jsonl") else "verl-metrics", source, out, **options)
    return out, compute(open_run(out))


def test_the_onset_is_where_the_prefix_first_raises_it(tmp_path: Path) -> None:
    """lr-too-high: judging up to each finding's onset raises it and up to its last good step
    does not, by a fresh analysis of the prefix (`--steps :s`, read again from the files)."""
    run, _ = _computed(tmp_path, "trl-real/lr-too-high", **TRL)
    report = analyze(run, cache_dir=tmp_path / "cache")
    assert report.findings and all(f.onset is not None for f in report.findings)
    for finding in report.findings:
        at = analyze(run, steps=(None, finding.onset), cache_dir=tmp_path / "cache")
        assert finding.id in {f.id for f in at.findings}, finding.id
        if finding.last_good is not None:
            before = analyze(run, steps=(None, finding.last_good), cache_dir=tmp_path / "cache")
            assert finding.id not in {f.id for f in before.findings}, finding.id


def test_lr_too_high_leads_with_the_collapse(tmp_path: Path) -> None:
    run, _ = _computed(tmp_path, "trl-real/lr-too-high", **TRL)
    report = analyze(run, cache_dir=tmp_path / "cache")
    root = report.findings[0]
    assert root.id == "performance-regression" and root.began == 2 and not root.caused_by
    assert root.evidence["baseline"] == "start" and root.evidence["first"] == pytest.approx(
        0.484375
    )
    assert "stability.kl" in root.evidence["changed"]
    dead = next(f for f in report.findings if f.id == "dead-prompts")
    assert dead.caused_by == ("performance-regression",)
    assert dict(report.causal_groups()[0][0].evidence)["began"] == 2
    # The report's first card is the root, with the step it began marked on its chart.
    page = render_html([report], [plot_data(run)])
    cards = re.findall(r"<div class='card \w+' id='finding-0-([\w-]+)'", page)
    assert cards[0] == "performance-regression"
    assert "performance-regression began (step 2)" in page
    assert "Because of</b> <code>performance-regression</code>" in page


# --- every prefix of a healthy run -------------------------------------------------------------

#: Genuine healthy runs, and the frozen critic (nothing but its critic is wrong there).
QUIET = {
    "trl-real/healthy": TRL,
    "trl-real/format-weighted-groupnorm": TRL,
    "ppo-critic/healthy.jsonl": {},
    "ppo-critic/frozen-critic.jsonl": {},
}
#: What a run of QUIET may raise, the one thing wrong with it.
EXPECTED_ALARMS = {"ppo-critic/frozen-critic.jsonl": {"critic-not-learning"}}
#: Findings that say opposite things of one quantity: never both, never one after the other.
OPPOSITES = [("kl-stalled", "kl-runaway"), ("clip-too-low", "clip-too-high")]
#: Steps every run is allowed before the prefix judgement must hold (a trend needs them).
WARM_UP = 10


def _prefix_alarms(computed: Computed, stride: int) -> dict[int, list[str]]:
    steps = sorted({s for r in computed.results.values() for s in r.steps})
    judged = {}
    for s in steps[WARM_UP - 1 :: stride]:
        found = evaluate_prefix(computed, s, Config()).findings
        judged[s] = [f.id for f in found if f.severity in ("warn", "critical")]
    return judged


def _assert_quiet_at_every_prefix(tmp_path: Path, name: str, stride: int) -> None:
    _, computed = _computed(tmp_path, name, **QUIET[name])
    allowed = EXPECTED_ALARMS.get(name, set())
    alarms = {
        s: unexpected
        for s, found in _prefix_alarms(computed, stride).items()
        if (unexpected := set(found) - allowed)
    }
    assert alarms == {}, f"{name}: {alarms}"


@pytest.mark.parametrize("name", sorted(QUIET))
def test_healthy_runs_raise_nothing_at_any_prefix(tmp_path: Path, name: str) -> None:
    """Every third prefix past the warm-up here; every prefix in the slow set."""
    _assert_quiet_at_every_prefix(tmp_path, name, stride=3)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(QUIET))
def test_healthy_runs_raise_nothing_at_every_prefix(tmp_path: Path, name: str) -> None:
    _assert_quiet_at_every_prefix(tmp_path, name, stride=1)


@pytest.mark.parametrize(
    "name", ["trl-real/lr-too-high", "trl-real/too-hard", "trl-tiny-grpo", *sorted(QUIET)]
)
def test_no_finding_flips_into_its_opposite(tmp_path: Path, name: str) -> None:
    _, computed = _computed(tmp_path, name, **QUIET.get(name, TRL))
    seen: set[str] = set()
    for s, found in _prefix_alarms(computed, stride=2).items():
        for a, b in OPPOSITES:
            assert not ({a, b} <= set(found)), (name, s, found)
            for one, other in ((a, b), (b, a)):
                assert not (one in seen and other in found), (name, s, one, other)
        seen.update(found)


def test_prefix_judgement_equals_a_fresh_analysis_of_the_prefix(tmp_path: Path) -> None:
    """engine.upto cuts what was computed; a fresh `--steps :s` reads the files again: the
    same findings and metric values at every prefix checked."""
    run, computed = _computed(tmp_path, "trl-real/too-hard", **TRL)
    for s in (12, 40, 77, 150):
        fresh = analyze(run, steps=(None, s), use_cache=False)
        cut = evaluate_prefix(computed, s, Config(), with_onsets=False)
        assert sorted((f.id, f.severity, f.message) for f in cut.findings) == sorted(
            (f.id, f.severity, f.message) for f in fresh.findings
        ), s


# --- genuine TRL runs the suite makes (tests/trainers/trl_lr_collapse.py) ------------------------


def _trl_run(tmp_path: Path, mode: str) -> Report:
    src = tmp_path / mode
    run_trainer("trl_lr_collapse.py", src, mode)
    return analyze(src, from_format="trl", import_options=TRL, cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_a_learning_rate_too_high_from_step_1_is_named_as_a_collapse(tmp_path: Path) -> None:
    """GRPOTrainer at 40x a sane learning rate: accuracy 0.78 at step 1, ~0 from step 2: the
    sequential test against step 1's level is sure at step 2."""
    report = _trl_run(tmp_path, "too-high")
    root = report.findings[0]
    assert root.id == "performance-regression" and root.evidence["baseline"] == "level so far"
    assert root.began == 2 and root.evidence["sure"] == 2 and root.onset == 2
    assert "stability.kl" in root.evidence["changed"]
    dead = next(f for f in report.findings if f.id == "dead-prompts")
    assert dead.caused_by == ("performance-regression",)
    assert (
        summary_line(report)
        .plain.split(": ", 2)[2]
        .startswith("performance-regression since step 2 (→")
    )


@pytest.mark.slow
def test_a_mid_run_learning_rate_jump_collapses_after_the_jump(tmp_path: Path) -> None:
    """The healthy learning rate, then x40 from step JUMP_STEP: the jump is named at its step,
    the collapse after it and filed under it, with the learning rate's change, and nothing
    else is raised before it."""
    jump = trainer_constant("trl_lr_collapse.py", "JUMP_STEP")
    report = _trl_run(tmp_path, "jump")
    change = next(f for f in report.findings if f.id == "update-change")
    assert change.onset == change.began == jump and "×40" in change.message
    collapse = next(f for f in report.findings if f.id == "performance-regression")
    assert collapse.onset is not None and jump < collapse.onset <= jump + 3
    assert collapse.began is not None and jump < collapse.began <= jump + 5
    assert "stability.lr" in collapse.evidence["changed"]
    assert "update-change" in collapse.caused_by
    assert all(
        f.onset is not None and f.onset > jump
        for f in report.findings
        if f.severity != "info" and f is not change
    )
    healthy = _trl_run(tmp_path, "healthy")
    assert "performance-regression" not in {f.id for f in healthy.findings}
