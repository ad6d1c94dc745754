"""`rlscope probe`: faithfulness probes of a run's rollouts, answered by an OpenAI-API server.

The library behind the command: `probe_run` picks rollouts per step (stratified: correct and
incorrect ones, each with a reasoning section and an answer; deterministic for a seed), applies
the interventions of `rlscope.probe.interventions` to their chains, has the served policy
answer (an editor model rewrites steps for `mistake` and `paraphrase`), extracts each answer
with the importers' rule, and appends the probe rows to the run through a TableWriter, as new
part files: existing files are never modified, and a killed process leaves only complete parts.
A probe already in the run with the same (rollout, kind, fraction, model) is not asked again, so
an interrupted run of the command, started again, finishes without a duplicate row. A server that
answers nothing for `give_up_after` seconds is given up on (ServerGone): the requests in flight
are cancelled, what was answered is written, and the error says how many probes are left.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from rlscope.errors import RlscopeError
from rlscope.importers.text import answer_expr
from rlscope.probe import interventions as iv
from rlscope.probe.client import (
    GIVE_UP_AFTER,
    Backend,
    Breaker,
    Endpoint,
    Reply,
    ServerGone,
    Usage,
)
from rlscope.reader import Run, open_run
from rlscope.store import RunPath, location
from rlscope.tablewriter import TableWriter
from rlscope.text import TagSet

__all__ = [
    "PROBE_RANK",
    "Asker",
    "ProbeSettings",
    "ProbeSummary",
    "ask_targets",
    "plan_probes",
    "probe_run",
    "run_coroutine",
    "targets_of",
]

#: The writer rank of probe part files (`probes/r900-*.parquet`): never a trainer's rank, so a
#: probe written while the trainer writes never takes a name the trainer will use.
PROBE_RANK = 900
#: Probe rows buffered before a part file is written.
FLUSH_PROBES = 64
#: Tokens a word costs, roughly, for the dry run's estimate (BPE tokenizers: ~0.75 words a token).
TOKENS_PER_WORD = 1.3
#: Seconds cancelled requests may take to end before their answered probes are written anyway.
CANCEL_SECONDS = 5.0

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ProbeSettings:
    """What `probe_run` asks, of which model, and how (see `rlscope probe --help`)."""

    endpoint: str
    model: str
    kinds: tuple[str, ...] = iv.KINDS
    fractions: dict[str, tuple[float, ...]] = field(default_factory=dict)
    per_step: int = 4
    steps: tuple[int | None, int | None] = (None, None)
    split: str = "train"
    concurrency: int = 4
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    checkpoint_step: int | None = None
    editor_endpoint: str | None = None
    editor_model: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    timeout: float = 120.0
    retries: int = 4
    give_up_after: float = GIVE_UP_AFTER
    tags: TagSet = field(default_factory=TagSet)

    def __post_init__(self) -> None:
        unknown = [k for k in self.kinds if k not in iv.KINDS]
        if unknown or not self.kinds:
            raise RlscopeError(
                f"--kinds: unknown {', '.join(unknown) or '(none given)'}",
                hint=f"choose from {', '.join(iv.KINDS)}",
            )
        for kind, values in self.fractions.items():
            if any(not 0.0 <= f <= 1.0 for f in values):
                raise RlscopeError(f"--fractions for {kind}: each must be in [0, 1]")
        if self.per_step < 1 or self.concurrency < 1 or self.max_tokens < 1:
            raise RlscopeError("--per-step, --concurrency and --max-tokens must be at least 1")
        if not self.give_up_after > 0:
            raise RlscopeError("--give-up-after must be more than 0 seconds")

    def fractions_of(self, kind: str) -> tuple[float, ...]:
        return self.fractions.get(kind) or iv.DEFAULT_FRACTIONS[kind]


@dataclass(frozen=True)
class Probe:
    """One probe to ask: its kind, the fraction recorded, and the step index it acts at."""

    kind: str
    fraction: float | None
    at: int


@dataclass
class Target:
    """A rollout to probe: its context, its chain, and the probes it still needs."""

    rollout_id: int
    step: int
    prompt: str | None
    messages: list[dict[str, Any]] | None
    answer: str
    chain: iv.Chain
    hint: str | None
    probes: list[Probe]


@dataclass
class ProbeSummary:
    """What a `probe_run` did (or, with dry_run, would do)."""

    run: Path
    model: str
    rollouts: int = 0
    probes_planned: int = 0
    probes_written: int = 0
    probes_already: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    estimated_prompt_tokens: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    dry_run: bool = False

    def add_usage(self, usage: Usage) -> None:
        self.requests += usage.requests
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.failures.update(usage.failures)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": str(self.run),
            "model": self.model,
            "dry_run": self.dry_run,
            "rollouts": self.rollouts,
            "probes_planned": self.probes_planned,
            "probes_written": self.probes_written,
            "probes_already": self.probes_already,
            "skipped": dict(sorted(self.skipped.items())),
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "estimated_prompt_tokens": self.estimated_prompt_tokens,
            "failures": dict(sorted(self.failures.items())),
            "seconds": round(self.seconds, 3),
        }


# --- choosing what to probe ----------------------------------------------------------------------


def _context_columns(run: Run) -> list[str]:
    found = [c for c in ("prompt", "messages") if run.has("rollouts", c)]
    if not found:
        raise RlscopeError(
            f"{run.path}: the rollouts have no `prompt` or `messages` column, so a probe cannot "
            "rebuild what the policy saw",
            hint="log it: RunWriter.log_rollouts({..., 'prompt': text_with_chat_template}) or "
            "'messages' (JSON); the TRL callback logs it; `rlscope import verl` fills it from "
            "the dump's `input`, `rlscope import trl` from the completions' `prompt`",
        )
    return found


def _order(seed: int, rollout_id: int) -> bytes:
    return hashlib.blake2b(f"{seed}:{rollout_id}".encode(), digest_size=8).digest()


def _stratified(rows: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """Up to n rows, half correct and half not where the step has both, in seeded order."""
    ranked = sorted(rows, key=lambda r: _order(seed, r["rollout_id"]))
    right = [r for r in ranked if r.get("correct")]
    wrong = [r for r in ranked if not r.get("correct")]
    take_right = min(len(right), max(n - len(wrong), (n + 1) // 2))
    chosen = right[:take_right] + wrong[: n - take_right]
    return sorted(chosen, key=lambda r: r["rollout_id"])


def _already(run: Run, model: str) -> set[tuple[int, str, float | None]]:
    """(rollout, kind, fraction) of the probes the run holds from `model`."""
    if "probes" not in run.tables:
        return set()
    frame = run.scan("probes")
    columns = ["rollout_id", "intervention", "fraction"]
    if run.has("probes", "model"):
        frame = frame.filter(pl.col("model") == model)
    else:
        return set()
    done = frame.select(columns).collect()
    return {
        (int(r), str(k), round(float(f), 6) if f is not None else None)
        for r, k, f in done.iter_rows()
    }


def _probes(chain: iv.Chain, settings: ProbeSettings, has_hint: bool) -> list[Probe]:
    """The probes of one chain: each fraction mapped to a whole number of steps (duplicates
    merged), recorded as the share of the chain's steps it acts at."""
    n = len(chain.steps)
    out: dict[tuple[str, float | None], Probe] = {}
    for kind in settings.kinds:
        if kind == "bias":
            if has_hint:
                out[(kind, None)] = Probe(kind, None, n)
            continue
        if kind == "filler":
            out[(kind, 1.0)] = Probe(kind, 1.0, n)
            continue
        for fraction in settings.fractions_of(kind):
            at = chain.kept(fraction)
            if kind == "mistake":
                at = min(at, n - 1)
            elif kind == "paraphrase":
                at = max(at, 1)
            share = round(at / n, 6)
            out[(kind, share)] = Probe(kind, share, at)
    return list(out.values())


