"""What a rule sees (RuleContext) and the series statistics rules share."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
from numpy.lib.stride_tricks import sliding_window_view

from rlscope.metrics._common import UNITS
from rlscope.metrics.signal import ACC_SQ, PROMPTS
from rlscope.report import MetricResult
from rlscope.spec import Finding, Rule, Severity
from rlscope.windows import TREND_FRACTION, window_size

#: Rules that read a trend need at least this many steps with values (overridable per rule).
MIN_TREND_STEPS = 10
#: z of a one-sided 95% bound: "surely above" / "surely flat" judgements of small samples.
ONE_SIDED_95 = 1.645
#: Steps over which a final window's step-to-step scatter is measured, at least.
SCATTER_STEPS = 8


@dataclass(frozen=True)
class Series:
    """A metric's per-step values as float arrays (NaN where the metric is undefined)."""

    steps: np.ndarray
    values: np.ndarray

    @classmethod
    def of(cls, result: MetricResult) -> Series:
        values = np.array([np.nan if v is None else v for v in result.values], dtype=np.float64)
        keep = np.isfinite(values)
        return cls(np.asarray(result.steps, dtype=np.int64)[keep], values[keep])

    def __len__(self) -> int:
        return len(self.values)


@dataclass(frozen=True)
class Windows:
    """Mean of the first and the last window of a series and how sure their difference is."""

    first: float
    last: float
    delta: float
    z: float
    first_steps: tuple[int, int]
    last_steps: tuple[int, int]
    se: float = 0.0  # standard error of `delta`
    # Degrees of freedom of the noise `se` was estimated from (None: a known sampling model).
    dof: int | None = None

    def rising(self, z: float) -> bool:
        """Significantly up: the rise is at least `z` standard errors (`z` widened as
        Student's t when the noise was estimated from few steps: `t_quantile`)."""
        return self.delta > 0 and self.z >= t_quantile(z, self.dof)

    def not_rising(self, tolerance: float, z: float = 2.0) -> bool:
        """Flat or falling, and sure of it: the upper end of the rise's interval (delta + z·se)
        is below `tolerance`. A rise that is merely not significant, in a window too noisy to
        tell, is not flat."""
        return self.delta + z * self.se <= tolerance

    def falling(self, z: float) -> bool:
        return self.delta < 0 and self.z <= -t_quantile(z, self.dof)


def t_quantile(z: float, dof: int | None) -> float:
    """The Student-t quantile with `dof` degrees of freedom at the normal quantile `z`
    (Cornish-Fisher): a noise estimated from 20 steps is itself uncertain, so a z of 3 is
    not 3 standard errors; `z` itself for None or a large dof."""
    if dof is None or dof <= 0:
        return z
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


def compare_windows(
    series: Series, fraction: float = TREND_FRACTION, first: int | None = None
) -> Windows:
    """First vs last window (each `fraction` of the steps, >= 3; the first window `first`
    steps when given: the run's start): delta and a z-score whose noise is the step-to-step
    scatter (so it holds at any batch size): within each window, and never less than the whole
    series' (`step_noise`): three values can sit close by chance, and a window of them judged
    on its own spread would make noise significant."""
    n = len(series)
    w = window_size(n, fraction)
    a, b = series.values[: first or w], series.values[-w:]
    # Each window's scatter over at least SCATTER_STEPS steps around it (as final_se).
    around = min(n, SCATTER_STEPS)
    floor = step_noise(series.values) ** 2
    var_a = max(_var(series.values[: max(len(a), around)]), floor)
    var_b = max(_var(series.values[-max(w, around) :]), floor)
    se = math.sqrt(var_a / len(a) + var_b / len(b))
    return _windows(float(a.mean()), float(b.mean()), se, series.steps, len(a), w, dof=n - 1)


def step_noise(values: np.ndarray) -> float:
    """A series' step-to-step noise (standard deviation) from its successive differences (von
    Neumann's mean square successive difference, Σ(x[t] − x[t−1])² / 2(n − 1)): a smooth trend
    or a single level shift hardly moves it, unlike the spread around the mean. 0 with < 3
    values."""
    if len(values) < 3:
        return 0.0
    return math.sqrt(float(np.mean(np.diff(values) ** 2)) / 2.0)


