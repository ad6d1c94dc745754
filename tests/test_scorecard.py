"""`make scorecard` in small: the scorecard end to end on genuine runs kept in the repository
(no trainer is run): a fault run named with its delay, a healthy one judged at every prefix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCORE = ROOT / "benchmarks" / "scorecard" / "score.py"


def test_the_scorecard_measures_genuine_runs(tmp_path: Path) -> None:
    out = tmp_path / "SCORECARD.md"
    done = subprocess.run(
        [
            sys.executable,
            str(SCORE),
            "--only",
            "genuine ppo-critic/healthy,genuine ppo-critic/frozen",
            "--corpus",
            str(tmp_path / "corpus"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    assert summary["fault_pairs"] == 1 and summary["named_pairs"] == 1
    assert summary["healthy_pairs"] == 1 and summary["healthy_with_alarm"] == 0
    table = out.read_text()
    assert table.startswith("# Scorecard") and "**Recall** 1/1" in table
    # the frozen critic is judged from 20 steps: named at step 20, 19 steps after its start,
    # where stop_on="critical" stops the run; no accuracy log, so no half-way step
    assert (
        "| genuine ppo-critic/frozen | critic frozen (1) | verl file logger | "
        "critic-not-learning:critical | 20 (`critic-not-learning`) | 20 | 19 / 19 | "
        "20 (`critic-not-learning`) | — |"
    ) in table
    assert "| genuine ppo-critic/healthy | verl file logger | 95 | 0 | none |" in table
    assert not (tmp_path / "corpus").exists() or not any((tmp_path / "corpus").iterdir())
