"""What `rlscope probe` did (or would do), as text for the terminal."""

from __future__ import annotations

from rlscope.probe import ProbeSummary


def probe_summary_text(summary: ProbeSummary) -> str:
    """The plan (dry run) or the outcome: probes, requests, tokens, time, failures by cause."""
    lines = []
    if summary.dry_run:
        lines.append(
            f"plan for {summary.run} with {summary.model}: {summary.probes_planned} probes of "
            f"{summary.rollouts} rollouts ({summary.probes_already} already in the run); "
            f"about {summary.estimated_prompt_tokens:,} prompt tokens; nothing sent"
        )
    else:
        lines.append(
            f"probed {summary.run} with {summary.model}: {summary.probes_written} of "
            f"{summary.probes_planned} probes written ({summary.rollouts} rollouts; "
            f"{summary.probes_already} were already in the run)"
        )
        lines.append(
            f"requests {summary.requests}, tokens in {summary.prompt_tokens:,}, out "
            f"{summary.completion_tokens:,}, {summary.seconds:.1f} s"
        )
        if summary.failures:
            causes = ", ".join(f"{cause} ×{n}" for cause, n in sorted(summary.failures.items()))
            lines.append(f"failed: {causes} (run the command again to retry them)")
    if summary.skipped:
        lines.append(
            "skipped: " + ", ".join(f"{why} ×{n}" for why, n in sorted(summary.skipped.items()))
        )
    return "\n".join(lines)