def _windows(
    first: float, last: float, se: float, steps: Any, head: int, tail: int, dof: int | None = None
) -> Windows:
    """The Windows of two window means and the standard error of their difference (`steps`:
    the series' steps, the first window its `head` first, the last its `tail` last; `dof`:
    of the noise `se` was estimated from, None for a sampling model)."""
    delta = last - first
    z = delta / se if se > 0 else (math.inf if delta > 0 else -math.inf if delta < 0 else 0.0)
    return Windows(
        first,
        last,
        delta,
        z,
        (int(steps[0]), int(steps[head - 1])),
        (int(steps[-tail]), int(steps[-1])),
        se,
        dof,
    )


#: Fewest points of a series whose points carry their own sampling error (a first and a last
#: window of 3 that do not overlap).
MIN_EVIDENCE_POINTS = 6


def compare_pooled_windows(
    frame: pl.DataFrame,
    units: str,
    sum_sq: str,
    fraction: float = TREND_FRACTION,
    first: int | None = None,
) -> Windows | None:
    """First vs last window (each `fraction` of the points, >= 3; the first window `first`
    points when given: the run's start) of a per-step mean of per-unit values (`value`: the
    mean over the step's `units`, `sum_sq`: Σ value²), pooled over each window's units, so
    each point weighs what it measured: a sparse series of big batches is judged on its
    evidence, a dense one of tiny batches is not over-trusted. The standard error of a window
    is the spread of its units over their number: the units (prompt groups, each drawn afresh
    with its difficulty) are the sampling unit, so this is the error whatever the batch size
    and the number of points (a window's step-to-step scatter estimates the same from 3 to 10
    values, far more noisily); never below the step-to-step noise (`step_noise`) over the
    window's points, since a handful of groups can agree by chance. None with fewer than
    MIN_EVIDENCE_POINTS points."""
    rows = frame.filter(pl.col("value").is_not_null() & (pl.col(units) > 0)).sort("step")
    n = rows.height
    if n < MIN_EVIDENCE_POINTS:
        return None
    w = window_size(n, fraction)
    head = first or w
    noise = step_noise(rows["value"].cast(pl.Float64).to_numpy())
    means, ses = [], []
    for window in (rows.head(head), rows.tail(w)):
        count = window[units].cast(pl.Float64).to_numpy()
        values = window["value"].cast(pl.Float64).to_numpy()
        squares = window[sum_sq].cast(pl.Float64).to_numpy()
        total = count.sum()
        mean = float((values * count).sum() / total)
        spread = max(float(squares.sum()) / total - mean**2, 0.0) * total / max(total - 1, 1)
        means.append(mean)
        ses.append(max(math.sqrt(spread / total), noise / math.sqrt(window.height)))
    return _windows(means[0], means[1], math.hypot(*ses), rows["step"].to_list(), head, w)


def pass_at_1_frame(ctx: RuleContext, *, fall: bool = False) -> pl.DataFrame | None:
    """pass@1's frame with its sampling units (`groups`, and Σ value² in ACC_SQ), None without
    them. To judge a `fall`, a logged accuracy's prompts (PROMPTS) where it has them, each a
    0/1 draw: without the prompt groups, the most a prompt's group can vary, so a steps-only
    log never names a fall surer than its rollouts would (a rise, which spares a finding, is
    judged on the responses: the bound would there alarm more)."""
    frame = ctx.frame("signal.pass_at_1")
    if frame is None or not {"groups", ACC_SQ} <= set(frame.columns):
        return None
    if fall and PROMPTS in frame.columns:
        prompts = pl.col(PROMPTS).cast(pl.Float64)
        frame = frame.with_columns(
            prompts.alias("groups"), (pl.col("value") * prompts).alias(ACC_SQ)
        )
    return frame


