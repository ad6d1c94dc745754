"""Run shapes for testing findings on runs rlscope's own `synth` did not write.

An independent latent model of GRPO training, written from the mechanism (it does not import or
copy `rlscope.synth`). Every layer of a run is drawn from the same few latent quantities, so
the layers move together as they do in real training:

* **Prompts.** A training set of arithmetic word problems, each with a latent difficulty
  ``d ~ N(0, 1.2)``. A step draws ``prompts`` of them (without replacement within an epoch).
* **Skill.** The policy's skill ``s(t)`` over training progress ``t in [0, 1]`` (healthy: a
  concave rise). A rollout is correct with probability ``p = sigmoid(s(t) - d)``: correctness
  is Bernoulli(p), so group accuracy, zero-σ groups and pass@k all follow from one latent.
* **Reward** = correctness (``{0, 1}``, or ``{-1, 1}``) plus an optional format term; GRPO
  advantage = (r − group mean) / (group std + 1e-4).
* **Entropy** ``H(t)`` (nats/token) drives both the token table and the *text*: a rollout
  deviates from its group's modal phrasing slot by slot with probability ``q = f(H)``, so lower
  entropy means more shared text within a group (and collapse means copies). Texts are short by
  default (``<think> 17 plus 25 so is 42 </think> <answer> 42 </answer>``, 9-12 words, as a
  small model on an arithmetic task writes: identical responses within a group appear as
  entropy falls, ~0.7 distinct per group at 0.32 nats); ``text="long"`` writes multi-sentence
  word-problem reasoning; agent shapes write search calls with their documents.
* **Tokens** (one per word of the response, <= 16 for short texts): entropy ~ Gamma(0.6)
  scaled to ``H(t)``;
  ``logprob = -entropy * Gamma(2, 1/2)``; ``old_logprob = logprob - δ`` with Laplace δ whose
  scale is solved for the target clip fraction under TRL's rule (``r < 1-ε`` with ``A < 0`` or
  ``r > 1+ε`` with ``A > 0``; ``δ ≡ 0`` on-policy); ``ref_logprob = logprob + η``,
  ``η ~ N(-κ, 2κ)`` so that the k3 estimator's mean is the target KL ``κ(t)``.
* **Steps**: loss ~ small noise around 0 plus β·KL, grad_norm lognormal (σ = 0.2, no spikes),
  linear lr decay; the logged kl / entropy / clip_frac are the token table's own step means
  (a trainer logs what it computed), or the latent targets when no token table is written.
* **Eval** splits: held-out prompts, ID at skill ``s(t)``, OOD at ``s0 + transfer·(s(t)−s0) − 0.4``.

``write_shape(path, shape, seed=, steps=, prompts=, group=)`` writes one run with RunWriter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from rlscope.writer import RunWriter

HEALTHY_SHAPES = (
    "base",
    "low-entropy",
    "dapo-dynamic-sampling",
    "pm1-rewards",
    "steps-from-1",
    "logged-every-k",
    "sparse-eval",
    "rollouts-only",
    "agent-coarse-actions",
    "long-plateau",
    "on-policy",
    "small-batch",
)
FAILURE_SHAPES = (
    "late-entropy-cliff",
    "low-entropy-high-clip",
    "clip-too-high",
    "clip-too-low-offpolicy",
    "reward-up-task-down",
    "text-collapse-constant-actions",
    "ood-stalls",
    "divergence",
)
SHAPES = HEALTHY_SHAPES + FAILURE_SHAPES

Curve = Callable[[float], float]


def _lin(a: float, b: float) -> Curve:
    return lambda t: a + (b - a) * t


def _rise(a: float, b: float, power: float = 0.6) -> Curve:
    """Concave rise from a to b (fast early learning, slowing later)."""
    return lambda t: a + (b - a) * (1 - (1 - t) ** (1 / power)) if t < 1 else b


def _plateau(a: float, b: float, until: float) -> Curve:
    """Rises from a to b over the first `until` of the run, then flat."""
    return lambda t: a + (b - a) * min(1.0, (1 - (1 - min(t / until, 1.0)) ** 2))


def _cliff(a: float, b: float, start: float, width: float) -> Curve:
    """Flat at a, then a fall to b between start and start + width (smoothstep)."""

    def f(t: float) -> float:
        x = min(1.0, max(0.0, (t - start) / width))
        return a + (b - a) * x * x * (3 - 2 * x)

    return f


@dataclass
class Spec:
    """The latent description of one run shape."""

    skill: Curve = field(default_factory=lambda: _rise(-0.5, 1.0))
    entropy: Curve = field(default_factory=lambda: _lin(0.95, 0.70))
    clip: Curve = field(default_factory=lambda: _lin(0.008, 0.004))  # target clip fraction
    kl: Curve = field(default_factory=lambda: _rise(3e-4, 4e-3, 0.8))  # target k3 KL
    on_policy: bool = False
    tokens: bool = True
    steps_table: bool = True
    log_kl_entropy_clip: bool = True
    first_step: int = 0
    step_every: int = 1
    eval_every: int | None = 5
    ood_transfer: float = 0.7
    ood_offset: float = 0.4
    rewards_pm1: bool = False
    write_correct: bool = True
    dapo: bool = False
    agent: bool = False
    constant_actions: bool = False
    # Text: extra share of a group copying one response (0 = none), over t.
    copy_group: Curve = field(default_factory=lambda: lambda t: 0.0)
    # reward-up-task-down: share of well-formed responses over t (None: always well formed)
    format_ok: Curve | None = None
    divergence_at: float | None = None
    grad_norm: float = 0.6
    # response style: `short` (<= 16 words, as a small model on an arithmetic task writes;
    # within-group duplicates appear as entropy falls) or `long` (multi-sentence reasoning)
    text: str = "short"


def _spec(shape: str, **kw: Any) -> Spec:
    s = Spec()
    if shape == "base":
        pass
    elif shape == "low-entropy":
        # as the real TRL healthy run: entropy ~0.65 -> ~0.35, accuracy to ~0.9 (many solved,
        # zero-σ groups late), a third of a group sharing one response at the end
        s = replace(
            s,
            entropy=_lin(0.55, 0.32),
            skill=_rise(-0.2, 2.6),
            clip=_lin(0.012, 0.006),
            kl=_rise(5e-4, 6e-3),
        )
    elif shape == "dapo-dynamic-sampling":
        s = replace(s, dapo=True, clip=_lin(0.015, 0.01))
    elif shape == "pm1-rewards":
        s = replace(s, rewards_pm1=True, write_correct=False)
    elif shape == "steps-from-1":
        s = replace(s, first_step=1)
    elif shape == "logged-every-k":
        s = replace(s, step_every=5)
    elif shape == "sparse-eval":
        s = replace(s, eval_every=20, ood_transfer=0.5)
    elif shape == "rollouts-only":
        s = replace(s, tokens=False, steps_table=False)
    elif shape == "agent-coarse-actions":
        s = replace(s, agent=True)
    elif shape == "long-plateau":
        s = replace(s, skill=_plateau(-0.5, 0.8, 0.4), entropy=_lin(0.82, 0.78))
    elif shape == "on-policy":
        s = replace(s, on_policy=True, clip=lambda t: 0.0)
    elif shape == "small-batch":
        pass
    # -- failure shapes --------------------------------------------------------------------
    elif shape == "late-entropy-cliff":
        s = replace(s, entropy=_cliff(0.70, 0.05, 0.6, 0.15))
    elif shape == "low-entropy-high-clip":
        s = replace(s, entropy=_lin(0.35, 0.13), clip=lambda t: 0.32, kl=_rise(2e-3, 2e-2))
    elif shape == "clip-too-high":
        s = replace(s, entropy=_lin(0.9, 0.75), clip=lambda t: 0.30)
    elif shape == "clip-too-low-offpolicy":
        s = replace(s, clip=lambda t: 1e-5, skill=lambda t: -0.1, entropy=_lin(0.85, 0.82))
    elif shape == "reward-up-task-down":
        s = replace(
            s,
            skill=_lin(-0.6, -1.0),
            format_ok=_rise(0.3, 0.95),
            entropy=_lin(0.9, 0.5),
            write_correct=True,
        )
    elif shape == "text-collapse-constant-actions":
        s = replace(
            s,
            agent=True,
            constant_actions=True,
            entropy=_lin(0.9, 0.3),
            copy_group=lambda t: min(1.0, max(0.0, (t - 0.55) / 0.25)),
        )
    elif shape == "ood-stalls":
        s = replace(s, skill=_rise(-0.5, 1.6), ood_transfer=-0.15, eval_every=4)
    elif shape == "divergence":
        s = replace(s, divergence_at=0.7)
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return replace(s, **kw)


def _sigmoid(x: np.ndarray | float) -> Any:
    return 1.0 / (1.0 + np.exp(-np.asarray(x)))


def _diversity_q(entropy: float) -> float:
    """Per-slot chance that a rollout departs from its group's modal phrasing."""
    return float(min(0.95, max(0.0, 1.2 * entropy - 0.15)))


