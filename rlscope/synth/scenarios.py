"""Scenarios: the latent model's knobs (Scenario), the healthy run and one variant per diagnosis."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

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
            "mean is ~5x the middle third's; skill flat (s = -0.3): the drift buys nothing.",
            kl=lambda u: 0.002 * math.exp(5.0 * u),
            skill=lambda u: -0.3,
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
