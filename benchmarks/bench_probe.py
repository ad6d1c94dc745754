"""`rlscope probe` against a real local server: probes and tokens per second at concurrency 1, 4
and 16, beside the same requests sent straight to the server by a minimal client (the standard
library's urllib, in threads). The server is `transformers serve` with the tiny reasoner of the
tests (tests/probe_server.py; needs RLSCOPE_TRL_PYTHON, a Python with torch and
transformers[serving]: `make test-slow` builds one). Writes its section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import write_section
from probe_server import post_json, sampled_run, served, tiny_reasoner_dir

from rlscope.probe import Asker, ProbeSettings, plan_probes, probe_run
from rlscope.probe.client import _openai
from rlscope.reader import open_run

SECTION = "## Faithfulness probes against a local server"


def bodies(run: Path, settings: ProbeSettings) -> list[dict[str, Any]]:
    """The /v1/completions bodies `rlscope probe` sends for `settings` (truncate and filler need
    no editor: one request a probe)."""
    targets, _ = plan_probes(open_run(run), settings)
    asker = Asker(None, None, settings)  # type: ignore[arg-type]  # only its texts are used
    out = []
    for target in targets:
        for probe in target.probes:
            text = asker.text(target, probe)
            out.append(
                {
                    "model": settings.model,
                    "prompt": (target.prompt or "") + text,
                    **asker.sampling(target),
                }
            )
    return out


def minimal(url: str, requests: list[dict[str, Any]], concurrency: int) -> tuple[float, int]:
    """The same requests, straight: (seconds, completion tokens)."""
    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda b: post_json(f"{url}/completions", b), requests))
    return time.perf_counter() - began, sum(a["usage"]["completion_tokens"] for a in answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--per-step", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = parser.parse_args()
    if not os.environ.get("RLSCOPE_TRL_PYTHON"):
        sys.exit("bench_probe: set RLSCOPE_TRL_PYTHON (make test-slow builds .venv-trl)")
    rows = []
    began = time.perf_counter()
    _openai()  # imported once per command (~0.7 s here): not a per-probe cost
    import_seconds = time.perf_counter() - began
    with tempfile.TemporaryDirectory() as tmp, served(tiny_reasoner_dir()) as server:
        source = sampled_run(server, Path(tmp) / "source", args.steps, args.per_step)
        for concurrency in (1, 4, 16):
            settings = ProbeSettings(
                endpoint=server.url,
                model=server.model,
                kinds=("truncate", "filler"),
                per_step=args.per_step,
                concurrency=concurrency,
                max_tokens=16,
            )
            run = Path(tmp) / f"run-{concurrency}"
            shutil.copytree(source, run)
            requests = bodies(run, settings)
            straight, straight_tokens = minimal(server.url, requests, concurrency)
            plan = probe_run(run, settings, dry_run=True).seconds  # open and plan: once a run
            summary = probe_run(run, settings)
            assert summary.probes_written == len(requests), summary.to_dict()
            # Greedy: the same requests generate the same tokens either way.
            assert summary.completion_tokens == straight_tokens, summary.to_dict()
            rows.append(
                (
                    concurrency,
                    len(requests),
                    summary.seconds,
                    summary.completion_tokens,
                    straight,
                    plan,
                )
            )
    lines = [
        SECTION,
        "",
        f"`python benchmarks/bench_probe.py` ({platform.machine()}, {os.cpu_count()} cores): "
        f"{args.steps} steps × {args.per_step} rollouts of the tiny reasoner (tests/probe_server"
        ".py), truncate and filler probes (one request each, at most 16 new tokens), served by "
        "`transformers serve` on 127.0.0.1, which runs one generation at a time. `rlscope` is "
        "`probe_run` end to end (plan, requests, answers, writing); `straight` the same request "
        "bodies sent by urllib in as many threads. The `openai` package's import, once per "
        f"command, took {import_seconds:.2f} s and is left out.",
        "",
        "| concurrency | probes | rlscope s | probes/s | tokens out/s | straight s | overhead | "
        "per probe | planning |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for concurrency, n, seconds, tokens, straight, plan in rows:
        lines.append(
            f"| {concurrency} | {n} | {seconds:.2f} | {n / seconds:.1f} | {tokens / seconds:.0f} "
            f"| {straight:.2f} | {100 * (seconds / straight - 1):+.1f}% | "
            f"{1000 * (seconds - straight) / n:+.1f} ms | {plan:.2f} s |"
        )
    write_section(args.out, lines)
    print("\n".join(lines))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
