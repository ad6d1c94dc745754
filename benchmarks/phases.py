"""Where an analysis's time goes, phase by phase (wall and process CPU seconds), for one run.

    python benchmarks/phases.py RUN [--repeat 3]

Phases: the imports; opening the run (listing, every file's footer read and checked); the
token source (the scan: reads, per-file reduction, merge); the other sources (steps, rollouts,
probes); the series, results and findings. The median of `--repeat` runs in fresh processes."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBE = r"""
import json, sys, time
clock = lambda: (time.perf_counter(), time.process_time())
marks = {"start": clock()}
import rlscope.analysis, rlscope.sources as sources
from rlscope import reader
marks["imports"] = clock()
spent = {"open": [0.0, 0.0], "tokens": [0.0, 0.0], "other tables": [0.0, 0.0]}
def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            end = clock()
            spent[name][0] += end[0] - start[0]
            spent[name][1] += end[1] - start[1]
    return wrapper
reader.open_run = timed("open", reader.open_run)
rlscope.analysis.open_run = reader.open_run
sources.SOURCES = tuple(
    timed("tokens" if s is sources.tokens_source else "other tables", s) for s in sources.SOURCES
)
import rlscope.engine
rlscope.engine.SOURCES = sources.SOURCES
rlscope.analysis.analyze(sys.argv[1], use_cache=False)
end = clock()
total = [end[0] - marks["imports"][0], end[1] - marks["imports"][1]]
phases = {"imports": [marks["imports"][i] - marks["start"][i] for i in (0, 1)]}
phases.update(spent)
phases["series, results, findings"] = [total[i] - sum(v[i] for v in spent.values()) for i in (0, 1)]
print(json.dumps(phases))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", help="a run folder or a store URL (s3://…)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", PROBE, str(args.run)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for _ in range(args.repeat)
    ]
    print(f"{'phase':<28}{'wall (s)':>10}{'CPU (s)':>10}")
    for phase in runs[0]:
        wall = statistics.median(r[phase][0] for r in runs)
        cpu = statistics.median(r[phase][1] for r in runs)
        print(f"{phase:<28}{wall:>10.2f}{cpu:>10.2f}")


if __name__ == "__main__":
    main()
