"""Synthetic format-v1 GRPO runs drawn from a documented latent model, one scenario per diagnosis.

Latent model. Time is training progress u = t / (steps - 1) in [0, 1], so each scenario shows its
pathology at any run length. Healthy values are given; `Scenario` names every knob.

* Prompts: a pool of max(4 * prompts_per_step, 64) prompts `p{j:05d}` with difficulty
  d_j ~ Normal(0, 1.2) (stratified: the pool holds that law's quantiles, shuffled; a scenario may
  mix several normals), base length L_j ~ LogNormal(log 42, 0.5) tokens (short enough that the
  default run is ~3M token rows) and reward scale c_j = 1 (a LogNormal scale is stratified the
  same way). Each step takes one prompt uniformly from each of prompts_per_step equal difficulty
  strata of the pool (every prompt equally likely, and even a small batch has a representative
  mix), then group_size rollouts of each; rollout_id counts up from 0.
* Correctness: each rollout has a standardised length noise z ~ Normal(0, 1);
  P(correct) = sigmoid(k h(u) (s(u) - d_j) - lambda z) with k = 1.5, sharpness h = 1, lambda = 0
  and skill s(u) = -1 + 1.8 u: pass@1 rises ~0.27 → ~0.69 and, as hard prompts improve too,
  pass@8 ~0.68 → ~0.96, while the share of zero-σ groups stays near a third.
* Length: response_len = round(L_j g(u) exp(0.25 z) b^correct) in [1, max_response_len], with
  g(u) = 1 + 0.3 u and b = 1.08 (within a prompt correct responses are a little longer, a
  correlation of about +0.1). truncated = response_len >= max_response_len (1024: ~never);
  truncated responses are incorrect.
* Reward c_j * correct (binary); answer "A" if correct, else one of "B", "C", "D"; advantage
  (r - mean_G) / (std_G(ddof=1) + 1e-6) within the prompt's group, 0 when the group's σ is 0.
* Tools: n_tool_calls = min(1 + Poisson(0.3), 5); call k of prompt j has the arguments
  '{"query": "q<j>-<k>"}'.
* Tokens, response_len rows per rollout: entropy ~ Gamma(shape 0.6, mean H(u)),
  H(u) = 1.2 exp(-0.9 u) + 0.15; ratio noise e ~ Normal(0, sigma_r(u)), sigma_r = 0.05; reference
  drift delta ~ Normal(0, sqrt(2 ln(1 + KL(u)))), so the mean k3 is exactly KL(u) = 0.002 + 0.02 u;
  logprob = -entropy * Exp(1) - max(0, e, delta), old_logprob = logprob + e and ref_logprob =
  logprob + delta (all <= 0); advantage = the rollout's; with r = exp(logprob - old_logprob),
  clipped = (r < 0.8 & A < 0) | (r > 1.28 & A > 0); segment "think" for the first 80% of
  positions, then "answer".
* Steps: loss = 0.05 (1 - 0.6 u) + Normal(0, 0.01), grad_norm = exp(Normal(-0.3 u, 0.2)),
  lr = 1e-6; kl, clip_frac and entropy are the step's token means of k3, clipped and entropy.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist
from typing import Literal

import numpy as np
import polars as pl
import pyarrow as pa

from rlscope.schema import RUN_JSON
from rlscope.writer import RunWriter

MAX_TOOL_CALLS = 5
CLIP_RATIO_LOW = 0.2
CLIP_RATIO_HIGH = 0.28
BASE_LEN = 42.0
SPIKE_GRAD_FACTOR = 20.0
SPIKE_REWARD = 25.0
_WRONG_ANSWERS = np.array(["B", "C", "D"])

TimeFn = Callable[[float], float]
ToolFn = Callable[[np.random.Generator, float, int], np.ndarray]


def _healthy_tools(rng: np.random.Generator, u: float, n: int) -> np.ndarray:
    return 1 + rng.poisson(0.3, n)


def _saturating_tools(rng: np.random.Generator, u: float, n: int) -> np.ndarray:
    return 1 + rng.poisson(0.3 + 8.0 * u**2, n)


def _bimodal_tools(rng: np.random.Generator, u: float, n: int) -> np.ndarray:
    busy = rng.choice([3, 4, 5], n, p=[0.35, 0.35, 0.3])
    return np.where(rng.random(n) < 0.55, 0, busy)


@dataclass(frozen=True)
class Scenario:
    """One setting of the latent model (see the module docstring); defaults are the healthy run."""

    name: str
    doc: str
    skill: TimeFn = lambda u: -1.0 + 1.8 * u
    entropy: TimeFn = lambda u: 1.2 * math.exp(-0.9 * u) + 0.15
    kl: TimeFn = lambda u: 0.002 + 0.02 * u
    growth: TimeFn = lambda u: 1.0 + 0.3 * u
    ratio_sd: TimeFn = lambda u: 0.05
    tools: ToolFn = _healthy_tools
    difficulty: tuple[tuple[float, float, float], ...] = ((1.0, 0.0, 1.2),)  # (weight, mean, sd)
    logit_slope: float = 1.5
    sharpness: TimeFn = lambda u: 1.0
    overthink: float = 0.0
    length_sd: float = 0.25
    length_bonus: float = 1.08
    max_response_len: int = 1024
    reward_scale_sd: float = 0.0
    advantage: Literal["grpo", "dr_grpo"] = "grpo"
    grad_spikes: tuple[float, ...] = ()
    # What the trainer's step log reports as KL, relative to the token-mean k3 (a logging bug).
    logged_kl_factor: float = 1.0


HEALTHY = Scenario(
    "healthy",
    "Skill rises linearly (pass@1 ~0.27 → ~0.69, pass@8 ~0.68 → ~0.96, about a third of the "
    "groups zero-σ), entropy declines smoothly (1.35 → 0.64), KL grows linearly "
    "(0.002 → 0.022), lengths grow 30% with correct responses slightly longer within a prompt, "
    "~1.3 tool calls, no truncation, no spikes. Should trigger no diagnosis.",
)


def _variant(name: str, doc: str, **changes: object) -> Scenario:
    return replace(HEALTHY, name=name, doc=doc, **changes)  # type: ignore[arg-type]


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        HEALTHY,
        _variant(
            "entropy-collapse",
            "H(u) = 1.2 exp(-u / 0.02) + 0.05: entropy falls from 1.25 to 0.05 within the first "
            "~5% of training and stays flat; skill rises only a little (s = -1 + 0.6 u).",
            entropy=lambda u: 1.2 * math.exp(-u / 0.02) + 0.05,
            skill=lambda u: -1.0 + 0.6 * u,
        ),
        _variant(
            "entropy-clip-conflict",
            "Entropy declines to a low level (H(u) = 1.2 exp(-6 u) + 0.05, ~0.11 at mid-run) while "
            "the behaviour-policy noise grows (sigma_r = 0.05 + 0.75 u), so the clip fraction "
            "rises to ~0.15-0.25 in the second half: low entropy with high clip.",
            entropy=lambda u: 1.2 * math.exp(-6.0 * u) + 0.05,
            ratio_sd=lambda u: 0.05 + 0.75 * u,
        ),
        _variant(
            "kl-stalled",
            "ref_logprob ≈ logprob (KL = 1e-5 throughout) and skill flat (s = -0.3): the policy "
            "is not moving and not learning.",
            kl=lambda u: 1e-5,
            skill=lambda u: -0.3,
        ),
        _variant(
            "kl-runaway",
            "KL(u) = 0.002 exp(5 u): convex, ~150x over the run (0.002 → 0.30); the last third's "
            "mean is ~5x the middle third's.",
            kl=lambda u: 0.002 * math.exp(5.0 * u),
        ),
        _variant(
            "grad-spike",
            "Healthy, except the steps at u ≈ 0.3, 0.55 and 0.8 have grad_norm x20 and, in each, "
            "one correct rollout with reward 25.0 (rewards are otherwise binary).",
            grad_spikes=(0.3, 0.55, 0.8),
        ),
        _variant(
            "spurious-length-growth",
            "Lengths grow 2.5x (g(u) = 1 + 1.5 u) while accuracy is flat (s = 0.2) and length has "
            "no relation to correctness within a prompt (b = 1).",
            growth=lambda u: 1.0 + 1.5 * u,
            length_bonus=1.0,
            skill=lambda u: 0.2,
        ),
        _variant(
            "overthinking",
            "Within a prompt longer responses are less often correct: the length noise z "
            "(length x exp(0.3 z)) also enters the logit as -1.2 z; lengths grow 60% "
            "(g(u) = 1 + 0.6 u) and b = 1.",
            overthink=1.2,
            length_sd=0.3,
            length_bonus=1.0,
            growth=lambda u: 1.0 + 0.6 * u,
        ),
        _variant(
            "truncation",
            "Healthy lengths under a cap of 80 tokens: ~20% of responses are truncated (rising "
            "slowly as lengths grow); truncated responses are incorrect.",
            max_response_len=80,
        ),
        _variant(
            "dead-prompts",
            "The pool is too easy (d_j ~ Normal(-3.5, 0.5)): nearly every group is all-correct, "
            "zero σ, no learning signal.",
            difficulty=((1.0, -3.5, 0.5),),
        ),
        _variant(
            "dead-prompts-hard",
            "The pool is too hard (d_j ~ Normal(4, 0.5)): nearly every group is all-wrong, "
            "zero σ, no learning signal.",
            difficulty=((1.0, 4.0, 0.5),),
        ),
        _variant(
            "reward-concentration",
            "Continuous rewards r = c_j * correct with a long-tailed prompt scale "
            "c_j ~ LogNormal(0, 2) and Dr. GRPO advantage r - mean_G (no σ normalisation): a few "
            "prompts carry most of the |advantage| mass.",
            reward_scale_sd=2.0,
            advantage="dr_grpo",
        ),
        _variant(
            "mode-collapse",
            "Probability concentrates on prompts the policy can already solve. 75% of the pool "
            "is moderate (d ~ Normal(0, 0.3)), 25% out of reach (d ~ Normal(1.3, 0.1), p ≈ 0.1 "
            "at the start); skill s = 0.2 + 0.6 u and sharpness h = 1 + 4 u push the moderate "
            "prompts to p → 1 and the rare successes on hard ones to 0: pass@1 rises "
            "(~0.5 → ~0.76 between the first and last fifths) while pass@8 falls (~0.85 → ~0.79; "
            "pass@16 ~0.9 → ~0.78). Groups end up deterministic, so zero-σ groups pile up too.",
            difficulty=((0.75, 0.0, 0.3), (0.25, 1.3, 0.1)),
            skill=lambda u: 0.2 + 0.6 * u,
            logit_slope=2.0,
            sharpness=lambda u: 1.0 + 4.0 * u,
        ),
        _variant(
            "tool-cap-saturation",
            "n_tool_calls = min(1 + Poisson(0.3 + 8 u²), 5): calls drift to the cap in the second "
            "half (~70% at the cap at u = 0.75, ~96% at the end).",
            tools=_saturating_tools,
        ),
        _variant(
            "tool-call-instability",
            "Each rollout independently makes 0 calls (p = 0.55) or 3/4/5 calls (p = .35/.35/.3): "
            "mean ~1.8 calls, within-group CV ~1.15, ~13% at the cap.",
            tools=_bimodal_tools,
        ),
        _variant(
            "logged-metric-mismatch",
            "Healthy, but the trainer's step log reports KL three times the token-mean k3 of the "
            "logged tokens (a wrong estimator or a normalisation bug in the trainer's metric).",
            logged_kl_factor=3.0,
        ),
    )
}


@dataclass(frozen=True)
class _Pool:
    ids: np.ndarray  # prompt_id strings
    difficulty: np.ndarray
    base_len: np.ndarray
    reward_scale: np.ndarray


def _stratified(
    rng: np.random.Generator, mixture: tuple[tuple[float, float, float], ...], size: int
) -> np.ndarray:
    """Quantiles of each (weight, mean, sd) normal in random order: draws would leave a 64-prompt
    pool with a spread (and a share of easy or hard prompts) that varies with the seed."""
    total = sum(w for w, _, _ in mixture)
    edges = np.rint(np.cumsum([0.0] + [w / total for w, _, _ in mixture]) * size).astype(int)
    values = []
    for (_, mean, sd), n in zip(mixture, np.diff(edges), strict=True):
        dist = NormalDist(mean, sd)
        values += [dist.inv_cdf((q + 0.5) / n) for q in range(n)]
    return rng.permutation(values)


def _pool(sc: Scenario, rng: np.random.Generator, size: int) -> _Pool:
    ids = np.array([f"p{j:05d}" for j in range(size)])
    difficulty = _stratified(rng, sc.difficulty, size)
    base_len = BASE_LEN * np.exp(rng.normal(0.0, 0.5, size))
    scale = (
        np.exp(_stratified(rng, ((1.0, 0.0, sc.reward_scale_sd),), size))
        if sc.reward_scale_sd
        else np.ones(size)
    )
    return _Pool(ids, difficulty, base_len, scale)


def _sample_prompts(rng: np.random.Generator, pool: _Pool, prompts: int) -> np.ndarray:
    """One prompt from each of `prompts` equal difficulty strata, in random order."""
    edges = np.arange(prompts + 1) * pool.ids.size // prompts
    picks = edges[:-1] + (rng.random(prompts) * np.diff(edges)).astype(np.int64)
    return rng.permutation(np.argsort(pool.difficulty, kind="stable")[picks])


def _advantage(reward: np.ndarray, kind: str) -> np.ndarray:
    """Group advantages of a (prompts, N) reward matrix."""
    if reward.shape[1] < 2:
        return np.zeros_like(reward)
    flat = np.ptp(reward, axis=1, keepdims=True) == 0
    centred = reward - reward.mean(axis=1, keepdims=True)
    if kind == "grpo":
        centred = centred / (reward.std(axis=1, ddof=1, keepdims=True) + 1e-6)
    return np.where(flat, 0.0, centred)


def _tool_calls(prompt: np.ndarray, n_calls: np.ndarray) -> pl.Series:
    offsets = np.concatenate([[0], np.cumsum(n_calls)]).astype(np.int32)
    row = np.repeat(np.arange(n_calls.size), n_calls)
    k = np.arange(offsets[-1]) - offsets[:-1][row]
    args = pl.select(
        pl.concat_str(
            pl.lit('{"query": "q'), pl.Series(prompt[row]), pl.lit("-"), pl.Series(k), pl.lit('"}')
        )
    ).to_series()
    return pl.Series("tool_calls", pa.ListArray.from_arrays(pa.array(offsets), args.to_arrow()))


def _rollouts(
    sc: Scenario,
    rng: np.random.Generator,
    pool: _Pool,
    u: float,
    step: int,
    first_id: int,
    prompts: int,
    group: int,
    spike: bool,
) -> pl.DataFrame:
    n = prompts * group
    j = np.repeat(_sample_prompts(rng, pool, prompts), group)
    z = rng.standard_normal(n)
    logit = sc.logit_slope * sc.sharpness(u) * (sc.skill(u) - pool.difficulty[j])
    correct = rng.random(n) < 1 / (1 + np.exp(-(logit - sc.overthink * z)))
    length = pool.base_len[j] * sc.growth(u) * np.exp(sc.length_sd * z)
    length *= np.where(correct, sc.length_bonus, 1.0)
    cap = sc.max_response_len
    response_len = np.clip(np.rint(length), 1, cap).astype(np.int32)
    truncated = response_len >= cap
    correct &= ~truncated
    reward = np.where(correct, pool.reward_scale[j], 0.0)
    if spike and (ok := np.flatnonzero(~truncated)).size:
        i = rng.choice(ok)
        correct[i], reward[i] = True, SPIKE_REWARD
    n_calls = np.minimum(sc.tools(rng, u, n), MAX_TOOL_CALLS).astype(np.int32)
    return pl.DataFrame(
        {
            "rollout_id": np.arange(first_id, first_id + n, dtype=np.int64),
            "step": np.full(n, step, dtype=np.int64),
            "prompt_id": pool.ids[j],
            "reward": reward,
            "correct": correct,
            "response_len": response_len,
            "truncated": truncated,
            "answer": np.where(correct, "A", rng.choice(_WRONG_ANSWERS, n)),
            "n_tool_calls": n_calls,
            "tool_calls": _tool_calls(j, n_calls),
            "advantage": _advantage(reward.reshape(prompts, group), sc.advantage).ravel(),
        }
    )


def _tokens(
    sc: Scenario, rng: np.random.Generator, u: float, rollouts: pl.DataFrame
) -> tuple[pl.DataFrame, dict[str, float]]:
    """The step's token rows and the token means the trainer would log."""
    lens = rollouts["response_len"].to_numpy().astype(np.int64)
    total = int(lens.sum())
    row = np.repeat(np.arange(lens.size), lens)
    pos = np.arange(total) - (np.cumsum(lens) - lens)[row]
    entropy = rng.gamma(0.6, sc.entropy(u) / 0.6, total)
    e = rng.normal(0.0, sc.ratio_sd(u), total)
    delta = rng.normal(0.0, math.sqrt(2 * math.log1p(sc.kl(u))), total)
    # Shifting by max(0, e, delta) keeps all three log-probs <= 0 and leaves e and delta intact.
    logprob = -entropy * rng.standard_exponential(total) - np.maximum(0.0, np.maximum(e, delta))
    lp = logprob.astype(np.float32)
    old = (logprob + e).astype(np.float32)
    ref = (logprob + delta).astype(np.float32)
    adv = rollouts["advantage"].to_numpy().astype(np.float32)[row]
    ratio = np.exp(lp.astype(np.float64) - old)
    clipped = ((ratio < 1 - CLIP_RATIO_LOW) & (adv < 0)) | (
        (ratio > 1 + CLIP_RATIO_HIGH) & (adv > 0)
    )
    d = ref.astype(np.float64) - lp
    ent32 = entropy.astype(np.float32)
    frame = pl.DataFrame(
        {
            "rollout_id": rollouts["rollout_id"].to_numpy()[row],
            "step": np.repeat(rollouts["step"].to_numpy(), lens),
            "pos": pos.astype(np.int32),
            "logprob": lp,
            "old_logprob": old,
            "ref_logprob": ref,
            "entropy": ent32,
            "advantage": adv,
            "clipped": clipped,
            "segment": pl.Series(
                np.where(pos < np.rint(0.8 * lens)[row], "think", "answer"), dtype=pl.Categorical()
            ),
        }
    )
    means = {
        "kl": float(np.mean(np.expm1(d) - d)),
        "clip_frac": float(clipped.mean()),
        "entropy": float(ent32.mean(dtype=np.float64)),
    }
    return frame, means


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
) -> Path:
    """Write a synthetic format-v1 run of `scenario` into `out_dir` (which must not hold a run).

    Deterministic given `seed`; rollouts and steps do not depend on `tokens` or
    `max_tokens_per_rollout`. The tokens table has response_len rows per rollout unless
    `max_tokens_per_rollout` keeps only each response's first positions (the step metrics still
    come from every token).
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; valid: {', '.join(SCENARIOS)}")
    if steps < 2 or prompts_per_step < 1 or group_size < 1:
        raise ValueError("need steps >= 2, prompts_per_step >= 1 and group_size >= 1")
    if max_tokens_per_rollout is not None and max_tokens_per_rollout < 1:
        raise ValueError("max_tokens_per_rollout must be >= 1")
    out = Path(out_dir)
    if (out / RUN_JSON).exists():
        raise FileExistsError(f"{out} already holds a run")
    sc = SCENARIOS[scenario]
    rng, token_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    pool = _pool(sc, rng, max(4 * prompts_per_step, 64))
    spikes = {round(u * (steps - 1)) for u in sc.grad_spikes}
    with RunWriter(
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
            rollouts = _rollouts(
                sc, rng, pool, u, t, first_id, prompts_per_step, group_size, t in spikes
            )
            token_rows, means = _tokens(sc, token_rng, u, rollouts)
            writer.log_rollouts(rollouts)
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