def _local(where: RunPath) -> Path:
    """The run's directory: probes are appended to the run, never written into a store."""
    if not isinstance(where, Path):
        raise RlscopeError(
            f"{where}: `rlscope probe` appends the probes to the run, and rlscope never "
            "writes into a store",
            hint="copy the run to a local directory (e.g. aws s3 sync URL DIR) and probe that",
        )
    return where


def plan_probes(run: Run, settings: ProbeSettings) -> tuple[list[Target], ProbeSummary]:
    """The rollouts to probe and their probes still missing, and the summary of that plan."""
    summary = ProbeSummary(_local(run.path), settings.model)
    context = _context_columns(run)
    if not run.has("rollouts", "answer", "response"):
        raise RlscopeError(
            f"{run.path}: the rollouts have no `answer` and `response`: a probe compares the "
            "answer after an intervention on the response's chain with the rollout's own",
            hint="log `response` (the generated text) and `answer` (the extracted answer)",
        )
    wanted = ["rollout_id", "step", "prompt_id", "split", "response", "answer", *context]
    if run.has("rollouts", "correct"):
        wanted.append("correct")
    frame = (
        run.scan("rollouts")
        .filter(pl.col("split") == settings.split)
        .select(wanted)
        .sort("step", "rollout_id")
        .collect()
    )
    if frame.height == 0:
        raise RlscopeError(f"{run.path}: no `{settings.split}` rollouts in the steps asked for")
    if frame["answer"].null_count() == frame.height:
        raise RlscopeError(
            f"{run.path}: no rollout has an answer",
            hint="the answer is what a probe's answer is compared with: log `answer`, or use "
            "an importer that extracts it (<answer>…</answer>, \\boxed{…}, `Answer: X`)",
        )
    targets = targets_of(frame, settings, _already(run, settings.model), summary, _local(run.path))
    summary.estimated_prompt_tokens = int(
        sum(_context_words(t) * len(t.probes) for t in targets) * TOKENS_PER_WORD
    )
    return targets, summary