# ------------------------------------------------------------------------------------------
# Response text
# ------------------------------------------------------------------------------------------

_NAMES = ("Maya", "Tom", "Lena", "Omar", "Priya", "Jonas", "Aiko", "Diego", "Sara", "Ben")
_ITEMS = ("apples", "books", "marbles", "stickers", "coins", "pencils", "cookies", "cards")
_FILLERS = ("Hmm,", "Okay,", "Wait,", "Alright,", "So", "Right,", "Well,", "Now")
_OPEN = (
    "Let me work through this step by step.",
    "We need to find the total number of {item}.",
    "First, read the problem carefully: {name} has {a} {item} and buys {b} packs of {c}.",
    "The question asks how many {item} {name} ends up with.",
    "Let's break the problem into two parts: the packs, then the ones already there.",
    "I will set up the expression {a} + {b} * {c} and evaluate it.",
)
_STEP1 = (
    "Each pack has {c} {item}, so {b} packs give {b} times {c}, which is {bc}.",
    "Multiply {b} by {c} to get {bc}.",
    "The packs contribute {b} * {c} = {bc} {item}.",
    "{b} groups of {c} makes {bc} in total from the packs.",
    "Compute the product first: {c} times {b} equals {bc}.",
)
_STEP2 = (
    "Then add the {a} {item} {name} already had: {a} + {bc} = {ans}.",
    "Adding {a} gives {ans}.",
    "Now {bc} plus {a} makes {ans}.",
    "So the total is {bc} + {a}, that is {ans}.",
    "Putting it together, {a} and {bc} sum to {ans}.",
)
_CHECK = (
    "Let me double check: {ans} minus {a} is {bc}, and {bc} divided by {c} is {b}.",
    "Checking by estimation, {b} packs of about {c} is near {bc}, so {ans} is plausible.",
    "Wait, let me verify the multiplication again. {b} times {c} is {bc}. Yes.",
    "A quick sanity check on the units: the answer counts {item}, which is what was asked.",
    "",
)
_CLOSE = (
    "So the answer is {ans}.",
    "Therefore {name} has {ans} {item}.",
    "Thus the final count is {ans}.",
    "Hence the result is {ans}.",
)
_DETAIL = (
    "The units digit of {x} is {xd}.",
    "Note that {x} is {xr} when rounded to the nearest ten.",
    "Carry the one from the tens place when adding {x}.",
    "Line up the digits of {x} before adding.",
    "Half of {x} would be about {xh}.",
    "{x} is {xe} than fifty.",
    "Keep track of the {item} separately from the packs.",
    "Writing it as a column sum makes the carry easier to see.",
)

