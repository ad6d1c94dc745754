"""A CheckResult for CI: text, JSON, JUnit XML, GitHub workflow commands, Markdown summary.

Every string from the data (run ids, paths, finding messages quoting prompt ids) is untrusted:
controls are made visible with `safe_text`, then escaped for the target format (XML by
ElementTree, GitHub's `%`/CR/LF (and `:`/`,` in properties), Markdown's table and code syntax).
"""

from __future__ import annotations

import html
import json
import re
import xml.etree.ElementTree as ET

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from rlscope.gates import CheckResult, GateResult
from rlscope.render.sanitize import safe_text
from rlscope.render.terminal import SEVERITY_STYLE, config_line, format_value
from rlscope.spec import Finding, severity_rank

FORMATS = ("text", "json", "junit", "github", "markdown")
# Characters XML 1.0 cannot hold at all (after safe_text only U+FFFE/U+FFFF can remain).
_XML_INVALID = re.compile("[\ufffe\uffff]")


def _finding_breach(result: CheckResult, finding: Finding) -> bool:
    return result.fail_on != "never" and severity_rank(finding.severity) >= severity_rank(
        result.fail_on
    )


def _headline(result: CheckResult) -> str:
    run = result.report.run
    state = "FAILED" if result.failed else "passed"
    gates, findings = len(result.breached_gates), len(result.breached_findings)
    return (
        f"rlscope check {state}: {run.run_id} (last step seen {run.last_step}); "
        f"{gates} gate(s) and {findings} finding(s) breached at --fail-on {result.fail_on}"
    )


# -- text -----------------------------------------------------------------------------------


def render_text(result: CheckResult, console: Console) -> None:
    parts: list = [
        Text(safe_text(_headline(result)), style="bold red" if result.failed else "bold green")
    ]
    if result.baseline is not None:
        base = result.baseline.run
        parts.append(Text(safe_text(f"baseline: {base.run_id} ({base.path})"), style="dim"))
    if result.report.config:
        parts.append(Text(safe_text(f"config: {config_line(result.report.config)}"), style="dim"))
    if result.gates:
        table = Table(box=None, pad_edge=False, padding=(0, 2), title="Gates", title_justify="left")
        for column in ("", "metric", "rule", "value", "limit", "severity"):
            table.add_column(column, no_wrap=True)
        for gate in result.gates:
            mark = Text(
                gate.status + ("" if gate.passed or gate.breach else " (below --fail-on)"),
                style="green" if gate.passed else "red" if gate.breach else "yellow",
            )
            table.add_row(
                mark,
                Text(safe_text(gate.metric)),
                Text(f"{gate.rule} {gate.setting:g}"),
                Text(format_value(gate.value)),
                Text(format_value(gate.limit)),
                Text(gate.severity),
            )
        parts.append(table)
    else:
        parts.append(Text(safe_text(f"no gates (source: {result.source or 'none'})"), style="dim"))
    if result.report.findings:
        table = Table(
            box=None, pad_edge=False, padding=(0, 2), title="Findings", title_justify="left"
        )
        for column in ("", "severity", "finding", "message"):
            table.add_column(column, no_wrap=column != "message")
        for finding in result.report.findings:
            breach = _finding_breach(result, finding)
            table.add_row(
                Text("FAIL", style="red") if breach else Text(""),
                Text(finding.severity.upper(), style=SEVERITY_STYLE.get(finding.severity, "")),
                Text(safe_text(finding.id)),
                Text(safe_text(finding.message)),
            )
        parts.append(table)
    else:
        parts.append(Text("no findings", style="green"))
    console.print(Group(*parts))


def render_json(result: CheckResult) -> str:
    return json.dumps(result.to_dict(), indent=2, ensure_ascii=True, allow_nan=False)


# -- JUnit ----------------------------------------------------------------------------------


def _xml_text(value: object) -> str:
    return _XML_INVALID.sub("\ufffd", safe_text(value, multiline=True))


