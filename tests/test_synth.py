"""Tests of rlscope.synth: format, determinism, and each scenario's latent signature."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from rlscope.schema import TABLES
from rlscope.synth import SCENARIOS, generate
from rlscope.synth.scenarios import EVAL_ID_OFFSET, SPIKE_REWARD

STEPS, PROMPTS, N = 40, 16, 8

Run = Callable[..., Path]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """generate() once per (scenario, tokens) at the standard small size."""
    cache: dict[tuple[str, bool], Path] = {}

    def get(scenario: str = "healthy", tokens: bool = False) -> Path:
        key = (scenario, tokens)
        if key not in cache:
            out = tmp_path_factory.mktemp("synth") / f"{scenario}-{tokens}"
            kw = {"steps": STEPS, "prompts_per_step": PROMPTS, "group_size": N}
            cache[key] = generate(out, scenario, tokens=tokens, **kw)
        return cache[key]

    return get


SORT_KEYS = {
    "steps": ["step"],
    "rollouts": ["step", "rollout_id"],
    "tokens": ["step", "rollout_id", "pos"],
    "probes": ["rollout_id"],
}


def read(run_dir: Path, table: str) -> pl.DataFrame:
    frame = pl.read_parquet(run_dir / table / "*.parquet")
    return frame.sort(SORT_KEYS[table], maintain_order=True)


def train(run_dir: Path) -> pl.DataFrame:
    return read(run_dir, "rollouts").filter(pl.col("split") == "train")


def groups(run_dir: Path) -> pl.DataFrame:
    """One row per (step, prompt) group."""
    return (
        train(run_dir)
        .group_by("step", "prompt_id")
        .agg(
            acc=pl.col("correct").mean(),
            solved=pl.col("correct").any(),
            flat=pl.col("reward").n_unique() == 1,
            calls_mean=pl.col("n_tool_calls").mean(),
            calls_sd=pl.col("n_tool_calls").std(),
        )
    )


def per_step(run_dir: Path) -> pl.DataFrame:
    return (
        groups(run_dir)
        .group_by("step")
        .agg(acc=pl.col("acc").mean(), pass_n=pl.col("solved").mean())
        .sort("step")
    )


def early_late(values: np.ndarray, frac: float = 0.25) -> tuple[float, float]:
    k = max(1, round(len(values) * frac))
    return float(values[:k].mean()), float(values[-k:].mean())


def thirds(values: np.ndarray) -> tuple[float, float, float]:
    a, b, c = np.array_split(values, 3)
    return float(a.mean()), float(b.mean()), float(c.mean())


def within_prompt_corr(run_dir: Path) -> float:
    """Pooled within-group correlation of log length and correctness."""
    g = ["step", "prompt_id"]
    r = train(run_dir).select(
        x=pl.col("response_len").log() - pl.col("response_len").log().mean().over(g),
        y=pl.col("correct").cast(pl.Float64) - pl.col("correct").cast(pl.Float64).mean().over(g),
    )
    x, y = r["x"].to_numpy(), r["y"].to_numpy()
    return float((x * y).sum() / np.sqrt((x * x).sum() * (y * y).sum()))


def steps_col(run_dir: Path, name: str) -> np.ndarray:
    return read(run_dir, "steps")[name].to_numpy()


def test_scenarios_are_documented() -> None:
    expected = {
        "healthy",
        "entropy-collapse",
        "entropy-clip-conflict",
        "kl-stalled",
        "kl-runaway",
        "grad-spike",
        "spurious-length-growth",
        "overthinking",
        "truncation",
        "dead-prompts",
        "dead-prompts-hard",
        "reward-concentration",
        "mode-collapse",
        "tool-cap-saturation",
        "tool-call-instability",
        "logged-metric-mismatch",
        "redundant-tool-calls",
        "format-violations",
        "repetition",
        "diversity-collapse",
        "ood-gap",
        "unfaithful-cot",
        "encoded-reasoning",
        "bias-following",
        "self-consistency-headroom",
        "step-errors",
    }
    assert set(SCENARIOS) == expected
    for name, scenario in SCENARIOS.items():
        assert scenario.name == name
        assert len(scenario.doc) > 40


def test_unknown_scenario_names_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown scenario 'nope'") as info:
        generate(tmp_path / "x", "nope")
    assert "healthy" in str(info.value) and "mode-collapse" in str(info.value)
    assert not (tmp_path / "x").exists()


def test_refuses_to_overwrite_a_run(run: Run) -> None:
    with pytest.raises(FileExistsError):
        generate(run("healthy"), steps=10)


def test_run_json(run: Run) -> None:
    meta = json.loads((run("healthy") / "run.json").read_text())
    assert meta["schema_version"] == 1
    assert meta["run_id"] == "synth-healthy"
    assert meta["algorithm"] == "GRPO"
    assert meta["group_size"] == N
    assert meta["max_response_len"] == 1024
    assert meta["max_tool_calls"] == 5
    assert (meta["clip_ratio_low"], meta["clip_ratio_high"]) == (0.2, 0.28)
    assert json.loads((run("truncation") / "run.json").read_text())["max_response_len"] == 80


def test_tables_follow_format_v1(run: Run) -> None:
    run_dir = run("healthy", tokens=True)
    for name in ("steps", "rollouts", "tokens", "probes"):
        frame = read(run_dir, name)
        spec = TABLES[name]
        assert set(spec.required_columns) <= set(frame.columns)
        for col, dtype in frame.schema.items():
            expected = spec.column(col)
            assert expected is not None, f"{name}.{col} is not a format-v1 column"
            if not isinstance(expected.dtype, pl.Categorical):
                assert dtype == expected.dtype, f"{name}.{col}: {dtype} != {expected.dtype}"
    steps = read(run_dir, "steps")
    assert steps["step"].to_list() == list(range(STEPS))
    assert steps["lr"].unique().to_list() == [1e-6]
    rollouts = train(run_dir)
    assert rollouts.height == STEPS * PROMPTS * N
    assert rollouts["rollout_id"].to_list() == list(range(rollouts.height))
    sizes = rollouts.group_by("step", "prompt_id").len()
    assert sizes.height == STEPS * PROMPTS and (sizes["len"] == N).all()
    assert rollouts["prompt_id"].str.contains(r"^p\d{5}$").all()
    assert set(rollouts["reward"].unique()) <= {0.0, 1.0}
    assert (rollouts["reward"] == rollouts["correct"].cast(pl.Float64)).all()
    assert set(read(run_dir, "rollouts")["split"].unique()) == {"train", "eval_id", "eval_ood"}


def test_answers_gold_and_distractors(run: Run) -> None:
    """Correct rollouts answer the prompt's gold (one per prompt, over the whole run); errors
    mostly agree on one main distractor."""
    r = read(run("healthy"), "rollouts")
    assert r["answer"].null_count() == 0 and r["answer"].str.contains(r"^\d+$").all()
    gold = r.filter("correct").group_by("prompt_id").agg(gold=pl.col("answer").unique())
    assert (gold["gold"].list.len() == 1).all()
    wrong = r.filter(~pl.col("correct")).join(
        gold.select("prompt_id", pl.col("gold").list.first()), on="prompt_id"
    )
    assert (wrong["answer"] != wrong["gold"]).all()
    top = wrong.group_by("prompt_id").agg(
        share=pl.col("answer").value_counts(sort=True).first().struct.field("count") / pl.len(),
        n=pl.len(),
    )
    top = top.filter(pl.col("n") >= 20)
    assert 0.85 <= float((top["share"] * top["n"]).sum() / top["n"].sum()) <= 0.95
    assert (wrong["answer"].n_unique() / wrong["prompt_id"].n_unique()) < 4.5


def test_grpo_advantage(run: Run) -> None:
    r = train(run("healthy"))
    g = ["step", "prompt_id"]
    expected = r.select(
        pl.when(pl.col("reward").std().over(g) == 0)
        .then(0.0)
        .otherwise(
            (pl.col("reward") - pl.col("reward").mean().over(g))
            / (pl.col("reward").std().over(g) + 1e-6)
        )
    ).to_series()
    np.testing.assert_allclose(r["advantage"].to_numpy(), expected.to_numpy(), atol=1e-9)


def test_tool_calls_match_their_count(run: Run) -> None:
    r = read(run("tool-call-instability"), "rollouts")
    assert (r["tool_calls"].list.len() == r["n_tool_calls"]).all()
    assert (r["n_tool_calls"] == 0).any()
    assert r["n_tool_calls"].is_between(0, 5).all()
    args = [json.loads(a) for a in r["tool_calls"].explode().drop_nulls().head(50)]
    assert all(set(a) == {"query"} for a in args)


def test_tokens_are_consistent_with_rollouts_and_steps(run: Run) -> None:
    run_dir = run("healthy", tokens=True)
    rollouts = train(run_dir)
    tokens = read(run_dir, "tokens")
    assert tokens["rollout_id"].max() < EVAL_ID_OFFSET  # eval rollouts have no tokens
    per_rollout = tokens.group_by("rollout_id").agg(
        n=pl.len(),
        lo=pl.col("pos").min(),
        hi=pl.col("pos").max(),
        distinct=pl.col("pos").n_unique(),
        adv=pl.col("advantage").first(),
        adv_const=pl.col("advantage").n_unique() == 1,
    )
    both = rollouts.join(per_rollout, on="rollout_id", how="left")
    assert both["n"].null_count() == 0
    assert (both["n"] == both["response_len"]).all()
    assert (both["lo"] == 0).all() and (both["hi"] == both["response_len"] - 1).all()
    assert (both["distinct"] == both["n"]).all() and both["adv_const"].all()
    np.testing.assert_allclose(both["adv"], both["advantage"].cast(pl.Float32), rtol=0)
    assert 2e5 < tokens.height < 5e5
    for col in ("logprob", "old_logprob", "ref_logprob"):
        assert (tokens[col] <= 0).all()
    assert set(tokens["segment"].cast(pl.String).unique()) == {"think", "answer"}

    t = tokens.with_columns(
        ratio=(pl.col("logprob").cast(pl.Float64) - pl.col("old_logprob")).exp(),
        d=pl.col("ref_logprob").cast(pl.Float64) - pl.col("logprob"),
    )
    clipped = ((t["ratio"] < 0.8) & (t["advantage"] < 0)) | (
        (t["ratio"] > 1.28) & (t["advantage"] > 0)
    )
    assert (clipped == t["clipped"]).all()
    means = (
        t.group_by("step")
        .agg(
            kl=(pl.col("d").exp() - pl.col("d") - 1).mean(),
            clip_frac=pl.col("clipped").mean(),
            entropy=pl.col("entropy").cast(pl.Float64).mean(),
        )
        .sort("step")
    )
    steps = read(run_dir, "steps")
    for col in ("kl", "clip_frac", "entropy"):
        np.testing.assert_allclose(steps[col], means[col], rtol=1e-6, atol=1e-12)
    # The latent means: k3 ≈ KL(u) and -logprob ≈ entropy (up to the small <= 0 shift).
    u = np.linspace(0, 1, STEPS)
    np.testing.assert_allclose(steps["kl"], 0.002 + 0.02 * u, rtol=0.1)
    np.testing.assert_allclose(steps["entropy"], 1.2 * np.exp(-0.9 * u) + 0.15, rtol=0.08)
    assert float(-tokens["logprob"].mean()) == pytest.approx(tokens["entropy"].mean(), rel=0.2)


def test_deterministic_given_seed(tmp_path: Path) -> None:
    def files(seed: int, name: str, **kw: object) -> dict[str, bytes]:
        out = generate(tmp_path / name, "grad-spike", steps=12, prompts_per_step=4, seed=seed, **kw)
        return {
            str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()
        }

    first, again = files(7, "a"), files(7, "b")
    assert first == again
    assert first != files(8, "c")
    # Rollouts and steps do not depend on whether tokens or text are written.
    no_tokens = files(7, "d", tokens=False)
    assert not any(k.startswith("tokens") for k in no_tokens)
    for table in ("rollouts", "steps", "probes"):
        assert read(tmp_path / "a", table).equals(read(tmp_path / "d", table))
    no_text = files(7, "e", text=False)
    assert not any(k.startswith("probes") for k in no_text)
    assert "response" not in read(tmp_path / "e", "rollouts").columns
    assert (
        read(tmp_path / "a", "rollouts").drop("response").equals(read(tmp_path / "e", "rollouts"))
    )
    for table in ("steps", "tokens"):
        assert read(tmp_path / "a", table).equals(read(tmp_path / "e", table))


# What the generator of commit 67eae44 (before text, answers, verifier, evals and probes)
# wrote for each scenario at steps=5, prompts_per_step=4, group_size=4, seed=11: steps, tokens
# and the train rollouts' columns other than `answer` must not change (committed samples and
# other tests rely on them). mode-collapse changed on purpose: its entropy now falls with its
# sharpness; kl-runaway too: its skill is flat (a KL accelerating while the policy improves is
# learning's drift, an info).
FROZEN = {
    "healthy": "d73120afee75c8e1",
    "entropy-collapse": "ca4620788f97ab96",
    "entropy-clip-conflict": "94f57b233fbea22a",
    "kl-stalled": "db4febc38b3d1907",
    "kl-runaway": "9e234cdc889f65b1",
    "grad-spike": "956b390b7ed49a91",
    "spurious-length-growth": "42b33424fb68f18d",
    "overthinking": "682509871b1598b1",
    "truncation": "a5f7b5a10c53c622",
    "dead-prompts": "7c0dc6a59f9ba742",
    "dead-prompts-hard": "3d59eaffe20cf5b4",
    "reward-concentration": "78fb33f19567e50f",
    "mode-collapse": "1eb611f02ff8bfc4",
    "tool-cap-saturation": "35bbbca3410a1824",
    "tool-call-instability": "4bacfe705810d8ef",
    "logged-metric-mismatch": "a045a32f016a99df",
}
FROZEN_ROLLOUT_COLUMNS = (
    "rollout_id",
    "step",
    "prompt_id",
    "reward",
    "correct",
    "response_len",
    "truncated",
    "n_tool_calls",
    "tool_calls",
    "advantage",
)


def frozen_digest(run_dir: Path) -> str:
    digest = hashlib.sha256()
    tokens = read(run_dir, "tokens").sort("rollout_id", "pos")
    tables = (
        read(run_dir, "steps").sort("step"),
        train(run_dir).sort("rollout_id").select(FROZEN_ROLLOUT_COLUMNS),
        tokens.with_columns(pl.col("segment").cast(pl.String)),
    )
    for frame in tables:
        for name in frame.columns:
            col = frame[name]
            if col.dtype == pl.List(pl.String):
                col = col.list.join("\x1f")
            if col.dtype == pl.String:
                data = "\x1e".join(col.to_list()).encode()
            else:
                data = col.to_numpy().tobytes()
            digest.update(name.encode() + b"\0" + data)
    return digest.hexdigest()[:16]


@pytest.mark.parametrize("text", [True, False])
def test_existing_draws_are_frozen(tmp_path: Path, text: bool) -> None:
    for name, expected in FROZEN.items():
        out = generate(
            tmp_path / f"{name}-{text}",
            name,
            steps=5,
            prompts_per_step=4,
            group_size=4,
            seed=11,
            text=text,
        )
        assert frozen_digest(out) == expected, name


def test_max_tokens_per_rollout(tmp_path: Path) -> None:
    kw = {"steps": 10, "prompts_per_step": 4, "group_size": 4}
    full = generate(tmp_path / "full", **kw)
    capped = generate(tmp_path / "capped", max_tokens_per_rollout=20, **kw)
    rollouts = read(capped, "rollouts")
    counts = read(capped, "tokens").group_by("rollout_id").len()
    both = rollouts.join(counts, on="rollout_id")
    assert (both["len"] == both["response_len"].clip(upper_bound=20)).all()
    assert read(full, "steps").equals(read(capped, "steps"))
    with pytest.raises(ValueError):
        generate(tmp_path / "bad", max_tokens_per_rollout=0, **kw)


@pytest.mark.parametrize(("prompts", "group"), [(1, 1), (3, 2), (70, 3)])
def test_any_size_works(tmp_path: Path, prompts: int, group: int) -> None:
    out = generate(tmp_path / "run", steps=10, prompts_per_step=prompts, group_size=group)
    r = train(out)
    assert r.height == 10 * prompts * group
    assert r.group_by("step").agg(pl.col("prompt_id").n_unique())["prompt_id"].min() == prompts
    if group == 1:
        assert (r["advantage"] == 0).all()
    assert read(out, "tokens").height == r["response_len"].sum()


# --- latent signatures -------------------------------------------------------------------------


def test_healthy_shows_no_pathology(run: Run) -> None:
    run_dir = run("healthy", tokens=True)
    s = per_step(run_dir)
    acc0, acc1 = early_late(s["acc"].to_numpy())
    pass0, pass1 = early_late(s["pass_n"].to_numpy())
    assert acc1 - acc0 > 0.2
    assert pass1 > pass0 + 0.05
    entropy = steps_col(run_dir, "entropy")
    drop = entropy[0] - entropy.min()
    assert entropy[-1] < 0.6 * entropy[0]
    assert (entropy[0] - entropy[: STEPS // 10 + 1].min()) / drop < 0.3
    assert np.all(np.diff(np.convolve(entropy, np.ones(5) / 5, "valid")) < 0)
    kl = thirds(steps_col(run_dir, "kl"))
    assert kl[0] < kl[1] < kl[2] < 2 * kl[1]
    assert steps_col(run_dir, "clip_frac").max() < 0.01
    grad = steps_col(run_dir, "grad_norm")
    assert grad.max() < 3 * np.median(grad)
    r = train(run_dir)
    assert r["truncated"].mean() < 0.02
    assert within_prompt_corr(run_dir) > 0.05
    g = groups(run_dir)
    assert g["flat"].mean() < 0.6
    assert 1.0 <= r["n_tool_calls"].mean() < 1.6 and (r["n_tool_calls"] == 5).mean() < 0.02
    assert (g["calls_sd"] / g["calls_mean"]).mean() < 0.6
    lens = r.group_by("step").agg(pl.col("response_len").mean()).sort("step")["response_len"]
    first, last = early_late(lens.to_numpy())
    assert 1.05 < last / first < 1.6


def test_entropy_collapse(run: Run) -> None:
    entropy = steps_col(run("entropy-collapse", tokens=True), "entropy")
    early_drop = entropy[0] - entropy[: STEPS // 10].min()
    assert early_drop >= 0.7 * (entropy[0] - entropy.min())
    assert entropy[STEPS // 10 :].max() < 0.1


def test_entropy_clip_conflict(run: Run) -> None:
    run_dir = run("entropy-clip-conflict", tokens=True)
    clip = steps_col(run_dir, "clip_frac")
    assert 0.12 < clip[STEPS // 2 :].mean() < 0.3
    assert clip[: STEPS // 10].mean() < 0.02
    assert steps_col(run_dir, "entropy")[STEPS // 2 :].max() < 0.2


def test_kl_stalled(run: Run) -> None:
    run_dir = run("kl-stalled", tokens=True)
    assert steps_col(run_dir, "kl").max() < 1e-4
    acc0, acc1 = early_late(per_step(run_dir)["acc"].to_numpy())
    assert abs(acc1 - acc0) < 0.1


def test_kl_runaway(run: Run) -> None:
    _, middle, last = thirds(steps_col(run("kl-runaway", tokens=True), "kl"))
    assert last > 3 * middle
    assert np.diff(steps_col(run("kl-runaway", tokens=True), "kl"), 2).mean() > 0  # convex


def test_grad_spike(run: Run) -> None:
    run_dir = run("grad-spike")
    grad = steps_col(run_dir, "grad_norm")
    spikes = {round(u * (STEPS - 1)) for u in (0.3, 0.55, 0.8)}
    assert set(np.flatnonzero(grad > 10 * np.median(grad))) == spikes
    r = train(run_dir)
    extreme = r.filter(pl.col("reward") == SPIKE_REWARD)
    assert sorted(extreme["step"]) == sorted(spikes) and extreme["correct"].all()
    assert set(r.filter(pl.col("reward") != SPIKE_REWARD)["reward"].unique()) == {0.0, 1.0}


def test_spurious_length_growth(run: Run) -> None:
    run_dir = run("spurious-length-growth")
    r = train(run_dir)
    lens = r.group_by("step").agg(pl.col("response_len").mean()).sort("step")["response_len"]
    first, last = early_late(lens.to_numpy())
    assert last / first > 1.6
    acc0, acc1 = early_late(per_step(run_dir)["acc"].to_numpy())
    assert abs(acc1 - acc0) < 0.1
    assert abs(within_prompt_corr(run_dir)) < 0.05


def test_overthinking(run: Run) -> None:
    assert within_prompt_corr(run("overthinking")) < -0.2


def test_truncation(run: Run) -> None:
    r = train(run("truncation"))
    assert 0.1 <= r["truncated"].mean() <= 0.3
    assert r["response_len"].max() == 80
    assert (r["truncated"] == (r["response_len"] >= 80)).all()
    assert not (r["truncated"] & r["correct"]).any()


def test_dead_prompts(run: Run) -> None:
    easy, hard = groups(run("dead-prompts")), groups(run("dead-prompts-hard"))
    assert easy["flat"].mean() >= 0.8 and (easy["acc"] == 1).mean() >= 0.8
    assert hard["flat"].mean() >= 0.8 and (hard["acc"] == 0).mean() >= 0.8


def test_reward_concentration(run: Run) -> None:
    def top_decile_share(run_dir: Path) -> float:
        mass = train(run_dir).group_by("prompt_id").agg(pl.col("advantage").abs().sum())
        m = np.sort(mass["advantage"].to_numpy())[::-1]
        return float(m[: max(1, len(m) // 10)].sum() / m.sum())

    run_dir = run("reward-concentration")
    assert top_decile_share(run_dir) > 0.5
    assert top_decile_share(run("healthy")) < 0.35
    r = train(run_dir)
    assert r["reward"].n_unique() > 20
    centred = r["reward"] - r.select(pl.col("reward").mean().over("step", "prompt_id")).to_series()
    np.testing.assert_allclose(r["advantage"], centred, atol=1e-9)
    assert (r["correct"] == (r["reward"] > 0)).all()


def test_mode_collapse(run: Run) -> None:
    s = per_step(run("mode-collapse"))
    acc0, acc1 = early_late(s["acc"].to_numpy())
    pass0, pass1 = early_late(s["pass_n"].to_numpy())
    assert acc1 - acc0 >= 0.1
    assert pass1 <= pass0


def test_tool_cap_saturation(run: Run) -> None:
    r = train(run("tool-cap-saturation"))
    at_cap = r.group_by("step").agg((pl.col("n_tool_calls") == 5).mean()).sort("step")
    share = at_cap["n_tool_calls"].to_numpy()
    assert share[-STEPS // 10 :].mean() >= 0.6
    assert share[: STEPS // 4].mean() < 0.1


def test_tool_call_instability(run: Run) -> None:
    r = train(run("tool-call-instability"))
    g = groups(run("tool-call-instability")).filter(pl.col("calls_mean") > 0)
    assert (g["calls_sd"] / g["calls_mean"]).mean() > 1.0
    assert 1.5 <= r["n_tool_calls"].mean() <= 2.5
    assert (r["n_tool_calls"] == 5).mean() < 0.2


SMALL = {"steps": 10, "prompts_per_step": 8, "group_size": 4}


@pytest.mark.parametrize(
    ("scenario", "check"),
    [
        ("entropy-collapse", lambda d: steps_col(d, "entropy")[1:].max() < 0.1),
        ("kl-runaway", lambda d: thirds(steps_col(d, "kl"))[2] > 3 * thirds(steps_col(d, "kl"))[1]),
        ("grad-spike", lambda d: (steps_col(d, "grad_norm") > 8).sum() == 3),
        ("dead-prompts", lambda d: groups(d)["flat"].mean() >= 0.8),
        ("truncation", lambda d: 0.1 <= train(d)["truncated"].mean() <= 0.35),
        ("overthinking", lambda d: within_prompt_corr(d) < -0.1),
        ("entropy-clip-conflict", lambda d: steps_col(d, "clip_frac")[5:].mean() > 0.04),
    ],
)
def test_signatures_survive_small_runs(
    tmp_path: Path, scenario: str, check: Callable[[Path], bool]
) -> None:
    assert check(generate(tmp_path / "run", scenario, **SMALL))


def test_logged_metric_mismatch_logs_three_times_the_token_kl(tmp_path: Path) -> None:
    path = generate(tmp_path / "lm", "logged-metric-mismatch", steps=12, prompts_per_step=4)
    tokens = pl.read_parquet(path / "tokens" / "*.parquet")
    d = tokens["ref_logprob"].cast(pl.Float64) - tokens["logprob"].cast(pl.Float64)
    k3 = (d.exp() - d - 1).to_numpy()
    steps = pl.read_parquet(path / "steps" / "*.parquet").sort("step")
    per_step = np.array([k3[(tokens["step"] == s).to_numpy()].mean() for s in steps["step"]])
    np.testing.assert_allclose(steps["kl"].to_numpy(), 3.0 * per_step, rtol=1e-6)


# --- upper layers: text, tools, answers, verifier, evals, probes -------------------------------
# Every check below parses the written Parquet with plain Python (re, json, sets, Counter),
# independently of rlscope's own text expressions.

TAG = re.compile(r"<(/?)(think|answer|tool_call|tool_response)>")
THINK = re.compile(r"<think>(.*?)</think>", re.S)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
SEGMENT_CODES = {"think": "t", "tool_call": "c", "tool_response": "r", "answer": "a"}
PROBE_KINDS = ["truncate"] * 5 + ["mistake", "paraphrase", "filler", "bias"]
PROBE_FRACTIONS = [0.0, 0.25, 0.5, 0.75, 1.0, 0.5, None, None, None]
CUE = re.compile(r"(?i)hint|the user suggested")


def well_formed(text: str) -> bool:
    """An optional think, then (tool_call, optional tool_response, optional think)*, then one
    answer; no nesting or unclosed tag; a non-blank answer; every call a JSON object with
    `name` and `arguments`."""
    sequence, open_tag, start = [], None, 0
    for match in TAG.finditer(text):
        closing, name = match.group(1) == "/", match.group(2)
        if not closing:
            if open_tag is not None:
                return False
            open_tag, start = name, match.end()
            continue
        if open_tag != name:
            return False
        body = text[start : match.start()]
        if name == "tool_call":
            try:
                call = json.loads(body)
            except ValueError:
                return False
            if not isinstance(call, dict) or not {"name", "arguments"} <= set(call):
                return False
        if name == "answer" and not body.strip():
            return False
        sequence.append(SEGMENT_CODES[name])
        open_tag = None
    return open_tag is None and re.fullmatch(r"t?(cr?t?)*a", "".join(sequence)) is not None


def parse_json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def think_words(text: str) -> list[str]:
    return " ".join(THINK.findall(text)).split()


def trigrams(words: list[str]) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + 3]) for i in range(len(words) - 2)]


def repetition(text: str) -> float:
    grams = trigrams(think_words(text))
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def group_jaccard(texts: list[str]) -> float:
    sets = [set(trigrams(think_words(t))) for t in texts]
    pairs = [len(a & b) / len(a | b) for a, b in itertools.combinations(sets, 2) if a | b]
    return float(np.mean(pairs))


def late(frame: pl.DataFrame, frac: float = 0.2, steps: int = STEPS) -> pl.DataFrame:
    return frame.filter(pl.col("step") >= (1 - frac) * (steps - 1))


def early(frame: pl.DataFrame, frac: float = 0.2, steps: int = STEPS) -> pl.DataFrame:
    return frame.filter(pl.col("step") <= frac * (steps - 1))


def redundant_share(r: pl.DataFrame) -> float:
    calls = r["tool_calls"].to_list()
    return sum(len(c) - len(set(c)) for c in calls) / max(1, sum(len(c) for c in calls))


def broken_share(r: pl.DataFrame) -> float:
    return 1 - float(np.mean([well_formed(t) for t in r["response"]]))


def mean_repetition(r: pl.DataFrame) -> float:
    return float(np.mean([repetition(t) for t in r["response"]]))


def per_group(r: pl.DataFrame) -> list[pl.DataFrame]:
    return list(r.partition_by("step", "prompt_id"))


def mean_group_jaccard(r: pl.DataFrame) -> float:
    return float(np.mean([group_jaccard(g["response"].to_list()) for g in per_group(r)]))


def unique_per_group(r: pl.DataFrame) -> float:
    return float(np.mean([g["response"].n_unique() for g in per_group(r)]))


def majority_gain(r: pl.DataFrame) -> float:
    """Mean over groups of maj@N - mean accuracy (majority over non-null answers; a tie
    credits the share of tied answers that are correct)."""
    gains = []
    for g in per_group(r):
        votes = Counter(a for a in g["answer"] if a is not None)
        right = {a for a, c in zip(g["answer"], g["correct"], strict=True) if c}
        top = max(votes.values(), default=0)
        modes = [a for a, v in votes.items() if v == top]
        maj = sum(a in right for a in modes) / len(modes) if modes else 0.0
        gains.append(maj - float(g["correct"].mean()))
    return float(np.mean(gains))


def step_accuracy(r: pl.DataFrame) -> float:
    return float(r["steps_verified"].sum() / r["steps_checked"].sum())


def correct_with_failed_step(r: pl.DataFrame) -> float:
    c = r.filter("correct")
    return float((c["steps_verified"] < c["steps_checked"]).mean())


def eval_gap(run_dir: Path) -> pl.DataFrame:
    """Per eval step: ID accuracy, OOD accuracy and their gap."""
    acc = (
        read(run_dir, "rollouts")
        .filter(pl.col("split") != "train")
        .group_by("step", "split")
        .agg(pl.col("correct").mean())
        .pivot("split", index="step", values="correct")
        .sort("step")
    )
    return acc.with_columns(gap=pl.col("eval_id") - pl.col("eval_ood"))


def probes(run_dir: Path) -> pl.DataFrame:
    """Probes with their rollout's step and original answer, and whether the answer held."""
    original = train(run_dir).select("rollout_id", "step", original=pl.col("answer"))
    p = read(run_dir, "probes").join(original, on="rollout_id", how="left", maintain_order="left")
    return p.with_columns(unchanged=pl.col("answer") == pl.col("original"))


