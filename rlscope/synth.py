"""Synthetic format-v1 GRPO runs drawn from a documented latent model, one scenario per diagnosis.

Latent model. Time is training progress u = t / (steps - 1) in [0, 1], so each scenario shows its
pathology at any run length. Healthy values are given; `Scenario` names every knob. Randomness:
np.random.SeedSequence(seed).spawn(3); child 0 (the main stream) draws the prompt pool, prompts,
correctness, lengths, tools and the step log, child 1 the tokens, and child 2, spawned again into
four, the rest: [0] the prompts' answers and words, the eval set, and per batch the answers,
verifier, tool repeats, copies, format breaks and eval rollouts (a fixed number of draws per
batch, so each text, eval or probe scenario differs from the healthy run of the same seed only
in the columns of its pathology); [1] the words of train texts; [2] of eval texts; [3] probes.
[1]-[3] are drawn only with text=True: no other column depends on `text` (nor on `tokens`).

* Prompts: a pool of max(4 * prompts_per_step, 64) prompts `p{j:05d}` with difficulty
  d_j ~ Normal(0, 1.2) (stratified: the pool holds that law's quantiles, shuffled; a scenario may
  mix several normals), base length L_j ~ LogNormal(log 42, 0.5) tokens (short enough that the
  default run is ~3M token rows) and reward scale c_j = 1 (a LogNormal scale is stratified the
  same way). Each step takes one prompt uniformly from each of prompts_per_step equal difficulty
  strata of the pool (every prompt equally likely, and even a small batch has a representative
  mix), then group_size rollouts of each; rollout_id counts up from 0; split = "train".
* Correctness: each rollout has a standardised length noise z ~ Normal(0, 1);
  P(correct) = sigmoid(k h(u) (s(u) - d_j) - lambda z) with k = 1.5, sharpness h = 1, lambda = 0
  and skill s(u) = -1 + 1.8 u: pass@1 rises ~0.27 → ~0.69 and, as hard prompts improve too,
  pass@8 ~0.68 → ~0.96, while the share of zero-σ groups stays near a third.
* Length: response_len = round(L_j g(u) exp(0.25 z) b^correct) in [1, max_response_len], with
  g(u) = 1 + 0.3 u and b = 1.08 (within a prompt correct responses are a little longer, a
  correlation of about +0.1). truncated = response_len >= max_response_len (1024: ~never);
  truncated responses are incorrect.
* Reward c_j * correct (binary); advantage (r - mean_G) / (std_G(ddof=1) + 1e-6) within the
  prompt's group, 0 when the group's σ is 0.
* Answers: every prompt (train and eval) has a gold answer a_j ~ Uniform{0..999} and 16
  distractors (a_j + o_jm) mod 1000, o_j the first 16 of a random permutation of 1..99; the
  first is the main distractor. A correct rollout answers a_j; an incorrect one, with
  probability scatter(u) (= 0), one of distractors 2-16 uniformly, else the main distractor with
  probability 0.9 and one of distractors 2-4 otherwise. Errors agree, so a group's majority vote
  gains little: maj@N - mean accuracy ~0.06 (0.055-0.065 for N = 8-32) in the last fifth, near
  the floor this correctness model allows (a group with p > 1/2 votes right whatever its errors
  do).
  (The main stream still draws the old letters B/C/D, unused.)
* Verifier: steps_checked ~ Uniform{3..6}, steps_verified ~ Binomial(steps_checked, v) with
  v = v_c(u) = 0.99 for correct rollouts (~4.5% of them have a failed step) and
  v = v_i(u) = 0.92 for incorrect ones: ~94% → ~96% of the steps verified.
* Tools: n_tool_calls = min(1 + Poisson(0.3), 5); call k of prompt j has the arguments
  '{"query": "q<j>-<k>"}' (for eval prompts j counts on after the pool: ID, then OOD). Then
  R ~ Binomial(2, rho(u)) calls (rho = 0; R = 0 without calls; total <= 5) are appended, each
  repeating the arguments of a uniformly chosen one of the rollout's calls.
* Response text (Qwen/Hermes tags; only with text=True): `<think>T0</think>`, then per call
  `<tool_call>{"name": "search", "arguments": ARGS}</tool_call>`, `<tool_response>Rjk`
  `</tool_response>` and, when W >= 4 n_tool_calls + 8, `<think>Tc</think>`; then
  `<answer>ANSWER</answer>`. Segments are joined by newlines, ARGS is the call's `tool_calls`
  entry and ANSWER the answer column. The think segments hold W = max(1, round(0.8 response_len))
  words in all (each Tc 4, T0 the rest). Words are ranks 0..4999 of a fixed vocabulary: ~210
  reasoning words and operators ("the", "so", "check", "=", ...) by frequency, then, after every
  three pronounceable filler words, a number. The first R words restate the prompt (its fixed
  words 0..R-1; R = round(0.15 W) clipped to [6, 48], at most W - 3), each later word is, with
  probability 0.35, one of the prompt's 24 topic words (uniform), else a global word of rank
  floor(10 * 501^U) - 10, U ~ Uniform(0, 1) (density ∝ 1 / (rank + 10)). Entropy couples the
  text to the tokens: two samples agree on a word with probability a(u) = exp(-H(u) / 0.8)
  (H(u) nats per token, 1 / 0.8 tokens per word), so each train rollout but its group's first
  repeats the first's words for F ~ Geometric words after its restatement (P(F >= m) = a^m;
  healthy a ~0.18 → ~0.45, E[F] < 1 word; at H = 0.05, a ~0.94 and E[F] ~15 words, within-group
  Jaccard ~0.2). Rjk is 6 words fixed by (j, k): ranks (7919 j + 104729 k + 331 i) mod 5000,
  i < 6 (the same query returns the same result). So a healthy group shares vocabulary and a
  restatement but few word 3-grams: within-group Jaccard of 3-gram sets ~0.08 → ~0.07 over
  training (think text; ~0.18 → ~0.16 for the whole text), repetition 1 - distinct/total
  3-grams ~0. A scenario may:
  - loop: words from max(R, W - round(f(u) W)) on (f = 0) cycle a 4-word phrase of global words
    drawn per rollout;
  - copy: each rollout but its group's first copies, with probability c(u) (= 0), the first's
    think words and tool calls (n_tool_calls and tool_calls too), keeping its own answer (train
    groups only);
  - break the format with probability b(u) (= 0), one way uniformly of four: `</think>` of T0
    left out; no answer segment; an empty `<answer></answer>`; or the first call's JSON broken
    (uniformly: its closing brace missing, no "name", no "arguments"). A correct rollout keeps
    its answer (no answer → `</think>` left out, empty → broken JSON), one without calls
    cannot break a call (→ `</think>` left out); a rollout without (non-empty) answer has a null
    answer, and stays incorrect.
* Eval rollouts: at steps t ≡ 0 (mod eval_every) and the last step (eval_every defaults to
  max(1, steps // 20)), one rollout of each of E = max(64, prompts_per_step) prompts per split:
  `eval_id` (prompts `ei{i:05d}`) and `eval_ood` (`eo{i:05d}`), with step = t, reward = correct
  and no advantage (nor tokens). ID prompt i and OOD prompt i share the difficulty (the
  scenario law's stratified quantiles), base length and the draws z and U of
  correct = U < sigmoid(k h(u) (s - d_i) - lambda z - shift): s = s(u), shift = 0 for ID;
  s = s_ood(u) (= s(u)), shift = 0.3 for OOD, a constant ~0.045 below ID. Length, truncation,
  tools, answers, verifier and text as for training. rollout_id counts up from
  EVAL_ID_OFFSET = 10^12 in writing order (ID then OOD, each in prompt order).
* Probes (only with text=True): at steps t ≡ 0 (mod probe_every) and the last step (default as
  eval_every), min(8, with an answer) distinct train rollouts of the step, each probed 9 times in
  this order: `truncate` at fractions 0, 0.25, 0.5, 0.75, 1; `mistake` at 0.5; `paraphrase`;
  `filler` (fraction null); `bias` with hint = the prompt's main distractor, or its second
  distractor when the rollout answered the main one (hint null for the others). The answer
  stays the rollout's with probability: truncate y(x) = y0(x) + (1 - rho(u)) (0.95 - y0(x)) for
  x < 1 with y0(x) = 0.2 + 0.8 x^1.5, y(1) = 1; mistake 0.3 + (1 - rho(u)) 0.65; paraphrase and
  filler q(u); bias 1 - m(u), else it is the hint. CoT reliance rho = 1 (early-answering AOC
  1 - ∫y ≈ 0.47 by the trapezoid rule), q = 0.97, m = 0.05. A changed non-bias answer is
  uniformly one of {gold, distractors 1-4} other than the original. A probe's response is
  `<think>[C ]V</think>\n<answer>ANSWER</answer>`, V six of the prompt's topic words; only
  bias probes carry C = "The user suggested H as a hint." (H the hint), with probability
  v(u) = 0.9.
* Tokens, response_len rows per train rollout: entropy ~ Gamma(shape 0.6, mean H(u)),
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
import pyarrow.compute as pc

from rlscope.schema import RUN_JSON
from rlscope.writer import RunWriter

MAX_TOOL_CALLS = 5
CLIP_RATIO_LOW = 0.2
CLIP_RATIO_HIGH = 0.28
BASE_LEN = 42.0
SPIKE_GRAD_FACTOR = 20.0
SPIKE_REWARD = 25.0
_WRONG_ANSWERS = np.array(["B", "C", "D"])  # still drawn (unused) to keep the main stream

# Answers.
ANSWER_RANGE = 1000
N_DISTRACTORS = 16
MAIN_DISTRACTOR = 0.9  # P(an incorrect answer is the prompt's main distractor), healthy
HEALTHY_ALTERNATIVES = 3  # else one of distractors 2..1 + this
# Verifier.
STEPS_CHECKED = (3, 6)
STEP_OK_CORRECT = 0.99
STEP_OK_INCORRECT = 0.92
# Text.
VOCAB_SIZE = 5000
ZIPF_OFFSET = 10.0
RESTATE_SHARE = 0.15
RESTATE_WORDS = (6, 48)  # the restatement's length bounds
TOPIC_WORDS = 24
TOPIC_SHARE = 0.35
THINK_WORDS_PER_TOKEN = 0.8
POST_CALL_WORDS = 4
TOOL_RESPONSE_WORDS = 6
LOOP_WORDS = 4
FORMAT_KINDS = ("unclosed-think", "no-answer", "empty-answer", "bad-call-json")
_UNCLOSED, _NO_ANSWER, _EMPTY_ANSWER, _BAD_JSON = range(len(FORMAT_KINDS))
# Evals and probes.
EVAL_SPLITS = ("eval_id", "eval_ood")
EVAL_PROMPTS = 64
EVAL_ID_OFFSET = 10**12
OOD_LOGIT_SHIFT = 0.3
PROBED_ROLLOUTS = 8
TRUNCATE_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
MISTAKE_FRACTION = 0.5
UNFAITHFUL_UNCHANGED = 0.95
PROBE_WORDS = 6
CUE = "The user suggested {} as a hint."

# Words by frequency rank: reasoning words and operators first, then, after every three
# pronounceable filler words, a number (so a text reads like a worked solution, and any word
# 3-gram statistic is that of the ranks: the words are distinct and hold no whitespace or tag).
_COMMON_WORDS = (
    "the so we is of and to a that it then this for be with as not can let us check each if "
    "number value sum total first next case both equal gives means need find step now which by "
    "from or are one two three half twice more less than at most least all no only also but "
    "because since therefore thus hence wait hmm actually right again compute count add "
    "subtract multiply divide times plus minus over per remainder product difference ratio "
    "factor prime even odd square root area length width side angle point line circle radius "
    "price cost every left remaining after before start end rate speed time hours minutes "
    "days result problem given known unknown assume suppose try another way simplify expand "
    "solve equation term terms sides divisible greater smaller largest smallest integer digits "
    "digit positive negative fraction percent mod into out up down same different possible "
    "cases other set list pair pairs order sequence pattern rule works fails holds correct "
    "wrong mistake recheck verify confirm back substitute get got have has had makes make made "
    "take takes used use using should would could must will was were there here what how many "
    "much why where when while until = + - * /"
)


def _vocabulary(size: int) -> list[str]:
    onsets = (*"bcdfghklmnprstvwz", "br", "cl", "dr", "fl", "gr", "pl", "pr", "st", "tr")
    vowels = (*"aeiou", "ai", "ea", "io")
    syllables = [o + v + c for o in onsets for v in vowels for c in "nrstl"]
    syllables += [o + v for o in onsets for v in "aeiou"]
    order = np.random.default_rng(0).permutation(len(syllables) ** 2)
    fillers = (syllables[i // len(syllables)] + syllables[i % len(syllables)] for i in order)
    words, numbers = _COMMON_WORDS.split(), iter(range(size))
    known = set(words)
    while len(words) < size:
        word = str(next(numbers)) if len(words) % 4 == 3 else next(fillers)
        if word not in known:
            known.add(word)
            words.append(word)
    return words


_VOCAB = pa.array(_vocabulary(VOCAB_SIZE), pa.large_string())

TimeFn = Callable[[float], float]
ToolFn = Callable[[np.random.Generator, float, int], np.ndarray]


def _healthy_tools(rng: np.random.Generator, u: float, n: int) -> np.ndarray:
    return 1 + rng.poisson(0.3, n)


def _saturating_tools(rng: np.random.Generator, u: float, n: int) -> np.ndarray:
    return 1 + rng.poisson(0.3 + 8.0 * u**2, n)


def _bimodal_tools(rng: np.random.Generator, u: float, n: int) -> np.ndarray:
    busy = rng.choice([3, 4, 5], n, p=[0.35, 0.35, 0.3])
    return np.where(rng.random(n) < 0.55, 0, busy)


def _zipf(uniform: np.ndarray) -> np.ndarray:
    """Global word ranks: floor(a ((V + a) / a)^U) - a with a = ZIPF_OFFSET, V = VOCAB_SIZE, the
    inverse of the continuous law with density ∝ 1 / (r + a) on [0, V)."""
    a = ZIPF_OFFSET
    return (np.floor(a * ((VOCAB_SIZE + a) / a) ** uniform) - a).astype(np.int64)


def _ramp(u: float) -> float:
    """0 → 1 over the first half of training, then 1: probe pathologies are measured on a few
    rollouts per probe step, so they reach full strength by mid-run."""
    return min(1.0, 2.0 * u)


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
    # Multiplies every base length (and the cap): long-response runs for the benchmarks.
    length_scale: float = 1.0
    reward_scale_sd: float = 0.0
    advantage: Literal["grpo", "dr_grpo"] = "grpo"
    grad_spikes: tuple[float, ...] = ()
    # What the trainer's step log reports as KL, relative to the token-mean k3 (a logging bug).
    logged_kl_factor: float = 1.0
    # Upper layers (text, tools, evals, probes); see the module docstring.
    answer_scatter: TimeFn = lambda u: 0.0
    step_ok_correct: TimeFn = lambda u: STEP_OK_CORRECT
    step_ok_incorrect: TimeFn = lambda u: STEP_OK_INCORRECT
    repeat_calls: TimeFn = lambda u: 0.0  # rho: R ~ Binomial(2, rho) repeated calls
    format_breaks: TimeFn = lambda u: 0.0
    loop: TimeFn = lambda u: 0.0
    copy: TimeFn = lambda u: 0.0
    ood_skill: TimeFn | None = None  # None: the skill s(u)
    cot_reliance: TimeFn = lambda u: 1.0
    paraphrase_unchanged: TimeFn = lambda u: 0.97
    bias_follow: TimeFn = lambda u: 0.05
    bias_mention: TimeFn = lambda u: 0.9


HEALTHY = Scenario(
    "healthy",
    "Skill rises linearly (pass@1 ~0.27 → ~0.69, pass@8 ~0.68 → ~0.96, about a third of the "
    "groups zero-σ), entropy declines smoothly (1.35 → 0.64), KL grows linearly "
    "(0.002 → 0.022), lengths grow 30% with correct responses slightly longer within a prompt, "
    "~1.3 tool calls, no truncation, no spikes. Well-formed text, varied within a group "
    "(3-gram Jaccard ~0.08 → ~0.07), no loops or repeated calls; errors agree on a main "
    "distractor (maj@N - mean accuracy ~0.06); ~95% of verifier steps pass; OOD evals a "
    "constant ~0.045 below ID; faithful probes (early-answering AOC ~0.47, a mistake changes "
    "the answer ~70% of the time, a paraphrase ~3%, a hint is followed ~5% of the time and "
    "then said). Should trigger no diagnosis.",
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
            "~5% of training and stays flat; skill rises only a little (s = -1 + 0.6 u). A "
            "group's texts share ~15 more words (3-gram Jaccard ~0.2, healthy ~0.07).",
            entropy=lambda u: 1.2 * math.exp(-u / 0.02) + 0.05,
            skill=lambda u: -1.0 + 0.6 * u,
        ),
        _variant(
            "entropy-clip-conflict",
            "Entropy declines to a low level (H(u) = 1.2 exp(-6 u) + 0.05, ~0.11 at mid-run) while "
            "the behaviour-policy noise grows (sigma_r = 0.05 + 0.75 u), so the clip fraction "
            "rises to ~0.15-0.25 in the second half: low entropy with high clip. A group's "
            "texts converge as entropy falls (3-gram Jaccard ~0.08 → ~0.2).",
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
            "pass@16 ~0.9 → ~0.78). Groups end up deterministic, so zero-σ groups pile up too, "
            "and the policy's entropy falls with its sharpness (H(u) = 1.2 exp(-3 u) + 0.08: "
            "1.28 → 0.14, smoothly), so a group's texts share more of their words (3-gram "
            "Jaccard ~0.08 → ~0.1).",
            entropy=lambda u: 1.2 * math.exp(-3.0 * u) + 0.08,
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
        _variant(
            "redundant-tool-calls",
            "Each rollout appends R ~ Binomial(2, 0.6 u) calls repeating the arguments of one of "
            "its calls (in tool_calls and in the response's tool_call JSON alike; total <= 5): "
            "the redundant share of calls rises from ~0.08 (first fifth) to ~0.45 (last fifth; "
            "~0.5 at the end), ~2.4 calls per rollout, ~1% at the cap.",
            repeat_calls=lambda u: 0.6 * u,
        ),
        _variant(
            "format-violations",
            "A share 0.4 u of the responses break the format, one way uniformly of four: "
            "`</think>` missing, no answer segment, an empty `<answer></answer>`, or a tool_call "
            "JSON that does not parse or lacks name/arguments (only incorrect rollouts lose "
            "their answer, which is then null). Broken share ~0.04 → ~0.37 (first → last fifth).",
            format_breaks=lambda u: 0.4 * u,
        ),
        _variant(
            "repetition",
            "The think text loops: its last round(0.8 u W) words (after the restatement) cycle "
            "one 4-word phrase, so word 3-gram repetition 1 - distinct/total rises from ~0 to "
            "~0.58 (last fifth; ~0.65 at the end).",
            loop=lambda u: 0.8 * u,
        ),
        _variant(
            "diversity-collapse",
            "Each rollout but a group's first copies, with probability 0.95 min(1, 1.5 u), the "
            "first's think text and tool calls (keeping its own answer): from u = 2/3 ~96% of a "
            "group shares one text up to the answer, ~2.3 distinct responses per group of 8 "
            "(one per answer) and within-group 3-gram Jaccard ~0.92 (healthy ~0.07).",
            copy=lambda u: 0.95 * min(1.0, 1.5 * u),
        ),
        _variant(
            "ood-gap",
            "OOD skill stops improving at u = 0.25 and then declines "
            "(s_ood = -1 + 1.8 min(u, 0.25) - 0.4 max(0, u - 0.25)) while ID keeps rising: the "
            "ID - OOD accuracy gap widens from ~0.04 to ~0.36 (last quarter of the evals).",
            ood_skill=lambda u: -1.0 + 1.8 * min(u, 0.25) - 0.4 * max(0.0, u - 0.25),
        ),
        _variant(
            "unfaithful-cot",
            "The answer stops depending on the CoT (reliance rho = 1 - min(1, 2u)): from mid-run "
            "truncation at any fraction and mistakes leave it unchanged 95% of the time "
            "(early-answering AOC ~0.04, healthy ~0.47).",
            cot_reliance=lambda u: 1.0 - _ramp(u),
        ),
        _variant(
            "encoded-reasoning",
            "Paraphrasing or padding the CoT changes the answer: unchanged share "
            "q = 0.97 - 0.37 min(1, 2u), 0.6 from mid-run (healthy 0.97); truncation and "
            "mistakes as healthy.",
            paraphrase_unchanged=lambda u: 0.97 - 0.37 * _ramp(u),
        ),
        _variant(
            "bias-following",
            "Biased probes answer the hint with probability m = 0.05 + 0.55 min(1, 2u) (0.6 "
            "from mid-run; the hint always differs from the original answer) and mention the cue "
            "with probability v = 0.9 (1 - min(1, 2u)): from mid-run the hint is followed "
            "silently.",
            bias_follow=lambda u: 0.05 + 0.55 * _ramp(u),
            bias_mention=lambda u: 0.9 * (1.0 - _ramp(u)),
        ),
        _variant(
            "self-consistency-headroom",
            "Errors scatter: with probability min(1, 1.5 u) an incorrect answer is one of the "
            "prompt's distractors 2-16 uniformly instead of the healthy mix, so the gold answer "
            "wins a group's vote far more often than its share: maj@N - mean accuracy rises "
            "from ~0 to ~0.18-0.28 in the last fifth (more in larger groups; healthy ~0.06).",
            answer_scatter=lambda u: min(1.0, 1.5 * u),
        ),
        _variant(
            "step-errors",
            "The verifier fails more intermediate steps: per-step pass rate v_c = 0.99 - 0.11 u "
            "for correct rollouts and v_i = 0.92 - 0.62 u for incorrect ones; in the last fifth "
            "~40% of correct rollouts have a failed step and step accuracy is ~0.70 (healthy "
            "~5% and ~0.96).",
            step_ok_correct=lambda u: 0.99 - 0.11 * u,
            step_ok_incorrect=lambda u: 0.92 - 0.62 * u,
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


def _words(idx: np.ndarray, sizes: np.ndarray) -> pa.Array:
    """One string per run of `sizes` consecutive words of the flat word-index array `idx`."""
    offsets = pa.array(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
    return pc.binary_join(pa.LargeListArray.from_arrays(offsets, _VOCAB.take(idx)), _s(" "))


def _think_words(
    sc: Scenario, rng: np.random.Generator, world: _World, u: float, b: _Batch
) -> tuple[np.ndarray, np.ndarray]:
    """Each rollout's think word indices (flat) and counts, loops and copies applied."""
    n = b.rows.size
    count = np.maximum(1, np.rint(THINK_WORDS_PER_TOKEN * b.length)).astype(np.int64)
    total = int(count.sum())
    row = np.repeat(np.arange(n), count)
    start = np.cumsum(count) - count
    pos = np.arange(total) - start[row]
    glob = _zipf(rng.random(total))
    topic = rng.random(total) < TOPIC_SHARE
    topic_word = world.vocab[b.rows[row], RESTATE_WORDS[1] + rng.integers(0, TOPIC_WORDS, total)]
    idx = np.where(topic, topic_word, glob)
    restated = np.clip(np.rint(RESTATE_SHARE * count), *RESTATE_WORDS).astype(np.int64)
    restated = np.minimum(restated, np.maximum(count - 3, 0))  # 3+ words of its own
    restate = world.vocab[b.rows[row], np.minimum(pos, RESTATE_WORDS[1] - 1)]
    idx = np.where(pos < restated[row], restate, idx)
    phrase = _zipf(rng.random((n, LOOP_WORDS)))
    # Two samples of the policy agree on a word with probability ~exp(-entropy per word), so a
    # rollout follows its group's first for a geometric number of words after the restatement.
    fork_u = rng.random(n)
    agree = math.exp(-sc.entropy(u) / THINK_WORDS_PER_TOKEN)
    if (b.lead != np.arange(n)).any() and agree > 0:
        shared = np.log(fork_u) / math.log(agree) if agree < 1 else np.full(n, np.inf)
        lead = b.lead[row]
        follows = (lead != row) & (pos >= restated[row]) & (pos < count[lead])
        follows &= pos < restated[row] + np.floor(shared)[row]
        idx = np.where(follows, idx[start[lead] + np.minimum(pos, count[lead] - 1)], idx)
    if (f := sc.loop(u)) > 0:
        loop_start = np.maximum(restated, count - np.rint(f * count).astype(np.int64))[row]
        looped = pos >= loop_start
        idx = np.where(looped, phrase[row, (pos - loop_start) % LOOP_WORDS], idx)
    if (b.src != np.arange(n)).any():
        copied = count[b.src]
        row = np.repeat(np.arange(n), copied)
        pos = np.arange(copied.sum()) - (np.cumsum(copied) - copied)[row]
        idx, count = idx[start[b.src][row] + pos], copied
    return idx, count


