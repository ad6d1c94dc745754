"""Importers: TRL's real output against its own logs, verl / verl-agent / metrics / JSONL round
trips, incremental re-imports, malformed lines, and sources left untouched."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import GENUINE

import rlscope
from rlscope.errors import RlscopeError
from rlscope.importers import IMPORTERS, MANIFEST, import_run
from rlscope.importers.text import (
    ASSISTANT,
    extract_answer,
    messages_expr,
    messages_to_text,
    prompt_id,
)
from rlscope.reader import open_run

TRL_FIXTURE = GENUINE / "trl-tiny-grpo"


# --- helpers ------------------------------------------------------------------------------


def tree(path: Path) -> dict[str, tuple[int, int, str]]:
    """Fingerprint of every file and folder below `path`: size, mtime and content hash."""
    out: dict[str, tuple[int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        here = Path(dirpath)
        for name in dirnames:
            stat = (here / name).stat()
            out[(here / name).relative_to(path).as_posix() + "/"] = (0, stat.st_mtime_ns, "")
        for name in filenames:
            file = here / name
            stat = file.stat()
            digest = hashlib.sha256(file.read_bytes()).hexdigest()
            out[file.relative_to(path).as_posix()] = (stat.st_size, stat.st_mtime_ns, digest)
    return out


def write_jsonl(path: Path, rows: Iterable[dict[str, Any] | str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def table(out: Path, name: str) -> pl.DataFrame:
    return open_run(out).scan(name).collect()


def series(report: rlscope.Report, metric: str) -> dict[int, float | None]:
    result = report.metrics[metric]
    return dict(zip(result.steps, result.values, strict=True))


PROMPTS = ("What is 2+3?", "What is 7*6?", "Name a prime above 10.")
ANSWERS = ("5", "42", "11")


def verl_step(step: int, *, acc: bool, n: int = 4, extra: bool = True) -> list[dict[str, Any]]:
    """One verl step dump: every prompt n times, rollout j of prompt i correct when j <= i."""
    rows = []
    for i, (prompt, answer) in enumerate(zip(PROMPTS, ANSWERS, strict=True)):
        for j in range(n):
            good = j <= i
            said = answer if good else "7"
            row: dict[str, Any] = {
                "input": prompt,
                "output": f"think {'hard ' * j}then <answer>{said}</answer>",
                "gts": answer,
                "score": 1.0 if good else 0.0,
                "step": step,
            }
            if acc:
                row |= {"acc": good, "pred": said}
            if extra:
                row |= {"format_ok": 1, "judge": "rule"}
            rows.append(row)
    return rows


@pytest.fixture
def verl_dir(tmp_path: Path) -> Path:
    src = tmp_path / "verl-run" / "rollouts"
    for step in (1, 2):
        write_jsonl(src / f"{step}.jsonl", verl_step(step, acc=True))
    write_jsonl(src / "3.jsonl", verl_step(3, acc=False))
    return src


# --- text helpers -------------------------------------------------------------------------


def test_text_helpers() -> None:
    assert prompt_id("What is 2+3?") == hashlib.blake2b(b"What is 2+3?", digest_size=8).hexdigest()
    assert extract_answer("a <answer> 12 </answer> b \\boxed{3}") == "12"
    assert extract_answer("so \\boxed{\\frac{\\sqrt{a^{2}}}{2}} and") == "\\frac{\\sqrt{a^{2}}}{2}"
    assert extract_answer("\\boxed{1} then \\boxed{2}") == "2"
    assert extract_answer("<answer>a</answer> <answer>b</answer>") == "b"
    assert extract_answer("no answer") is None and extract_answer(None) is None
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": "4"},
        {"role": "assistant", "content": "done"},
    ]
    assert messages_to_text(chat) == "be brief\n4\ndone"
    assert messages_to_text(chat, ASSISTANT) == "4\ndone"
    frame = pl.DataFrame({"m": [chat]})
    via_polars = frame.select(messages_expr("m", frame.schema["m"], ASSISTANT)).item()
    assert via_polars == messages_to_text(chat, ASSISTANT)


# --- TRL: the real fixture ----------------------------------------------------------------


def test_trl_fixture_agrees_with_trl_logs(tmp_path: Path) -> None:
    """TRL 1.16 numbers completions files and log_history by the same global_step (both are
    written in `log()` after the optimizer step, from the batch that step trained on), so the
    recomputed metrics line up with no offset. TRL computes `reward` as the mean of the summed
    reward functions over the gathered batch and `frac_reward_zero_std` over blocks of
    num_generations consecutive rows; rlscope's groups are those blocks, so both agree
    exactly (max abs difference 0 over 150 steps). Grouping by prompt text instead would not:
    11 of the 589 prompt draws repeat a prompt within a step, and merging those groups moves
    frac_reward_zero_std by up to 0.25. response_len (words) cannot agree with
    completions/mean_length (tokens): TRL counts the EOS token of every terminated completion
    and special tokens the policy emitted that decoding with skip_special_tokens drops (5 of
    the 23 vocabulary entries never appear as words); words + EOS stay below TRL's mean at
    every step, by 2.1..4.9 tokens, and words are ~82% of it (max abs difference 5.7)."""
    before = tree(TRL_FIXTURE)
    out = tmp_path / "out"
    ticks: list[tuple[int, int]] = []
    result = import_run("trl", TRL_FIXTURE, out, progress=lambda d, t: ticks.append((d, t)))
    assert tree(TRL_FIXTURE) == before
    assert result.rows == {"rollouts": 4800, "steps": 150}
    assert (result.first_step, result.last_step, result.steps_imported) == (1, 150, 150)
    assert ticks[-1] == (151, 151)
    assert any("accuracy_reward" in n and "format_reward" in n for n in result.notes)
    assert json.loads((out / "run.json").read_text())["group_size"] == 8

    report = rlscope.analyze(out)
    steps = table(out, "steps").sort("step")
    logged = {c: dict(zip(steps["step"], steps[c], strict=True)) for c in steps.columns}
    reward, zero = series(report, "signal.reward"), series(report, "signal.zero_std_frac")
    assert sorted(reward) == list(range(1, 151))
    diff_reward = max(abs(reward[s] - logged["reward"][s]) for s in reward)
    diff_zero = max(abs(zero[s] - logged["frac_reward_zero_std"][s]) for s in zero)
    assert diff_reward < 1e-9 and diff_zero < 1e-9
    # the same numbers through the report's own logged-vs-recomputed pairing
    assert report.metrics["signal.reward"].logged.column == "reward"
    # an offset of one step would not fit
    assert max(abs(reward[s] - logged["reward"][s + 1]) for s in range(1, 150)) > 0.1

    rollouts = table(out, "rollouts")
    by_text = (
        rollouts.group_by("step", "prompt")
        .agg(zero=pl.col("reward").max() == pl.col("reward").min())
        .group_by("step")
        .agg(pl.col("zero").mean())
    )
    merged = dict(zip(by_text["step"], by_text["zero"], strict=True))
    assert max(abs(merged[s] - logged["frac_reward_zero_std"][s]) for s in merged) > 0.1
    assert rollouts["prompt_id"].str.contains("#2").sum() == 11 * 8

    length = series(report, "behavior.response_len")
    mean_len, clipped = (
        logged["completions/mean_length_logged"],
        logged["completions/clipped_ratio"],
    )
    gaps = [mean_len[s] - (length[s] + 1 - clipped[s]) for s in length]
    assert min(gaps) > 0  # words + EOS never exceed TRL's token count
    ratio = sum(length.values()) / sum(mean_len[s] for s in length)
    assert 0.75 < ratio < 0.9
    assert max(abs(length[s] - mean_len[s]) for s in length) < 6
    # steps table mapping
    assert {"loss", "grad_norm", "entropy", "kl", "clip_frac", "lr"} <= set(steps.columns)
    assert steps["lr"][0] == pytest.approx(0.001)


def test_trl_incremental(tmp_path: Path) -> None:
    """A growing TRL output dir: first 100 completions files and a trainer_state of 90 steps,
    then everything; the re-import appends only the new steps of each table."""
    src = tmp_path / "trl-run"
    (src / "completions").mkdir(parents=True)
    files = sorted((TRL_FIXTURE / "completions").glob("*.parquet"))
    for path in files[:100]:
        shutil.copy2(path, src / "completions" / path.name)
    state = json.loads((TRL_FIXTURE / "checkpoint-150" / "trainer_state.json").read_text())
    partial = {**state, "global_step": 90, "log_history": state["log_history"][:90]}
    (src / "checkpoint-90").mkdir()
    (src / "checkpoint-90" / "trainer_state.json").write_text(json.dumps(partial))
    out = tmp_path / "out"
    first = import_run("trl", src, out)
    assert first.rows == {"rollouts": 3200, "steps": 90}

    for path in files[100:]:
        shutil.copy2(path, src / "completions" / path.name)
    shutil.copytree(TRL_FIXTURE / "checkpoint-150", src / "checkpoint-150")
    second = import_run("trl", src, out)
    assert second.rows == {"rollouts": 1600, "steps": 60}
    assert (second.first_step, second.last_step) == (101, 150)
    assert second.files_unchanged == 100 and second.steps_skipped == 100
    rollouts, steps = table(out, "rollouts"), table(out, "steps")
    assert rollouts.height == 4800 and rollouts["rollout_id"].n_unique() == 4800
    assert steps["step"].sort().to_list() == list(range(1, 151))
    manifest = json.loads((out / MANIFEST).read_text())["imports"]["trl"]
    assert manifest["last_step"] == {"rollouts": 150, "steps": 150}

    files_before = tree(out)
    third = import_run("trl", src, out)
    assert not third.written and tree(out) == files_before


def write_trl_file(folder: Path, step: int, rows: list[dict[str, Any]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    frame = pl.DataFrame([{"step": step, **r} for r in rows])
    frame.write_parquet(folder / f"completions_{step:05d}.parquet")


def chat(role: str, text: str) -> list[dict[str, str]]:
    return [{"role": role, "content": text}]


def test_trl_chat_messages_and_options(tmp_path: Path) -> None:
    """Conversational prompts (list<struct<role, content>>), a prompt drawn twice in one step
    (two groups, as in TRL), weights, extra numeric columns and a correctness column."""
    src = tmp_path / "chat-run"
    rows = []
    for prompt, rewards in (("A", (1.0, 0.0)), ("B", (1.0, 1.0)), ("A", (0.0, 0.0))):
        for r in rewards:
            rows.append(
                {
                    "prompt": [
                        {"role": "system", "content": "sys"},
                        {"role": "user", "content": prompt},
                    ],
                    "completion": chat("assistant", f"the answer is \\boxed{{{int(r)}}}"),
                    "accuracy_reward": r,
                    "format_reward": 0.5,
                    "tokens_seen": 7,
                    "advantage": 0.0,
                }
            )
    write_trl_file(src / "completions", 3, rows)
    out = tmp_path / "out"
    result = import_run(
        "trl",
        src,
        out,
        extra_columns=["tokens_seen"],
        reward_weights={"format_reward": 2.0},
        correct_column="accuracy_reward",
    )
    assert result.rows == {"rollouts": 6, "steps": 0}
    frame = table(out, "rollouts").sort("rollout_id")
    assert frame["reward"].to_list() == [2.0, 1.0, 2.0, 2.0, 1.0, 1.0]
    assert frame["correct"].to_list() == [True, False, True, True, False, False]
    assert frame["response"][0] == "the answer is \\boxed{1}"
    assert frame["answer"].to_list() == ["1", "0", "1", "1", "0", "0"]
    assert frame["prompt"][0] == "sys\nA"
    assert frame["tokens_seen"].to_list() == [7.0] * 6
    ids = frame["prompt_id"].to_list()
    assert ids[0] == ids[1] == prompt_id("sys\nA") and ids[4] == ids[5] == ids[0] + "#2"
    assert json.loads((out / "run.json").read_text())["group_size"] == 2
    report = rlscope.analyze(out)
    assert report.run.n_groups == 3
    assert series(report, "signal.zero_std_frac") == {3: pytest.approx(2 / 3)}


def test_trl_reused_batch_is_not_imported_twice(tmp_path: Path) -> None:
    src = tmp_path / "reuse"
    rows = [{"prompt": "p", "completion": c, "r": float(i)} for i, c in enumerate("ab")]
    for step in (1, 2, 3, 4):  # one generation batch for four optimizer steps
        write_trl_file(src / "completions", step, rows)
    result = import_run("trl", src, tmp_path / "out")
    assert result.rows["rollouts"] == 2
    # One line with the count, not a note per file.
    reused = [n for n in result.notes if "generation batch reused" in n]
    assert reused == [
        "3 completions file(s) hold the same batch as the file before (a generation batch "
        "reused for several optimizer steps: steps_per_generation or num_iterations > 1), "
        "not imported again"
    ]


# --- verl ---------------------------------------------------------------------------------


def test_verl_round_trip(verl_dir: Path, tmp_path: Path) -> None:
    before = tree(verl_dir.parent)
    out = tmp_path / "out"
    result = import_run("verl", verl_dir, out)
    assert tree(verl_dir.parent) == before
    assert result.rows == {"rollouts": 36} and result.steps_imported == 3
    assert any("correct from `acc`" in n for n in result.notes)
    assert any("correct = score > 0" in n for n in result.notes)
    meta = json.loads((out / "run.json").read_text())
    assert {k: meta[k] for k in ("schema_version", "run_id", "algorithm", "group_size")} == {
        "schema_version": 1,
        "run_id": "rollouts",
        "algorithm": "GRPO",
        "group_size": 4,
    }
    assert meta["response_len_unit"] == "words" and set(meta["provenance"]) >= {"groups"}

    frame = table(out, "rollouts")
    sizes = frame.group_by("step", "prompt_id").len()
    assert sizes.height == 9 and set(sizes["len"]) == {4}
    assert set(frame["prompt_id"]) == {prompt_id(p) for p in PROMPTS}
    # correct follows acc in steps 1-2 and score > 0 in step 3: prompt i has i + 1 correct
    per_prompt = frame.group_by("step", "prompt").agg(pl.col("correct").sum())
    expected = {p: i + 1 for i, p in enumerate(PROMPTS)}
    assert all(expected[p] == n for p, n in per_prompt.select("prompt", "correct").iter_rows())
    step3 = frame.filter(pl.col("step") == 3)
    assert set(step3["answer"]) == {"5", "42", "11", "7"}  # extracted from <answer> tags
    assert {"gts", "format_ok", "judge"} <= set(frame.columns)
    assert frame["format_ok"].dtype == pl.Float64
    # response_len: whitespace words ("think hard hard then <answer>5</answer>")
    row = frame.filter((pl.col("step") == 1) & (pl.col("rollout_id") % 1_000_000 == 2)).row(
        0, named=True
    )
    assert row["response_len"] == len(row["response"].split())
    assert sorted(frame["rollout_id"].to_list())[:2] == [1_000_000, 1_000_001]

    report = rlscope.analyze(out)
    pass1 = series(report, "signal.pass_at_1")
    assert pass1 == {s: pytest.approx((1 + 2 + 3) / 12) for s in (1, 2, 3)}
    assert report.run.n_groups == 9


def test_verl_validation_dump_as_eval_split(verl_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    import_run("verl", verl_dir, out)
    val = tmp_path / "val"
    rows = [r | {"reward": r["score"]} for r in verl_step(2, acc=True, n=2)]
    write_jsonl(val / "2.jsonl", rows)
    result = import_run("verl", val, out, split="eval_id")
    assert result.rows == {"rollouts": 6}
    assert any("`raw_reward`" in n for n in result.notes)
    frame = table(out, "rollouts")
    assert frame["rollout_id"].n_unique() == frame.height == 42
    assert frame.filter(pl.col("split") == "eval_id").height == 6
    assert "raw_reward" in frame.columns
    manifest = json.loads((out / MANIFEST).read_text())["imports"]
    assert set(manifest) == {"verl", "verl:eval_id"}
    with pytest.raises(RlscopeError, match="split"):
        import_run("verl", val, tmp_path / "o2", split="validation")


def test_verl_agent_rows_fold_into_trajectories(tmp_path: Path) -> None:
    src = tmp_path / "agent"
    rows = []
    for traj, n_steps, won in (("t1", 3, True), ("t2", 2, False), ("t3", 1, True)):
        for k in range(n_steps):
            rows.append(
                {
                    "input": "You are in a kitchen." if k == 0 else f"obs {k}",
                    "output": f"go {traj} {k}",
                    "score": 1.0 if (won and k == n_steps - 1) else 0.0,
                    "traj_uid": traj,
                    "won": won,
                }
            )
    rows.insert(1, rows.pop(3))  # interleave trajectories, as batched env steps are
    write_jsonl(src / "5.jsonl", rows)
    out = tmp_path / "out"
    result = import_run("verl", src, out)
    assert result.rows == {"rollouts": 3}
    assert any("traj_uid" in n for n in result.notes)
    frame = table(out, "rollouts").sort("rollout_id")
    assert frame["traj_uid"].to_list() == ["t1", "t2", "t3"]
    assert frame["n_env_steps"].to_list() == [3, 2, 1]
    assert frame["actions"][0].to_list() == ["go t1 0", "go t1 1", "go t1 2"]
    assert frame["response"][0] == "go t1 0\ngo t1 1\ngo t1 2"
    assert frame["reward"].to_list() == [1.0, 0.0, 1.0]
    assert frame["response_len"].to_list() == [9, 6, 3]
    assert frame["won"].to_list() == [True, False, True]
    assert frame["step"].to_list() == [5, 5, 5]
    assert frame["prompt_id"].n_unique() == 1  # one starting prompt: one group of 3
    report = rlscope.analyze(out)
    assert series(report, "signal.reward") == {5: pytest.approx(2 / 3)}


def test_verl_metrics_combined_with_verl(verl_dir: Path, tmp_path: Path) -> None:
    metrics = tmp_path / "verl-run" / "metrics.jsonl"
    lines = []
    for step in (1, 2, 3):
        lines.append(
            {
                "step": step,
                "data": {
                    "actor/grad_norm": 0.5 * step,
                    "actor/entropy": 1.0 / step,
                    "actor/pg_clipfrac": 0.01,
                    "actor/kl_loss": 0.001 * step,
                    "actor/pg_loss": -0.1,
                    "actor/lr": 1e-6,
                    "actor/ppo_kl": 0.002,
                    "critic/score/mean": 0.5,
                    "response_length/mean": 5.0,
                    "response_length/clip_ratio": 0.0,
                    "timing/host": "node-1",
                },
            }
        )
    lines.append({"step": 3, "data": {"actor/grad_norm": 9.0}})  # a resumed run re-logs
    write_jsonl(metrics, lines)
    out = tmp_path / "out"
    first = import_run("verl-metrics", metrics, out)
    assert first.rows == {"steps": 3}
    assert any("non-numeric" in n and "timing/host" in n for n in first.notes)
    second = import_run("verl", verl_dir, out)
    assert second.rows == {"rollouts": 36}
    meta = json.loads((out / "run.json").read_text())
    assert meta["run_id"] == "verl-run" and meta["group_size"] == 4
    manifest = json.loads((out / MANIFEST).read_text())["imports"]
    assert set(manifest) == {"verl", "verl-metrics"}

    steps = table(out, "steps").sort("step")
    assert steps["grad_norm"].to_list() == [0.5, 1.0, 9.0]
    assert steps["clip_frac"].to_list() == [0.01] * 3
    assert steps["lr"][0] == 1e-6 and steps["loss"][0] == -0.1
    assert {"actor/ppo_kl", "critic/score/mean", "response_length/clip_ratio"} <= set(steps.columns)
    assert "timing/host" not in steps.columns
    report = rlscope.analyze(out)
    assert series(report, "stability.grad_norm") == {1: 0.5, 2: 1.0, 3: 9.0}
    assert series(report, "signal.reward") == {s: pytest.approx(0.5) for s in (1, 2, 3)}
    assert report.metrics["signal.reward"].logged.column == "critic/score/mean"
    trl = tmp_path / "trl"
    write_trl_file(trl / "completions", 1, [{"prompt": "p", "completion": "c", "r": 1.0}])
    with pytest.raises(RlscopeError, match="steps table was already imported"):
        import_run("trl", trl, out)


# --- generic JSONL ------------------------------------------------------------------------


def test_jsonl_with_mapping(tmp_path: Path) -> None:
    src = tmp_path / "generic"
    rows = []
    for it in (10, 20):
        for uid, p in (("q1", 0.25), ("q2", 0.75)):
            for k in range(4):
                score = 1.0 if k < p * 4 else 0.0
                rows.append(
                    {
                        "iteration": it,
                        "uid": uid,
                        "score": score,
                        "text": f"some words then \\boxed{{{k}}}",
                        "model": "m-7b",
                    }
                )
    write_jsonl(src / "a.jsonl", rows[:10])
    write_jsonl(src / "b.jsonl", rows[10:])
    out = tmp_path / "out"
    mapping = "step=iteration,prompt_id=uid,reward=score,response=text"
    result = import_run("jsonl", src, out, mapping=mapping)
    assert result.rows == {"rollouts": 16} and (result.first_step, result.last_step) == (10, 20)
    meta = json.loads((out / "run.json").read_text())
    assert meta["algorithm"] == "unknown" and meta["group_size"] == 4
    frame = table(out, "rollouts")
    assert frame["rollout_id"].n_unique() == 16
    assert frame.group_by("step", "prompt_id").len()["len"].to_list() == [4] * 4
    assert set(frame["answer"]) == {"0", "1", "2", "3"}
    assert set(frame["response_len"]) == {4}
    assert frame["model"].to_list() == ["m-7b"] * 16
    report = rlscope.analyze(out)
    assert series(report, "signal.pass_at_1") == {10: 0.5, 20: 0.5}
    with pytest.raises(RlscopeError, match="unknown format-v1 name"):
        import_run("jsonl", src, tmp_path / "o2", mapping={"score": "reward"})
    with pytest.raises(RlscopeError, match="prompt_id"):
        import_run("jsonl", src, tmp_path / "o3", mapping={"step": "iteration"})


# --- incremental, idempotent --------------------------------------------------------------


def test_verl_incremental_reimport(verl_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = import_run("verl", verl_dir, out)
    assert first.rows == {"rollouts": 36}
    write_jsonl(verl_dir / "4.jsonl", verl_step(4, acc=True))
    before = tree(verl_dir)
    second = import_run("verl", verl_dir, out)
    assert tree(verl_dir) == before
    assert second.rows == {"rollouts": 12}
    assert (second.first_step, second.last_step, second.steps_imported) == (4, 4, 1)
    assert second.steps_skipped == 3 and second.files_unchanged == 3
    frame = table(out, "rollouts")
    assert frame.height == 48 and frame["rollout_id"].n_unique() == 48
    manifest = json.loads((out / MANIFEST).read_text())["imports"]["verl"]
    assert manifest["last_step"] == {"rollouts": 4} and "4.jsonl" in manifest["files"]

    unchanged = tree(out)
    third = import_run("verl", verl_dir, out)
    assert not third.written and third.files_read == 0 and tree(out) == unchanged

    with open(verl_dir / "2.jsonl", "a") as handle:  # an imported step's file changes
        handle.write(json.dumps(verl_step(2, acc=True)[0]) + "\n")
    fourth = import_run("verl", verl_dir, out)
    assert not fourth.written
    assert any("2.jsonl" in w and "already imported" in w for w in fourth.warnings)
    assert table(out, "rollouts").height == 48

    with pytest.raises(RlscopeError, match="options differ"):
        import_run("verl", verl_dir, out, correct_threshold=0.5)
    import_run("verl", verl_dir, out, strict=True)  # strict does not change the data


def test_reimport_guards(verl_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(RlscopeError, match="formats: verl, verl-metrics, trl, jsonl"):
        import_run("openrlhf", verl_dir, tmp_path / "o")
    with pytest.raises(RlscopeError, match="unknown option"):
        import_run("verl", verl_dir, tmp_path / "o", mapping={})
    with pytest.raises(RlscopeError, match="inside the source"):
        import_run("verl", verl_dir, verl_dir / "out")
    out = tmp_path / "out"
    import_run("verl", verl_dir, out)
    other = write_jsonl(tmp_path / "other" / "1.jsonl", verl_step(1, acc=False)).parent
    with pytest.raises(RlscopeError, match="holds a `verl` import of"):
        import_run("verl", other, out)
    with pytest.raises(RlscopeError, match="train rollouts were already imported by `verl`"):
        import_run("jsonl", other, out, mapping={"prompt": "input", "reward": "score"})
    (out / "rollouts" / "r001-000001.parquet").write_bytes(b"stray")
    with pytest.raises(RlscopeError, match="no import recorded"):
        import_run("verl", verl_dir, out)


# --- malformed lines ----------------------------------------------------------------------


def test_malformed_lines_are_skipped_and_located(tmp_path: Path) -> None:
    src = tmp_path / "bad"
    good = verl_step(7, acc=True)
    lines: list[dict[str, Any] | str] = [
        good[0],
        '{"input": "q", "output": ',  # line 2: bad JSON
        {"input": "q", "score": 1.0},  # line 3: no output
        {"input": "q", "output": "o", "score": "high"},  # line 4: wrong type
        "[1, 2]",  # line 5: not an object
        {"input": "q", "output": "o", "score": True},  # line 6: bool is not a number
        *good[1:],
    ]
    path = write_jsonl(src / "7.jsonl", lines)
    result = import_run("verl", src, tmp_path / "out")
    assert result.rows == {"rollouts": len(good)}
    assert result.lines_skipped == {
        "bad JSON": 1,
        "missing `output`": 1,
        "wrong type for `score`": 2,
        "not a JSON object": 1,
    }
    assert f"{path}:2: bad JSON (Expecting value)" in result.line_examples
    assert f"{path}:4: wrong type for `score` (string, expected a number)" in result.line_examples
    assert f"{path}:3: missing `output`" in result.line_examples
    with pytest.raises(RlscopeError, match=r"7\.jsonl:2: bad JSON"):
        import_run("verl", src, tmp_path / "strict", strict=True)

    metrics = write_jsonl(
        tmp_path / "m" / "log.jsonl",
        [{"step": 1, "data": {"a": 1}}, "nope", {"step": "x", "data": {}}, {"step": 2}],
    )
    result = import_run("verl-metrics", metrics, tmp_path / "out-m")
    assert result.rows == {"steps": 1}
    assert result.lines_skipped == {
        "bad JSON": 1,
        "wrong type for `step`": 1,
        "missing `data`": 1,
    }
    with pytest.raises(RlscopeError, match=r"log\.jsonl:2"):
        import_run("verl-metrics", metrics, tmp_path / "out-m2", strict=True)


def test_every_importer_documents_itself() -> None:
    for name, importer in IMPORTERS.items():
        assert importer.name == name
        assert "Options:" in importer.doc and "strict" in importer.doc
        assert len(importer.doc.splitlines()) > 10


def test_flushes_keep_the_manifest_in_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small flushes: several Parquet files, each recorded in import.json when written; rows
    of only the required verl keys (no extra column); a step of too many rollouts is an
    error rather than clashing ids."""
    import rlscope.importers.session as base

    src = tmp_path / "plain"
    for step in (1, 2, 3):
        rows = [{"input": p, "output": "x y", "score": 0.0} for p in PROMPTS for _ in range(4)]
        write_jsonl(src / f"{step}.jsonl", rows)
    monkeypatch.setattr(base, "FLUSH_ROWS", 10)
    out = tmp_path / "out"
    result = import_run("verl", src, out)
    assert result.rows == {"rollouts": 36}
    files = sorted(p.relative_to(out).as_posix() for p in (out / "rollouts").glob("*.parquet"))
    assert len(files) == 3
    assert json.loads((out / MANIFEST).read_text())["imports"]["verl"]["outputs"] == files
    assert set(table(out, "rollouts")["response_len"]) == {2}

    monkeypatch.setattr(base, "STEP", 5)
    with pytest.raises(RlscopeError, match="rollouts or more"):
        import_run("verl", src, tmp_path / "out2")
