"""generate(): a scenario written as a format-v1 run, batch by batch, with TableWriter."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl

from rlscope.schema import RUN_JSON
from rlscope.synth.scenarios import (
    CLIP_RATIO_HIGH,
    CLIP_RATIO_LOW,
    EVAL_ID_OFFSET,
    EVAL_PROMPTS,
    MAX_TOOL_CALLS,
    SCENARIOS,
    SPIKE_GRAD_FACTOR,
    Scenario,
)
from rlscope.synth.text import _probes, _responses
from rlscope.synth.world import (
    _Batch,
    _behaviour,
    _eval_rollouts,
    _pool,
    _rollouts,
    _tokens,
    _World,
    _world,
)
from rlscope.tablewriter import TableWriter

_COLUMNS = (
    "rollout_id",
    "step",
    "prompt_id",
    "split",
    "reward",
    "correct",
    "response_len",
    "truncated",
    "answer",
    "response",
    "n_tool_calls",
    "tool_calls",
    "advantage",
    "steps_checked",
    "steps_verified",
)


def _with_text(
    sc: Scenario,
    rng: np.random.Generator | None,
    world: _World,
    u: float,
    frame: pl.DataFrame,
    batch: _Batch,
) -> pl.DataFrame:
    if rng is not None:
        frame = frame.hstack([_responses(sc, rng, world, u, batch)])
    return frame[[c for c in _COLUMNS if c in frame.columns]]


def _schedule(steps: int, every: int | None, what: str) -> set[int]:
    every = max(1, steps // 20) if every is None else every
    if every < 1:
        raise ValueError(f"{what} must be >= 1")
    return set(range(0, steps, every)) | {steps - 1}


def generate(
    out_dir: str | os.PathLike[str],
    scenario: str = "healthy",
    *,
    steps: int = 200,
    prompts_per_step: int = 32,
    group_size: int = 8,
    seed: int = 0,
    tokens: bool = True,
    max_tokens_per_rollout: int | None = None,
    text: bool = True,
    eval_every: int | None = None,
    probe_every: int | None = None,
    length_scale: float = 1.0,
) -> Path:
    """Write a synthetic format-v1 run of `scenario` into `out_dir` (which must not hold a run).

    Deterministic given `seed`; rollouts and steps do not depend on `tokens`,
    `max_tokens_per_rollout` or `text`. The tokens table has response_len rows per train rollout
    unless `max_tokens_per_rollout` keeps only each response's first positions (the step metrics
    still come from every token). `text=False` leaves out the `response` column and the probes
    table. Eval rollouts (splits eval_id and eval_ood) are written every `eval_every` steps and
    probes every `probe_every` steps (default max(1, steps // 20)), both also at the last step.
    `length_scale` multiplies every response length and the length cap (1: the scenario's own).
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; valid: {', '.join(SCENARIOS)}")
    if steps < 2 or prompts_per_step < 1 or group_size < 1:
        raise ValueError("need steps >= 2, prompts_per_step >= 1 and group_size >= 1")
    if max_tokens_per_rollout is not None and max_tokens_per_rollout < 1:
        raise ValueError("max_tokens_per_rollout must be >= 1")
    evals = _schedule(steps, eval_every, "eval_every")
    probes = _schedule(steps, probe_every, "probe_every")
    out = Path(out_dir)
    if (out / RUN_JSON).exists():
        raise FileExistsError(f"{out} already holds a run")
    if length_scale <= 0:
        raise ValueError("length_scale must be > 0")
    sc = SCENARIOS[scenario]
    if length_scale != 1.0:
        cap = max(1, round(sc.max_response_len * length_scale))
        sc = replace(sc, length_scale=length_scale, max_response_len=cap)
    main_seed, token_seed, extra_seed = np.random.SeedSequence(seed).spawn(3)
    rng, token_rng = np.random.default_rng(main_seed), np.random.default_rng(token_seed)
    latent_rng, word_rng, eval_word_rng, probe_rng = (
        np.random.default_rng(s) for s in extra_seed.spawn(4)
    )
    text_rng, eval_text_rng = (word_rng, eval_word_rng) if text else (None, None)
    pool = _pool(sc, rng, max(4 * prompts_per_step, 64))
    world = _world(sc, latent_rng, pool.ids.size, max(EVAL_PROMPTS, prompts_per_step))
    spikes = {round(u * (steps - 1)) for u in sc.grad_spikes}
    next_eval_id = EVAL_ID_OFFSET
    with TableWriter(
        out,
        run_id=f"synth-{scenario}",
        algorithm="GRPO",
        group_size=group_size,
        max_response_len=sc.max_response_len,
        max_tool_calls=MAX_TOOL_CALLS,
        clip_ratio_low=CLIP_RATIO_LOW,
        clip_ratio_high=CLIP_RATIO_HIGH,
    ) as writer:
        for t in range(steps):
            u = t / (steps - 1)
            first_id = t * prompts_per_step * group_size
            rollouts, rows = _rollouts(
                sc, rng, pool, u, t, first_id, prompts_per_step, group_size, t in spikes
            )
            rollouts, batch = _behaviour(sc, latent_rng, world, u, rollouts, rows, group_size)
            token_rows, means = _tokens(sc, token_rng, u, rollouts)
            writer.log_rollouts(_with_text(sc, text_rng, world, u, rollouts, batch))
            if t in evals:
                frame = _eval_rollouts(sc, latent_rng, world, u, t, next_eval_id)
                next_eval_id += frame.height
                frame, evals_batch = _behaviour(
                    sc, latent_rng, world, u, frame, world.eval_rows, None
                )
                writer.log_rollouts(_with_text(sc, eval_text_rng, world, u, frame, evals_batch))
            if text and t in probes:
                probe_rows = _probes(sc, probe_rng, world, u, batch)
                if probe_rows is not None:
                    writer.log_probes(probe_rows)
            if tokens:
                if max_tokens_per_rollout is not None:
                    token_rows = token_rows.filter(pl.col("pos") < max_tokens_per_rollout)
                writer.log_tokens(token_rows)
            grad_norm = math.exp(rng.normal(-0.3 * u, 0.2))
            means["kl"] *= sc.logged_kl_factor
            writer.log_step(
                t,
                loss=0.05 * (1 - 0.6 * u) + rng.normal(0.0, 0.01),
                grad_norm=grad_norm * (SPIKE_GRAD_FACTOR if t in spikes else 1.0),
                lr=1e-6,
                **means,
            )
    return out