# agent (search) task
_ENTITIES = (
    "the Riverside Library",
    "Northgate Bridge",
    "the Halden Observatory",
    "Lakeview Museum",
    "the Corven Railway",
    "Port Elms Lighthouse",
    "the Ashford Botanical Garden",
    "Millbrook Town Hall",
)
_QUERIES = (
    "{ent} founding year",
    "when was {ent} built",
    "{ent} history opened",
    "year {ent} established",
    "{ent} construction completed",
)
_DOCS = (
    "{ent} was established in {year} after a decade of planning by the city council.",
    "Records show that {ent} opened to the public in {year}; it was renovated decades later.",
    "According to the archive, construction of {ent} finished in {year}.",
    "{ent}, completed in {year}, remains one of the oldest landmarks in the region.",
)
_AGENT_THINK = (
    "I need the year {ent} was founded. I should search for it.",
    "The question asks about {ent}. Let me look it up.",
    "I do not remember when {ent} opened, so I will search.",
    "To answer, I need the founding year of {ent}.",
)
_AGENT_AFTER = (
    "The document says {year}.",
    "The search result gives {year} as the year.",
    "So {ent} dates from {year}.",
    "Based on the information, the answer is {year}.",
    "The archive confirms {year}.",
)
_AGENT_RETRY = (
    "That result is not specific enough. Let me search again.",
    "I should confirm this with another source.",
    "Let me refine the query to be sure.",
)


