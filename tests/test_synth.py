"""Tests of rlscope.synth: format, determinism, and each scenario's latent signature."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from rlscope.schema import TABLES
from rlscope.synth import SCENARIOS, SPIKE_REWARD, generate

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


def read(run_dir: Path, table: str) -> pl.DataFrame:
    frame = pl.read_parquet(run_dir / table / "*.parquet")
    return frame.sort("step", "rollout_id", "pos") if table == "tokens" else frame.sort("step")


def groups(run_dir: Path) -> pl.DataFrame:
    """One row per (step, prompt) group."""
    return (
        read(run_dir, "rollouts")
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
    r = read(run_dir, "rollouts").select(
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
    for name in ("steps", "rollouts", "tokens"):
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
    rollouts = read(run_dir, "rollouts")
    assert rollouts.height == STEPS * PROMPTS * N
    assert rollouts["rollout_id"].to_list() == list(range(rollouts.height))
    sizes = rollouts.group_by("step", "prompt_id").len()
    assert sizes.height == STEPS * PROMPTS and (sizes["len"] == N).all()
    assert rollouts["prompt_id"].str.contains(r"^p\d{5}$").all()
    assert set(rollouts["reward"].unique()) <= {0.0, 1.0}
    assert (rollouts["reward"] == rollouts["correct"].cast(pl.Float64)).all()
    assert (rollouts["answer"] == "A").eq(rollouts["correct"]).all()
    assert set(rollouts["answer"].unique()) == {"A", "B", "C", "D"}


def test_grpo_advantage(run: Run) -> None:
    r = read(run("healthy"), "rollouts")
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
    assert r["n_tool_calls"].is_between(0, 5).all()
    args = [json.loads(a) for a in r["tool_calls"].explode().drop_nulls().head(50)]
    assert all(set(a) == {"query"} for a in args)


def test_tokens_are_consistent_with_rollouts_and_steps(run: Run) -> None:
    run_dir = run("healthy", tokens=True)
    rollouts = read(run_dir, "rollouts")
    tokens = read(run_dir, "tokens")
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
    # Rollouts and steps do not depend on whether tokens are written.
    no_tokens = files(7, "d", tokens=False)
    assert not any(k.startswith("tokens") for k in no_tokens)
    for table in ("rollouts", "steps"):
        assert read(tmp_path / "a", table).equals(read(tmp_path / "d", table))


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
    r = read(out, "rollouts")
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
    r = read(run_dir, "rollouts")
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
    r = read(run_dir, "rollouts")
    extreme = r.filter(pl.col("reward") == SPIKE_REWARD)
    assert sorted(extreme["step"]) == sorted(spikes) and extreme["correct"].all()
    assert set(r.filter(pl.col("reward") != SPIKE_REWARD)["reward"].unique()) == {0.0, 1.0}


def test_spurious_length_growth(run: Run) -> None:
    run_dir = run("spurious-length-growth")
    r = read(run_dir, "rollouts")
    lens = r.group_by("step").agg(pl.col("response_len").mean()).sort("step")["response_len"]
    first, last = early_late(lens.to_numpy())
    assert last / first > 1.6
    acc0, acc1 = early_late(per_step(run_dir)["acc"].to_numpy())
    assert abs(acc1 - acc0) < 0.1
    assert abs(within_prompt_corr(run_dir)) < 0.05


def test_overthinking(run: Run) -> None:
    assert within_prompt_corr(run("overthinking")) < -0.2


def test_truncation(run: Run) -> None:
    r = read(run("truncation"), "rollouts")
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
        mass = read(run_dir, "rollouts").group_by("prompt_id").agg(pl.col("advantage").abs().sum())
        m = np.sort(mass["advantage"].to_numpy())[::-1]
        return float(m[: max(1, len(m) // 10)].sum() / m.sum())

    run_dir = run("reward-concentration")
    assert top_decile_share(run_dir) > 0.5
    assert top_decile_share(run("healthy")) < 0.35
    r = read(run_dir, "rollouts")
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
    r = read(run("tool-cap-saturation"), "rollouts")
    at_cap = r.group_by("step").agg((pl.col("n_tool_calls") == 5).mean()).sort("step")
    share = at_cap["n_tool_calls"].to_numpy()
    assert share[-STEPS // 10 :].mean() >= 0.6
    assert share[: STEPS // 4].mean() < 0.1


def test_tool_call_instability(run: Run) -> None:
    r = read(run("tool-call-instability"), "rollouts")
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
        ("truncation", lambda d: 0.1 <= read(d, "rollouts")["truncated"].mean() <= 0.35),
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