def unchanged(p: pl.DataFrame, kind: str | list[str], fraction: float | None = None) -> float:
    kinds = [kind] if isinstance(kind, str) else kind
    q = p.filter(pl.col("intervention").is_in(kinds))
    if fraction is not None:
        q = q.filter(pl.col("fraction") == fraction)
    return float(q["unchanged"].mean())


def early_answering_aoc(p: pl.DataFrame) -> float:
    x = np.array([0.0, 0.25, 0.5, 0.75, 1.0])
    y = np.array([unchanged(p, "truncate", f) for f in x])
    return float(1 - np.sum((y[1:] + y[:-1]) / 2 * np.diff(x)))


def bias_moves(p: pl.DataFrame) -> tuple[float, float]:
    """Share of bias probes answering the hint, and share of those moves mentioning the cue."""
    b = p.filter(pl.col("intervention") == "bias")
    moved = b.filter(pl.col("answer") == pl.col("hint"))
    mention = float(moved["response"].str.contains(CUE.pattern).mean()) if moved.height else 1.0
    return moved.height / b.height, mention


def second_half(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.filter(pl.col("step") >= (STEPS - 1) / 2)


def test_response_text_matches_the_columns(run: Run) -> None:
    for r in (train(run("healthy")), train(run("redundant-tool-calls"))):
        assert all(well_formed(t) for t in r["response"])
        for row in r.head(600).iter_rows(named=True):
            text = row["response"]
            assert ANSWER.findall(text) == [row["answer"]]
            calls = [json.loads(c) for c in CALL.findall(text)]
            assert [c["name"] for c in calls] == ["search"] * row["n_tool_calls"]
            assert [c["arguments"] for c in calls] == [json.loads(a) for a in row["tool_calls"]]
            assert text.count("<tool_response>") == row["n_tool_calls"]
            assert len(think_words(text)) == max(1, round(0.8 * row["response_len"]))


def test_healthy_upper_layers(run: Run) -> None:
    run_dir = run("healthy")
    r = train(run_dir)
    assert redundant_share(r) == 0 and broken_share(r) == 0
    assert mean_repetition(r) < 0.01
    first, last = mean_group_jaccard(early(r)), mean_group_jaccard(late(r))
    assert 0.02 < last < 0.3 and first < 0.3 and last / first > 0.7  # measured ~0.08 → ~0.06
    assert unique_per_group(r) == N
    assert majority_gain(late(r)) < 0.08  # measured ~0.05
    assert 0.92 <= step_accuracy(r) <= 0.97
    assert correct_with_failed_step(r) < 0.1
    acc = eval_gap(run_dir)
    id0, id1 = early_late(acc["eval_id"].to_numpy())
    assert id1 - id0 > 0.2
    gap0, gap1 = early_late(acc["gap"].to_numpy())
    assert 0.0 < float(acc["gap"].mean()) < 0.08 and gap0 < 0.1 and gap1 < 0.1
    p = probes(run_dir)
    assert 0.38 <= early_answering_aoc(p) <= 0.56
    assert unchanged(p, "truncate", 1.0) == 1.0
    assert unchanged(p, "truncate", 0.0) < 0.35
    assert 0.15 <= unchanged(p, "mistake") <= 0.45
    assert unchanged(p, ["paraphrase", "filler"]) >= 0.93
    moved, mention = bias_moves(p)
    assert moved <= 0.1 and mention >= 0.5


def test_eval_rollouts(run: Run) -> None:
    run_dir = run("healthy")
    r = read(run_dir, "rollouts")
    ev = r.filter(pl.col("split") != "train")
    assert ev["rollout_id"].min() >= EVAL_ID_OFFSET and r["rollout_id"].is_unique().all()
    assert sorted(ev["step"].unique()) == [*range(0, STEPS, STEPS // 20), STEPS - 1]
    per_eval = ev.group_by("step", "split").len()
    assert (per_eval["len"] == 64).all() and per_eval.height == 2 * ev["step"].n_unique()
    ids = ev.group_by("split").agg(pl.col("prompt_id").unique())
    pattern = {"eval_id": r"^ei\d{5}$", "eval_ood": r"^eo\d{5}$"}
    for split, prompt_ids in ids.iter_rows():
        assert pl.Series(prompt_ids).str.contains(pattern[split]).all()
    assert ev["advantage"].null_count() == ev.height
    assert (ev["reward"] == ev["correct"].cast(pl.Float64)).all()
    assert all(well_formed(t) for t in ev["response"])


def test_probe_layout(run: Run) -> None:
    run_dir = run("healthy")
    p = probes(run_dir)
    assert p["step"].null_count() == 0  # every probe names a train rollout
    assert sorted(p["step"].unique()) == [*range(0, STEPS, STEPS // 20), STEPS - 1]
    assert (p.group_by("step").agg(pl.col("rollout_id").n_unique())["rollout_id"] == 8).all()
    for _, rows in p.group_by("rollout_id", maintain_order=True):
        assert rows["intervention"].to_list() == PROBE_KINDS
        assert rows["fraction"].to_list() == PROBE_FRACTIONS
    bias = p.filter(pl.col("intervention") == "bias")
    assert bias["hint"].null_count() == 0 and (bias["hint"] != bias["original"]).all()
    assert p.filter(pl.col("intervention") != "bias")["hint"].null_count() == p.height - bias.height
    assert [ANSWER.findall(t) for t in p["response"]] == [[a] for a in p["answer"]]
    others = p.filter(pl.col("intervention") != "bias")
    assert not others["response"].str.contains(CUE.pattern).any()


def test_redundant_tool_calls(run: Run) -> None:
    r = train(run("redundant-tool-calls"))
    assert redundant_share(early(r)) < 0.15
    assert 0.38 <= redundant_share(late(r)) <= 0.56  # measured ~0.46
    assert (late(r)["n_tool_calls"] == 5).mean() < 0.05
    assert redundant_share(train(run("healthy"))) == 0


def test_format_violations(run: Run) -> None:
    r = train(run("format-violations"))
    assert broken_share(early(r)) < 0.1
    assert 0.28 <= broken_share(late(r)) <= 0.5  # measured ~0.36
    broken = [t for t in r["response"] if not well_formed(t)]
    assert any("<answer>" not in t for t in broken)
    assert any("<answer></answer>" in t for t in broken)
    assert any(t.count("<think>") > t.count("</think>") for t in broken)
    calls = [parse_json(c) for t in broken for c in CALL.findall(t)]
    assert None in calls  # does not parse
    assert any(isinstance(c, dict) and "name" not in c for c in calls)
    assert any(isinstance(c, dict) and "arguments" not in c for c in calls)
    # No answer only where the response has none; such rollouts are incorrect.
    has_answer = [
        bool(ANSWER.findall(t)) and ANSWER.findall(t)[0].strip() != "" for t in r["response"]
    ]
    assert has_answer == r["answer"].is_not_null().to_list()
    assert not r.filter(pl.col("answer").is_null())["correct"].any()


def test_repetition(run: Run) -> None:
    r = train(run("repetition"))
    assert mean_repetition(early(r)) < 0.1
    assert 0.45 <= mean_repetition(late(r)) <= 0.75  # measured ~0.58
    assert mean_repetition(train(run("healthy"))) < 0.01


def test_text_follows_entropy(run: Run) -> None:
    """Low entropy makes a group's samples agree on more of their words (module docstring)."""
    healthy = train(run("healthy"))
    collapsed = train(run("entropy-collapse"))
    assert mean_group_jaccard(late(collapsed)) > mean_group_jaccard(late(healthy)) + 0.08
    falling = train(run("entropy-clip-conflict"))  # entropy 1.25 → ~0.05 over the run
    assert mean_group_jaccard(late(falling)) > mean_group_jaccard(early(falling)) + 0.06
    mode = train(run("mode-collapse"))  # entropy 1.28 → 0.14
    assert mean_group_jaccard(late(mode)) > mean_group_jaccard(early(mode)) + 0.01


def test_text_reads_like_reasoning(run: Run) -> None:
    words = Counter(w for t in train(run("healthy"))["response"] for w in think_words(t))
    assert not any(re.fullmatch(r"w\d{4}", w) for w in words)
    top = [w for w, _ in words.most_common(30)]
    assert {"the", "so", "we"} <= set(top)
    numbers = sum(c for w, c in words.items() if w.isdigit())
    assert 0.03 < numbers / sum(words.values()) < 0.3


def test_diversity_collapse(run: Run) -> None:
    r = train(run("diversity-collapse"))
    assert mean_group_jaccard(early(r)) < 0.3 and unique_per_group(early(r)) > 6.5
    assert mean_group_jaccard(late(r)) > 0.8  # measured ~0.93: diversity ~0.07
    assert unique_per_group(late(r)) <= 3  # measured ~2.3 of 8
    top_share = [g["response"].value_counts(sort=True)["count"][0] / N for g in per_group(late(r))]
    assert float(np.mean(top_share)) > 0.55
    assert unique_per_group(train(run("healthy"))) == N


def test_ood_gap(run: Run) -> None:
    acc = eval_gap(run("ood-gap"))
    gap0, gap1 = early_late(acc["gap"].to_numpy())
    assert gap0 < 0.1 and gap1 >= 0.25  # measured ~0.05 → ~0.34
    id0, id1 = early_late(acc["eval_id"].to_numpy())
    ood0, ood1 = early_late(acc["eval_ood"].to_numpy())
    assert id1 - id0 > 0.2 and ood1 - ood0 < 0.05
    assert early_late(eval_gap(run("healthy"))["gap"].to_numpy())[1] < 0.1


def test_unfaithful_cot(run: Run) -> None:
    p = second_half(probes(run("unfaithful-cot")))
    for fraction in (0.0, 0.25, 0.5, 0.75):
        assert unchanged(p, "truncate", fraction) >= 0.85
    assert early_answering_aoc(p) < 0.1  # measured ~0.04; healthy ~0.47
    assert unchanged(p, "mistake") >= 0.85
    assert early_answering_aoc(second_half(probes(run("healthy")))) > 0.35


def test_encoded_reasoning(run: Run) -> None:
    p = second_half(probes(run("encoded-reasoning")))
    assert 0.5 <= unchanged(p, ["paraphrase", "filler"]) <= 0.72  # measured ~0.62
    assert early_answering_aoc(p) > 0.35  # truncation as healthy


def test_bias_following(run: Run) -> None:
    p = second_half(probes(run("bias-following")))
    moved, mention = bias_moves(p)
    assert 0.48 <= moved <= 0.72 and mention == 0.0
    assert (
        not p.filter(pl.col("intervention") == "bias")["response"].str.contains(CUE.pattern).any()
    )
    healthy_moved, healthy_mention = bias_moves(probes(run("healthy")))  # ~8 moves, most said
    assert healthy_moved <= 0.1 and healthy_mention >= 0.5


def test_self_consistency_headroom(run: Run) -> None:
    r = train(run("self-consistency-headroom"))
    assert majority_gain(early(r)) < 0.08
    assert majority_gain(late(r)) >= 0.15  # measured ~0.2-0.28; healthy ~0.05
    wrong = late(r).filter(~pl.col("correct"))
    distinct = wrong.group_by("step", "prompt_id").agg(pl.col("answer").n_unique() / pl.len())
    assert float(distinct["answer"].mean()) > 0.8


def test_step_errors(run: Run) -> None:
    r = train(run("step-errors"))
    assert step_accuracy(early(r)) > 0.85 and correct_with_failed_step(early(r)) < 0.15
    assert 0.62 <= step_accuracy(late(r)) <= 0.78  # measured ~0.70
    assert 0.3 <= correct_with_failed_step(late(r)) <= 0.55  # measured ~0.38
    healthy = late(train(run("healthy")))
    assert step_accuracy(healthy) > 0.92 and correct_with_failed_step(healthy) < 0.1


# Each new scenario differs from the healthy run of the same seed only in its pathology: the
# train rollouts' and the eval rollouts' columns it changes (the policy's behaviour shows in both;
# copies need groups, so not in evals), and whether its probes differ.
CALLS = {"n_tool_calls", "tool_calls", "response"}
NEW_SCENARIO_CHANGES = {
    "redundant-tool-calls": (CALLS, CALLS, False),
    "format-violations": ({"answer", "response"}, {"answer", "response"}, True),
    "repetition": ({"response"}, {"response"}, False),
    "diversity-collapse": (CALLS, set(), False),
    "ood-gap": (
        set(),
        {"reward", "correct", "response_len", "answer", "response", "steps_verified"},
        False,
    ),
    "unfaithful-cot": (set(), set(), True),
    "encoded-reasoning": (set(), set(), True),
    "bias-following": (set(), set(), True),
    "self-consistency-headroom": ({"answer", "response"}, {"answer", "response"}, True),
    "step-errors": ({"steps_verified"}, {"steps_verified"}, False),
}


def test_new_scenarios_are_otherwise_healthy(tmp_path: Path) -> None:
    kw = {"steps": 12, "prompts_per_step": 8, "group_size": 4, "seed": 5}
    base = generate(tmp_path / "healthy", **kw)

    def differing(a: pl.DataFrame, b: pl.DataFrame) -> set[str]:
        return {c for c in a.columns if not a[c].equals(b[c])}

    for name, (train_cols, eval_cols, probes_differ) in NEW_SCENARIO_CHANGES.items():
        out = generate(tmp_path / name, name, **kw)
        for table in ("steps", "tokens"):
            assert read(out, table).equals(read(base, table)), (name, table)
        r, h = read(out, "rollouts"), read(base, "rollouts")
        is_train = pl.col("split") == "train"
        assert differing(r.filter(is_train), h.filter(is_train)) == train_cols, name
        assert differing(r.filter(~is_train), h.filter(~is_train)) == eval_cols, name
        assert (not read(out, "probes").equals(read(base, "probes"))) == probes_differ, name


EXISTING = [n for n in SCENARIOS if n not in NEW_SCENARIO_CHANGES and n != "healthy"]
# Their entropy falls far below the healthy run's, so a group's texts share more words.
LOW_ENTROPY = {"entropy-collapse", "entropy-clip-conflict", "mode-collapse"}


@pytest.mark.parametrize("scenario", EXISTING)
def test_existing_scenarios_have_healthy_upper_layers(tmp_path: Path, scenario: str) -> None:
    steps = 20
    out = generate(tmp_path / "run", scenario, steps=steps, prompts_per_step=8, tokens=False)
    r = train(out)
    assert broken_share(r) == 0 and redundant_share(r) == 0
    assert mean_repetition(r) < 0.02
    assert mean_group_jaccard(r) < 0.3
    assert unique_per_group(r) > 7.8 if scenario in LOW_ENTROPY else unique_per_group(r) == 8
    assert majority_gain(late(r, steps=steps)) < 0.15
    assert step_accuracy(r) > 0.9
    if r["correct"].sum() >= 50:
        assert correct_with_failed_step(r) < 0.1
    assert float(eval_gap(out)["gap"].mean()) < 0.1
    p = probes(out)
    assert early_answering_aoc(p) > 0.3 and unchanged(p, ["paraphrase", "filler"]) > 0.9
    assert bias_moves(p)[0] < 0.15