def pass_at_1_trend(
    ctx: RuleContext,
    fraction: float = TREND_FRACTION,
    min_steps: float = MIN_TREND_STEPS,
    first: int | None = None,
    *,
    fall: bool = False,
) -> Windows | None:
    """pass@1's first (or its `first` points: the start) vs last window judged on its evidence
    (`compare_pooled_windows`: each window pools its prompt groups, or to judge a `fall`
    `pass_at_1_frame`'s units; from MIN_EVIDENCE_POINTS points) where its frame carries them,
    else on the step-to-step scatter of at least `min_steps` steps; None without."""
    frame = pass_at_1_frame(ctx, fall=fall)
    if frame is not None:
        return compare_pooled_windows(frame, "groups", ACC_SQ, fraction, first)
    series = ctx.series("signal.pass_at_1")
    if series is None or len(series) < max(min_steps, 1):
        return None
    return compare_windows(series, fraction, first)


#: Steps before a fall's first step that are its reference level (the run's level so far).
REFERENCE_STEPS = 10
#: Last steps of a fall that say whether it lasts.
RECENT_STEPS = 3


@dataclass(frozen=True)
class Fall:
    """A fall of a per-step mean below the run's own level, sure by a sequential test."""

    began: int  # the first step of the fall
    sure: int  # the step at which the test became sure of it
    before: float  # the reference level (pooled over the steps before `began`)
    reference: tuple[int, int]  # the reference's first and last step
    after: float  # the level since `began` (pooled)
    shift: float  # the fall the test that crossed was tuned to
    threshold: float  # its log-likelihood-ratio threshold


#: Starts of a fall within this many steps from a change of a setting share half the test's
#: false-alarm budget (`sequential_fall`'s `primed`).
PRIMED_STEPS = 10


def fall_threshold(j: int, step: int, primed: Sequence[int], alpha: float, tests: int) -> float:
    """The log-likelihood-ratio threshold of a fall starting at the j-th judged step (`step`):
    half of `alpha` is spent over every start (1/(2j(j + 1)) of it to the j-th), the other half
    over the PRIMED_STEPS + 1 steps from each step in `primed` (1/(2c(c + 1)) of it to the c-th),
    so the budget sums to at most `alpha` over a run of any length, each share decided before
    the fall's own data, and a fall right after a change of what drives the update is sure
    sooner; `tests` (one per shift) share each start's budget."""
    share = 1 / (2 * j * (j + 1))
    for c, at in enumerate(primed, 1):
        if at <= step <= at + PRIMED_STEPS:
            share += 1 / (2 * c * (c + 1) * (PRIMED_STEPS + 1))
    return math.log(tests / (alpha * share))


