"""The registry is complete: every metric and finding is documented, explained and in the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlscope.catalog import default_catalog
from rlscope.spec import LAYERS, SEVERITIES

METRICS = default_catalog().metrics
RULES = default_catalog().rules

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
METRICS_PAGE = (DOCS / "reference" / "metrics" / "index.md").read_text()
FINDINGS_PAGE = (DOCS / "reference" / "findings" / "index.md").read_text()
ID_PATTERN = re.compile(r"^[a-z]+\.[a-z0-9_]+(\.[a-z0-9_]+|\.\*)?$")
NAMESPACES = {
    "stability": "L1",
    "behavior": "L2",
    "signal": "L3",
    "exploration": "L4",
    "generalization": "L5",
    "reasoning": "L6",
}


@pytest.mark.parametrize("metric_id", sorted(METRICS))
def test_metric_is_documented(metric_id: str) -> None:
    metric = METRICS[metric_id]
    assert ID_PATTERN.match(metric.id)
    assert metric.layer in LAYERS
    assert NAMESPACES[metric.id.split(".")[0]] == metric.layer, "the namespace names the layer"
    assert len(metric.doc) >= 80, "the doc says what it measures and why"
    assert metric.healthy, "the doc gives a healthy range"
    template = metric.is_template  # a family (`signal.reward.*`): its members have variants
    assert metric.title and (metric.variants or template)
    assert metric.brief and "\n" not in metric.brief, "a one-line brief for the metrics table"
    for variant in metric.variants:
        assert variant.table in ("steps", "rollouts", "tokens", "probes") and variant.requires
    text = metric.explain()
    assert metric.id in text and "Healthy:" in text
    listed = f"`{metric.id[:-1]}<name>`" if template else f"`{metric.id}`"
    assert listed in METRICS_PAGE, "the metrics page's table lists every id"
    layer_page = (DOCS / "reference" / "metrics" / f"{metric.layer.lower()}.md").read_text()
    assert f"{{#{metric.id.replace('*', 'name')}}}" in layer_page, "a section of its own"


@pytest.mark.parametrize("rule_id", sorted(RULES))
def test_finding_is_documented(rule_id: str) -> None:
    rule = RULES[rule_id]
    assert re.match(r"^[a-z]+(-[a-z]+)*$", rule.id)
    assert rule.layer in LAYERS and rule.severity in SEVERITIES
    assert len(rule.doc) >= 80 and rule.remedy and rule.title
    assert rule.brief and "\n" not in rule.brief, "a one-line brief for the findings table"
    assert all(m in METRICS for m in rule.metrics), "a rule reads registered metrics"
    for name, param in rule.params.items():
        assert param.doc, f"threshold {name} is documented"
        assert f"`{name}`" in rule.doc or name == "min_steps", f"the doc explains {name}"
    text = rule.explain()
    assert "What to try:" in text and rule.id in text
    assert f"`{rule.id}`" in FINDINGS_PAGE, "the findings page's table lists every id"
    layer_page = (DOCS / "reference" / "findings" / f"{rule.layer.lower()}.md").read_text()
    assert f"{{#{rule.id}}}" in layer_page and rule.explain() in layer_page, "`explain`, anchored"


def test_rates_are_declared_shares() -> None:
    """The property tests check every share metric stays in [0, 1]; the rates must be among them."""
    from rlscope.catalog import default_catalog

    rates = {
        "signal.zero_std_frac",
        "signal.pass_at_1",
        "signal.pass_at_k",
        "stability.clip_frac",
        "behavior.truncation_rate",
        "behavior.tool_cap_frac",
        "signal.medium_adv_share",
        "behavior.format_ok",
        "behavior.repetition",
        "behavior.redundant_tool_calls",
        "exploration.unique_frac",
        "exploration.pairwise_diversity",
        "generalization.eval_id",
        "generalization.eval_ood",
        "reasoning.answer_unchanged.truncate",
        "reasoning.early_answer_aoc",
        "reasoning.bias_following",
        "reasoning.step_accuracy",
    }
    assert rates <= set(default_catalog().share_metrics())


def test_the_generated_docs_are_current() -> None:
    """The site's reference pages (metrics, findings, formats, commands, run format, Python API,
    benchmark tables) and the layers tables of the README and the layers page say what the
    source says: no mkdocs needed, `make docs` regenerates them."""
    from rlscope.docs import MARKED, stale_pages, update_readme

    for path, base in MARKED.items():
        text = path.read_text(encoding="utf-8")
        assert update_readme(text, base) == text, f"{path.name}: run `make docs`"
    assert stale_pages() == [], "run `make docs`"


def test_every_command_format_and_option_has_a_page() -> None:
    from typer.main import get_command

    from rlscope.cli import app
    from rlscope.importers import IMPORTERS

    cli = (DOCS / "reference" / "cli.md").read_text()
    for name, command in get_command(app).commands.items():  # type: ignore[attr-defined]
        assert f"## `rlscope {name}` {{#{name}}}" in cli
        for param in command.params:
            if not param.hidden and param.param_type_name == "option":
                assert f"`{param.opts[0]}" in cli, (name, param.opts)
    for name in IMPORTERS:
        assert (DOCS / "reference" / "formats" / f"{name}.md").is_file()
    assert len(README.splitlines()) <= 250, "the README sells and starts; the rest is in docs/"


def test_the_shipped_reference_is_generated_from_the_catalog() -> None:
    """`explain` and `metrics` read rlscope/reference.json (no Polars import): it must say what
    the catalog says."""
    from rlscope import reference
    from rlscope.docs import reference_text

    assert reference.PATH.read_text(encoding="utf-8") == reference_text(), "run `make docs`"
    ref = reference.load()
    for metric in METRICS.values():
        entry = ref.lookup(metric.id)
        assert entry is not None and entry["text"] == metric.explain()
        assert reference.as_json(entry) == metric.to_dict()
    assert ref.lookup("signal.reward.accuracy_reward") == ref.lookup("signal.reward.*")
    assert ref.lookup("signal.reward.") is None and ref.lookup("nope") is None
    from rlscope.importers import IMPORTERS

    assert [f["name"] for f in ref.formats] == list(IMPORTERS)


TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("metric_id", sorted(METRICS))
def test_every_metric_has_a_value_test(metric_id: str) -> None:
    """Named in a test, literally or by the f-string of a loop over its family
    (`f"behavior.segment_len.{segment}"`): a new metric without a test fails here."""
    texts = "\n".join(p.read_text() for p in TESTS.glob("test_*.py"))
    prefix = metric_id.rpartition(".")[0]
    assert (
        f'"{metric_id}"' in texts
        or ("." in prefix and f'f"{prefix}.{{' in texts)
        or (metric_id.endswith(".*") and f'"{prefix}.' in texts)
    )


def test_no_two_metrics_compute_the_same_series(tmp_path: Path) -> None:
    """A metric that duplicates another's formula shows up as an identical series on a run where
    they should differ (continuous rewards, so reward is not pass@1)."""
    import itertools

    import numpy as np

    from rlscope.analysis import analyze
    from rlscope.config import Config
    from rlscope.synth import generate

    run = generate(
        tmp_path / "run", "reward-concentration", steps=12, prompts_per_step=8, group_size=4
    )
    report = analyze(run, config=Config(), use_cache=False)
    series = {m: dict(zip(r.steps, r.values, strict=True)) for m, r in report.metrics.items()}
    assert len(series) > 40
    same = []
    for a, b in itertools.combinations(sorted(series), 2):
        steps = sorted(set(series[a]) & set(series[b]))
        x = np.array([series[a][s] for s in steps], dtype=float)
        y = np.array([series[b][s] for s in steps], dtype=float)
        ok = np.isfinite(x) & np.isfinite(y)
        if ok.sum() >= 3 and np.ptp(x[ok]) > 0 and np.allclose(x[ok], y[ok], rtol=1e-9):
            same.append((a, b))
    assert same == []