def targets_of(
    frame: pl.DataFrame,
    settings: ProbeSettings,
    done: set[tuple[int, str, float | None]],
    summary: ProbeSummary,
    where: Path,
) -> list[Target]:
    """The rollouts of `frame` (rollout_id, step, prompt_id, response, answer, prompt and/or
    messages, optionally correct) to probe, per step, and their probes not in `done`; what is
    skipped and already done counted in `summary`."""
    targets: list[Target] = []
    for (step,), rows in frame.partition_by("step", as_dict=True, maintain_order=True).items():
        usable = []
        for row in rows.iter_rows(named=True):
            if row["answer"] is None:
                summary.skipped["no answer"] += 1
                continue
            chain = iv.split_chain(row["response"] or "", settings.tags)
            if chain is None:
                summary.skipped["no reasoning section"] += 1
                continue
            if row.get("prompt") is None and row.get("messages") is None:
                summary.skipped["no prompt or messages"] += 1
                continue
            usable.append(row | {"chain": chain})
        group_answers: dict[str, list[str]] = {}
        for row in rows.iter_rows(named=True):
            if row["answer"] is not None:
                group_answers.setdefault(row["prompt_id"], []).append(row["answer"])
        for row in _stratified(usable, settings.per_step, settings.seed):
            hint = iv.wrong_hint(row["answer"], group_answers.get(row["prompt_id"], []))
            if "bias" in settings.kinds and hint is None:
                summary.skipped["bias: no wrong answer to hint"] += 1
            probes = _probes(row["chain"], settings, hint is not None)
            missing = [p for p in probes if (row["rollout_id"], p.kind, p.fraction) not in done]
            summary.probes_already += len(probes) - len(missing)
            if not missing:
                continue
            targets.append(
                Target(
                    int(row["rollout_id"]),
                    int(step),
                    row.get("prompt"),
                    _messages(row.get("messages"), where),
                    row["answer"],
                    row["chain"],
                    hint,
                    missing,
                )
            )
    summary.rollouts += len(targets)
    summary.probes_planned += sum(len(t.probes) for t in targets)
    return targets


def _messages(raw: str | None, path: Path) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    try:
        messages = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RlscopeError(f"{path}: rollouts.messages is not JSON ({exc})") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RlscopeError(f"{path}: rollouts.messages must be a JSON list of {{role, content}}")
    return messages


def _context_words(target: Target) -> int:
    context = target.prompt or json.dumps(target.messages or [])
    return len(context.split()) + len(target.chain.prefix(len(target.chain.steps)).split())


# --- asking ------------------------------------------------------------------------------------


def _closer(answer_open: str) -> str | None:
    """The text that closes the answer the chain opened (`</answer>` for `<answer>`)."""
    tag = answer_open.rstrip().rsplit("<", 1)
    if len(tag) == 2 and tag[1].endswith(">") and not tag[1].startswith("/"):
        return f"</{tag[1][:-1]}>"
    return None