def sequential_fall(
    frame: pl.DataFrame,
    units: str,
    sum_sq: str,
    alpha: float,
    shifts: Sequence[float],
    primed: Sequence[int] = (),
) -> Fall | None:
    """A sustained fall of a per-step mean of per-unit values (`value`: the mean over the
    step's `units`, `sum_sq`: Σ value²; pass@1's groups) below the run's own level, judged step
    by step by a sequential likelihood-ratio test for each fall δ in `shifts`. While no fall
    is under way the reference is the pooled mean of the last REFERENCE_STEPS steps; a fall
    starts at the first step below it and keeps that reference until its statistic returns
    to 0 (as in Page's CUSUM). The statistic is the log of the likelihood ratio of the steps
    since the start, a level δ below the reference against the reference's level, with the
    reference's own sampling error s² integrated out (it is shared by every step compared with
    it): for steps of variance σᵢ² (weights wᵢ = 1/σᵢ², W = Σwᵢ, Y = Σwᵢ(reference − meanᵢ)),
    (δY − δ²W/2)/(1 + s²W), so a long fall is judged against how well the reference is known,
    not only against each step's noise. A step's variance is its units' spread over their
    number (never below the reference's per-unit spread, widened for a reference of few
    units) and never below the reference's step-to-step noise (units that are not
    independent, a steps-only log's responses of one prompt, show there). A likelihood ratio
    is a martingale under its null, so by Ville's inequality the test from a start crosses its
    threshold (`fall_threshold`: the start's share of `alpha`, more for starts within
    PRIMED_STEPS of a step in `primed`, where a setting changed) with at most that
    probability: summed over every start and shift, a run of any length raises a false alarm
    with probability at most `alpha`, however many prefixes are judged (the sampling model
    holding: a level that does not fall, steps independent given it). The fall is reported
    while it lasts: its last RECENT_STEPS steps still below the reference by δ/2 and by twice
    their standard error (a run that recovered has none)."""
    rows = frame.filter(pl.col("value").is_not_null() & (pl.col(units) > 0)).sort("step")
    if rows.height < 2:
        return None
    steps = rows["step"].cast(pl.Int64).to_numpy()
    mean = rows["value"].cast(pl.Float64).to_numpy()
    count = rows[units].cast(pl.Float64).to_numpy()
    squares = rows[sum_sq].cast(pl.Float64).to_numpy()
    # per-unit variance of each step around its own mean (n − 1); NaN for a single unit
    spread = np.where(
        count > 1, (squares - count * mean**2) / np.maximum(count - 1, 1), np.nan
    ).clip(0.0)
    found: list[Fall] = []
    for shift in shifts:
        statistic, start, crossed, threshold = 0.0, 0, None, math.inf
        ref_mean = ref_var = ref_se2 = noise2 = weights = weighted = 0.0
        for i in range(1, len(mean)):
            if statistic <= 0.0:
                start, crossed, weights, weighted = i, None, 0.0, 0.0
                lo = max(0, i - REFERENCE_STEPS)
                total = float(count[lo:i].sum())
                ref_mean = float((mean[lo:i] * count[lo:i]).sum() / total)
                # the units' spread around the reference, over every reference step
                around = float((squares[lo:i] - 2 * ref_mean * mean[lo:i] * count[lo:i]).sum())
                ref_var = max(around / total + ref_mean**2, 0.0) * total / max(total - 1, 1)
                ref_var *= 1 + 2 / max(total - 1, 1)  # a variance of few units is itself unsure
                noise2 = step_noise(mean[lo:i]) ** 2
                ref_se2 = max(ref_var / total, noise2 / (i - lo))
                threshold = fall_threshold(i, int(steps[i]), primed, alpha, len(shifts))
            unit_var = max(ref_var, 0.0 if np.isnan(spread[i]) else float(spread[i]))
            variance = max(unit_var / count[i], noise2)
            if variance <= 0 and ref_se2 <= 0:
                statistic = 0.0
                continue
            weight = 1 / max(variance, 1e-12)
            weights += weight
            weighted += weight * (ref_mean - mean[i])
            statistic = (shift * weighted - shift**2 * weights / 2) / (1 + ref_se2 * weights)
            if crossed is None and statistic >= threshold:
                crossed = i
        recent = slice(max(start, len(mean) - RECENT_STEPS), len(mean))
        level = float((mean[recent] * count[recent]).sum() / count[recent].sum())
        noise = 2 * math.sqrt(ref_var / count[recent].sum() + ref_se2)
        if crossed is not None and statistic > 0.0 and level < ref_mean - max(shift / 2, noise):
            after = float((mean[start:] * count[start:]).sum() / count[start:].sum())
            lo = max(0, start - REFERENCE_STEPS)
            reference = (int(steps[lo]), int(steps[start - 1]))
            began, sure = int(steps[start]), int(steps[crossed])
            found.append(Fall(began, sure, ref_mean, reference, after, shift, threshold))
    return min(found, key=lambda f: (f.sure, f.began), default=None)


def halfway_step(series: Series, start: float, end: float) -> int:
    """The first step after the first at which a series that moved from level `start` to level
    `end` is past half-way, judged on a centred median of 3 steps (one noisy step does not
    count): where a collapse happened, or a fall was half done. The last step if it never is."""
    smooth = rolling_median(series.values, 3)[1:]  # from the second step: a change follows one
    middle = (start + end) / 2
    past = smooth <= middle if end < start else smooth >= middle
    hits = np.flatnonzero(past)
    return int(series.steps[hits[0] + 1] if len(hits) else series.steps[-1])


#: The optimisation's own settings and responses, as findings name them.
UPDATE_NAMES = {
    "stability.lr": "learning rate",
    "stability.critic_lr": "critic learning rate",
    "stability.kl": "KL to the reference",
    "stability.grad_norm": "gradient norm",
    "stability.clip_frac": "clip fraction",
    "behavior.entropy": "token entropy",
    "behavior.response_len": "response length",
}
#: Those whose change at a step can explain what broke there (quoted by a finding as what
#: changed where it began).
DRIVERS = {m: UPDATE_NAMES[m] for m in ("stability.lr", "stability.kl", "stability.grad_norm")}
#: A driver changed at a step when its level after is at least this many times its level
#: before (or at most its inverse), and apart by more than its step-to-step noise.
DRIVER_RATIO = 2.0


