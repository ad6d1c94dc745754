"""The scorecard: every finding and reader measured on the genuine corpus, at every prefix.

    python benchmarks/scorecard/score.py [--corpus .scorecard] [--python .venv-trl/bin/python]
        [--only NAME,...] [--out benchmarks/SCORECARD.md]

Makes the corpus (benchmarks/scorecard/corpus.py) where it is missing, then reads every run
through every sink it was written to, judges it at every prefix (`--steps :s`, from what was
computed once: rlscope.evaluation.evaluate_prefix) and prints, as Markdown:
- per fault run and sink: whether a finding that names the fault fired (warn or above) on the
  whole run, and the detection delay, steps from the fault's start to the first prefix where
  one fires at warn and at critical;
- per finding: recall over the (fault run, sink) pairs that expect it, and the median delays;
- per healthy run and sink: the prefixes past the warm-up with a warn or critical finding;
- per multi-sink run: whether every sink gives the same verdict, and how far each sink's
  per-step pass@1 is from the trainer's own log (TRL's rewards/accuracy_reward/mean).
The same tables go to `--out` with the date, the machine and the commit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from corpus import CORPUS, ROOT, Run, Sink, generate

from rlscope.config import Config
from rlscope.engine import Computed, compute
from rlscope.evaluation import evaluate_prefix
from rlscope.importers import import_run
from rlscope.reader import open_run
from rlscope.rules.base import Series, halfway_step

#: Prefixes of at most this many steps are the warm-up: a verdict there is not counted.
WARMUP_STEPS = 5
ALARM = ("warn", "critical")


@dataclass
class Judged:
    """One run read through one sink, judged at every prefix."""

    run: Run
    sink: Sink
    steps: list[int] = field(default_factory=list)
    #: finding id -> (first prefix with it at warn or above, first at critical or None)
    first: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    #: prefixes past the warm-up with a warn or critical finding -> their ids
    alarms: dict[int, list[str]] = field(default_factory=dict)
    verdict: list[str] = field(default_factory=list)  # the whole run's, "id:severity"
    unjudged: set[str] = field(default_factory=set)  # findings whose inputs the sink lacks
    pass_at_1: dict[int, float] = field(default_factory=dict)
    #: the first prefix with a critical finding (where stop_on="critical" judged every step
    #: stops) and that finding
    stop: tuple[int, str] | None = None
    error: str = ""
    seconds: float = 0.0


def judge(run: Run, sink: Sink, scratch: Path) -> Judged:
    judged = Judged(run, sink)
    started = time.perf_counter()
    try:
        path = sink.path
        if sink.format:
            path = scratch / f"{run.name}-{sink.name}".replace(" ", "_").replace("/", "_")
            import_run(sink.format, sink.path, path, **sink.options)
        computed = compute(open_run(path))
    except Exception as exc:  # a reader's failure is a scorecard row, not a crash
        judged.error = f"{type(exc).__name__}: {exc}"[:300]
        return judged
    judged.steps = _steps(computed)
    config = Config()
    for step in judged.steps:
        evaluation = evaluate_prefix(computed, step, config)
        findings = evaluation.findings
        alarms = sorted({f.id for f in findings if f.severity in ALARM})
        if alarms and step > WARMUP_STEPS:
            judged.alarms[step] = alarms
        critical = sorted(f.id for f in findings if f.severity == "critical")
        if critical and judged.stop is None:
            judged.stop = (step, critical[0])
        for f in findings:
            if f.severity not in ALARM:
                continue
            warn, critical = judged.first.get(f.id, (step, None))
            if critical is None and f.severity == "critical":
                critical = step
            judged.first[f.id] = (warn, critical)
        if step == judged.steps[-1]:
            judged.verdict = sorted(f"{f.id}:{f.severity}" for f in findings if f.severity in ALARM)
            judged.unjudged = {
                s.metric for s in evaluation.skipped if s.kind == "finding" and not s.needs_steps
            }
    pass_1 = computed.results.get("signal.pass_at_1")
    if pass_1 is not None:
        judged.pass_at_1 = {
            int(s): float(v)
            for s, v in zip(pass_1.steps, pass_1.values, strict=True)
            if v is not None
        }
    judged.seconds = time.perf_counter() - started
    return judged


def _steps(computed: Computed) -> list[int]:
    return sorted({int(s) for result in computed.results.values() for s in result.steps})


def trainer_pass_at_1(run: Run, corpus: Path) -> dict[int, float]:
    """The TRL trainer's own per-step accuracy (log_history rewards/accuracy_reward/mean, over
    the reward scale): pass@1 as the trainer logged it."""
    out = run.output(corpus)
    states = sorted(out.glob("trainer_state.json")) or sorted(
        out.glob("checkpoint-*/trainer_state.json")
    )
    if run.family not in ("trl", "genuine") or not states or "reward-bug" in run.command:
        return {}  # (a bugged verifier's reward is no accuracy)
    scale = float(run.env.get("TRAINER_REWARD_SCALE", "1"))
    history = json.loads(states[-1].read_text())["log_history"]
    key = "rewards/accuracy_reward/mean"
    return {int(e["step"]): e[key] / scale for e in history if key in e}


#: A fall of the trainer's own accuracy smaller than this is no fall to be half-way through.
MIN_FALL = 0.1


def halfway(run: Run, logged: dict[int, float]) -> int | None:
    """The step where the trainer's own accuracy had fallen half-way from its level before the
    fault (the 10 steps before its start; its first step for a fault from the start) to its
    level over the last tenth of the run (rlscope.rules.base.halfway_step: a median of 3 past
    the middle); None without a log or a fall of MIN_FALL."""
    if run.fault_start is None or not logged:
        return None
    steps = np.array(sorted(logged))
    values = np.array([logged[s] for s in steps])
    before = values[(steps < run.fault_start) & (steps >= run.fault_start - 10)]
    start = float(before.mean()) if len(before) else float(values[0])
    end = float(values[-max(3, len(values) // 10) :].mean())
    if start - end < MIN_FALL:
        return None
    after = steps >= max(run.fault_start, int(steps[0]) + 1)
    return halfway_step(Series(steps[after], values[after]), start, end)


def _delay(first: int | None, start: int | None) -> str:
    return "—" if first is None or start is None else str(first - start)


def _named(judged: Judged) -> list[str]:
    """Expected findings in the whole run's verdict."""
    return [v for v in judged.verdict if v.split(":")[0] in judged.run.expect]