class Asker:
    """Asks one target's probes of a policy (and of an editor, for mistakes and paraphrases)."""

    def __init__(self, policy: Backend, editor: Backend, settings: ProbeSettings) -> None:
        self.policy, self.editor, self.settings = policy, editor, settings

    def sampling(self, target: Target) -> dict[str, Any]:
        """The sampling fields of the target's requests: the answer's closer as a stop."""
        s = self.settings
        out: dict[str, Any] = {
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "seed": s.seed,
        }
        closer = _closer(target.chain.answer_open)
        if closer:
            out["stop"] = [closer]
        return out

    @staticmethod
    def text(target: Target, probe: Probe) -> str:
        """The response's intervened beginning the policy continues, for the kinds that need no
        editor and keep the prompt (truncate, filler)."""
        if probe.kind == "truncate":
            return iv.truncated(target.chain, probe.at)
        if probe.kind == "filler":
            return iv.filler(target.chain)
        raise ValueError(f"{probe.kind} probes are written by the editor or change the prompt")

    async def _continue(self, target: Target, text: str) -> Reply | None:
        """The policy's continuation of the rollout's context followed by `text`."""
        sampling = self.sampling(target)
        if target.prompt is not None:
            return await self.policy.complete(target.prompt + text, **sampling)
        messages = [*(target.messages or []), {"role": "assistant", "content": text}]
        return await self.policy.chat(messages, **sampling)

    async def _edit(self, request: str) -> str | None:
        reply = await self.editor.chat(
            [{"role": "user", "content": request}],
            max_tokens=self.settings.max_tokens,
            temperature=self.settings.temperature,
            seed=self.settings.seed,
        )
        return iv.editor_text(reply.text) if reply is not None else None

    async def one(self, target: Target, probe: Probe) -> dict[str, Any] | None:
        chain = target.chain
        closer = _closer(chain.answer_open)
        hint = None
        if probe.kind in ("truncate", "filler"):
            text = self.text(target, probe)
        elif probe.kind == "bias":
            hint = target.hint
            assert hint is not None
            sampling = self.sampling(target)
            if target.prompt is not None:
                reply = await self.policy.complete(
                    iv.biased_prompt(target.prompt, hint), **sampling
                )
            else:
                messages = iv.biased_messages(target.messages or [], hint)
                reply = await self.policy.chat(messages, **sampling)
            return self._row(target, probe, "", reply, closer, hint)
        else:
            if probe.kind == "mistake":
                rewritten = await self._edit(iv.mistake_request(chain, probe.at))
                text = iv.with_mistake(chain, probe.at, rewritten) if rewritten else ""
            else:
                rewritten = await self._edit(iv.paraphrase_request(chain, probe.at))
                text = iv.continued(chain, rewritten) if rewritten else ""
            if not text:
                self.policy.usage.failures["editor gave no text"] += 1
                return None
        reply = await self._continue(target, text)
        return self._row(target, probe, text, reply, closer, hint)

    def _row(
        self,
        target: Target,
        probe: Probe,
        text: str,
        reply: Reply | None,
        closer: str | None,
        hint: str | None,
    ) -> dict[str, Any] | None:
        if reply is None:
            return None
        response = text + reply.text
        if closer and closer not in reply.text:
            response += closer  # OpenAI's servers leave the stop string out (transformers keeps it)
        return {
            "rollout_id": target.rollout_id,
            "intervention": probe.kind,
            "fraction": probe.fraction,
            "hint": hint,
            "response": response,
            "model": self.settings.model,
            "checkpoint_step": self.settings.checkpoint_step,
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens,
        }


async def _ask_all(
    targets: Sequence[Target],
    settings: ProbeSettings,
    writer: TableWriter,
    summary: ProbeSummary,
    progress: Progress | None,
) -> None:
    usage = Usage()
    limit = asyncio.Semaphore(settings.concurrency)
    breakers: dict[str, Breaker] = {}  # one a server: the policy's and the editor's may differ

    def endpoint(url: str, model: str) -> Endpoint:
        return Endpoint(
            url,
            model,
            api_key_env=settings.api_key_env,
            limit=limit,
            usage=usage,
            timeout=settings.timeout,
            retries=settings.retries,
            breaker=breakers.setdefault(url, Breaker(settings.give_up_after)),
        )

    policy = endpoint(settings.endpoint, settings.model)
    editing = any(k in iv.EDITED for k in settings.kinds)
    separate_editor = settings.editor_endpoint is not None or settings.editor_model is not None
    editor = (
        endpoint(
            settings.editor_endpoint or settings.endpoint, settings.editor_model or settings.model
        )
        if separate_editor
        else policy
    )

    async def ask() -> None:
        await policy.check(chat=any(t.prompt is None for t in targets))
        if editing:  # the editor is asked in chat, a new turn
            await editor.check(chat=True, continuing=False)
        await ask_targets(targets, Asker(policy, editor, settings), writer, summary, progress)

    try:
        await _watched(ask(), [policy, editor])
    finally:
        summary.add_usage(usage)
        for client in {id(policy): policy, id(editor): editor}.values():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(client.close(), CANCEL_SECONDS)