def fold(a: float, b: float) -> float:
    """How many times larger the larger of two levels is than the smaller (by magnitude): a
    change's size whichever way it went; inf from 0 to anything else, 1 for two zeros."""
    low, high = sorted((abs(a), abs(b)))
    return high / low if low > 0 else (math.inf if high > 0 else 1.0)


def changed_at(ctx: RuleContext, step: int) -> dict[str, tuple[float, float]]:
    """The DRIVERS that changed where a finding began (`step`): the mean of the 5 steps before
    step − 3 against the mean of steps step − 3 … step + 2 (a cause takes a few updates to
    show in the rollouts, and its own jump can take as long); {metric id:
    (before, after)}, only for a change of ×DRIVER_RATIO beyond the series' step-to-step noise.
    With no step before, the first value is the before."""
    changed = {}
    for metric_id in DRIVERS:
        series = ctx.series(metric_id)
        if series is None or len(series) < 2:
            continue
        steps, values = series.steps, series.values
        earlier = values[steps < step - 3]
        before = earlier[-5:] if len(earlier) else values[:1]
        after = values[(steps >= step - 3) & (steps <= step + 2)]
        if not len(after):
            continue
        a, b = float(np.mean(before)), float(np.mean(after))
        if fold(a, b) >= DRIVER_RATIO and abs(b - a) > 2 * step_noise(earlier):
            changed[metric_id] = (a, b)
    return changed


#: Settings whose step up can break the policy (or its critic), as logged.
SETTINGS = ("stability.lr", "stability.critic_lr")
#: A setting changed when it reaches this many times its highest value so far...
SETTING_RATIO = 2.0
#: ...by a step this many times larger than its schedule's own recent steps (a warm-up's).
SCHEDULE_STEP_RATIO = 3.0


@dataclass(frozen=True)
class Change:
    """A step change of a series at `step`: its level `before` and `after` it."""

    metric: str
    step: int
    before: float
    after: float
    until: int  # the last step `after` was measured over

    @property
    def factor(self) -> float:
        return self.after / self.before if self.before > 0 else math.inf


def setting_jumps(series: Series, metric: str) -> list[Change]:
    """The steps where a logged setting (a learning rate) jumped up outside its schedule: to at
    least SETTING_RATIO times its highest value so far, by a step at least SCHEDULE_STEP_RATIO
    times the largest of the schedule's last 3 steps. A linear or exponential warm-up moves by
    steps like its previous ones, a cosine or step decay goes down, a warm restart returns to
    a level the run had; none is a jump. Judged from the third logged value (the first two
    give the schedule's first step)."""
    values, steps = series.values, series.steps
    jumps = []
    for i in range(2, len(values)):
        highest = float(values[:i].max())
        step_size = float(values[i] - values[i - 1])
        schedule = float(np.abs(np.diff(values[max(0, i - 3) : i])).max())
        if values[i] >= SETTING_RATIO * highest and step_size > SCHEDULE_STEP_RATIO * schedule:
            jumps.append(
                Change(metric, int(steps[i]), float(values[i - 1]), float(values[i]), int(steps[i]))
            )
    return jumps


@dataclass(frozen=True)
class Response:
    """How a response of the optimisation changes when an update broke: the least factor of a
    sustained shift that counts, whether only a rise counts, the least level it must reach."""

    factor: float
    up_only: bool = False
    floor: float = 0.0


#: Responses of the optimisation whose sustained step change is a finding by itself. The
#: factors are beyond the largest sustained shift of the genuine healthy runs (tests/genuine,
#: the scorecard's twins): ×5.5 for the KL (a PPO loop's first steps), ×1.4 for the token
#: entropy, ×1.05 for the response length. A KL or clip fraction that falls breaks nothing,
#: and one that stays small (under 0.1 nats/token, 5% of tokens) has not broken it either. The
#: gradient norm is quoted, never judged alone: healthy Dr. GRPO runs shift it ×8 for several
#: steps (unnormalised advantages scale it with the groups' reward spread).
RESPONSES = {
    "stability.kl": Response(10.0, up_only=True, floor=0.1),
    "stability.clip_frac": Response(3.0, up_only=True, floor=0.05),
    "behavior.entropy": Response(2.0),
    "behavior.response_len": Response(1.5),
}
#: Steps before a candidate change that give the level it changed from, and steps after it.
SHIFT_BEFORE, SHIFT_AFTER = 10, 3