@dataclass
class _Prompt:
    pid: str
    difficulty: float
    a: int
    b: int
    c: int
    name: str
    item: str
    ent: str
    year: int


def _make_prompts(rng: np.random.Generator, n: int, prefix: str, spread: float) -> list[_Prompt]:
    out = []
    for i in range(n):
        out.append(
            _Prompt(
                pid=f"{prefix}{i:04d}",
                difficulty=float(rng.normal(0.0, spread)),
                a=int(rng.integers(3, 60)),
                b=int(rng.integers(2, 13)),
                c=int(rng.integers(3, 25)),
                name=str(rng.choice(_NAMES)),
                item=str(rng.choice(_ITEMS)),
                ent=str(rng.choice(_ENTITIES)),
                year=int(rng.integers(1820, 1990)),
            )
        )
    return out


@dataclass
class _Mode:
    """A group's modal choices: what rollouts share when they do not explore."""

    choices: list[int]
    details: list[tuple[int, int]]
    filler_at: list[int]


def _draw_mode(rng: np.random.Generator, agent: bool) -> _Mode:
    n_slots = 8
    return _Mode(
        choices=[int(rng.integers(0, 1000)) for _ in range(n_slots)],
        details=[(int(rng.integers(0, 1000)), int(rng.integers(10, 999))) for _ in range(3)],
        filler_at=[int(rng.integers(0, 6))],
    )


def _pick(options: tuple[str, ...], mode_choice: int, rng: np.random.Generator, q: float) -> str:
    idx = int(rng.integers(0, len(options))) if rng.random() < q else mode_choice % len(options)
    return options[idx]


def _detail(idx: int, x: int, p: _Prompt) -> str:
    return _DETAIL[idx % len(_DETAIL)].format(
        x=x,
        xd=x % 10,
        xr=round(x, -1),
        xh=x // 2,
        xe="more" if x > 50 else "less",
        item=p.item,
    )


_SHORT_WORDS = ("", "", "so", "ok", "hmm", "then", "wait", "first", "carry", "check", "now", "yes")


def _tagged(
    think: str,
    answer: str,
    well_formed: bool,
    rng: np.random.Generator,
    *,
    after: str,
    untagged: str,
) -> str:
    """The response: well formed, or one of the malformations a half-trained policy makes (an
    unclosed think, text after the answer, or `untagged`), drawn with one rng call."""
    if well_formed:
        return f"<think> {think} </think> <answer> {answer} </answer>"
    kind = rng.integers(0, 3)
    if kind == 0:
        return f"<think> {think} <answer> {answer} </answer>"
    if kind == 1:
        return f"<think> {think} </think> <answer> {answer} </answer> {after}"
    return untagged


def _short_text(
    p: _Prompt, correct: bool, mode: _Mode, q: float, rng: np.random.Generator, well_formed: bool
) -> tuple[str, str]:
    """`<think> [w] 17 plus 25 [w] is 42 [w] </think> <answer> 42 </answer>`: 9 to 12 words.

    Each filler slot and the operand order follow the group's mode unless the rollout explores
    (probability q per slot), so identical responses within a group become common only as
    entropy falls (as in a real small-model run: ~0.93 distinct per group at 0.65 nats,
    ~0.69 at 0.37)."""
    x, y = p.a, p.c
    ans = x + y
    if not correct:
        ans = int(rng.choice([ans - 1, ans + 1, ans + 10, ans - 10, abs(x - y), x * 2]))
        if ans == x + y:
            ans += 1
    w = [_pick(_SHORT_WORDS, mode.choices[k], rng, q) for k in range(3)]
    swap = (mode.choices[3] % 2 == 1) != (rng.random() < q * 0.5)
    a, b = (y, x) if swap else (x, y)
    words = [w[0], str(a), "plus", str(b), w[1], "is", str(ans), w[2]]
    think = " ".join(v for v in words if v)
    answer = str(ans)
    untagged = f"{think} </think> <answer> {answer} </answer>"
    return _tagged(think, answer, well_formed, rng, after="ok", untagged=untagged), answer