def tables(results: list[Judged], corpus: Path) -> tuple[str, dict[str, float]]:
    lines: list[str] = []
    faults = [j for j in results if not j.run.healthy]
    healthy = [j for j in results if j.run.healthy]

    lines += ["### Faults: named, and how soon", ""]
    lines += [
        "`first warn` is the first prefix where a finding that names the fault fires (which one);"
        ' `stop` the first prefix with any critical finding, where `stop_on="critical"` judging '
        "every step stops the run; `half-way` the step where the trainer's own accuracy had "
        f"fallen half-way to its final level (a fall of at least {MIN_FALL}; — without one).",
        "",
        "| run | fault (from step) | sink | named (whole run) | first warn | first critical | "
        "delay warn / critical | stop | half-way |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for j in faults:
        firsts = sorted((w, i) for i in j.run.expect if i in j.first for w in [j.first[i][0]])
        warn = firsts[0][0] if firsts else None
        critical = min(
            (c for i in j.run.expect if i in j.first and (c := j.first[i][1]) is not None),
            default=None,
        )
        named = ", ".join(_named(j)) or ("**reader failed**: " + j.error if j.error else "**no**")
        stop = f"{j.stop[0]} (`{j.stop[1]}`)" if j.stop else "—"
        half = halfway(j.run, trainer_pass_at_1(j.run, corpus))
        lines.append(
            f"| {j.run.name} | {j.run.fault} ({j.run.fault_start}) | {j.sink.name} | {named} | "
            + (f"{warn} (`{firsts[0][1]}`)" if firsts else "—")
            + f" | {critical or '—'} | {_delay(warn, j.run.fault_start)} / "
            f"{_delay(critical, j.run.fault_start)} | {stop} | {half or '—'} |"
        )

    lines += ["", "### Findings: recall and detection delay", ""]
    lines += [
        "A fault is named when any of its findings fires; a finding's row counts the fault runs "
        "× sinks that list it among theirs, and how often it fired (warn or above, whole run).",
        "",
        "| finding | fault runs × sinks listing it | fired (whole run) | median delay to warn | "
        "to critical |",
    ]
    lines += ["|---|---|---|---|---|"]
    for finding in sorted({i for j in faults for i in j.run.expect}):
        pairs = [j for j in faults if finding in j.run.expect]
        hits = [j for j in pairs if finding in {v.split(":")[0] for v in j.verdict}]
        warns = [
            j.first[finding][0] - (j.run.fault_start or 0) for j in pairs if finding in j.first
        ]
        crits = [
            c - (j.run.fault_start or 0)
            for j in pairs
            if finding in j.first and (c := j.first[finding][1]) is not None
        ]
        lines.append(
            f"| `{finding}` | {len(pairs)} | {len(hits)}/{len(pairs)} | "
            f"{statistics.median(warns) if warns else '—'} | "
            f"{statistics.median(crits) if crits else '—'} |"
        )

    lines += ["", f"### Healthy runs: warn or critical at any prefix past step {WARMUP_STEPS}", ""]
    lines += ["| run | sink | prefixes judged | prefixes with an alarm | findings (first prefix) |"]
    lines += ["|---|---|---|---|---|"]
    for j in healthy:
        if j.error:
            lines.append(f"| {j.run.name} | {j.sink.name} | — | **reader failed** | {j.error} |")
            continue
        judged = len([s for s in j.steps if s > WARMUP_STEPS])
        ids: dict[str, int] = {}
        for step, found in sorted(j.alarms.items()):
            for i in found:
                ids.setdefault(i, step)
        shown = ", ".join(f"`{i}` ({s})" for i, s in ids.items()) or "none"
        lines.append(f"| {j.run.name} | {j.sink.name} | {judged} | {len(j.alarms)} | {shown} |")

    lines += ["", "### Readers: every sink of a run, the same verdict and pass@1", ""]
    lines += [
        "| run | sink | verdict (whole run, warn+) | same as the first sink (findings both "
        "judge) | "
        "pass@1: max abs diff to the trainer's log |"
    ]
    lines += ["|---|---|---|---|---|"]
    by_run: dict[str, list[Judged]] = {}
    for j in results:
        by_run.setdefault(j.run.name, []).append(j)
    agree_runs = multi = 0
    for name, sinks in by_run.items():
        if len(sinks) < 2:
            continue
        multi += 1
        logged = trainer_pass_at_1(sinks[0].run, corpus)
        reference = sinks[0]
        same_all = True
        for j in sinks:
            same = not j.error and _comparable(j, reference) == _comparable(reference, j)
            same_all &= same
            common = sorted(set(logged) & set(j.pass_at_1))
            diff = (
                f"{max(abs(logged[s] - j.pass_at_1[s]) for s in common):.3g} ({len(common)} steps)"
                if common
                else "not computed"
            )
            verdict = ", ".join(j.verdict) or "none"
            lines.append(
                f"| {name} | {j.sink.name} | {('failed: ' + j.error) if j.error else verdict} | "
                f"{'yes' if same else '**no**'} | {diff} |"
            )
        agree_runs += same_all

    fault_pairs = len(faults)
    named_pairs = sum(1 for j in faults if _named(j))
    alarm_pairs = sum(1 for j in healthy if j.alarms or j.error)
    summary = {
        "recall": named_pairs / fault_pairs if fault_pairs else math.nan,
        "fault_pairs": fault_pairs,
        "named_pairs": named_pairs,
        "healthy_pairs": len(healthy),
        "healthy_with_alarm": alarm_pairs,
        "multi_sink_runs": multi,
        "agreeing_runs": agree_runs,
    }
    head = [
        f"**Recall** {named_pairs}/{fault_pairs} (run × sink pairs whose whole-run verdict names "
        f"the fault at warn or above: {summary['recall']:.0%}). **False alarms** "
        f"{alarm_pairs}/{len(healthy)} healthy run × sink pairs with a warn or critical finding at "
        f"some prefix past step {WARMUP_STEPS}. **Readers** {agree_runs}/{multi} multi-sink runs "
        "with one verdict across sinks (on the findings each sink has the inputs to judge).",
        "",
    ]
    return "\n".join(head + lines) + "\n", summary


def _comparable(judged: Judged, other: Judged) -> list[str]:
    """`judged`'s verdict on the findings `other` could judge too (a steps-only sink has no
    rollouts to judge dead prompts by, say): what two readers of one run must agree on."""
    return [v for v in judged.verdict if v.split(":")[0] not in other.unjudged]


def machine() -> str:
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return (
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}, commit {commit or '?'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=ROOT / ".scorecard")
    parser.add_argument("--python", default=os.environ.get("RLSCOPE_TRL_PYTHON", ""))
    parser.add_argument("--only", default="", help="run names, comma-separated")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    runs = [r for r in CORPUS if not args.only or r.name in args.only.split(",")]
    started = time.perf_counter()
    if any(r.command for r in runs):
        if not args.python or not Path(args.python).is_file():
            sys.exit("--python (or RLSCOPE_TRL_PYTHON): a Python with torch, trl and rlscope")
        print(f"corpus: {args.corpus}", file=sys.stderr)
        generate(args.corpus, str(Path(args.python).absolute()), runs, args.jobs)
    made = time.perf_counter() - started
    results: list[Judged] = []
    with tempfile.TemporaryDirectory() as scratch:
        for run in runs:
            for sink in run.sinks(args.corpus):
                results.append(judge(run, sink, Path(scratch)))
                print(f"  judged {run.name} via {sink.name}", file=sys.stderr, flush=True)
    text, summary = tables(results, args.corpus)
    took = time.perf_counter() - started
    header = (
        f"Scorecard of {len(runs)} genuine runs ({machine()}): corpus made in {made:.0f} s, "
        f"judged at every prefix in {took - made:.0f} s.\n\n"
    )
    print(header + text)
    if args.out is not None:
        args.out.write_text("# Scorecard\n\n" + header + text)
    print(json.dumps(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