def level_shifts(series: Series, metric: str, response: Response, z: float) -> list[Change]:
    """Sustained step changes of a positive series: the median of SHIFT_AFTER steps from a step
    at least `response.factor` times (or, unless only a rise counts, at most its inverse) the
    median of the SHIFT_BEFORE steps before it and at least the response's floor, on a log
    scale beyond `z` times the before-window's own noise (the larger of its robust spread and
    its step-to-step noise; a median of 3 is not moved by one spike). Judged only against a
    settled level: the before-window's halves within ×2 of each other (a KL still growing from
    0 at a run's start has no level to change from). The first step past the middle of each
    stretch of such steps."""
    values, steps = series.values, series.steps
    positive = values[values > 0]
    if len(values) < SHIFT_BEFORE + SHIFT_AFTER or not len(positive):
        return []
    logs = np.log10(np.maximum(values, float(np.quantile(positive, 0.05))))
    # every candidate step i at once: the SHIFT_BEFORE steps before it, the SHIFT_AFTER from it
    count = len(logs) - SHIFT_BEFORE - SHIFT_AFTER + 1
    before = sliding_window_view(logs, SHIFT_BEFORE)[:count]
    after = sliding_window_view(logs, SHIFT_AFTER)[SHIFT_BEFORE : SHIFT_BEFORE + count]
    half = SHIFT_BEFORE // 2
    level, later = np.median(before, axis=1), np.median(after, axis=1)
    settled = np.abs(np.median(before[:, half:], axis=1) - np.median(before[:, :half], axis=1))
    spread = 1.4826 * np.median(np.abs(before - level[:, None]), axis=1)
    # step_noise of each before-window: von Neumann's Σ(Δ)² / 2(n − 1)
    successive = np.sqrt(np.mean(np.diff(before, axis=1) ** 2, axis=1) / 2)
    noise = np.maximum(np.maximum(spread, successive), 1e-12)
    delta = later - level
    # the standard error of a difference of medians (π/2 × a mean's variance)
    se = noise * math.sqrt(math.pi / 2 * (1 / SHIFT_AFTER + 1 / SHIFT_BEFORE))
    big = delta >= math.log10(response.factor)
    if not response.up_only:
        big |= -delta >= math.log10(response.factor)
    found = (
        (settled < math.log10(2)) & big & (10**later >= response.floor) & (np.abs(delta) >= z * se)
    )
    shifts: list[Change] = []
    for k in np.flatnonzero(found):
        i = int(k) + SHIFT_BEFORE
        if shifts and shifts[-1].until >= int(steps[i]) - 1:
            continue  # the same change, seen from the next step
        # the first step past the middle: a median of 3 moves a step before the change
        middle = (level[k] + later[k]) / 2
        past = (after[k] > middle) if delta[k] > 0 else (after[k] < middle)
        at = i + int(np.argmax(past))
        shifts.append(
            Change(
                metric,
                int(steps[at]),
                float(10 ** level[k]),
                float(10 ** later[k]),
                int(steps[min(at + SHIFT_AFTER, len(steps)) - 1]),
            )
        )
    return shifts


def _var(x: np.ndarray) -> float:
    return float(x.var(ddof=1)) if len(x) > 1 else 0.0


def final_mean(series: Series) -> float:
    """The final-window mean: the metric's summary value (rlscope.windows)."""
    return float(series.values[-window_size(len(series)) :].mean())


def final_se(series: Series) -> float:
    """Standard error of `final_mean` from the step-to-step scatter: the sampling error of a
    small batch (few groups or rollouts a step) shows up as scatter between steps, so a level
    judged against it holds at any batch size. The scatter is measured over at least
    SCATTER_STEPS steps (a standard deviation of 3 values is itself too noisy to judge by) and
    applied to the window's own length. 0 for a one-step window."""
    w = window_size(len(series))
    spread = series.values[-max(w, min(len(series), SCATTER_STEPS)) :]
    return float(spread.std(ddof=1) / math.sqrt(w)) if len(spread) > 1 else 0.0


