"""The vocabulary and the catalog: typed evidence, declarations, a catalog built from them."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest
from conftest import WriteRun

from rlscope.analysis import analyze
from rlscope.catalog import Catalog, default_catalog
from rlscope.errors import RlscopeError
from rlscope.spec import Declarations, Finding, Metric, Param, Variant


def _finding(**evidence: Any) -> Finding:
    return Finding("grad-spike", "warn", "L1", "m", evidence)


def test_evidence_of_the_grad_spike_shape_names_every_rollout() -> None:
    finding = _finding(
        steps=[3, 9],
        rollouts={
            3: [{"rollout_id": 30, "reward": 1.0}, {"rollout_id": 31}],
            9: [{"rollout_id": 90}],
        },
        rollout_ids=[5, 30],
        metrics=["stability.grad_norm"],
        z=4.2,
    )
    assert finding.rollout_ids == (5, 30, 31, 90)
    assert finding.steps == (3, 9)
    assert finding.names("stability.grad_norm") and not finding.names("stability.kl")
    assert _finding(steps=[1]).rollout_ids == ()
    # The JSON form keeps the rule's order and its own numbers.
    assert list(finding.evidence) == ["steps", "rollouts", "rollout_ids", "metrics", "z"]


@pytest.mark.parametrize(
    "evidence",
    [
        {"steps": [1.5]},
        {"steps": 3},
        {"rollout_ids": ["a"]},
        {"rollout_ids": [True]},
        {"metrics": [1]},
        {"rollouts": {3: [{"reward": 1.0}]}},
        {"rollouts": [1, 2]},
    ],
)
def test_shared_evidence_keys_have_one_shape(evidence: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match="grad-spike: evidence"):
        _finding(**evidence)


def _declared(metric_id: str = "demo.mean_reward", rule_id: str = "demo-low") -> Declarations:
    declared = Declarations()
    declared.metric(
        Metric(
            id=metric_id,
            layer="L3",
            title="Mean reward",
            doc="The mean reward of a step's rollouts.",
            healthy="up",
            variants=(
                Variant(
                    "rollouts",
                    ("reward",),
                    lambda lf, ctx: lf.group_by("step").agg(
                        (pl.col("demo_sum").sum() / pl.col("demo_n").sum()).alias("value")
                    ),
                    {"demo_sum": pl.col("reward").sum(), "demo_n": pl.len()},
                ),
            ),
            better="up",
        )
    )

    @declared.rule(
        rule_id,
        layer="L3",
        title="Reward low",
        doc="The final reward is low.",
        remedy="Look.",
        metrics=(metric_id,),
        params={"below": Param(0.5, "fires below this")},
    )
    def low(ctx: Any) -> Any:
        series = ctx.series(metric_id)
        if series is not None and series.values[-1] < ctx.params["below"]:
            yield ctx.finding("reward is low", steps=[int(series.steps[-1])])

    return declared


#: Four steps of two prompt groups of two, for the demo catalog.
DEMO_ROWS = {
    "step": [s for s in range(4) for _ in range(4)],
    "prompt_id": ["p", "p", "q", "q"] * 4,
    "rollout_id": list(range(16)),
    "response_len": [10] * 16,
    "reward": [0.0, 0.2, 0.1, 0.3] * 4,
}


def test_a_catalog_of_ones_own_declarations_is_computed_and_judged(write_run: WriteRun) -> None:
    """Everything takes its catalog: a user's own metric and rule, nothing of rlscope's."""
    rows = {**DEMO_ROWS, "correct": [False, False, False, True] * 4}
    run = write_run({"rollouts": rows})
    catalog = Catalog.of([_declared()])
    report = analyze(run, catalog=catalog, use_cache=False)
    assert list(report.metrics) == ["demo.mean_reward"]
    assert report.metrics["demo.mean_reward"].value == pytest.approx(0.15)
    assert [f.id for f in report.findings] == ["demo-low"]
    assert report.findings[0].steps == (3,)
    both = default_catalog().extended(_declared())
    assert list(both.metrics)[-1] == "demo.mean_reward" and "demo-low" in both.rules
    assert len(both.metrics) == len(default_catalog().metrics) + 1


def test_a_catalog_refuses_duplicate_ids() -> None:
    with pytest.raises(ValueError, match=r"duplicate metric id demo\.mean_reward"):
        Catalog.of([_declared(rule_id="a"), _declared(rule_id="b")])
    with pytest.raises(ValueError, match="duplicate rule id demo-low"):
        Catalog.of([_declared(), _declared("demo.other")])


def test_lookup_select_and_one_hint() -> None:
    catalog = default_catalog()
    assert catalog.lookup("signal.reward.accuracy_reward") is catalog.metrics["signal.reward.*"]
    assert catalog.lookup("entropy-collapse") is catalog.rules["entropy-collapse"]
    assert catalog.lookup("nothing") is None
    assert "behavior.entropy" in catalog.hint("behavior.entrpy")
    assert "entropy-collapse" in catalog.hint("entropy-colapse", metrics=False)
    available = dict(catalog.metrics)
    assert {m.layer for m in catalog.select(["L3"], available)} == {"L3"}
    assert all(m.id.startswith("signal.") for m in catalog.select(["signal.*"], available))
    with pytest.raises(RlscopeError, match="unknown metric id"):
        catalog.select(["signal.pass_at_kk"], available)
    with pytest.raises(RlscopeError, match="matches no metric"):
        catalog.select(["nope.*"], available)


def test_a_rule_that_raises_is_a_failed_skip_and_a_warning_never_the_end(
    write_run: WriteRun,
) -> None:
    """One rule's bug: that rule is skipped (`failed`, with the error) and a warning asks for a
    report; every other rule still judges; the terminal does not list it as inputs missing;
    JUnit counts it as an error."""
    from rich.console import Console

    from rlscope.gates import check
    from rlscope.render.ci import render_junit
    from rlscope.render.terminal import render_terminal

    declared = _declared()

    @declared.rule(
        "demo-broken",
        layer="L3",
        title="Broken",
        doc="Raises.",
        remedy="Report it.",
        metrics=("demo.mean_reward",),
    )
    def broken(ctx: Any) -> Any:
        yield ctx.finding("never")
        raise KeyError("sxx")

    run = write_run({"rollouts": DEMO_ROWS})
    catalog = Catalog.of([declared])
    report = analyze(run, catalog=catalog, use_cache=False)
    assert [f.id for f in report.findings] == ["demo-low"]  # the half-made finding is dropped
    (skip,) = [s for s in report.skipped if s.metric == "demo-broken"]
    assert skip.failed and skip.kind == "finding" and "KeyError" in skip.reason
    assert any(w.startswith("demo-broken: rlscope failed") for w in report.warnings)
    console = Console(record=True, width=100, color_system=None)
    render_terminal(report, console)
    assert "inputs missing" not in console.export_text()  # demo-broken lacks no input
    assert report.inputs_missing == ()
    junit = render_junit(check(run, catalog=catalog))
    assert 'errors="1"' in junit and '<error message="rlscope failed (KeyError' in junit