def _math_text(
    p: _Prompt,
    correct: bool,
    mode: _Mode,
    q: float,
    rng: np.random.Generator,
    well_formed: bool,
    style: str = "long",
) -> tuple[str, str]:
    if style == "short":
        return _short_text(p, correct, mode, q, rng, well_formed)
    return _long_text(p, correct, mode, q, rng, well_formed)


def _long_text(
    p: _Prompt, correct: bool, mode: _Mode, q: float, rng: np.random.Generator, well_formed: bool
) -> tuple[str, str]:
    bc = p.b * p.c
    ans = p.a + bc
    if not correct:  # an arithmetic slip in one of the two steps
        if rng.random() < 0.6:
            bc = bc + int(rng.choice([-p.c, p.c, -1, 1, 10, -10]))
        ans = p.a + bc + (int(rng.choice([-1, 1, 2])) if rng.random() < 0.4 else 0)
        if ans == p.a + p.b * p.c:
            ans += 1
    fmt = dict(a=p.a, b=p.b, c=p.c, bc=bc, ans=ans, name=p.name, item=p.item)
    parts = [_pick(_OPEN, mode.choices[0], rng, q)]
    # details: shared with the group unless exploring; exploring rollouts add their own
    details = [
        (d if rng.random() >= q else (int(rng.integers(0, 1000)), int(rng.integers(10, 999))))
        for d in mode.details[: 1 + (mode.choices[5] % 3)]
    ]
    if rng.random() < q:
        details.append((int(rng.integers(0, 1000)), int(rng.integers(10, 999))))
    parts.append(_pick(_STEP1, mode.choices[1], rng, q))
    parts += [_detail(i, x, p) for i, x in details[:2]]
    parts.append(_pick(_STEP2, mode.choices[2], rng, q))
    parts += [_detail(i, x, p) for i, x in details[2:]]
    check = _pick(_CHECK, mode.choices[3], rng, q)
    if check:
        parts.append(check)
    if not correct and rng.random() < 0.3:
        parts.append("Hmm, I am not completely sure about the product, but I will go with it.")
    parts.append(_pick(_CLOSE, mode.choices[4], rng, q))
    # fillers: where the group puts them, or anywhere when exploring
    at = mode.filler_at[0] if rng.random() >= q else int(rng.integers(0, len(parts)))
    if at < len(parts):
        filler = _pick(_FILLERS, mode.choices[6], rng, q)
        parts[at] = f"{filler} {parts[at][0].lower()}{parts[at][1:]}"
    think = " ".join(parts).format(**fmt)
    answer = str(ans)
    untagged = f"{think} The answer is {answer}."
    return (
        _tagged(think, answer, well_formed, rng, after="I hope this helps.", untagged=untagged),
        answer,
    )


def _agent_text(
    p: _Prompt,
    correct: bool,
    mode: _Mode,
    q: float,
    rng: np.random.Generator,
    n_calls: int,
) -> tuple[str, str, list[str]]:
    year = p.year if correct else p.year + int(rng.choice([-10, -3, -1, 1, 2, 5, 20]))
    fmt = dict(ent=p.ent, year=year)
    parts = [f"<think> {_pick(_AGENT_THINK, mode.choices[0], rng, q).format(**fmt)} </think>"]
    calls = []
    for k in range(n_calls):
        query = _pick(_QUERIES, mode.choices[1 + k], rng, q).format(ent=p.ent)
        if rng.random() < q * 0.5:  # a personal touch to the query
            query += " " + str(rng.choice(["official", "date", "records", "wiki", "archive"]))
        doc_year = year if k == n_calls - 1 else p.year + int(rng.integers(-40, 40))
        doc = _pick(_DOCS, mode.choices[4 + k % 3], rng, q).format(ent=p.ent, year=doc_year)
        calls.append(json.dumps({"query": query}))
        parts.append(f"<search> {query} </search> <information> {doc} </information>")
        if k < n_calls - 1:
            parts.append(f"<think> {_pick(_AGENT_RETRY, mode.choices[7], rng, q)} </think>")
    after = _pick(_AGENT_AFTER, mode.choices[7], rng, q).format(**fmt)
    parts.append(f"<think> {after} </think> <answer> {year} </answer>")
    return " ".join(parts), str(year), calls