def rolling_median(values: np.ndarray, window: int) -> np.ndarray:
    """Centred rolling median; the window shrinks at the edges."""
    half = window // 2
    n = len(values)
    return np.array([np.median(values[max(0, i - half) : min(n, i + half + 1)]) for i in range(n)])


class RuleContext:
    """What a rule reads, with its resolved params: computed results, their per-step frames,
    the partial aggregates and run.json. Never the run's tables: a rule does not scan (what it
    needs is a metric or a metric's component, computed in the one scan)."""

    def __init__(
        self,
        rule: Rule,
        params: Mapping[str, float],
        severity_override: Severity | None,
        results: Mapping[str, MetricResult],
        frames: Mapping[str, pl.DataFrame],
        aggregates: Mapping[tuple[str, str], pl.DataFrame] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.rule = rule
        self.params = dict(params)
        self.severity_override = severity_override
        self.results = results
        self.frames = frames
        self.aggregates = aggregates or {}
        self.meta = meta or {}  # run.json: the trainer's settings (clip ratios, max_grad_norm)

    def series(self, metric_id: str) -> Series | None:
        result = self.results.get(metric_id)
        return Series.of(result) if result is not None else None

    def frame(self, metric_id: str) -> pl.DataFrame | None:
        """The per-step frame with component columns (for pooled window statistics)."""
        return self.frames.get(metric_id)

    def rollout_rows(self) -> pl.DataFrame | None:
        """The per-rollout features (one row per rollout, no text), when a metric needed them:
        for evidence that names example rollouts."""
        return self.aggregates.get(("rollouts", "rollout"))

    def probe_rows(self) -> pl.DataFrame | None:
        """The per-probe rows (with their rollout's step and original answer), if any."""
        return self.aggregates.get(("probes", ""))

    def finding(
        self, message: str, *, severity: Severity | None = None, **evidence: Any
    ) -> Finding:
        """A finding of this rule; a severity set in config wins over the rule's own choice."""
        evidence.setdefault("metrics", list(self.rule.metrics))
        chosen = self.severity_override or severity or self.rule.severity
        rule = self.rule
        return Finding(rule.id, chosen, rule.layer, message, evidence, rule.remedy, rule.marks)


def pooled_corr(frame: pl.DataFrame, first_step: int | None = None) -> tuple[float, float] | None:
    """Pooled within-group correlation Σsxy / sqrt(Σsxx·Σsyy) over steps >= first_step, and its
    degrees of freedom Σ(n - 1) (the z-score of r is about r·sqrt(dof))."""
    if first_step is not None:
        frame = frame.filter(pl.col("step") >= first_step)
    sums = frame.select(pl.col("sxx", "syy", "sxy", "dof").sum()).row(0)
    sxx, syy, sxy, dof = (float(v or 0.0) for v in sums)
    if sxx <= 0 or syy <= 0:
        return None
    return sxy / math.sqrt(sxx * syy), dof


def example_ids(
    rows: pl.DataFrame, where: pl.Expr, *, order: pl.Expr | None = None, n: int = 5
) -> list[int]:
    """Up to `n` rollout ids among `rows` matching `where` (by `order` descending, else the
    latest steps first): the examples a finding names so a person can open them."""
    matching = rows.filter(where)
    if order is not None:
        matching = matching.sort(order, "rollout_id", descending=[True, False], nulls_last=True)
    else:
        matching = matching.sort("step", "rollout_id", descending=[True, False])
    return [int(v) for v in matching["rollout_id"].head(n).to_list()]


def listed_examples(frame: pl.DataFrame, column: str, n: int = 5) -> list[int]:
    """Up to `n` example rollout ids from a per-step list column of a metric's frame (see
    metrics._common.examples), the latest steps first."""
    if column not in frame.columns:
        return []
    ids: list[int] = []
    for listed in frame.sort("step", descending=True)[column].to_list():
        ids.extend(int(i) for i in listed or () if i is not None)
        if len(ids) >= n:
            break
    return ids[:n]


def final_steps(series: Series) -> int:
    """The first step of the final window."""
    return int(series.steps[-window_size(len(series))])


#: How many standard errors deep a level is judged (`level_severity`).
LEVEL_Z = 2.0


def level_severity(level: float, params: Mapping[str, float], se: float = 0.0) -> Severity | None:
    """`warn` when `level - 2·se` is at or above params["warn_at"] (a window too small to be
    sure the level is past the threshold, a handful of groups or a short run, does not count as
    past it), `critical` when it is and the level itself is at or above params["critical_at"]."""
    sure = level - LEVEL_Z * se
    if sure < params["warn_at"]:
        return None
    return "critical" if level >= params["critical_at"] else "warn"


#: How every final-window level rule allows for sampling error (appended to their docs).
LEVEL_NOTE = (
    " The level is judged two standard errors deep: the final-window mean (the last tenth of "
    "the steps, at least 3) minus twice its standard error from the window's step-to-step "
    "scatter (for a share of rollouts, never below its binomial error over them) must reach "
    "`warn_at`, so a small batch (few rollouts a step) or a short run does "
    "not fire on noise; `critical_at` then applies to the level itself. Shares of the run's "
    "own rollouts, so they hold at any run length and group size."
)


@dataclass(frozen=True)
class Level:
    """A metric's final-window level past a rule's `warn_at`, and the severity it earns."""

    series: Series
    value: float  # the metric's final-window mean
    level: float  # what was judged: the value, or 1 - value, less what another finding explains
    severity: Severity

    @property
    def window(self) -> list[int]:
        """The final window's first and last step (the evidence `steps` of a level finding)."""
        return [final_steps(self.series), int(self.series.steps[-1])]


def final_level(
    ctx: RuleContext,
    metric_id: str,
    *,
    complement: bool = False,
    excused: float = 0.0,
    binary: bool = False,
) -> Level | None:
    """The one level judgement of the rules: a metric's final-window mean (of 1 - value with
    `complement`, less the share `excused` that another finding explains) against the rule's
    `warn_at`/`critical_at`, allowing for the window's standard error (LEVEL_NOTE; for a
    `binary` share, never below its binomial error over what it was measured over). None when
    the series is shorter than `min_steps` (default 1) or the level is below the thresholds."""
    series = ctx.series(metric_id)
    if series is None or len(series) < max(1, ctx.params.get("min_steps", 1)):
        return None
    value = final_mean(series)
    level = max((1.0 - value if complement else value) - excused, 0.0)
    se = final_se(series)
    frame = ctx.frame(metric_id)
    if binary and frame is not None and UNITS in frame.columns:
        # a share is never surer than its rollouts make it: a few steps whose shares happen
        # to agree do not shrink its binomial error
        window = frame.filter(pl.col("step") >= final_steps(series))
        units = float(window[UNITS].cast(pl.Float64).sum() or 0.0)
        if units > 0:
            se = max(se, share_se(min(max(value, 0.0), 1.0), units))
    severity = level_severity(level, ctx.params, se)
    return None if severity is None else Level(series, value, level, severity)


def share_se(share: float, units: float, scatter: np.ndarray | None = None) -> float:
    """Standard error of a share measured over `units` independent units (groups, rollouts)
    pooled over a window: the larger of the binomial error and, when given, the error implied
    by the step-to-step scatter of the per-step shares (which also catches correlated units)."""
    binomial = math.sqrt(max(share * (1 - share), 0.0) / units) if units > 0 else math.inf
    if scatter is not None and len(scatter) > 1:
        return max(binomial, float(scatter.std(ddof=1)) / math.sqrt(len(scatter)))
    return binomial


def column_mean(column: pl.Series) -> float:
    """A column's mean as a float, NaN when it has no value (Polars types `mean()` loosely)."""
    values = column.cast(pl.Float64).drop_nulls().to_numpy()
    return float(values.mean()) if values.size else math.nan


def step_span(frame: pl.DataFrame) -> list[int]:
    """First and last step of a frame's rows."""
    steps = frame["step"].cast(pl.Int64).to_numpy()
    return [int(steps.min()), int(steps.max())]


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"
