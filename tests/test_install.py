"""A plain `pip install .` (no extras, not editable) into a fresh venv runs every command a new
user tries first: the wheel carries what they read (reference.json), and `report` needs no
extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_plain_install_runs_the_demo_explain_formats_and_report(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    done = subprocess.run(
        [*pip, "--disable-pip-version-check", str(ROOT)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rlscope = str(venv / "bin" / "rlscope")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [rlscope, *args], capture_output=True, text=True, cwd=tmp_path, timeout=300
        )

    demo = run("analyze", str(ROOT / "sample_logs" / "entropy-collapse"), "-q")
    assert demo.returncode == 1 and demo.stdout.startswith("verdict: 1 critical"), demo.stderr
    assert run("explain", "kl-runaway").stdout.startswith("kl-runaway")
    assert "verl" in run("formats").stdout
    # The report's charts need no plotting library: the core install writes it.
    report = run("report", str(ROOT / "sample_logs" / "healthy"), "-o", str(tmp_path / "r.html"))
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "r.html").read_text().count("<svg") >= 20