_SEGMENT_TAGS = {
    "think": "think",
    "answer": "answer",
    "search": "tool_call",
    "information": "tool_response",
}


def _segments(text: str) -> list[str]:
    """Segment of every whitespace word (tags belong to the segment they open or close)."""
    out = []
    current = "text"
    for word in text.split():
        if word.startswith("<") and word.endswith(">"):
            name = word.strip("</>")
            seg = _SEGMENT_TAGS.get(name, "text")
            out.append(seg)
            current = "text" if word.startswith("</") else seg
        else:
            out.append(current)
    return out


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------


def _clip_noise(target: float, adv: np.ndarray, rng: np.random.Generator, eps: float = 0.2):
    """δ = log r for every token: Laplace(0, b), b solved (bisection on these very draws) so
    that TRL's rule (r < 1-ε with A < 0, or r > 1+ε with A > 0) clips `target` of the tokens.
    Capped at what is reachable: tokens with A = 0 (zero-σ groups) are never clipped."""
    u = rng.laplace(0.0, 1.0, adv.shape[0])
    if target <= 0:
        return np.zeros_like(u)
    hi_cut, lo_cut = math.log(1 + eps), math.log(1 - eps)
    pos, neg = adv > 0, adv < 0

    def clipped(b: float) -> float:
        d = b * u
        return float(np.mean((pos & (d > hi_cut)) | (neg & (d < lo_cut))))

    if target * adv.shape[0] < 20:
        # Too few tokens for the target to be met on these draws (e.g. 1e-5 of 1,500 tokens):
        # solve the expected fraction instead, so most steps clip nothing and a few clip one.
        fp, fn = float(np.mean(pos)), float(np.mean(neg))

        def expected(b: float) -> float:
            return 0.5 * (fp * math.exp(-hi_cut / b) + fn * math.exp(lo_cut / b))

        fraction = expected
    else:
        fraction = clipped
    lo, hi = 1e-4, 20.0
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if fraction(mid) < target else (lo, mid)
    return math.sqrt(lo * hi) * u


