"""The sampled world: prompt pools, rollouts, eval rollouts, tokens and per-batch behaviour."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from rlscope.synth.scenarios import (
    _BAD_JSON,
    _EMPTY_ANSWER,
    _NO_ANSWER,
    _UNCLOSED,
    _WRONG_ANSWERS,
    ANSWER_RANGE,
    BASE_LEN,
    CLIP_RATIO_HIGH,
    CLIP_RATIO_LOW,
    EVAL_SPLITS,
    FORMAT_KINDS,
    HEALTHY_ALTERNATIVES,
    MAIN_DISTRACTOR,
    MAX_TOOL_CALLS,
    N_DISTRACTORS,
    OOD_LOGIT_SHIFT,
    RESTATE_WORDS,
    SPIKE_REWARD,
    STEPS_CHECKED,
    TOPIC_WORDS,
    VOCAB_SIZE,
    Scenario,
)


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


def _call_args(prompt: np.ndarray, k: np.ndarray) -> pl.Series:
    """The serialized arguments of each call: call k of prompt j asks for "q<j>-<k>"."""
    return pl.select(
        pl.concat_str(
            pl.lit('{"query": "q'), pl.Series(prompt), pl.lit("-"), pl.Series(k), pl.lit('"}')
        )
    ).to_series()


def _call_lists(args: pl.Series, offsets: np.ndarray) -> pl.Series:
    offsets32 = pa.array(offsets.astype(np.int32))
    return pl.Series("tool_calls", pa.ListArray.from_arrays(offsets32, args.to_arrow()))


def _tool_calls(prompt: np.ndarray, n_calls: np.ndarray) -> pl.Series:
    offsets = np.concatenate([[0], np.cumsum(n_calls)])
    row = np.repeat(np.arange(n_calls.size), n_calls)
    k = np.arange(offsets[-1]) - offsets[:-1][row]
    return _call_lists(_call_args(prompt[row], k), offsets)


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
) -> tuple[pl.DataFrame, np.ndarray]:
    """The step's train rollouts (main stream) and each one's prompt row in the pool."""
    n = prompts * group
    j = np.repeat(_sample_prompts(rng, pool, prompts), group)
    z = rng.standard_normal(n)
    logit = sc.logit_slope * sc.sharpness(u) * (sc.skill(u) - pool.difficulty[j])
    correct = rng.random(n) < 1 / (1 + np.exp(-(logit - sc.overthink * z)))
    length = sc.length_scale * pool.base_len[j] * sc.growth(u) * np.exp(sc.length_sd * z)
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
    frame = pl.DataFrame(
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
    return frame, j


def _eval_rollouts(
    sc: Scenario, rng: np.random.Generator, world: _World, u: float, step: int, first_id: int
) -> pl.DataFrame:
    """One rollout of each eval prompt (eval_id, then eval_ood) at checkpoint `step`. OOD prompt
    i pairs with ID prompt i: same difficulty, base length and noise draws."""
    d = world.eval_difficulty
    n = d.size
    pairs = len(EVAL_SPLITS)
    z = np.tile(rng.standard_normal(n // pairs), pairs)
    uniform = np.tile(rng.random(n // pairs), pairs)
    ood_skill = sc.skill(u) if sc.ood_skill is None else sc.ood_skill(u)
    skill = np.where(world.eval_ood, ood_skill, sc.skill(u))
    logit = sc.logit_slope * sc.sharpness(u) * (skill - d) - OOD_LOGIT_SHIFT * world.eval_ood
    correct = uniform < 1 / (1 + np.exp(-(logit - sc.overthink * z)))
    length = sc.length_scale * world.eval_base_len * sc.growth(u) * np.exp(sc.length_sd * z)
    length *= np.where(correct, sc.length_bonus, 1.0)
    response_len = np.clip(np.rint(length), 1, sc.max_response_len).astype(np.int32)
    truncated = response_len >= sc.max_response_len
    correct &= ~truncated
    n_calls = np.minimum(sc.tools(rng, u, n), MAX_TOOL_CALLS).astype(np.int32)
    return pl.DataFrame(
        {
            "rollout_id": np.arange(first_id, first_id + n, dtype=np.int64),
            "step": np.full(n, step, dtype=np.int64),
            "prompt_id": world.eval_ids,
            "split": world.eval_split,
            "reward": correct.astype(np.float64),
            "correct": correct,
            "response_len": response_len,
            "truncated": truncated,
            "n_tool_calls": n_calls,
            "tool_calls": _tool_calls(world.eval_rows, n_calls),
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


@dataclass(frozen=True)
class _World:
    """Per-prompt answers and words (train pool rows first, then the eval prompts: eval_id, then
    eval_ood) and the fixed eval set."""

    gold: np.ndarray  # (rows,) answer value
    distractors: np.ndarray  # (rows, N_DISTRACTORS); column 0 is the main distractor
    vocab: np.ndarray  # (rows, RESTATE_WORDS[1] + TOPIC_WORDS) word indices
    eval_rows: np.ndarray  # world row of each eval prompt
    eval_ood: np.ndarray  # whether it is an eval_ood prompt
    eval_ids: pl.Series
    eval_split: pl.Series
    eval_difficulty: np.ndarray
    eval_base_len: np.ndarray


def _world(sc: Scenario, rng: np.random.Generator, pool_size: int, eval_size: int) -> _World:
    rows = pool_size + len(EVAL_SPLITS) * eval_size
    gold = rng.integers(0, ANSWER_RANGE, rows)
    offsets = rng.permuted(np.tile(np.arange(1, 100), (rows, 1)), axis=1)[:, :N_DISTRACTORS]
    distractors = (gold[:, None] + offsets) % ANSWER_RANGE
    vocab = rng.integers(0, VOCAB_SIZE, (rows, RESTATE_WORDS[1] + TOPIC_WORDS))
    splits = np.repeat(np.array(EVAL_SPLITS), eval_size)
    tags = {"eval_id": "ei", "eval_ood": "eo"}
    return _World(
        gold,
        distractors,
        vocab,
        pool_size + np.arange(splits.size),
        splits == "eval_ood",
        pl.Series([f"{tags[s]}{j:05d}" for s in EVAL_SPLITS for j in range(eval_size)]),
        pl.Series(splits.tolist()),
        np.tile(_stratified(rng, sc.difficulty, eval_size), len(EVAL_SPLITS)),
        np.tile(BASE_LEN * np.exp(rng.normal(0.0, 0.5, eval_size)), len(EVAL_SPLITS)),
    )


@dataclass(frozen=True)
class _Batch:
    """What the text and the probes of a batch of rollouts are made from."""

    rollout_id: np.ndarray
    rows: np.ndarray  # world row of each rollout's prompt
    length: np.ndarray  # response_len
    answer: np.ndarray  # answer value, -1 = none
    src: np.ndarray  # the rollout whose think words and calls it uses (itself unless copying)
    lead: np.ndarray  # its group's first rollout (itself for eval rollouts)
    n_calls: np.ndarray
    call_k: np.ndarray  # per call (flat, in order): the argument index k of "q<j>-<k>"
    breaks: np.ndarray  # index into FORMAT_KINDS, -1 = well-formed
    json_variant: np.ndarray


def _behaviour(
    sc: Scenario,
    rng: np.random.Generator,
    world: _World,
    u: float,
    frame: pl.DataFrame,
    rows: np.ndarray,
    group: int | None,
) -> tuple[pl.DataFrame, _Batch]:
    """Answers, verifier counts, repeated or copied calls and format breaks of a batch of
    rollouts (train groups of `group`, or eval rollouts: None). The draws' number and order do
    not depend on the scenario."""
    n = frame.height
    ids = np.arange(n)
    correct = frame["correct"].to_numpy()
    n_calls = frame["n_tool_calls"].to_numpy().astype(np.int64)
    copy_u = rng.random(n)
    repeat_u = rng.random((n, 2, 2))  # [:, i, 0]: is there an i-th repeat; [:, i, 1]: of which call
    broken = rng.random(n) < sc.format_breaks(u)
    kind = rng.integers(0, len(FORMAT_KINDS), n)
    variant = rng.integers(0, 3, n)
    scatter = rng.random(n) < sc.answer_scatter(u)
    main = rng.random(n) < MAIN_DISTRACTOR
    alt = rng.integers(1, 1 + HEALTHY_ALTERNATIVES, n)
    wide = rng.integers(1, N_DISTRACTORS, n)
    checked = rng.integers(STEPS_CHECKED[0], STEPS_CHECKED[1] + 1, n)
    step_u = rng.random((n, STEPS_CHECKED[1]))

    first = ids // group * group if group else ids
    src = np.where((ids != first) & (copy_u < sc.copy(u)), first, ids)
    distinct = n_calls[src]
    repeats = (repeat_u[:, :, 0] < sc.repeat_calls(u)).sum(axis=1)[src]
    extra = np.where(distinct > 0, np.minimum(repeats, MAX_TOOL_CALLS - distinct), 0)
    total = distinct + extra
    offsets = np.concatenate([[0], np.cumsum(total)])
    row = np.repeat(ids, total)
    pos = np.arange(offsets[-1]) - offsets[:-1][row]
    later = np.clip(pos - distinct[row], 0, 1)
    target = (repeat_u[src[row], later, 1] * np.maximum(distinct[row], 1)).astype(np.int64)
    call_k = np.where(pos < distinct[row], pos, target)

    # A correct rollout has its answer: it can only break the think or a call.
    kind = np.where(correct & (kind == _NO_ANSWER), _UNCLOSED, kind)
    kind = np.where(correct & (kind == _EMPTY_ANSWER), _BAD_JSON, kind)
    kind = np.where((kind == _BAD_JSON) & (total == 0), _UNCLOSED, kind)
    kind = np.where(broken, kind, -1)
    pick = np.where(scatter, wide, np.where(main, 0, alt))
    answer = np.where(correct, world.gold[rows], world.distractors[rows, pick])
    answer = np.where((kind == _NO_ANSWER) | (kind == _EMPTY_ANSWER), -1, answer)
    updates: dict[str, pl.Series] = {}
    if (total != n_calls).any() or (src != ids).any():
        updates["n_tool_calls"] = pl.Series(total.astype(np.int32))
        updates["tool_calls"] = _call_lists(_call_args(rows[row], call_k), offsets)
    ok = np.where(correct, sc.step_ok_correct(u), sc.step_ok_incorrect(u))
    checks = np.arange(STEPS_CHECKED[1]) < checked[:, None]
    verified = ((step_u < ok[:, None]) & checks).sum(axis=1)
    if group:
        updates["split"] = pl.repeat("train", n, eager=True)
    text = pa.array(answer).cast(pa.large_string())
    updates["answer"] = pl.Series(_when(answer >= 0, text, pa.scalar(None, pa.large_string())))
    updates["steps_checked"] = pl.Series(checked, dtype=pl.Int32)
    updates["steps_verified"] = pl.Series(verified, dtype=pl.Int32)
    frame = frame.with_columns(**updates)
    batch = _Batch(
        frame["rollout_id"].to_numpy(),
        rows,
        frame["response_len"].to_numpy().astype(np.int64),
        answer,
        src,
        first,
        total,
        call_k,
        kind,
        variant,
    )
    return frame, batch


def _s(text: str) -> pa.Scalar:
    return pa.scalar(text, pa.large_string())


def _cat(*parts: pa.Array | pa.Scalar) -> pa.Array:
    """Element-wise concatenation (Arrow kernels: no query planning per small batch)."""
    return pc.binary_join_element_wise(*parts, _s(""))


def _when(
    mask: np.ndarray, then: pa.Array | pa.Scalar, otherwise: pa.Array | pa.Scalar
) -> pa.Array:
    return pc.if_else(pa.array(mask, pa.bool_()), then, otherwise)
