"""Gates: parsing (files, errors), absolute and relative bounds, severities, watch, the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import run_cli as rlscope

from rlscope.analysis import analyze
from rlscope.errors import RlscopeError
from rlscope.gates import GateSpec, check, evaluate_gates, load_gates, snapshot_key, watch
from rlscope.synth import generate
from rlscope.writer import RunWriter

ROOT = Path(__file__).resolve().parent.parent
HEALTHY = ROOT / "sample_logs" / "healthy"
COLLAPSE = ROOT / "sample_logs" / "entropy-collapse"
GATES = """
fail_on = "critical"
[gates."behavior.entropy"]
min = 0.2
[gates."signal.pass_at_1"]
min = 0.3
severity = "critical"
"""


def gates_file(tmp_path: Path, text: str, name: str = "gates.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def reports() -> tuple:
    return analyze(HEALTHY), analyze(COLLAPSE)


def test_gates_are_read_from_a_file_rlscope_toml_or_pyproject(tmp_path: Path) -> None:
    spec = load_gates(gates_file(tmp_path, GATES))
    assert [g.metric for g in spec.gates] == ["behavior.entropy", "signal.pass_at_1"]
    assert spec.fail_on == "critical" and spec.gates[0].severity == "critical"
    here = tmp_path / "project"
    here.mkdir()
    gates_file(here, '[gates."signal.reward"]\nmax = 2\n', "rlscope.toml")
    assert load_gates(search_from=here).gates[0].bounds == {"max": 2.0}
    (here / "rlscope.toml").unlink()
    gates_file(here, '[tool.rlscope]\nfail_on = "warn"\n[tool.rlscope.gates."signal.reward"]\n'
               "min = 0.1\nseverity = \"warn\"\n", "pyproject.toml")  # fmt: skip
    spec = load_gates(search_from=here)
    assert spec.fail_on == "warn" and spec.gates[0].severity == "warn"
    assert spec.source is not None and spec.source.endswith("pyproject.toml")
    (here / "pyproject.toml").unlink()
    assert load_gates(search_from=here) == GateSpec()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[gates."signal.nope"]\nmin = 1\n', 'gates."signal.nope"]: unknown metric id'),
        ('[gates."signal.reward"]\nminimum = 1\n', "unknown key `minimum`"),
        ('[gates."signal.reward"]\nmin = "high"\n', "min must be a number"),
        ('[gates."signal.reward"]\nmin = 1\nseverity = "fatal"\n', "severity must be one of"),
        ('[gates."signal.reward"]\nseverity = "warn"\n', "no bound set"),
        ('[gates."signal.reward"]\nmin = 2\nmax = 1\n', "min is above max"),
        ('[gates."signal.reward"]\nmax_drop = -0.1\n', "max_drop must be >= 0"),
        ('fail_on = "sometimes"\n', "fail_on = 'sometimes'"),
        ("gates = 3\n", "[gates] must be a table"),
        ("[findings.nope]\nenabled = false\n", "unknown finding id"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_config_errors_name_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = gates_file(tmp_path, text)
    with pytest.raises(RlscopeError) as error:
        load_gates(path)
    assert message in str(error.value) and str(path) in str(error.value)


def test_missing_gates_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RlscopeError, match="gates file not found"):
        load_gates(tmp_path / "absent.toml")


def test_absolute_bounds(tmp_path: Path, reports: tuple) -> None:
    healthy, collapse = reports
    entropy = healthy.metrics["behavior.entropy"].value
    spec = load_gates(
        gates_file(
            tmp_path,
            f'[gates."behavior.entropy"]\nmin = {entropy - 0.01}\nmax = {entropy + 0.01}\n',
        )
    )
    results = evaluate_gates(spec, healthy, None, "critical")
    assert [(r.rule, r.passed) for r in results] == [("min", True), ("max", True)]
    results = evaluate_gates(spec, collapse, None, "critical")
    assert [(r.rule, r.passed, r.breach) for r in results] == [
        ("min", False, True),
        ("max", True, False),
    ]
    assert results[0].limit == pytest.approx(entropy - 0.01)
    assert "breached: behavior.entropy" in results[0].message


def test_relative_bounds_against_the_baseline(tmp_path: Path, reports: tuple) -> None:
    healthy, collapse = reports
    base = healthy.metrics["behavior.entropy"].value
    value = collapse.metrics["behavior.entropy"].value
    lost = (base - value) / base  # about 0.92 of the baseline's entropy
    text = (
        f'[gates."behavior.entropy"]\nmax_drop = {lost + 0.01}\n'
        f'[gates."signal.pass_at_1"]\nmax_drop = {lost - 0.5}\n'
        f'[gates."stability.kl"]\nmax_rise_abs = 0.0\nmax_drop_abs = 1.0\n'
    )
    spec = load_gates(gates_file(tmp_path, text))
    results = {(r.metric, r.rule): r for r in evaluate_gates(spec, collapse, healthy, "critical")}
    entropy = results["behavior.entropy", "max_drop"]
    assert entropy.passed and entropy.limit == pytest.approx(base * (1 - lost - 0.01))
    assert entropy.baseline == base
    pass_at_1 = results["signal.pass_at_1", "max_drop"]
    drop = (
        1 - collapse.metrics["signal.pass_at_1"].value / healthy.metrics["signal.pass_at_1"].value
    )
    assert pass_at_1.passed == (drop <= lost - 0.5)
    kl_base = healthy.metrics["stability.kl"].value
    kl = collapse.metrics["stability.kl"].value
    assert results["stability.kl", "max_rise_abs"].passed == (kl <= kl_base)
    assert results["stability.kl", "max_rise_abs"].limit == kl_base
    assert results["stability.kl", "max_drop_abs"].passed
    # Compared with itself, nothing dropped or rose.
    assert all(r.passed for r in evaluate_gates(spec, healthy, healthy, "critical"))


def test_relative_gate_without_baseline_is_a_config_error(tmp_path: Path, reports: tuple) -> None:
    spec = load_gates(gates_file(tmp_path, '[gates."stability.kl"]\nmax_rise = 0.5\n'))
    with pytest.raises(RlscopeError, match="relative to a baseline") as error:
        evaluate_gates(spec, reports[0], None, "critical")
    assert "--baseline" in str(error.value)


def test_gate_on_a_metric_without_inputs_is_a_config_error(tmp_path: Path, reports: tuple) -> None:
    spec = load_gates(gates_file(tmp_path, '[gates."behavior.entropy_p80"]\nmin = 0.1\n'))
    evaluate_gates(spec, reports[0], None, "critical")  # the healthy sample has tokens
    with pytest.raises(RlscopeError, match=r"cannot compute behavior\.entropy_p80") as error:
        evaluate_gates(spec, reports[1], None, "critical")  # no tokens table
    assert "tokens" in str(error.value)
    # ...and as the baseline of a relative gate.
    spec = load_gates(gates_file(tmp_path, '[gates."behavior.entropy_p80"]\nmax_drop = 0.1\n'))
    with pytest.raises(RlscopeError, match="baseline run"):
        evaluate_gates(spec, reports[0], reports[1], "critical")


def test_severity_below_fail_on_is_reported_not_failed(tmp_path: Path, reports: tuple) -> None:
    text = '[gates."behavior.entropy"]\nmin = 0.2\nseverity = "warn"\n'
    spec = load_gates(gates_file(tmp_path, text))
    (result,) = evaluate_gates(spec, reports[1], None, "critical")
    assert not result.passed and not result.breach and result.status == "below min"
    (result,) = evaluate_gates(spec, reports[1], None, "warn")
    assert result.breach
    (result,) = evaluate_gates(spec, reports[1], None, "never")
    assert not result.breach


def test_check_applies_fail_on_and_finding_overrides_from_the_gates_file(tmp_path: Path) -> None:
    result = check(COLLAPSE, gates=load_gates(gates_file(tmp_path, GATES)))
    assert result.failed and result.last_step == 99
    assert [f.id for f in result.breached_findings] == ["entropy-collapse"]
    assert [g.metric for g in result.breached_gates] == ["behavior.entropy"]
    quiet = GATES + "[findings.entropy-collapse]\nenabled = false\n"
    result = check(COLLAPSE, gates=load_gates(gates_file(tmp_path, quiet)))
    assert not result.breached_findings and result.breached_gates
    cases = {rule_id: reason for rule_id, _, _, reason in result.finding_cases()}
    assert "disabled" in (cases["entropy-collapse"] or "")
    assert not check(HEALTHY, gates=load_gates(gates_file(tmp_path, GATES))).failed
    assert not check(COLLAPSE, gates=GateSpec(), fail_on="never").failed
    with pytest.raises(RlscopeError, match="--fail-on"):
        check(HEALTHY, gates=GateSpec(), fail_on="sometimes")


def _write_steps(writer: RunWriter, steps: range, reward: float) -> None:
    for step in steps:
        ids = [step * 8 + i for i in range(8)]
        writer.log_rollouts(
            {
                "rollout_id": ids,
                "step": [step] * 8,
                "prompt_id": [f"p{i % 2}" for i in range(8)],
                "reward": [reward if i % 4 else 1.0 - reward for i in range(8)],
                "response_len": [10 + i for i in range(8)],
            }
        )
    writer.flush()


def test_watch_rechecks_as_files_arrive_and_stops_at_the_first_breach(tmp_path: Path) -> None:
    run = tmp_path / "live"
    spec = load_gates(gates_file(tmp_path, '[gates."signal.reward"]\nmax = 0.5\n'))
    writer = RunWriter(run, run_id="live", algorithm="GRPO", group_size=4)
    _write_steps(writer, range(0, 10), 0.0)  # mean reward 0.25
    results = []
    polls = []

    def sleep(seconds: float) -> None:
        polls.append(seconds)
        if len(polls) == 2:  # the run grows, with a partial file under a hidden name
            (run / "rollouts" / ".tmp-partial.parquet").write_bytes(b"PAR1 not done")
            _write_steps(writer, range(10, 20), 1.0)  # mean reward 0.75: breach

    before = snapshot_key(run)
    final = watch(
        lambda: check(run, gates=spec), run, interval=7, on_result=results.append, sleep=sleep
    )
    writer.close()
    assert polls == [7, 7] and len(results) == 2
    assert not results[0].failed and results[0].last_step == 9
    assert final.failed and final.last_step == 19 and final is results[-1]
    assert snapshot_key(run) != before


def test_watch_stops_after_max_polls_without_new_files(tmp_path: Path) -> None:
    run = generate(tmp_path / "r", "healthy", steps=12, prompts_per_step=4, tokens=False)
    results = []
    final = watch(
        lambda: check(run, gates=GateSpec()),
        run,
        interval=1,
        on_result=results.append,
        sleep=lambda s: None,
        max_polls=3,
    )
    assert not final.failed and len(results) == 1


def test_cli_watch_says_what_each_check_read_and_took(tmp_path: Path) -> None:
    """`check --watch` on a run that breaches at once: one progress line on stderr with the
    seconds and the files read per table (all of them, the cache being empty), exit 1."""
    gates = gates_file(tmp_path, GATES)
    watched = rlscope(
        "check",
        str(COLLAPSE),
        "--gates",
        str(gates),
        "--watch",
        "0.1",
        env={"RLSCOPE_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert watched.returncode == 1
    line = next(x for x in watched.stderr.splitlines() if x.startswith("checked "))
    rollouts = len(list((COLLAPSE / "rollouts").glob("*.parquet")))
    assert re.search(r" in \d+\.\d s \(files read: .*rollouts " + f"{rollouts} of {rollouts}", line)
    assert line.endswith(": breach")


# -- CLI exit codes ---------------------------------------------------------------------------


def test_cli_check_exit_codes(tmp_path: Path) -> None:
    gates = gates_file(tmp_path, GATES)
    ok = rlscope("check", str(HEALTHY), "--gates", str(gates))
    assert ok.returncode == 0, ok.stderr
    assert "passed" in ok.stdout and "last step seen 59" in ok.stdout
    sick = rlscope("check", str(COLLAPSE), "--gates", str(gates))
    assert sick.returncode == 1 and "FAILED" in sick.stdout
    assert rlscope("check", str(COLLAPSE), "--gates", str(gates), "--exit-zero").returncode == 0
    never = rlscope("check", str(COLLAPSE), "--gates", str(gates), "--fail-on", "never")
    assert never.returncode == 0


@pytest.mark.parametrize(
    ("text", "args", "message"),
    [
        ('[gates."signal.nope"]\nmin = 1\n', [], "unknown metric id"),
        ('[gates."behavior.entropy_p80"]\nmin = 0.1\n', [], "cannot compute"),
        ('[gates."stability.kl"]\nmax_rise = 0.1\n', [], "--baseline"),
        (GATES, ["--fail-on", "sometimes"], "--fail-on"),
        (GATES, ["--format", "xml"], "--format"),
        (GATES, ["--watch", "0"], "--watch"),
    ],
)
def test_cli_check_config_errors_exit_2(
    tmp_path: Path, text: str, args: list[str], message: str
) -> None:
    gates = gates_file(tmp_path, text)
    done = rlscope("check", str(COLLAPSE), "--gates", str(gates), *args)
    assert done.returncode == 2, done.stdout
    assert message in done.stderr and "Traceback" not in done.stderr


def test_cli_check_reads_rlscope_toml_from_the_working_directory(tmp_path: Path) -> None:
    gates_file(tmp_path, GATES, "rlscope.toml")
    assert rlscope("check", str(COLLAPSE), cwd=tmp_path).returncode == 1
    done = rlscope("check", str(COLLAPSE), "--baseline", str(HEALTHY), cwd=tmp_path)
    assert done.returncode == 1 and "baseline: synth-healthy" in done.stdout


def test_gate_status_words_say_what_happened(tmp_path: Path, reports: tuple) -> None:
    from rlscope.gates import GateResult

    def gate(rule: str, passed: bool) -> GateResult:
        return GateResult("m", rule, 0.1, 0.1, 0.0, None, "critical", passed, not passed, "")

    words = {r: gate(r, False).status for r in ("min", "max", "max_drop", "max_rise_abs")}
    assert words == {
        "min": "below min",
        "max": "above max",
        "max_drop": "dropped too far",
        "max_rise_abs": "rose too far",
    }
    assert gate("min", True).status == "ok"
    text = '[gates."behavior.entropy"]\nmin = 0.2\nseverity = "warn"\n'
    file = gates_file(tmp_path, text)
    done = rlscope("check", str(COLLAPSE), "--gates", str(file), "--fail-on", "never")
    assert "below min (below --fail-on)" in done.stdout and done.returncode == 0
    as_json = ("check", str(COLLAPSE), "--gates", str(file), "--fail-on", "never", "-f", "json")
    document = json.loads(rlscope(*as_json).stdout)
    (entry,) = document["gates"]
    assert entry["status"] == "below min" and entry["within_limit"] is False
    assert entry["fails_check"] is False and document["passed"] is True