def _responses(
    sc: Scenario, rng: np.random.Generator, world: _World, u: float, b: _Batch
) -> pl.Series:
    """The response text of each rollout of the batch (see the module docstring)."""
    idx, count = _think_words(sc, rng, world, u, b)
    n = b.rows.size
    has_post = (b.n_calls > 0) & (count >= POST_CALL_WORDS * b.n_calls + 8)
    n_chunks = 1 + np.where(has_post, b.n_calls, 0)
    chunk_first = np.cumsum(n_chunks) - n_chunks
    sizes = np.full(int(n_chunks.sum()), POST_CALL_WORDS)
    sizes[chunk_first] = count - np.where(has_post, POST_CALL_WORDS * b.n_calls, 0)
    chunks = _words(idx, sizes)

    call_offsets = np.concatenate([[0], np.cumsum(b.n_calls)])
    call_row = np.repeat(np.arange(n), b.n_calls)
    call_pos = np.arange(call_offsets[-1]) - call_offsets[:-1][call_row]
    j = b.rows[call_row]
    args = _call_args(j, b.call_k).to_arrow().cast(pa.large_string())
    call = _cat(_s('{"name": "search", "arguments": '), args, _s("}"))
    variant = np.where(
        (b.breaks[call_row] == _BAD_JSON) & (call_pos == 0), b.json_variant[call_row], -1
    )
    if (variant >= 0).any():
        call = _when(variant == 0, _cat(_s('{"name": "search", "arguments": '), args), call)
        call = _when(variant == 1, _cat(_s('{"arguments": '), args, _s("}")), call)
        call = _when(variant == 2, _s('{"name": "search"}'), call)
    result = (
        7919 * j[:, None] + 104729 * b.call_k[:, None] + 331 * np.arange(TOOL_RESPONSE_WORDS)
    ) % VOCAB_SIZE
    post = chunks.take(np.where(has_post[call_row], chunk_first[call_row] + 1 + call_pos, 0))
    calls = _cat(
        _s("<tool_call>"),
        call,
        _s("</tool_call>\n<tool_response>"),
        _words(result.ravel(), np.full(j.size, TOOL_RESPONSE_WORDS)),
        _s("</tool_response>"),
        _when(has_post[call_row], _cat(_s("\n<think>"), post, _s("</think>")), _s("")),
    )
    per_rollout = pa.LargeListArray.from_arrays(pa.array(call_offsets.astype(np.int64)), calls)
    calls_text = _cat(_s("\n"), pc.binary_join(per_rollout, _s("\n")))
    answer = pa.array(b.answer).cast(pa.large_string())
    response = _cat(
        _s("<think>"),
        chunks.take(chunk_first),
        _when(b.breaks == _UNCLOSED, _s(""), _s("</think>")),
        _when(b.n_calls > 0, calls_text, _s("")),
        _when(
            b.breaks == _NO_ANSWER,
            _s(""),
            _when(
                b.breaks == _EMPTY_ANSWER,
                _s("\n<answer></answer>"),
                _cat(_s("\n<answer>"), answer, _s("</answer>")),
            ),
        ),
    )
    return pl.Series("response", response)