async def _watched(work: Coroutine[Any, Any, None], endpoints: Sequence[Endpoint]) -> None:
    """`work`, unless a server's breaker trips first: then the work is cancelled (and hands over
    what was answered) and ServerGone says which server and how."""
    task = asyncio.ensure_future(work)
    tick = min(0.5, min(e.breaker.stall for e in endpoints) / 4)
    try:
        while True:
            await asyncio.wait({task}, timeout=tick)
            if task.done():
                task.result()  # its error, if it failed
                return
            tripped = next((e for e in endpoints if e.breaker.tripped), None)
            if tripped is not None:
                task.cancel()
                await asyncio.wait({task}, timeout=CANCEL_SECONDS)
                raise await tripped.gone()
    finally:
        task.cancel()  # a no-op once done; else the work ends with its caller (Ctrl-C)


async def ask_targets(
    targets: Sequence[Target],
    asker: Asker,
    writer: TableWriter,
    summary: ProbeSummary,
    progress: Progress | None = None,
) -> None:
    """Every target's probes, a target's all at once (so that a server's prefix cache serves
    them), at most `concurrency` targets at a time. Answered probes are handed to the writer
    FLUSH_PROBES at a time, their answers extracted together (one query, not one a probe)."""
    done = 0
    total = sum(len(t.probes) for t in targets)
    answered: list[dict[str, Any]] = []

    def hand_over() -> None:
        if answered:
            writer.log_probes(with_answers(answered))
            summary.probes_written += len(answered)
            answered.clear()

    async def ask(target: Target, probe: Probe) -> None:
        row = await asker.one(target, probe)
        if row is not None:  # kept at once: the target's other probes may yet be cancelled
            answered.append(row)

    async def target_done(target: Target) -> None:
        nonlocal done
        await asyncio.gather(*(ask(target, p) for p in target.probes))
        if len(answered) >= FLUSH_PROBES:
            hand_over()
        done += len(target.probes)
        if progress is not None:
            progress(done, total)

    pending: set[asyncio.Task[None]] = set()
    try:
        for target in targets:
            if len(pending) >= asker.settings.concurrency:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            pending.add(asyncio.create_task(target_done(target)))
        if pending:
            await asyncio.gather(*pending)
    finally:
        # Cancelled (a server gone, Ctrl-C) or failed: the rest is cancelled, what was answered
        # is kept.
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=CANCEL_SECONDS)
        hand_over()


def with_answers(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Probe rows with their `answer` extracted from their `response` by the importers' rule
    (rlscope.importers.text.answer_expr), in one query."""
    frame = pl.DataFrame(rows, schema_overrides={"response": pl.String, "hint": pl.String})
    return frame.with_columns(answer_expr(pl.col("response")).alias("answer"))


def run_coroutine(coroutine: Any) -> Any:
    """Run `coroutine` to its end from synchronous code, also where an event loop is already
    running in this thread (a notebook): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def probe_run(
    path: str | Path,
    settings: ProbeSettings,
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> ProbeSummary:
    """Probe the run at `path` (a format-v1 run directory) and append the probes to it.

    Checks the server first (it answers, offers the model, serves the endpoint needed): an
    RlscopeError before anything is written otherwise. A server that answers nothing for
    `settings.give_up_after` seconds is given up on: what was answered is written, then an
    RlscopeError says which server and how many probes are left. With `dry_run`, only plans."""
    started = time.monotonic()
    run = open_run(_local(location(path)), steps=settings.steps)
    targets, summary = plan_probes(run, settings)
    summary.dry_run = dry_run
    if dry_run or not targets:
        summary.seconds = time.monotonic() - started
        return summary
    writer = TableWriter(_local(run.path), rank=PROBE_RANK, flush_rows={"probes": FLUSH_PROBES})
    gone: ServerGone | None = None
    try:
        run_coroutine(_ask_all(targets, settings, writer, summary, progress))
    except ServerGone as exc:
        gone = exc
    finally:
        writer.close()  # what was answered is kept, in complete part files
        summary.seconds = time.monotonic() - started
    if gone is not None:
        written, planned = summary.probes_written, summary.probes_planned
        kept = (
            f"{written} of {planned} probes were written and are kept"
            if written
            else f"None of the {planned} probes was written"
        )
        raise RlscopeError(
            f"{gone.url} stopped answering: {gone.how}. {kept}; {planned - written} are left",
            hint="run the same command again once the server answers: it resumes, asking only "
            "the probes left (no duplicates); for a server that is only slow, raise "
            "--give-up-after",
        )
    return summary
