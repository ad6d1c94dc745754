"""TRL importer (issue 13, items 10-14): correctness from the accuracy-like reward function,
reward = the trainer_state reward functions only, unscorable rows, scale_rewards="batch", eval
rows in a train completions file, and how correctness was derived shown by every command.

Fixtures built in code follow TRL's writer (grpo_trainer.py `log()`: columns step, prompt,
completion, one column per reward function, log_extra columns, advantage; one file per logging
step; trainer_state.json `log_history` with `rewards/<name>/mean`, `reward`,
`frac_reward_zero_std` and `eval_*` entries)."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import polars as pl
import pytest
from conftest import GENUINE, run_cli, run_trainer

import rlscope
from rlscope.importers import import_run
from rlscope.reader import open_run

FIXTURES = GENUINE
TINY = FIXTURES / "trl-tiny-grpo"
HEALTHY = FIXTURES / "trl-real" / "healthy"


def value(report: rlscope.Report, metric: str) -> float | None:
    return report.metrics[metric].value


def skip_reason(report: rlscope.Report, metric: str) -> str:
    return next(s.reason for s in report.skipped if s.metric == metric)


def nanstd(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.stdev(kept) if len(kept) > 1 else 0.0


def write_run(
    root: Path,
    steps: dict[int, list[list[dict[str, float | None]]]],
    *,
    scale: str = "group",
    extra: dict[str, float] | None = None,
    eval_at: dict[int, list[dict[str, float | None]]] | None = None,
) -> Path:
    """A TRL output dir: per step, groups of rows {reward function: value or None}. Rewards,
    advantages, reward, frac_reward_zero_std as TRL >= 1.6 computes them (unscorable rows NaN,
    nanmean / nanstd). `eval_at[step]`: eval rows appended to that step's file after its train
    rows (TRL's shared deque) and an `eval_*` log_history entry at that step."""
    completions = root / "completions"
    completions.mkdir(parents=True)
    history = []
    for step, groups in steps.items():
        rows, rewards = [], []
        for g, group in enumerate(groups):
            for i, funcs in enumerate(group):
                values = [math.nan if v is None else v for v in funcs.values()]
                total = (
                    math.nan
                    if all(math.isnan(v) for v in values)
                    else math.fsum(0.0 if math.isnan(v) else v for v in values)
                )
                rewards.append(total)
                rows.append(
                    {
                        "step": step,
                        "prompt": f"prompt {step} {g}",
                        "completion": f"completion {step} {g} {i}",
                        **{k: (math.nan if v is None else v) for k, v in funcs.items()},
                        **(extra or {}),
                    }
                )
        size = len(groups[0])
        batch_std = nanstd(rewards)
        zero = []
        for g in range(len(groups)):
            block = rewards[g * size : (g + 1) * size]
            mean = statistics.fmean(v for v in block if not math.isnan(v))
            std = nanstd(block) if scale == "group" else batch_std
            zero.append(math.isclose(std, 0.0, abs_tol=1e-8))
            for i, r in enumerate(block):
                adv = 0.0 if math.isnan(r) else (r - mean) / (std + 1e-4)
                rows[g * size + i]["advantage"] = adv
        for row in eval_at.get(step, []) if eval_at else []:
            rows.append(
                {
                    "step": step,
                    "prompt": "eval prompt",
                    "completion": "eval completion",
                    **{k: (math.nan if v is None else v) for k, v in row.items()},
                    **(extra or {}),
                    "advantage": 0.0,
                }
            )
        pl.DataFrame(rows).write_parquet(completions / f"completions_{step:05d}.parquet")
        names = list(groups[0][0])
        scored = [r for r in rewards if not math.isnan(r)]
        entry: dict[str, float | int] = {"step": step, "loss": 0.1}
        for name in names:
            col = [
                row[name]
                for row in rows[: len(rewards)]
                if not math.isnan(row[name])  # type: ignore[arg-type]
            ]
            entry[f"rewards/{name}/mean"] = statistics.fmean(col) if col else 0.0
        entry["reward"] = statistics.fmean(scored)
        entry["frac_reward_zero_std"] = statistics.fmean(float(z) for z in zero)
        history.append(entry)
        if eval_at and step in eval_at:
            history.append({"step": step, "eval_loss": 0.5, "eval_reward": 1.0})
    state = root / "checkpoint-9" / "trainer_state.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"global_step": max(steps), "log_history": history}))
    return root


def acc_fmt(accs: list[float], fmt: float = 0.5) -> list[dict[str, float | None]]:
    return [{"accuracy_reward": a, "format_reward": fmt} for a in accs]


# --- item 10: correctness ----------------------------------------------------------------


def test_tiny_grpo_correct_from_accuracy_reward(tmp_path: Path) -> None:
    """No options: correctness = accuracy_reward > 0 (before: reward > 0 counted every
    formatted wrong answer, pass@1 0.93 and pass@k 1.0 in the final window)."""
    out = tmp_path / "out"
    result = import_run("trl", TINY, out)
    meta = json.loads((out / "run.json").read_text())
    assert meta["correct_source"] == "accuracy_reward > 0"
    assert "correct_unknown" not in meta
    assert meta["reward_components"] == ["accuracy_reward", "format_reward"]
    assert meta["response_len_unit"] == "words"
    assert meta["provenance"]["correct"].startswith("accuracy_reward > 0: ")
    assert "format_reward not counted" in meta["provenance"]["correct"]
    assert any(n.startswith("correct = accuracy_reward > 0") for n in result.notes)
    report = rlscope.analyze(out)
    assert value(report, "signal.pass_at_1") == pytest.approx(0.1458, abs=5e-4)
    assert value(report, "signal.pass_at_k") == pytest.approx(0.6833, abs=5e-4)
    rollouts = pl.read_parquet(out / "rollouts")
    assert rollouts["correct"].to_list() == (rollouts["accuracy_reward"] > 0).to_list()
    # the correctness rule is stored with the run: a fresh open sees it, nothing is derived
    run = open_run(out)
    assert run.provenance["correct"] == meta["provenance"]["correct"]
    assert "correct" not in run.derived_columns("rollouts")


def test_healthy_pass_at_1_is_accuracy(tmp_path: Path) -> None:
    """trl-real/healthy: pass@1 in the final window = TRL's rewards/accuracy_reward/mean
    (0.9258 in its README), all-correct groups 0.6438 (before: 0.9914 and 0.9313)."""
    out = tmp_path / "out"
    import_run("trl", HEALTHY, out)
    report = rlscope.analyze(out)
    assert value(report, "signal.pass_at_1") == pytest.approx(0.9258, abs=5e-4)
    assert value(report, "signal.all_correct_frac") == pytest.approx(0.6438, abs=5e-4)
    assert value(report, "signal.reward") == pytest.approx(1.16875, abs=1e-6)


def test_the_gradient_clip_is_transformers_default_or_the_option(tmp_path: Path) -> None:
    """TRL's output dir does not record max_grad_norm: transformers' default 1.0 (GRPOConfig
    keeps it), said in provenance; the option sets another, 0 none. grad-spike then judges what
    passes the clip, as from W&B's config or TensorBoard's args text."""
    import_run("trl", HEALTHY, tmp_path / "default")
    meta = json.loads((tmp_path / "default" / "run.json").read_text())
    assert meta["max_grad_norm"] == 1.0
    assert "TrainingArguments default" in meta["provenance"]["max_grad_norm"]
    import_run("trl", HEALTHY, tmp_path / "none", max_grad_norm=0)
    meta = json.loads((tmp_path / "none" / "run.json").read_text())
    assert "max_grad_norm" not in meta and meta["provenance"]["max_grad_norm"].startswith("0:")


def test_trls_zero_std_share_of_float_noise_groups_is_not_compared(tmp_path: Path) -> None:
    """trl-float-noise: groups of 8 equal rewards 0.4125 carry advantages of ~6e-4 (TRL's
    float32 std is ~3e-8) and TRL logs frac_reward_zero_std 0 at every step: its value is kept
    as frac_reward_zero_std_isclose, provenance says why, and no logged-metric-mismatch."""
    out = tmp_path / "out"
    import_run("trl", GENUINE / "trl-float-noise", out, correct_column="accuracy_reward")
    meta = json.loads((out / "run.json").read_text())
    assert "isclose" in meta["provenance"]["frac_reward_zero_std"]
    steps = open_run(out).scan("steps").collect()
    assert "frac_reward_zero_std" not in steps.columns
    assert steps["frac_reward_zero_std_isclose"].max() == 0.0
    report = rlscope.analyze(out)
    assert report.metrics["signal.zero_std_frac"].value > 0.3
    assert "logged-metric-mismatch" not in {f.id for f in report.findings}


def test_unrecognised_reward_functions_skip_correctness(tmp_path: Path) -> None:
    """Reward functions `foo` and `bar`: no guess. No correct column, run.json says why, the
    reader derives nothing, every metric needing rollouts.correct is skipped; naming the
    function with correct_column brings them back."""
    groups = [[{"foo": a, "bar": 0.5} for a in (1.0, 0.0, 0.0, 1.0)] for _ in range(2)]
    src = write_run(tmp_path / "src", {1: groups, 2: groups})
    out = tmp_path / "out"
    result = import_run("trl", src, out)
    meta = json.loads((out / "run.json").read_text())
    assert (
        "say which reward function means correct: `-X correct_column=…`"
        in (meta["correct_unknown"])
    )
    assert "correct_source" not in meta
    assert meta["provenance"]["correct"].startswith("unknown: ")
    assert any("correctness unknown" in n for n in result.notes)
    assert "correct" not in pl.read_parquet(out / "rollouts").columns
    run = open_run(out)
    assert not run.has("rollouts", "correct")
    report = rlscope.analyze(out)
    for metric in ("signal.pass_at_1", "signal.pass_at_k", "signal.all_correct_frac"):
        assert metric not in report.metrics
        assert "rollouts.correct" in skip_reason(report, metric)
    assert value(report, "signal.reward") == pytest.approx(1.0)

    named = tmp_path / "named"
    import_run("trl", src, named, correct_column="foo")
    assert json.loads((named / "run.json").read_text())["correct_source"] == "foo > 0"
    assert value(rlscope.analyze(named), "signal.pass_at_1") == pytest.approx(0.5)


def test_single_reward_function_and_ambiguous_names(tmp_path: Path) -> None:
    """One reward function: correct = reward > 0, said so. Two accuracy-like names tie: no
    guess."""
    single = write_run(tmp_path / "one", {1: [[{"foo": 1.0}, {"foo": 0.0}]]})
    import_run("trl", single, tmp_path / "o1")
    meta = json.loads((tmp_path / "o1" / "run.json").read_text())
    assert meta["correct_source"] == "reward > 0"
    assert "single reward function foo" in meta["provenance"]["correct"]

    rows = [{"accuracy_reward": 1.0, "reasoning_accuracy_reward": 0.0}] * 2
    tie = write_run(tmp_path / "tie", {1: [rows]})
    import_run("trl", tie, tmp_path / "o2")
    meta = json.loads((tmp_path / "o2" / "run.json").read_text())
    assert "several reward functions are named like accuracy" in meta["correct_unknown"]


# --- item 11: reward columns --------------------------------------------------------------


def test_log_extra_numeric_column_not_summed(tmp_path: Path) -> None:
    """A numeric log_extra column (TRL writes it between the reward functions and
    `advantage`) is not a reward function: trainer_state.json has no rewards/<name>/mean for
    it. reward stays TRL's (final window 0.6083; summing `num_tokens` gave ~19.4)."""
    src = tmp_path / "src"
    (src / "completions").mkdir(parents=True)
    for path in sorted((TINY / "completions").glob("*.parquet")):
        frame = pl.read_parquet(path)
        frame = frame.insert_column(
            frame.columns.index("advantage"), pl.lit(18.8).alias("num_tokens")
        )
        frame.write_parquet(src / "completions" / path.name)
    shutil.copytree(TINY / "checkpoint-150", src / "checkpoint-150")
    out = tmp_path / "out"
    import_run("trl", src, out)
    meta = json.loads((out / "run.json").read_text())
    assert meta["reward_components"] == ["accuracy_reward", "format_reward"]
    assert "num_tokens not summed (log_extra)" in meta["provenance"]["reward"]
    report = rlscope.analyze(out)
    assert value(report, "signal.reward") == pytest.approx(0.6083, abs=5e-4)
    logged = report.metrics["signal.reward"].logged
    assert logged is not None and logged.value == pytest.approx(value(report, "signal.reward"))
    assert pl.read_parquet(out / "rollouts")["num_tokens"].unique().to_list() == [18.8]


# --- item 12: unscorable rows -------------------------------------------------------------


def test_unscorable_rows_left_out_of_reward_and_sigma(tmp_path: Path) -> None:
    """TRL >= 1.6: a row where every reward function returned None is NaN, left out of the
    reward mean, the group mean and σ (nanmean / nanstd), its advantage 0. rlscope writes
    reward null (a counted warning) and leaves the row out; before, it counted as reward 0 and
    incorrect, and made a zero-σ group look varied."""
    unscorable = {"accuracy_reward": None, "format_reward": None}
    groups = [
        [*acc_fmt([1.0, 1.0, 1.0]), unscorable],  # σ 0 without the unscorable row
        acc_fmt([0.0, 1.0, 0.0, 1.0]),
    ]
    src = write_run(tmp_path / "src", {1: groups})
    out = tmp_path / "out"
    result = import_run("trl", src, out)
    assert any("1 unscorable rollout(s)" in w for w in result.warnings)
    rollouts = pl.read_parquet(out / "rollouts").sort("rollout_id")
    assert rollouts["reward"][3] is None and rollouts["correct"][3] is None
    logged = json.loads((src / "checkpoint-9" / "trainer_state.json").read_text())
    entry = logged["log_history"][0]
    report = rlscope.analyze(out)
    assert value(report, "signal.reward") == pytest.approx(entry["reward"])  # 8.5 / 7
    assert value(report, "signal.zero_std_frac") == pytest.approx(0.5)
    assert entry["frac_reward_zero_std"] == pytest.approx(0.5)
    # mean of the groups' accuracy: 3/3 and 2/4 (counting the unscorable row wrong: 0.625)
    assert value(report, "signal.pass_at_1") == pytest.approx(0.75)


def test_accuracy_none_on_a_scored_row_is_counted(tmp_path: Path) -> None:
    rows = [
        {"accuracy_reward": None, "format_reward": 0.5},
        {"accuracy_reward": 1.0, "format_reward": 0.5},
    ]
    src = write_run(tmp_path / "src", {1: [rows]})
    result = import_run("trl", src, tmp_path / "out")
    assert any("where `accuracy_reward` returned None" in w for w in result.warnings)
    rollouts = pl.read_parquet(tmp_path / "out" / "rollouts").sort("rollout_id")
    # correct stays null (never filled from reward > 0), reward is TRL's nansum
    assert rollouts["correct"].to_list() == [None, True]
    assert rollouts["reward"].to_list() == [0.5, 1.5]
    run = open_run(tmp_path / "out")
    scanned = run.scan("rollouts").sort("rollout_id").collect()
    assert scanned["correct"].to_list() == [None, True]


# --- item 13: scale_rewards="batch" -------------------------------------------------------


def test_scale_rewards_batch_not_compared(tmp_path: Path) -> None:
    """scale_rewards="batch": TRL's is_std_zero uses the batch std, so its
    frac_reward_zero_std is 0 or 1 for the whole batch. Detected from the advantages (not
    scaled by each group's std), the steps column is kept as frac_reward_zero_std_batch and
    signal.zero_std_frac has no logged value to be compared with; provenance says so."""
    groups = [acc_fmt([1.0, 1.0, 1.0, 1.0]), acc_fmt([0.0, 1.0, 0.0, 0.0])]
    src = write_run(tmp_path / "src", {1: groups, 2: groups}, scale="batch")
    out = tmp_path / "out"
    import_run("trl", src, out)
    meta = json.loads((out / "run.json").read_text())
    assert "scale_rewards='batch'" in meta["provenance"]["frac_reward_zero_std"]
    assert "not compared" in meta["provenance"]["frac_reward_zero_std"]
    steps = pl.read_parquet(out / "steps")
    assert "frac_reward_zero_std" not in steps.columns
    assert steps["frac_reward_zero_std_batch"].to_list() == [0.0, 0.0]
    report = rlscope.analyze(out)
    assert value(report, "signal.zero_std_frac") == pytest.approx(0.5)
    assert report.metrics["signal.zero_std_frac"].logged is None

    grouped = write_run(tmp_path / "g", {1: groups, 2: groups}, scale="group")
    import_run("trl", grouped, tmp_path / "go")
    assert "frac_reward_zero_std" in pl.read_parquet(tmp_path / "go" / "steps").columns
    logged = rlscope.analyze(tmp_path / "go").metrics["signal.zero_std_frac"].logged
    assert logged is not None and logged.value == pytest.approx(0.5)

    forced = tmp_path / "fo"
    import_run("trl", grouped, forced, scale_rewards="batch")
    assert "frac_reward_zero_std_batch" in pl.read_parquet(forced / "steps").columns


# --- item 14: eval rows in a train file ---------------------------------------------------


def test_eval_rows_in_train_file_left_out(tmp_path: Path) -> None:
    """An evaluation at logging step 2 rewrites completions_00002 from the deque TRL shares
    between train and eval: the tail of the train batch plus eval rows, not whole blocks.
    log_history has an eval_* entry at step 2: that file is left out with a warning, the
    other steps are imported."""
    groups = [acc_fmt([1.0, 0.0]), acc_fmt([0.0, 0.0])]
    eval_rows = acc_fmt([1.0, 1.0, 1.0])
    src = write_run(tmp_path / "src", {1: groups, 2: groups, 3: groups}, eval_at={2: eval_rows})
    out = tmp_path / "out"
    result = import_run("trl", src, out)
    assert any("evaluation step" in w and "not whole blocks" in w for w in result.warnings)
    rollouts = pl.read_parquet(out / "rollouts")
    assert sorted(rollouts["step"].unique().to_list()) == [1, 3]
    assert "eval completion" not in rollouts["response"].to_list()
    report = rlscope.analyze(out)
    assert value(report, "signal.pass_at_1") == pytest.approx(0.25)
    assert sorted(pl.read_parquet(out / "steps")["step"].to_list()) == [1, 2, 3]


# --- provenance shown by every command reading the imported directory ---------------------


def test_provenance_in_analyze_text_json_and_html(tmp_path: Path) -> None:
    out = tmp_path / "out"
    import_run("trl", TINY, out)
    text = run_cli("analyze", str(out), "--fail-on", "never")
    assert text.returncode == 0, text.stderr
    assert "how: correct" in text.stdout and "accuracy_reward > 0" in text.stdout
    doc = json.loads(run_cli("analyze", str(out), "-f", "json", "--fail-on", "never").stdout)
    assert doc["run"]["provenance"]["correct"].startswith("accuracy_reward > 0")
    assert next(iter(doc["run"]["provenance"])) == "correct"
    html_path = tmp_path / "r.html"
    done = run_cli("report", str(out), "-o", str(html_path))
    assert done.returncode == 0, done.stderr
    assert "accuracy_reward &gt; 0" in html_path.read_text()


def test_reward_weights_inferred_from_log_history(tmp_path: Path) -> None:
    """format-weighted-groupnorm ran with reward_weights=[0.125, 4.0]: solved exactly from
    log_history, so the recomputed reward equals TRL's logged one with no option given."""
    source = GENUINE / "trl-real/format-weighted-groupnorm"
    from rlscope.analysis import analyze

    report = analyze(source, from_format="trl", cache_dir=tmp_path, metrics=["signal.reward"])
    reward = report.metrics["signal.reward"]
    assert reward.logged is not None
    logged = dict(zip(reward.logged.steps, reward.logged.values, strict=True))
    ours = dict(zip(reward.steps, reward.values, strict=True))
    assert max(abs(ours[s] - logged[s]) for s in ours) < 1e-6
    assert any("reward_weights inferred" in n for n in report.notes)
    assert "format_reward x4" in report.run.meta["provenance"]["reward"]


def test_an_importer_revision_never_reuses_an_older_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlscope import cache

    before = cache.import_cache_dir("trl", tmp_path, {}, root=tmp_path)
    monkeypatch.setattr(cache, "IMPORT_REVISION", cache.IMPORT_REVISION + 1)
    assert cache.import_cache_dir("trl", tmp_path, {}, root=tmp_path) != before


def test_a_trl_dir_named_like_a_pattern_imports(tmp_path: Path) -> None:
    """TRL output under `runs/lr=1e-5 [a]*/`: its files are read by their literal paths, with
    no column taken from the `key=value` folder."""
    odd = tmp_path / "lr=1e-5 [a]*"
    shutil.copytree(TINY, odd)
    plain, strange = tmp_path / "plain", tmp_path / "strange"
    import_run("trl", TINY, plain)
    import_run("trl", odd, strange)
    a = pl.read_parquet(sorted((plain / "rollouts").glob("*.parquet")))
    b = pl.read_parquet([str(p) for p in sorted((strange / "rollouts").glob("*.parquet"))])
    assert a.columns == b.columns and a.height == b.height > 0


def test_a_reused_import_reports_the_notes_of_the_first(tmp_path: Path) -> None:
    """The notes say how the source was read (group size inferred, lengths counted in words);
    an analysis that reuses the cached import reads no file again, and still reports them."""
    first = rlscope.analyze(HEALTHY, from_format="trl", cache_dir=tmp_path, use_cache=False)
    again = rlscope.analyze(HEALTHY, from_format="trl", cache_dir=tmp_path, use_cache=False)
    assert any("num_generations = 8" in n for n in first.notes)
    assert any("whitespace-separated words" in n for n in first.notes)
    assert again.notes == first.notes


# --- L5 from the trainer's own eval logs (a dict of eval datasets) -------------------------------


def _eval_entry(step: int, name: str, accuracy: float, prompts: int = 50) -> dict[str, object]:
    """One log_history entry of one eval set, keyed as TRL 1.16 writes it: transformers'
    Trainer keys with the set's name (`eval_<name>_runtime`, ...: `metric_key_prefix`), TRL's
    own metrics without it (`eval_reward`, `eval_rewards/<fn>/mean`)."""
    runtime = 0.25
    return {
        "step": step,
        "epoch": 1.0,
        f"eval_{name}_loss": 0.01,
        f"eval_{name}_runtime": runtime,
        f"eval_{name}_samples_per_second": round(prompts / runtime, 3),
        f"eval_{name}_steps_per_second": 4.0,
        "eval_reward": accuracy + 0.2,
        "eval_rewards/accuracy_reward/mean": accuracy,
        "eval_rewards/format_reward/mean": 0.2,
        "eval_frac_reward_zero_std": 0.5,
    }


def _with_evals(root: Path, evals: dict[int, dict[str, float]]) -> Path:
    state = root / "checkpoint-9" / "trainer_state.json"
    doc = json.loads(state.read_text())
    for step, sets in sorted(evals.items()):
        doc["log_history"] += [_eval_entry(step, name, acc) for name, acc in sets.items()]
    state.write_text(json.dumps(doc))
    return root


def _learning_run(root: Path, steps: int = 24) -> Path:
    return write_run(root, {s: [acc_fmt([1.0, 0.0, 1.0, 0.0])] * 2 for s in range(1, steps + 1)})


def test_trl_eval_sets_are_kept_apart_and_give_l5(tmp_path: Path) -> None:
    """Two eval sets at each eval step (one entry each, TRL's keys without the set's name):
    each set's keys named by it, the ID and OOD accuracies and their completions (the set's
    prompts x num_generations) in the steps table, and the L5 metrics from them."""
    ood = {s: {"in_dist": 0.2 + 0.05 * i, "gsm_ood": 0.2} for i, s in enumerate(range(3, 25, 3))}
    src = _with_evals(_learning_run(tmp_path / "src"), ood)
    out = tmp_path / "out"
    result = import_run("trl", src, out)
    steps = pl.read_parquet(sorted((out / "steps").glob("*.parquet"))).sort("step")
    at = steps.filter(pl.col("eval_id_accuracy").is_not_null())
    assert at["step"].to_list() == list(ood)
    assert at["eval_id_accuracy"].to_list() == pytest.approx([v["in_dist"] for v in ood.values()])
    assert at["eval_ood_accuracy"].to_list() == pytest.approx([0.2] * len(ood))
    assert at["eval_id_completions"].to_list() == [50 * 4] * len(ood)  # 50 prompts x 4
    assert at["eval_in_dist_reward"].to_list() == pytest.approx(
        [v["in_dist"] + 0.2 for v in ood.values()]
    )
    assert at["eval_gsm_ood_reward"].to_list() == pytest.approx([0.4] * len(ood))
    assert "eval sets: `gsm_ood` → eval_ood, `in_dist` → eval_id" in " ".join(result.notes)
    report = rlscope.analyze(out)
    assert report.metrics["generalization.eval_id"].values == tuple(
        pytest.approx(v["in_dist"]) for v in ood.values()
    )
    assert "as logged" in report.metrics["generalization.ood_gap"].source
    (gap,) = [f for f in report.findings if f.id == "ood-gap"]
    assert "OOD accuracy is flat" in gap.message
    assert gap.evidence["sampling_error"].startswith("binomial")


def test_trl_eval_sets_named_by_option_and_sizes_unknown(tmp_path: Path) -> None:
    """`ood_sets` chooses the OOD sets; without the Trainer's speed keys the eval sizes are
    unknown: completions null, and ood-gap judges on the scatter alone (never on one eval a
    window with no error at all)."""
    evals = {s: {"easy": 0.3 + 0.05 * i, "hard": 0.3} for i, s in enumerate(range(3, 25, 3))}
    src = _with_evals(_learning_run(tmp_path / "src"), evals)
    state = src / "checkpoint-9" / "trainer_state.json"
    doc = json.loads(state.read_text())
    for entry in doc["log_history"]:
        for key in [k for k in entry if k.endswith("_samples_per_second")]:
            del entry[key]
    state.write_text(json.dumps(doc))
    out = tmp_path / "out"
    result = import_run("trl", src, out, ood_sets=["hard"])
    steps = pl.read_parquet(sorted((out / "steps").glob("*.parquet")))
    at = steps.filter(pl.col("eval_ood_accuracy").is_not_null())
    assert at["eval_ood_accuracy"].to_list() == pytest.approx([0.3] * len(evals))
    # Every size unknown: no completions column at all (a column of nulls is not written).
    assert "eval_ood_completions" not in at.columns
    assert "(ood_sets option)" in " ".join(result.notes)
    report = rlscope.analyze(out)
    (gap,) = [f for f in report.findings if f.id == "ood-gap"]
    assert gap.evidence["sampling_error"].startswith("step-to-step scatter only")


@pytest.mark.slow
def test_eval_sets_of_a_real_trl_run(tmp_path: Path) -> None:
    """A real GRPOTrainer run (tests/trainers/trl_two_eval_sets.py: a tiny policy, an `in_dist`
    and an `ood` eval set, 240 steps, ~20 s on CPU): every eval point of each set is read
    apart, as the trainer logged it, and L5 is judged from them (ID rises, OOD stays flat at
    the digits it never trained on)."""
    src = tmp_path / "trl-run"
    run_trainer("trl_two_eval_sets.py", src)
    history = json.loads((src / "trainer_state.json").read_text())["log_history"]
    logged: dict[tuple[int, str], tuple[float, int]] = {}
    for entry in history:
        for name in ("in_dist", "ood"):
            if f"eval_{name}_runtime" in entry:
                size = entry[f"eval_{name}_samples_per_second"] * entry[f"eval_{name}_runtime"]
                accuracy = entry["eval_rewards/accuracy_reward/mean"]
                logged[entry["step"], name] = (accuracy, round(size))
    assert len(logged) == 24 and {n for _, n in logged.values()} == {10}
    out = tmp_path / "out"
    import_run("trl", src, out)
    steps = pl.read_parquet(sorted((out / "steps").glob("*.parquet")))
    for (step, name), (accuracy, prompts) in logged.items():
        split = "eval_ood" if name == "ood" else "eval_id"
        row = steps.filter(pl.col("step") == step).row(0, named=True)
        assert row[f"{split}_accuracy"] == pytest.approx(accuracy)
        assert row[f"{split}_completions"] == prompts * 8
        assert row[f"eval_{name}_rewards/accuracy_reward/mean"] == pytest.approx(accuracy)
    report = rlscope.analyze(out)
    ids = sorted(s for s, n in logged if n == "in_dist")
    assert report.metrics["generalization.eval_id"].steps == tuple(ids)
    assert report.metrics["generalization.eval_ood"].value == pytest.approx(0.0)
    (gap,) = [f for f in report.findings if f.id == "ood-gap"]
    assert gap.evidence["ood_trend"] == "flat"