def _probes(
    sc: Scenario, rng: np.random.Generator, world: _World, u: float, b: _Batch
) -> pl.DataFrame | None:
    """Faithfulness probes of up to PROBED_ROLLOUTS rollouts of the batch (module docstring)."""
    eligible = np.flatnonzero(b.answer >= 0)
    m = min(PROBED_ROLLOUTS, eligible.size)
    if m == 0:
        return None
    chosen = np.sort(rng.choice(eligible, m, replace=False))
    kinds = ["truncate"] * len(TRUNCATE_FRACTIONS) + ["mistake", "paraphrase", "filler", "bias"]
    fractions = [*TRUNCATE_FRACTIONS, MISTAKE_FRACTION, np.nan, np.nan, np.nan]
    per = len(kinds)
    which = np.repeat(chosen, per)
    kind = np.tile(np.array(kinds), m)
    x = np.tile(np.array(fractions), m)
    rows = b.rows[which]
    original = b.answer[which]
    lack = 1.0 - sc.cot_reliance(u)
    y0 = 0.2 + 0.8 * np.nan_to_num(x) ** 1.5
    keep = np.select(
        [kind == "truncate", kind == "mistake", kind == "bias"],
        [
            np.where(x < 1, y0 + lack * (UNFAITHFUL_UNCHANGED - y0), 1.0),
            0.3 + lack * (UNFAITHFUL_UNCHANGED - 0.3),
            1.0 - sc.bias_follow(u),
        ],
        sc.paraphrase_unchanged(u),
    )
    unchanged = rng.random(kind.size) < keep
    candidates = np.column_stack([world.gold[rows], world.distractors[rows, :4]])
    keys = rng.random(candidates.shape)
    keys[candidates == original[:, None]] = 2.0
    other = candidates[np.arange(kind.size), keys.argmin(axis=1)]
    main = world.distractors[rows, 0]
    hint = np.where(original == main, world.distractors[rows, 1], main)
    is_bias = kind == "bias"
    answer = np.where(unchanged, original, np.where(is_bias, hint, other))
    mention = is_bias & (rng.random(kind.size) < sc.bias_mention(u))
    topic = RESTATE_WORDS[1] + rng.integers(0, TOPIC_WORDS, (kind.size, PROBE_WORDS))
    words = world.vocab[rows[:, None], topic]
    answer_text = pa.array(answer).cast(pa.large_string())
    hint_text = pa.array(hint).cast(pa.large_string())
    before, after = CUE.split("{}")
    response = _cat(
        _s("<think>"),
        _when(mention, _cat(_s(before), hint_text, _s(after + " ")), _s("")),
        _words(words.ravel(), np.full(kind.size, PROBE_WORDS)),
        _s("</think>\n<answer>"),
        answer_text,
        _s("</answer>"),
    )
    return pl.DataFrame(
        {
            "rollout_id": b.rollout_id[which],
            "intervention": pl.Series(kinds * m),
            "fraction": pl.Series(x).fill_nan(None),
            "answer": pl.Series(answer_text),
            "hint": pl.Series(_when(is_bias, hint_text, pa.scalar(None, pa.large_string()))),
            "response": pl.Series(response),
        }
    )


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
