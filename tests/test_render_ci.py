"""CI output formats: JUnit parses, GitHub commands are well formed, Markdown and text are inert."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import run_cli as rlscope
from rich.console import Console

from rlscope.catalog import default_catalog
from rlscope.config import Config
from rlscope.gates import CheckResult, GateSpec, check, evaluate_gates, load_gates
from rlscope.render.ci import FORMATS, github_property, markdown_text, render, render_text
from rlscope.report import MetricResult, Report, RunInfo, Skipped
from rlscope.spec import Finding

RULES = default_catalog().rules

ROOT = Path(__file__).resolve().parent.parent
HEALTHY = ROOT / "sample_logs" / "healthy"
COLLAPSE = ROOT / "sample_logs" / "entropy-collapse"
HOSTILE = (
    "p\x1b]0;pwned\x07 <script>alert(1)</script> | `code` %0A 100% a:b,c\r\n"
    "::error::forged\n]]> & \u202e \ufffe"
)
GITHUB_LINE = re.compile(r"^::(error|warning|notice)( [a-z]+=[^:]*)?::")


def hostile_result(fail_on: str = "warn") -> CheckResult:
    metric = MetricResult(
        "signal.reward", "L3", "Mean reward", 0.2, (0, 1, 2), (0.1, 0.2, 0.3), source="x"
    )
    report = Report(
        run=RunInfo(HOSTILE, HOSTILE, HOSTILE, 3, 0, 2, 24, 6, 0, ("rollouts",)),
        metrics={"signal.reward": metric},
        findings=(
            Finding("grad-spike", "critical", "L1", f"spike at prompt {HOSTILE}", {"steps": [1]}),
            Finding("truncation", "info", "L2", f"info {HOSTILE}", {"steps": [2]}),
        ),
        skipped=(Skipped("overthinking", f"needs {HOSTILE}"),),
    )
    spec = GateSpec(
        gates=load_gates_text('[gates."signal.reward"]\nmin = 0.5\nmax = 1\n').gates,
        source=HOSTILE,
    )
    gates = evaluate_gates(spec, report, None, fail_on)
    return CheckResult(report, None, gates, fail_on, spec.source, Config())


def load_gates_text(text: str) -> GateSpec:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "gates.toml"
        path.write_text(text)
        return load_gates(path)


def assert_no_raw_controls(text: str) -> None:
    bad = [ch for ch in text if (ord(ch) < 0x20 and ch not in "\n\t") or 0x7F <= ord(ch) < 0xA0]
    assert not bad, f"raw controls in output: {bad!r}"
    assert "\u202e" not in text


def test_junit_parses_with_one_case_per_gate_and_per_finding() -> None:
    result = hostile_result()
    xml = render(result, "junit")
    root = ET.fromstring(xml.encode())
    (suite,) = root.findall("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == len(result.gates) + len(RULES)
    failures = [c for c in cases if c.find("failure") is not None]
    # min 0.5 breached (critical >= warn); grad-spike critical; truncation info is below warn.
    names = sorted(c.get("name") for c in failures)
    assert names == ["grad-spike (L1)", "signal.reward min 0.5"]
    assert suite.get("failures") == "2" and suite.get("tests") == str(len(cases))
    (skipped,) = [c for c in cases if c.find("skipped") is not None]
    assert skipped.get("name") == "overthinking (L2)"
    truncation = next(c for c in cases if c.get("name") == "truncation (L2)")
    assert "below --fail-on" in (truncation.findtext("system-out") or "")
    message = next(c for c in failures if c.get("name") == "grad-spike (L1)").find("failure")
    assert "<script>alert(1)</script>" in message.get("message")  # text, escaped as XML
    assert_no_raw_controls(xml)
    assert "<script>" not in xml


def test_github_lines_are_well_formed_and_escaped() -> None:
    result = hostile_result()
    lines = render(result, "github").splitlines()
    assert lines and all(GITHUB_LINE.match(line) for line in lines), lines
    kinds = [GITHUB_LINE.match(line).group(1) for line in lines]
    # gate min breached: error; grad-spike: error; truncation info below fail_on: notice;
    # then the summary (error: the check failed).
    assert kinds == ["error", "error", "notice", "error"]
    for line in lines:
        properties, message = line[2:].split("::", 1)
        assert "," not in properties.split("title=", 1)[1]
        assert ":" not in properties.split("title=", 1)[1]
        assert "\r" not in message
        assert re.search(r"%(?!25|0A|0D|3A|2C)", message) is None  # every % escaped
    joined = "\n".join(lines)
    assert "%0A%3A%3A" not in joined  # messages keep `:`; newlines become %0A
    assert "100%25" in joined and "%0A::error::forged" in joined
    assert_no_raw_controls(joined)
    assert github_property("a:b,c%\n") == "a%3Ab%2Cc%25%0A"


def test_markdown_is_inert_and_keeps_the_table_shape() -> None:
    result = hostile_result()
    markdown = render(result, "markdown")
    assert "<script>" not in markdown and "&lt;script&gt;" in markdown
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    for row in rows:
        cells = re.split(r"(?<!\\)\|", row)
        assert len(cells) in (8, 6), row  # gates: 6 columns, findings: 4 (+ the outer two)
    assert "`" not in markdown.replace("\\`", "")
    assert_no_raw_controls(markdown)
    assert markdown_text("a|b`c") == "a\\|b\\`c"


def test_text_and_json_are_safe() -> None:
    result = hostile_result()
    console = Console(record=True, width=200, force_terminal=False)
    render_text(result, console)
    assert_no_raw_controls(console.export_text())
    document = json.loads(render(result, "json"))
    assert document["passed"] is False and document["fail_on"] == "warn"
    gate = document["gates"][0]
    assert gate["rule"] == "min" and gate["status"] == "below min"
    assert gate["within_limit"] is False and gate["fails_check"] is True
    assert document["run"]["run_id"] == HOSTILE  # raw in JSON, ASCII-escaped on the wire
    assert render(result, "json").isascii()


def test_a_passing_check_has_no_failures() -> None:
    result = check(HEALTHY, gates=GateSpec())
    root = ET.fromstring(render(result, "junit").encode())
    assert root.get("failures") == "0"
    assert render(result, "github").splitlines()[-1].startswith("::notice title=rlscope::")
    assert "✅" in render(result, "markdown")


@pytest.mark.parametrize("format", FORMATS)
def test_cli_gates_fail_the_sick_run_and_pass_the_healthy_one(tmp_path: Path, format: str) -> None:
    gates = tmp_path / "gates.toml"
    gates.write_text('fail_on = "critical"\n[gates."behavior.entropy"]\nmin = 0.2\n')
    sick = rlscope("check", str(COLLAPSE), "--gates", str(gates), "--format", format)
    healthy = rlscope("check", str(HEALTHY), "--gates", str(gates), "--format", format)
    assert (sick.returncode, healthy.returncode) == (1, 0), sick.stderr + healthy.stderr
    for done, failed in ((sick, True), (healthy, False)):
        out = done.stdout
        if format == "json":
            assert json.loads(out)["passed"] is not failed
        elif format == "junit":
            assert (ET.fromstring(out.encode()).get("failures") != "0") is failed
        elif format == "github":
            assert all(GITHUB_LINE.match(line) for line in out.splitlines())
            assert ("::error" in out) is failed
        elif format == "markdown":
            assert ("❌" in out) is failed
        else:
            assert ("FAILED" in out) is failed