def write_shape(
    path: str | Path,
    shape: str,
    *,
    seed: int,
    steps: int,
    prompts: int,
    group: int,
    **kw: Any,
) -> Path:
    """Write one run of `shape` (see HEALTHY_SHAPES, FAILURE_SHAPES) to `path`; return it.

    `kw` overrides fields of the shape's Spec (e.g. ``tokens=False``).
    """
    if shape == "small-batch":
        prompts, group = min(prompts, 4), min(group, 4)
    spec = _spec(shape, **kw)
    path = Path(path)
    rng = np.random.default_rng(seed * 7919 + sum(map(ord, shape)))
    n_train = max(4 * prompts, 64)
    train_prompts = _make_prompts(rng, n_train, "p", 1.2)
    eval_id = _make_prompts(rng, 24, "id", 1.2)
    eval_ood = _make_prompts(rng, 24, "ood", 1.2)
    skill0 = spec.skill(0.0)
    meta: dict[str, Any] = dict(
        group_size=group,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        max_response_len=1024,
    )
    if spec.format_ok is not None:
        meta["reward_components"] = ["accuracy_reward", "format_reward"]
        meta["correct_source"] = "accuracy_reward > 0"
    if spec.agent:
        meta["max_tool_calls"] = 5
    order: list[int] = []
    rollout_id = 0
    with RunWriter(
        path,
        run_id=f"{shape}-{seed}",
        algorithm="GRPO (DAPO)" if spec.dapo else "GRPO",
        flush_rows={"tokens": 400_000, "rollouts": 50_000},
        **meta,
    ) as writer:
        for i in range(steps):
            t = i / max(1, steps - 1)
            step = spec.first_step + i * spec.step_every
            skill = spec.skill(t)
            ent = spec.entropy(t)
            q = _diversity_q(ent)
            copy = spec.copy_group(t)
            fmt_p = spec.format_ok(t) if spec.format_ok is not None else 1.0
            rows: list[dict[str, Any]] = []
            groups_logged = 0
            attempts = 0
            while groups_logged < prompts:
                attempts += 1
                if not order:
                    order = list(rng.permutation(n_train))
                pr = train_prompts[order.pop()]
                p_correct = float(_sigmoid(skill - pr.difficulty))
                correct = rng.random(group) < p_correct
                fmt_ok = rng.random(group) < fmt_p
                acc_r = correct.astype(float)
                fmt_r = np.where(fmt_ok, 0.25, 0.0) if spec.format_ok is not None else 0 * acc_r
                reward = (2 * acc_r - 1) if spec.rewards_pm1 else acc_r + fmt_r
                if spec.dapo and np.all(reward == reward[0]) and attempts < 20 * prompts:
                    continue  # DAPO dynamic sampling: zero-σ groups never reach the update
                group_rows = _group_rows(
                    spec, pr, rng, step, q, copy, t, correct, fmt_ok, reward, acc_r, fmt_r, group
                )
                rows += group_rows
                groups_logged += 1
            for row in rows:
                row["rollout_id"] = rollout_id
                rollout_id += 1
            writer.log_rollouts(rows)
            # eval
            if (spec.eval_every and i % spec.eval_every == 0) or (
                spec.eval_every and i == steps - 1
            ):
                s_ood = skill0 + spec.ood_transfer * (skill - skill0) - spec.ood_offset
                eval_rows = []
                for split, pool, s in (("eval_id", eval_id, skill), ("eval_ood", eval_ood, s_ood)):
                    for pr in pool:
                        c = rng.random(2) < float(_sigmoid(s - pr.difficulty))
                        for k in range(2):
                            text, answer = _math_text(
                                pr, bool(c[k]), _draw_mode(rng, False), q, rng, True, spec.text
                            )
                            eval_rows.append(
                                dict(
                                    rollout_id=rollout_id,
                                    step=step,
                                    prompt_id=pr.pid,
                                    split=split,
                                    reward=float(c[k]) * (2 if spec.rewards_pm1 else 1)
                                    - (1 if spec.rewards_pm1 else 0),
                                    correct=bool(c[k]),
                                    response_len=len(text.split()),
                                    truncated=False,
                                    answer=answer,
                                    response=text,
                                )
                            )
                            rollout_id += 1
                if not spec.write_correct:
                    for r in eval_rows:
                        r.pop("correct")
                writer.log_rollouts(eval_rows)
            # tokens and steps
            logged: dict[str, float] = {}
            kl_target = spec.kl(t)
            clip_target = spec.clip(t)
            if spec.tokens:
                logged = _write_tokens(writer, rows, rng, step, ent, kl_target, clip_target, spec)
            else:
                logged = dict(
                    entropy=ent * float(np.exp(rng.normal(0, 0.03))),
                    kl=kl_target * float(np.exp(rng.normal(0, 0.1))),
                    clip_frac=clip_target * float(np.exp(rng.normal(0, 0.1))),
                )
            if spec.steps_table:
                gn = spec.grad_norm * float(np.exp(rng.normal(0, 0.2)))
                loss = float(rng.normal(0, 0.015)) + 0.04 * logged["kl"]
                if spec.divergence_at is not None and i == int(spec.divergence_at * steps):
                    gn, loss = float("nan"), float("inf")
                metrics: dict[str, float] = dict(loss=loss, grad_norm=gn, lr=1e-6 * (1 - 0.9 * t))
                if spec.log_kl_entropy_clip:
                    metrics.update(logged)
                writer.log_step(step, **metrics)
    return path