def render_junit(result: CheckResult) -> str:
    """One <testcase> per gate bound and per registered finding: a breach is a <failure>; a
    breached gate or fired finding below --fail-on passes with the message in <system-out>; a
    finding that could not run (inputs missing, disabled) is <skipped>, one whose rule failed
    (rlscope's bug) an <error>."""
    run = result.report.run
    suites = ET.Element("testsuites", name="rlscope")
    cases: list[ET.Element] = []
    failures = skipped = errors = 0
    failed = {s.metric for s in result.report.skipped if s.failed}
    for gate in result.gates:
        case = ET.Element(
            "testcase",
            classname=_xml_text(f"rlscope.gates.{run.run_id}"),
            name=_xml_text(f"{gate.metric} {gate.rule} {gate.setting:g}"),
        )
        if gate.breach:
            failures += 1
            failure = ET.SubElement(
                case, "failure", message=_xml_text(gate.message), type=gate.severity
            )
            failure.text = _xml_text(gate.message)
        elif not gate.passed:
            ET.SubElement(case, "system-out").text = _xml_text(
                f"{gate.severity} (below --fail-on {result.fail_on}): {gate.message}"
            )
        cases.append(case)
    for rule_id, layer, finding, reason in result.finding_cases():
        case = ET.Element(
            "testcase",
            classname=_xml_text(f"rlscope.findings.{run.run_id}"),
            name=f"{rule_id} ({layer})",
        )
        if finding is not None and _finding_breach(result, finding):
            failures += 1
            failure = ET.SubElement(
                case, "failure", message=_xml_text(finding.message), type=finding.severity
            )
            failure.text = _xml_text(f"{finding.severity}: {finding.message}")
        elif finding is not None:
            ET.SubElement(case, "system-out").text = _xml_text(
                f"{finding.severity} (below --fail-on {result.fail_on}): {finding.message}"
            )
        elif rule_id in failed:
            errors += 1
            ET.SubElement(case, "error", message=_xml_text(reason or ""), type="rlscope")
        elif reason is not None:
            skipped += 1
            ET.SubElement(case, "skipped", message=_xml_text(reason))
        cases.append(case)
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=_xml_text(f"rlscope check {run.run_id}"),
        tests=str(len(cases)),
        failures=str(failures),
        errors=str(errors),
        skipped=str(skipped),
    )
    properties = ET.SubElement(suite, "properties")
    for name, value in (
        ("path", run.path),
        ("last_step", run.last_step),
        ("fail_on", result.fail_on),
        ("gates_source", result.source or ""),
    ):
        ET.SubElement(properties, "property", name=name, value=_xml_text(value))
    suite.extend(cases)
    suites.set("tests", str(len(cases)))
    suites.set("failures", str(failures))
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode")


# -- GitHub Actions -------------------------------------------------------------------------


def github_data(text: object) -> str:
    """A workflow command's message: controls made visible, then GitHub's escapes."""
    value = safe_text(text, multiline=True)
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def github_property(text: object) -> str:
    """A workflow command's property value (also `:` and `,` escaped)."""
    return github_data(text).replace(":", "%3A").replace(",", "%2C")


def _command(kind: str, title: str, message: str) -> str:
    return f"::{kind} title={github_property(title)}::{github_data(message)}"


def _level(severity: str, breach: bool) -> str:
    if breach:
        return "error"
    return "warning" if severity_rank(severity) >= severity_rank("warn") else "notice"


def render_github(result: CheckResult) -> str:
    """One workflow command per breached gate and per finding, then a summary notice."""
    lines = []
    for gate in result.gates:
        if not gate.passed:
            lines.append(
                _command(
                    _level(gate.severity, gate.breach),
                    f"rlscope gate {gate.metric} {gate.rule}",
                    gate.message,
                )
            )
    for finding in result.report.findings:
        breach = _finding_breach(result, finding)
        lines.append(
            _command(
                _level(finding.severity, breach),
                f"rlscope {finding.severity} {finding.id}",
                finding.message,
            )
        )
    lines.append(_command("error" if result.failed else "notice", "rlscope", _headline(result)))
    return "\n".join(lines)


# -- Markdown -------------------------------------------------------------------------------

_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def markdown_text(text: object) -> str:
    """Data as inert Markdown inside a table cell: one line, HTML escaped, syntax backslashed."""
    value = safe_text(text)  # one line: no raw newline can end the table row
    value = _MD_SPECIAL.sub(r"\\\1", html.escape(value, quote=False))
    return value


def render_markdown(result: CheckResult) -> str:
    """A summary for $GITHUB_STEP_SUMMARY: verdict, gates table, findings table."""
    run = result.report.run
    icon = "❌" if result.failed else "✅"
    lines = [
        f"## {icon} rlscope check: {markdown_text(run.run_id)}",
        "",
        markdown_text(_headline(result)),
        "",
    ]
    if result.baseline is not None:
        lines += [f"Baseline: {markdown_text(result.baseline.run.run_id)}", ""]
    if result.gates:
        lines += [
            "| | metric | rule | value | limit | severity |",
            "|---|---|---|---:|---:|---|",
        ]
        for gate in result.gates:
            lines.append(
                f"| {_gate_icon(gate)} | {markdown_text(gate.metric)} | "
                f"{markdown_text(f'{gate.rule} {gate.setting:g}')} | "
                f"{markdown_text(format_value(gate.value))} | "
                f"{markdown_text(format_value(gate.limit))} | {gate.severity} |"
            )
        lines.append("")
    else:
        lines += ["No gates configured.", ""]
    if result.report.findings:
        lines += ["| | severity | finding | message |", "|---|---|---|---|"]
        for finding in result.report.findings:
            mark = "❌" if _finding_breach(result, finding) else "⚠️"
            lines.append(
                f"| {mark} | {finding.severity} | {markdown_text(finding.id)} | "
                f"{markdown_text(finding.message)} |"
            )
    else:
        lines.append("No findings.")
    return "\n".join(lines) + "\n"


def _gate_icon(gate: GateResult) -> str:
    return "✅" if gate.passed else "❌" if gate.breach else "⚠️"


def render(result: CheckResult, format: str) -> str:
    """Any non-terminal format as one string."""
    renderers = {
        "json": render_json,
        "junit": render_junit,
        "github": render_github,
        "markdown": render_markdown,
    }
    return renderers[format](result)
