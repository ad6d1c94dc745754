"""Text from the data cannot send terminal escapes or Rich markup through the report or the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_cli as rlscope
from rich.console import Console

from rlscope.render.sanitize import safe_text
from rlscope.render.terminal import render_terminal
from rlscope.synth import generate

RUN_ID = "\x1b]0;pwned\x07evil\x1b[31m"
ALGORITHM = "[bold red]x[/]\u202eGRPO"
PROMPT_PREFIX = "\x1b[2J"
EXTRA_COLUMN = "\x1b[5mcol"
LINK_NAME = "\x1b[1mlink.parquet"
BIDI = re.compile("[\u202a-\u202e\u2066-\u2069]")
SGR = re.compile(r"\x1b\[[0-9;]*m")
# What Rich's own live display (the progress bar on a forced terminal) writes besides SGR.
RICH_CONTROL = re.compile(r"\x1b\[\?25[lh]|\x1b\[2K|\x1b\[\d*[ABCDG]|\r")
RICH_OUTPUT = re.compile(f"{SGR.pattern}|{RICH_CONTROL.pattern}")


def assert_clean(text: str, *, allowed: re.Pattern[str] | None = None) -> None:
    """No ESC, BEL, other C0 (but \\n, \\t) or bidi override, once `allowed` sequences are cut."""
    rest = allowed.sub("", text) if allowed else text
    bad = [ch for ch in rest if (ord(ch) < 0x20 and ch not in "\n\t") or 0x7F <= ord(ch) < 0xA0]
    assert not bad, f"raw controls reached the terminal: {bad!r}"
    assert not BIDI.search(rest), "a bidi override reached the terminal"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("untrusted")
    run = generate(root / "run\u202egnp", "grad-spike", steps=30, prompts_per_step=8, tokens=False)
    meta = json.loads((run / "run.json").read_text())
    meta.update(run_id=RUN_ID, algorithm=ALGORITHM)
    (run / "run.json").write_text(json.dumps(meta))
    (path,) = (run / "rollouts").glob("*.parquet")
    table = pq.read_table(path)
    prompt = pa.array([PROMPT_PREFIX + p for p in table["prompt_id"].to_pylist()])
    table = table.set_column(table.schema.get_field_index("prompt_id"), "prompt_id", prompt)
    table = table.append_column(EXTRA_COLUMN, pa.array([f"v\x1b[7m{i}" for i in range(len(table))]))
    pq.write_table(table, path)
    outside = root / "outside.parquet"
    pq.write_table(table, outside)
    (run / "rollouts" / LINK_NAME).symlink_to(outside)
    return run


def test_safe_text_escapes_controls_visibly() -> None:
    assert safe_text(RUN_ID) == "\\x1b]0;pwned\\x07evil\\x1b[31m"
    assert safe_text("a\u202eb\u2066c\u2069\u200f") == "a\\u202eb\\u2066c\\u2069\\u200f"
    assert safe_text("\x00\x7f\x80\x9b\r") == "\\x00\\x7f\\x80\\x9b\\x0d"
    assert safe_text("one\ntwo\tthree\u2028") == "one\\x0atwo\\x09three\\u2028"
    assert safe_text("one\ntwo\tthree\r", multiline=True) == "one\ntwo\tthree\\x0d"
    assert safe_text("bad\udcff byte") == "bad\\udcff byte"
    plain = "rollouts/step=1/part-0.parquet: ünïcode ✓ [bold]x[/] C:\\runs"
    assert safe_text(plain) == plain
    assert safe_text(42) == "42"


def test_report_shows_data_as_escaped_plain_text(hostile: Path) -> None:
    import rlscope

    report = rlscope.analyze(hostile)
    assert report.run.run_id == RUN_ID  # the library keeps raw data; escaping is the renderer's
    console = Console(record=True, width=200, force_terminal=True, color_system="truecolor")
    render_terminal(report, console)
    out = console.export_text(styles=True, clear=False)
    assert_clean(out, allowed=SGR)
    plain = console.export_text()
    assert "\\x1b]0;pwned\\x07evil\\x1b[31m" in plain
    assert "[bold red]x[/]\\u202eGRPO" in plain  # markup in data is shown, not applied
    assert "\\x1b[1mlink.parquet" in plain


@pytest.mark.parametrize("force_color", [False, True])
def test_analyze_cli_output_is_clean(hostile: Path, force_color: bool) -> None:
    env = {"FORCE_COLOR": "1"} if force_color else {"NO_COLOR": "1"}
    result = rlscope("analyze", str(hostile), "--fail-on", "never", env=env)
    assert result.returncode == 0, result.stderr
    if force_color:
        assert SGR.search(result.stdout), "FORCE_COLOR=1 should colour the report"
        assert_clean(result.stdout, allowed=SGR)
        assert_clean(result.stderr, allowed=RICH_OUTPUT)
    else:
        assert_clean(result.stdout)
        assert_clean(result.stderr)
    plain = SGR.sub("", result.stdout)
    assert "\\x1b]0;pwned\\x07evil\\x1b[31m" in plain
    assert "[bold red]x[/]\\u202eGRPO" in plain
    assert "run\\u202egnp" in plain
    assert "\\x1b[1mlink.parquet: symlink" in plain


def test_json_output_keeps_raw_strings_escaped_by_json(hostile: Path) -> None:
    result = rlscope("analyze", str(hostile), "--format", "json", "--fail-on", "never")
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    document = json.loads(result.stdout)
    assert document["run"]["run_id"] == RUN_ID
    assert document["run"]["algorithm"] == ALGORITHM
    (finding,) = [f for f in document["findings"] if f["id"] == "grad-spike"]
    prompts = [r["prompt_id"] for rows in finding["evidence"]["rollouts"].values() for r in rows]
    assert prompts and all(p.startswith(PROMPT_PREFIX) for p in prompts)
    assert any(LINK_NAME in w for w in document["warnings"])


@pytest.mark.parametrize("force_color", [False, True])
def test_validate_output_is_clean(hostile: Path, force_color: bool) -> None:
    env = {"FORCE_COLOR": "1"} if force_color else {}
    result = rlscope("validate", str(hostile), env=env)
    assert result.returncode == 0, result.stderr
    allowed = SGR if force_color else None
    assert_clean(result.stdout, allowed=allowed)
    assert_clean(result.stderr, allowed=allowed)
    assert "valid format-v1 run `\\x1b]0;pwned\\x07evil\\x1b[31m`" in result.stdout
    assert "\\x1b[5mcol" in result.stdout
    assert "\\x1b[1mlink.parquet: symlink pointing outside" in result.stderr


def _copy_run(hostile: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(hostile, dest, symlinks=True)
    return dest


@pytest.mark.parametrize("force_color", [False, True])
def test_error_messages_are_clean(hostile: Path, tmp_path: Path, force_color: bool) -> None:
    env = {"FORCE_COLOR": "1"} if force_color else {}
    allowed = SGR if force_color else None
    allowed_err = RICH_OUTPUT if force_color else None  # the progress bar on a forced terminal
    bad_value = _copy_run(hostile, tmp_path / "bad-value")
    meta = json.loads((bad_value / "run.json").read_text())
    meta["group_size"] = "\x1b[31m8\u202e"
    (bad_value / "run.json").write_text(json.dumps(meta))
    bad_version = _copy_run(hostile, tmp_path / "bad-version")
    (bad_version / "run.json").write_text(json.dumps({**meta, "schema_version": "\x1b]0;x\x07"}))
    bad_file = _copy_run(hostile, tmp_path / "bad-file\x1b[8m")
    (bad_file / "rollouts" / "\x1b[1mtorn.parquet").write_bytes(b"PAR1 not parquet")
    missing = tmp_path / "missing\x1b]0;pwned\x07\u202e"
    cases = [
        (bad_value, "group_size"),
        (bad_version, "schema_version"),
        (bad_file, "\\x1b[1mtorn.parquet"),
        (missing, "missing\\x1b]0;pwned\\x07\\u202e"),
    ]
    for run, expected in cases:
        for command in ("analyze", "validate"):
            result = rlscope(command, str(run), env=env)
            assert result.returncode == 2, (command, run, result.stdout, result.stderr)
            errors = [line for line in RICH_OUTPUT.sub("", result.stderr).splitlines() if line]
            (error,) = [line for line in errors if line.startswith("error: ")]
            assert expected in error, result.stderr
            assert "Traceback" not in result.stderr
            assert_clean(result.stdout, allowed=allowed)
            assert_clean(result.stderr, allowed=allowed_err)


def test_fail_keeps_the_hint_on_its_own_line(tmp_path: Path) -> None:
    result = rlscope("analyze", str(tmp_path / "nope\n\x1b[2J"), "--steps", "5:1\x1b[2J")
    assert result.returncode == 2
    assert_clean(result.stderr)
    assert "\\x1b[2J" in result.stderr
    result = rlscope("synth", str(tmp_path / "s"), "--scenario", "\x1b[31mnope")
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: unknown scenario") and lines[1].startswith("  hint: ")
    assert_clean(result.stderr)