def _group_rows(
    spec: Spec,
    pr: _Prompt,
    rng: np.random.Generator,
    step: int,
    q: float,
    copy: float,
    t: float,
    correct: np.ndarray,
    fmt_ok: np.ndarray,
    reward: np.ndarray,
    acc_r: np.ndarray,
    fmt_r: np.ndarray,
    group: int,
) -> list[dict[str, Any]]:
    mode = _draw_mode(rng, spec.agent)
    # collapse: a share of the group is a copy of its first rollout (same text, same answer)
    copies = rng.random(group) < copy
    copies[0] = False
    if copies.any():
        correct = correct.copy()
        correct[copies] = correct[0]
        fmt_ok = fmt_ok.copy()
        fmt_ok[copies] = fmt_ok[0]
        acc_r = correct.astype(float)
        fmt_r = np.where(fmt_ok, 0.25, 0.0) if spec.format_ok is not None else 0 * acc_r
        reward = (2 * acc_r - 1) if spec.rewards_pm1 else acc_r + fmt_r
    std = float(np.std(reward, ddof=1)) if group > 1 else 0.0
    adv = (reward - reward.mean()) / (std + 1e-4)
    rows = []
    for k in range(group):
        src = 0 if copies[k] else k
        if k == src or not rows:
            row: dict[str, Any] = dict(step=step, prompt_id=pr.pid, split="train")
            if spec.agent:
                if spec.constant_actions:
                    n_calls = 1
                else:
                    # Search-R1 style: most rollouts search once; re-searching is common early
                    # and fades as the policy learns to write one good query
                    research = 0.45 - 0.40 * t
                    n_calls = 1 if rng.random() >= research else int(rng.integers(2, 4))
                text, answer, calls = _agent_text(pr, bool(correct[k]), mode, q, rng, n_calls)
                row.update(
                    actions=["search"] * n_calls + ["answer"],
                    tool_calls=calls,
                    n_tool_calls=n_calls,
                )
            else:
                text, answer = _math_text(
                    pr, bool(correct[k]), mode, q, rng, bool(fmt_ok[k]), spec.text
                )
            row.update(response=text, answer=answer, response_len=len(text.split()))
        else:
            row = dict(rows[src])
        row.update(
            reward=float(reward[k]),
            advantage=float(adv[k]),
            truncated=False,
        )
        if spec.write_correct:
            row["correct"] = bool(correct[k])
        if spec.format_ok is not None:
            row["accuracy_reward"] = float(acc_r[k])
            row["format_reward"] = float(fmt_r[k])
        rows.append(row)
    return rows


def _write_tokens(
    writer: RunWriter,
    rows: list[dict[str, Any]],
    rng: np.random.Generator,
    step: int,
    ent: float,
    kl_target: float,
    clip_target: float,
    spec: Spec,
) -> dict[str, float]:
    lens = np.array([r["response_len"] for r in rows])
    n = int(lens.sum())
    rid = np.repeat(np.array([r["rollout_id"] for r in rows]), lens)
    adv = np.repeat(np.array([r["advantage"] for r in rows]), lens)
    pos = np.concatenate([np.arange(m) for m in lens])
    seg = [s for r in rows for s in _segments(r["response"])]
    # skewed per-token entropy: most tokens near-deterministic, a few forking tokens
    shape_k = 0.6
    entropy = rng.gamma(shape_k, ent / shape_k, n)
    logprob = -entropy * rng.gamma(2.0, 0.5, n)
    old = logprob.copy() if spec.on_policy else logprob - _clip_noise(clip_target, adv, rng)
    eta = rng.normal(-kl_target, math.sqrt(2 * kl_target), n)
    ref = logprob + eta
    writer.log_tokens(
        dict(
            rollout_id=rid,
            step=np.full(n, step),
            pos=pos.astype(np.int32),
            logprob=logprob.astype(np.float32),
            old_logprob=old.astype(np.float32),
            ref_logprob=ref.astype(np.float32),
            entropy=entropy.astype(np.float32),
            advantage=adv.astype(np.float32),
            segment=seg,
        )
    )
    # what the trainer would log: its own step means over the same tokens
    lp, od, rf = (x.astype(np.float32).astype(np.float64) for x in (logprob, old, ref))
    ratio = np.exp(lp - od)
    clipped = ((ratio < 0.8) & (adv < 0)) | ((ratio > 1.2) & (adv > 0))
    d = rf - lp
    return dict(
        entropy=float(entropy.astype(np.float32).mean()),
        kl=float(np.mean(np.exp(d) - d - 1)),
        clip_frac=float(clipped.mean()),
    )
