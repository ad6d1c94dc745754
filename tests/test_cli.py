"""The real `rlscope` command: output, exit codes, bad-input messages, read-only analysis."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import GENUINE
from conftest import run_cli as rlscope

from rlscope.synth import generate

ISSUE_METRICS = [
    "stability.loss",
    "stability.grad_norm",
    "stability.clip_frac",
    "stability.kl",
    "stability.ppo_kl",
    "behavior.entropy",
    "behavior.entropy_p80",
    "behavior.entropy_adv_cov",
    "behavior.response_len",
    "behavior.response_len_correct",
    "behavior.response_len_incorrect",
    "behavior.truncation_rate",
    "behavior.len_correct_corr",
    "behavior.tool_calls",
    "behavior.tool_cap_frac",
    "signal.reward",
    "signal.group_std",
    "signal.zero_std_frac",
    "signal.all_correct_frac",
    "signal.all_wrong_frac",
    "signal.pass_at_1",
    "signal.pass_at_k",
    "signal.pass_gap",
    "signal.effective_prompt_frac",
    "signal.medium_adv_share",
]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(
        tmp_path_factory.mktemp("cli") / "healthy",
        "healthy",
        steps=30,
        prompts_per_step=8,
        group_size=8,
        seed=0,
    )


@pytest.fixture(scope="module")
def truncating(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(
        tmp_path_factory.mktemp("cli") / "trunc",
        "truncation",
        steps=30,
        prompts_per_step=8,
        tokens=False,
    )


def _fingerprint(root: Path) -> dict[str, tuple[int, str]]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_analyze_text_report(healthy: Path) -> None:
    before = _fingerprint(healthy)
    result = rlscope("analyze", str(healthy))
    assert result.returncode == 0, result.stderr
    for title in ("L1 Training stability", "L2 Policy behaviour", "L3 Learning signal", "Findings"):
        assert title in result.stdout
    assert "signal.pass_at_k" in result.stdout and "Traceback" not in result.stderr
    assert _fingerprint(healthy) == before, "analyze must not touch the run directory"


def test_analyze_json_is_strict_and_complete(healthy: Path) -> None:
    result = rlscope("analyze", str(healthy), "--format", "json")
    assert result.returncode == 0, result.stderr

    def reject(constant: str) -> None:
        raise AssertionError(f"non-strict JSON constant {constant}")

    doc = json.loads(result.stdout, parse_constant=reject)
    assert set(doc) >= {
        "rlscope_version",
        "schema_version",
        "run",
        "metrics",
        "findings",
        "skipped",
    }
    assert set(ISSUE_METRICS) <= set(doc["metrics"])
    for metric_id, metric in doc["metrics"].items():
        series = metric["series"]
        assert len(series["step"]) == len(series["value"]) > 0, metric_id
        assert series["step"] == sorted(series["step"])
    assert doc["run"]["rollouts"] - doc["run"]["eval_rollouts"] == 30 * 8 * 8
    assert doc["metrics"]["signal.pass_at_k"]["k"] == 8
    assert set(doc["metrics"]["signal.pass_at_k"]["components"]) == {
        "pass@1",
        "pass@2",
        "pass@4",
        "pass@8",
    }


def test_steps_range(healthy: Path) -> None:
    result = rlscope("analyze", str(healthy), "--format", "json", "--steps", "5:9")
    doc = json.loads(result.stdout)
    assert doc["metrics"]["signal.reward"]["series"]["step"] == [5, 6, 7, 8, 9]
    assert doc["run"]["rollouts"] - doc["run"]["eval_rollouts"] == 5 * 8 * 8


def test_fail_on_levels(truncating: Path) -> None:
    default = rlscope("analyze", str(truncating), "--format", "json")
    findings = {f["id"]: f["severity"] for f in json.loads(default.stdout)["findings"]}
    assert "truncation" in findings
    expected_default = 1 if "critical" in findings.values() else 0
    assert default.returncode == expected_default
    assert rlscope("analyze", str(truncating), "--fail-on", "warn").returncode == 1
    assert rlscope("analyze", str(truncating), "--fail-on", "never").returncode == 0


def test_healthy_passes_even_at_fail_on_warn(healthy: Path) -> None:
    assert rlscope("analyze", str(healthy), "--fail-on", "warn").returncode == 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("analyze", "/nonexistent/run"), "no such run directory"),
        (("analyze", "{run}", "--steps", "9:1"), "start is after the end"),
        (("analyze", "{run}", "--steps", "abc"), "expected A:B"),
        (("analyze", "{run}", "--format", "xml"), "choose text or json"),
        (("analyze", "{run}", "--fail-on", "bad"), "--fail-on"),
        (("analyze", "{run}", "--metrics", "nope.metric"), "unknown metric id"),
        (("explain", "no-such-thing"), "unknown id"),
        (("validate", "/nonexistent/run"), "no such run directory"),
    ],
)
def test_bad_input_exits_2_without_traceback(
    healthy: Path, args: tuple[str, ...], needle: str
) -> None:
    result = rlscope(*(a.format(run=healthy) for a in args))
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_the_installed_command_in_a_real_process(healthy: Path) -> None:
    """The other tests run the app in process; this one runs the console script itself."""
    ok = rlscope("analyze", str(healthy), "--format", "json", process=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["findings"] == []
    bad = rlscope("analyze", str(healthy), "--steps", "9:1", process=True)
    assert bad.returncode == 2 and "start is after the end" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_bad_run_json_names_the_file(tmp_path: Path, healthy: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "run.json").write_text("{not json")
    result = rlscope("analyze", str(broken))
    assert (
        result.returncode == 2 and "run.json" in result.stderr and "not valid JSON" in result.stderr
    )


def test_bad_config_is_an_error(tmp_path: Path, healthy: Path) -> None:
    config = tmp_path / "rlscope.toml"
    config.write_text("[findings.no-such-finding]\nwarn_at = 1\n")
    result = rlscope("analyze", str(healthy), "--config", str(config))
    assert result.returncode == 2 and "unknown finding id" in result.stderr
    config.write_text("[findings.truncation]\nwarn_at = 'high'\n")
    result = rlscope("analyze", str(healthy), "--config", str(config))
    assert result.returncode == 2 and "must be a number" in result.stderr


def test_validate_lists_tables(healthy: Path) -> None:
    result = rlscope("validate", str(healthy))
    assert result.returncode == 0
    assert "rollouts:" in result.stdout and "tokens:" in result.stdout


def test_metrics_and_explain() -> None:
    listing = rlscope("metrics")
    assert listing.returncode == 0
    assert all(m in listing.stdout for m in ISSUE_METRICS)
    explained = rlscope("explain", "signal.pass_at_k")
    assert explained.returncode == 0 and "Healthy:" in explained.stdout
    finding = rlscope("explain", "entropy-collapse")
    assert finding.returncode == 0 and "What to try:" in finding.stdout
    assert "cliff_share" in finding.stdout


def test_no_color_is_respected(healthy: Path) -> None:
    colored = rlscope("analyze", str(healthy), env={"FORCE_COLOR": "1", "TERM": "xterm"})
    plain = rlscope("analyze", str(healthy), env={"FORCE_COLOR": "1", "NO_COLOR": "1"})
    assert "\x1b[3" in colored.stdout, "sanity: forced colour emits colour codes"
    assert "\x1b[3" not in plain.stdout


def test_help_has_examples() -> None:
    for command in ("analyze", "validate", "metrics", "explain", "synth", "import", "formats"):
        result = rlscope(command, "--help")
        assert result.returncode == 0 and "Examples" in result.stdout, command


def test_synth_refuses_non_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    result = rlscope("synth", str(tmp_path), "--steps", "10")
    assert result.returncode == 2 and "not empty" in result.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine"
    result = rlscope("synth", str(tmp_path / "new"), "--scenario", "nope")
    assert result.returncode == 2 and "unknown scenario" in result.stderr


def test_synth_then_analyze(tmp_path: Path) -> None:
    out = tmp_path / "run"
    made = rlscope(
        "synth",
        str(out),
        "--scenario",
        "dead-prompts",
        "--steps",
        "20",
        "--prompts",
        "8",
        "--no-tokens",
    )
    assert made.returncode == 0, made.stderr
    result = rlscope("analyze", str(out), "--format", "json", "--fail-on", "never")
    assert "dead-prompts" in {f["id"] for f in json.loads(result.stdout)["findings"]}


def _verl_dump(root: Path, steps: range) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for step in steps:
        lines = []
        for p in range(3):
            for k in range(4):
                right = (k + p + step) % 3 == 0
                lines.append(
                    json.dumps(
                        {
                            "input": f"question {p}",
                            "output": f"<think>step {k}</think><answer>{int(right)}</answer>",
                            "score": 1.0 if right else 0.0,
                            "step": step,
                        }
                    )
                )
        (root / f"{step}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_import_is_incremental_and_leaves_the_source_alone(tmp_path: Path) -> None:
    source = _verl_dump(tmp_path / "dumps", range(1, 4))
    before = _fingerprint(source)
    out = tmp_path / "run"
    first = rlscope("import", "verl", str(source), str(out))
    assert first.returncode == 0, first.stderr
    assert "36 rollouts" in first.stdout
    _verl_dump(source, range(4, 6))
    second = rlscope("import", "verl", str(source), str(out))
    assert second.returncode == 0 and "24 rollouts" in second.stdout
    assert "3 step(s) already imported" in second.stdout
    doc = json.loads(rlscope("analyze", str(out), "--format", "json").stdout)
    assert doc["run"]["rollouts"] == 60 and doc["run"]["groups"] == 15
    assert doc["metrics"]["signal.pass_at_k"]["k"] == 4
    for path, stamp in before.items():
        assert _fingerprint(source)[path] == stamp, "the source is never written"


def test_analyze_from_imports_into_the_cache(tmp_path: Path) -> None:
    source = _verl_dump(tmp_path / "dumps", range(1, 3))
    cache = tmp_path / "cache"
    result = rlscope(
        "analyze", str(source), "--from", "verl", "--cache-dir", str(cache), "--format", "json"
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["run"]["rollouts"] == 24
    assert any("imported from verl" in note for note in doc["notes"])
    assert list((cache / "imports").iterdir()), "the import lives in the cache dir"
    assert sorted(p.name for p in source.iterdir()) == ["1.jsonl", "2.jsonl"]


def test_import_errors_exit_2(tmp_path: Path) -> None:
    source = _verl_dump(tmp_path / "dumps", range(1, 2))
    bad = rlscope("import", "nope", str(source), str(tmp_path / "o"))
    assert bad.returncode == 2 and "unknown import format" in bad.stderr
    bad = rlscope("import", "verl", str(source), str(tmp_path / "o"), "-X", "bogus=1")
    assert bad.returncode == 2 and "unknown option" in bad.stderr
    bad = rlscope("analyze", str(source), "-X", "split=eval_id")
    assert bad.returncode == 2 and "--from" in bad.stderr
    # The old spelling of --option, -o, is still read for one release, with a warning.
    old = rlscope("import", "verl", str(source), str(tmp_path / "o"), "-o", "bogus=1")
    assert old.returncode == 2 and "unknown option" in old.stderr
    assert "-o KEY=VALUE is deprecated" in old.stderr and "-X KEY=VALUE" in old.stderr
    (source / "1.jsonl").write_text("{not json\n")
    strict = rlscope("import", "verl", str(source), str(tmp_path / "s"), "--strict")
    assert strict.returncode == 2 and "1.jsonl:1" in strict.stderr
    assert "Traceback" not in strict.stderr


def test_formats_lists_importers() -> None:
    listing = rlscope("formats")
    assert listing.returncode == 0
    assert all(name in listing.stdout for name in ("verl", "verl-metrics", "trl", "jsonl"))
    detail = rlscope("formats", "trl")
    assert detail.returncode == 0 and "Options:" in detail.stdout


UPPER_METRICS = [
    "behavior.format_ok",
    "behavior.repetition",
    "behavior.redundant_tool_calls",
    "behavior.segment_len.think",
    "behavior.entropy.think",
    "exploration.unique_frac",
    "exploration.pairwise_diversity",
    "exploration.cluster_sizes",
    "generalization.eval_id",
    "generalization.eval_ood",
    "generalization.ood_gap",
    "reasoning.self_consistency_gap",
    "reasoning.maj_at_n_first",
    "reasoning.answer_unchanged.truncate",
    "reasoning.early_answer_aoc",
    "reasoning.bias_following",
    "reasoning.step_accuracy",
]
SAMPLE = Path(__file__).resolve().parent.parent / "sample_logs" / "healthy"


def test_sample_has_every_layer() -> None:
    """The shipped healthy sample carries text, eval splits and probes: L1-L6 all computed."""
    doc = json.loads(rlscope("analyze", str(SAMPLE), "--format", "json").stdout)
    assert set(UPPER_METRICS) <= set(doc["metrics"])
    assert {m["layer"] for m in doc["metrics"].values()} == {"L1", "L2", "L3", "L4", "L5", "L6"}
    assert doc["findings"] == []
    curve = doc["metrics"]["reasoning.early_answer_aoc"]["curve"]
    assert curve["fraction"] == sorted(curve["fraction"]) and curve["unchanged"][-1] == 1.0


def test_show_and_rollouts_on_the_sample() -> None:
    listed = rlscope("rollouts", str(SAMPLE), "--filter", "correct == true", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    first = json.loads(listed.stdout)["rollouts"][0]["rollout_id"]
    shown = rlscope("show", str(SAMPLE), str(first), env={"NO_COLOR": "1"})
    assert shown.returncode == 0, shown.stderr
    assert "think" in shown.stdout and "answer" in shown.stdout
    as_json = json.loads(rlscope("show", str(SAMPLE), str(first), "--format", "json").stdout)
    assert as_json["probes"] and as_json["segments"]


def test_version_and_short_help() -> None:
    from rlscope import __version__

    version = rlscope("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"rlscope {__version__}"
    assert rlscope("-V").stdout == version.stdout
    assert rlscope("-h").returncode == 0 and "Commands" in rlscope("-h").stdout
    assert "--metrics" in rlscope("analyze", "-h").stdout
    assert "--install-completion" in rlscope("--help").stdout  # shell completion


def test_metrics_by_layer_and_glob(healthy: Path) -> None:
    def chosen(selection: str) -> list[str]:
        done = rlscope("analyze", str(healthy), "--metrics", selection, "-f", "json")
        assert done.returncode == 0, done.stderr
        return list(json.loads(done.stdout)["metrics"])

    layer = chosen("L1")
    assert layer and all(m.startswith("stability.") for m in layer)
    assert chosen("signal.pass*") == ["signal.pass_at_1", "signal.pass_at_k", "signal.pass_gap"]
    assert chosen("signal.pass_gap,L1")[0] == "signal.pass_gap"  # in the order named
    bad = rlscope("analyze", str(healthy), "--metrics", "sgnal.*")
    assert bad.returncode == 2 and "matches no metric" in bad.stderr
    typo = rlscope("analyze", str(healthy), "--metrics", "signal.pass_at_l")
    assert (
        typo.returncode == 2 and "did you mean" in typo.stderr and "signal.pass_at_1" in typo.stderr
    )


def test_the_config_file_in_use_is_shown(tmp_path: Path, healthy: Path) -> None:
    (tmp_path / "rlscope.toml").write_text("[findings.truncation]\nwarn_at = 0.9\n")
    text = rlscope("analyze", str(healthy), cwd=tmp_path)
    assert "config" in text.stdout and "truncation.warn_at=0.9" in text.stdout
    doc = json.loads(rlscope("analyze", str(healthy), "-f", "json", cwd=tmp_path).stdout)
    assert doc["config"]["overrides"] == ["truncation.warn_at=0.9"]
    assert doc["config"]["source"].endswith("rlscope.toml")
    check = rlscope("check", str(healthy), cwd=tmp_path)
    assert "config: " in check.stdout and "truncation.warn_at=0.9" in check.stdout
    plain = json.loads(rlscope("analyze", str(healthy), "-f", "json", cwd=healthy.parent).stdout)
    assert plain["config"] is None


def test_metrics_and_explain_as_json() -> None:
    from rlscope.catalog import default_catalog

    METRICS = default_catalog().metrics
    RULES = default_catalog().rules

    listing = rlscope("metrics", "--format", "json")
    assert listing.returncode == 0, listing.stderr
    doc = json.loads(listing.stdout)
    assert [m["id"] for m in doc["metrics"]] == list(METRICS)
    assert [f["id"] for f in doc["findings"]] == list(RULES)
    kl = json.loads(rlscope("explain", "stability.kl", "-f", "json").stdout)
    assert kl["kind"] == "metric" and kl["layer"] == "L1" and kl["computed_from"]
    assert kl["brief"] and kl["doc"] == METRICS["stability.kl"].doc
    finding = json.loads(rlscope("explain", "kl-high", "-f", "json").stdout)
    assert finding["kind"] == "finding" and finding["thresholds"]["warn_at"]["default"] == 0.5
    assert rlscope("explain", "kl-high", "-f", "xml").returncode == 2
    assert rlscope("metrics", "-f", "xml").returncode == 2


TRL_REAL = GENUINE / "trl-real"


def test_from_works_on_compare_check_and_report(tmp_path: Path) -> None:
    """`--from FORMAT --option K=V` imports a trainer's output for every command that reads a
    run, as for analyze (the real TRL fixtures, imported into the isolated cache)."""
    healthy, sick = TRL_REAL / "healthy", TRL_REAL / "lr-too-high"
    source = ("--from", "trl", "--option", "correct_column=accuracy_reward")
    compared = rlscope("compare", str(healthy), str(sick), *source, "-f", "json")
    assert compared.returncode == 0, compared.stderr
    assert len(json.loads(compared.stdout)["runs"]) == 2
    checked = rlscope("check", str(sick), *source, "-f", "json", "--fail-on", "never")
    assert checked.returncode == 0, checked.stderr
    found = {f["id"] for f in json.loads(checked.stdout)["findings"]}
    assert "kl-high" in found
    out = tmp_path / "trl.html"
    reported = rlscope("report", str(sick), "-o", str(out), *source, "--metrics", "L1")
    assert reported.returncode == 0, reported.stderr
    assert "kl-high" in out.read_text()
    alone = rlscope("compare", str(healthy), str(sick), "--option", "a=b")
    assert alone.returncode == 2 and "use it with --from" in alone.stderr


def test_every_option_has_an_upper_case_metavar() -> None:
    """Help names what an option takes (FILE, A:B, KEY=VALUE), never a Python type, and -o
    means --output wherever it exists."""
    import re

    from rlscope.cli import app

    commands = ["analyze", "compare", "check", "report", "import", "synth", "show", "rollouts"]
    commands += ["validate", "explain", "metrics", "formats"]
    for command in commands:
        text = rlscope(command, "--help", env={"COLUMNS": "200"}).stdout
        options = [line for line in text.splitlines() if re.match(r"\s+-", line)]
        assert options, command
        assert not [line for line in options if re.search(r"<[a-z\[\]]+>", line)], command
        for line in options:
            if re.match(r"\s+-o,", line):
                assert "--output" in line, (command, line)
    assert app is not None


COLLAPSE = SAMPLE.parent / "entropy-collapse"


def test_the_verdict_comes_first_and_is_never_cut_at_80_columns() -> None:
    """At 80 columns every metric id and every status label is whole (the sparkline and the
    trainer's logged value give way), and the first line is the verdict."""
    from rlscope.analysis import analyze
    from rlscope.config import Config

    report = analyze(COLLAPSE, config=Config())
    lines = rlscope("analyze", str(COLLAPSE), columns=80).stdout.splitlines()
    assert lines[0] == "verdict: 1 critical: entropy-collapse since step 9"
    assert max(len(line) for line in lines) <= 80
    for metric in report.metrics.values():
        row = next((ln for ln in lines if f"│ {metric.id} " in ln), None)
        assert row is not None, metric.id
        status = report.status(metric)
        if status is not None:
            assert status[0] in row, (metric.id, row)
    healthy = rlscope("analyze", str(SAMPLE), columns=80).stdout.splitlines()
    assert healthy[0].startswith("verdict: no findings")


def test_piped_output_follows_columns() -> None:
    narrow = rlscope("analyze", str(SAMPLE), columns=72).stdout.splitlines()
    assert max(len(line) for line in narrow) <= 72
    wide = rlscope("analyze", str(SAMPLE), env={"COLUMNS": None}).stdout.splitlines()
    assert max(len(line) for line in wide) == 110  # no COLUMNS: wide enough for a metric a line


def test_quiet_prints_the_verdict_and_the_findings_only() -> None:
    quiet = rlscope("analyze", str(COLLAPSE), "-q", columns=80)
    assert quiet.returncode == 1  # the exit code does not depend on how much is printed
    assert quiet.stdout.startswith("verdict: 1 critical: entropy-collapse")
    assert "CRITICAL" in quiet.stdout and "entropy-collapse (L2)" in quiet.stdout
    assert "behavior.response_len" not in quiet.stdout and "rlscope analyze" not in quiet.stdout
    # what did not fire, and why, is the full report's: once, grouped by the missing input
    assert "not checked" not in quiet.stdout and "train-inference-mismatch" not in quiet.stdout
    full = rlscope("analyze", str(COLLAPSE), columns=80).stdout
    assert full.count("not checked, inputs missing:") == 1
    assert "• log a tokens table to judge 3 more findings: train-inference-mismatch," in full


def test_compare_fits_80_columns_and_gates_on_regression(tmp_path: Path) -> None:
    base, new = str(SAMPLE), str(COLLAPSE)
    shown = rlscope("compare", base, new, "--metrics", "L2,L3", columns=80)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert lines[0].startswith("verdict: run 2 (synth-entropy-collapse) vs baseline: ")
    assert lines[0].endswith("task outcome worse (pass@1 ") and "new findings:" in shown.stdout
    assert "0.69 → 0.373, pass@k 0.958 → 0.806, reward 0.69 → 0.373" in lines[1]
    for metric_id in ("behavior.entropy", "signal.pass_at_k", "behavior.response_len_incorrect"):
        assert f"│ {metric_id}  healthier:" in shown.stdout, metric_id
    gate = rlscope("compare", base, new, "--metrics", "L3", "--fail-on-regression")
    assert gate.returncode == 1
    same = rlscope("compare", base, base, "--metrics", "L3", "--fail-on-regression")
    assert same.returncode == 0
    # A lower entropy alone is no regression: entropy is healthy in a band, not a direction.
    entropy = rlscope("compare", base, new, "--metrics", "L2", "--fail-on-regression")
    assert entropy.returncode == 0
    doc = json.loads(rlscope("compare", base, new, "--metrics", "L2,L3", "-f", "json").stdout)
    (verdict,) = doc["verdicts"]
    assert verdict["run"] == 1 and verdict["regressed"] is True
    assert verdict["worse"] == ["signal.pass_at_1", "signal.pass_at_k", "signal.reward"]
    assert "behavior.entropy" in verdict["differs"]
    assert {"id": "entropy-collapse", "severity": "critical"} in verdict["new_findings"]
