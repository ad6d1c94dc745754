"""The verl importers on data shaped exactly as verl writes it: the shared fixture (dumps from
verl's own `_dump_generations` after `balance_batch`, file-logger metrics of 0.5 / 0.6 / 0.7 /
main) and small dumps built here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl
import pytest
from conftest import GENUINE

from rlscope.analysis import analyze
from rlscope.errors import RlscopeError
from rlscope.importers import import_run
from rlscope.reader import open_run

FIXTURE = GENUINE / "verl-dapo"
DUMPS = FIXTURE / "run" / "rollout_data"


def metrics_log(path: Path, data: dict[str, float], steps: int = 3) -> Path:
    """A verl file-logger log: one `{"step", "data"}` line per step 1..steps, the same data."""
    path.write_text("\n".join(json.dumps({"step": s, "data": data}) for s in range(1, steps + 1)))
    return path


def table(run: Path, name: str) -> pl.DataFrame:
    return pl.read_parquet(sorted((run / name).glob("*.parquet")))


def truth() -> pl.DataFrame:
    return pl.read_ndjson(FIXTURE / "run" / "truth.jsonl").filter(pl.col("split") == "train")


def imported(tmp_path: Path, version: str, **options: str) -> Path:
    out = tmp_path / f"verl-{version}"
    import_run(
        "verl", DUMPS, out, metrics=str(FIXTURE / f"metrics-verl-{version}.jsonl"), **options
    )
    return out


def test_groups_equal_verls_uids_except_repeated_prompts(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = import_run("verl", DUMPS, out)
    rollouts = table(out, "rollouts").with_columns((pl.col("rollout_id") % 1_000_000).alias("line"))
    joined = rollouts.join(truth(), on=["step", "line"])
    assert joined.height == rollouts.height == 640
    # Each of our groups is one uid, or the union of the uids of one prompt drawn twice.
    per_group = joined.group_by("step", "prompt_id").agg(pl.col("uid").n_unique().alias("uids"))
    merged = per_group.filter(pl.col("uids") > 1)
    assert per_group.filter(pl.col("uids") == 1).height + merged.height == per_group.height
    assert merged.height == 7 and (merged["uids"] == 2).all()
    # No uid is split across two of our groups.
    assert (
        joined.group_by("step", "uid").agg(pl.col("prompt_id").n_unique())["prompt_id"].max() == 1
    )
    assert any("7 of 153 groups hold a multiple" in w for w in result.warnings)
    assert json.loads((out / "run.json").read_text())["group_size"] == 4


def test_uid_of_verl_0_9_is_the_group(tmp_path: Path) -> None:
    source = tmp_path / "dumps"
    source.mkdir()
    lines = [
        {
            "input": "same prompt",
            "output": f"<think>x</think> Answer: {i}",
            "score": 1.0,
            "step": 1,
            "uid": f"{'a' if i < 2 else 'b'}_0_{i}",
        }
        for i in range(4)
    ]
    (source / "1.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    import_run("verl", source, tmp_path / "out")
    rollouts = table(tmp_path / "out", "rollouts").sort("rollout_id")
    ids = rollouts["prompt_id"].to_list()
    assert ids[0] == ids[1] != ids[2] == ids[3]
    assert rollouts["answer"].to_list() == ["0", "1", "2", "3"]


@pytest.mark.parametrize("version", ["0.5", "0.6", "0.7", "head"])
def test_no_false_alarm_from_any_metrics_file(tmp_path: Path, version: str) -> None:
    report = analyze(imported(tmp_path, version))
    found = {f.id: f for f in report.findings}
    assert "kl-stalled" not in found and "format-violations" not in found
    # The `Answer: X` style parses: well-formed where not truncated.
    assert report.metrics["behavior.format_ok"].value >= 0.7
    # Truncation from verl's own token-based clip ratio, equal to the truth's token share.
    shares = truth().group_by("step").agg((pl.col("response_len") >= 48).mean().alias("share"))
    expected = dict(shares.iter_rows())
    trunc = report.metrics["behavior.truncation_rate"]
    assert "as logged" in trunc.source
    assert all(abs(v - expected[s]) < 1e-9 for s, v in zip(trunc.steps, trunc.values, strict=True))
    assert found["truncation"].severity in ("warn", "critical")
    kl = report.metrics.get("stability.kl")
    provenance = report.run.provenance
    if version in ("0.5", "0.6"):
        assert kl is not None and "actor/kl_loss" in provenance["kl"]
    else:
        assert kl is None and provenance["kl"].startswith("not logged")
    assert ("divergence" in found) == (version == "head")
    if version == "head":
        assert found["divergence"].severity == "critical"
        assert found["divergence"].evidence["steps"] == [7]


def test_nan_grad_norm_reaches_the_steps_table(tmp_path: Path) -> None:
    out = tmp_path / "m"
    import_run("verl-metrics", FIXTURE / "metrics-verl-head.jsonl", out)
    steps = table(out, "steps").sort("step")
    grad = dict(zip(steps["step"].to_list(), steps["grad_norm"].to_list(), strict=True))
    assert math.isnan(grad[7]) and all(math.isfinite(v) for s, v in grad.items() if s != 7)


def test_kl_loss_scale_and_version_semantics(tmp_path: Path) -> None:
    runs = {}
    for version, options in (("0.5", {}), ("0.6", {"verl_version": "0.6", "kl_loss_scale": "16"})):
        out = tmp_path / version
        import_run("verl-metrics", FIXTURE / f"metrics-verl-{version}.jsonl", out, **options)
        runs[version] = table(out, "steps").sort("step")["kl"].to_list()
        assert json.loads((out / "run.json").read_text())["provenance"]["kl"]
    # 0.6 logged the KL divided by the 16 gradient-accumulation steps: scaled back, equal.
    assert runs["0.6"] == pytest.approx(runs["0.5"], rel=1e-6)
    assert runs["0.5"][0] == pytest.approx(0.004, rel=0.05)


def test_entropy_unit_follows_loss_agg_mode(tmp_path: Path) -> None:
    source = metrics_log(
        tmp_path / "metrics.jsonl", {"actor/entropy": 70.0, "actor/grad_norm": 1.0}
    )
    out = tmp_path / "out"
    import_run("verl-metrics", source, out, loss_agg_mode="seq-mean-token-sum")
    steps = table(out, "steps")
    assert "entropy" not in steps.columns and "actor/entropy" in steps.columns
    assert (
        "not nats per token" in json.loads((out / "run.json").read_text())["provenance"]["entropy"]
    )
    out2 = tmp_path / "out2"
    import_run("verl-metrics", source, out2)
    assert "entropy" in table(out2, "steps").columns


def test_reward_kl_penalty_is_read(tmp_path: Path) -> None:
    source = tmp_path / "metrics.jsonl"
    rows = [{"actor/kl_loss": 0.0, "actor/reward_kl_penalty": 0.01 * s} for s in range(1, 4)]
    source.write_text("\n".join(json.dumps({"step": s, "data": r}) for s, r in enumerate(rows, 1)))
    import_run("verl-metrics", source, tmp_path / "out")
    assert table(tmp_path / "out", "steps").sort("step")["kl"].to_list() == [0.01, 0.02, 0.03]


def _dump(folder: Path, lines: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "1.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return folder


def test_tokenizer_counts_tokens_and_truncation(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {w: i for i, w in enumerate(["[UNK]", "a", "b", "Answer:", "1", "2"])}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    texts = ["a b a b Answer: 1", "a Answer: 2", "a b a b a b", "b Answer: 1"]
    source = _dump(
        tmp_path / "d",
        [{"input": "p", "output": t, "score": 1.0, "step": 1} for t in texts],
    )
    out = tmp_path / "out"
    import_run("verl", source, out, tokenizer=str(tmp_path / "tokenizer.json"), max_response_len=6)
    rollouts = table(out, "rollouts").sort("rollout_id")
    assert rollouts["response_len"].to_list() == [6, 3, 6, 3]
    assert rollouts["truncated"].to_list() == [True, False, True, False]
    assert json.loads((out / "run.json").read_text())["response_len_unit"] == "tokens"


def test_words_are_never_compared_with_a_token_cap(tmp_path: Path) -> None:
    source = _dump(
        tmp_path / "d",
        [{"input": "p", "output": "a " * 60, "score": 0.0, "step": 1} for _ in range(4)],
    )
    out = tmp_path / "out"
    import_run("verl", source, out, max_response_len=48)
    run = open_run(out)
    assert run.meta["response_len_unit"] == "words"
    assert not run.has("rollouts", "truncated")


def test_odd_fields_are_nulled_not_dropped(tmp_path: Path) -> None:
    lines = [
        {
            "input": "p",
            "output": "<think>x</think> Answer: 1",
            "score": 1.0,
            "step": 1,
            "acc": "True",
            "pred": "1",
        },
        {
            "input": "p",
            "output": "<think>x</think> Answer: 2",
            "score": 0.0,
            "step": 1,
            "acc": {"odd": 1},
            "pred": ["2"],
        },
        {
            "input": "p",
            "output": "Answer: 3",
            "score": 0.0,
            "step": 1,
            "acc": "False",
            "pred": "[INVALID]",
        },
    ]
    out = tmp_path / "out"
    result = import_run("verl", _dump(tmp_path / "d", lines), out)
    rollouts = table(out, "rollouts").sort("rollout_id")
    assert rollouts.height == 3
    assert rollouts["correct"].to_list() == [True, False, False]  # the odd acc: score > 0
    assert rollouts["answer"].to_list() == ["1", '["2"]', "3"]
    assert any("`acc` is not" in w and "1 line(s)" in w for w in result.warnings)


def test_import_with_no_row_is_an_error(tmp_path: Path) -> None:
    source = tmp_path / "d"
    source.mkdir()
    (source / "1.jsonl").write_text('{"no": "fields"}\n[1, 2]\n')
    with pytest.raises(RlscopeError, match="no rollout could be read"):
        import_run("verl", source, tmp_path / "out")


def test_extras_out_of_line_with_outputs_are_warned(tmp_path: Path) -> None:
    lines = [
        {
            "input": "p",
            "output": f"<think>x</think> Answer: {i}",
            "score": 1.0,
            "step": 1,
            "pred": str((i + 1) % 8),
        }
        for i in range(8)
    ]
    result = import_run("verl", _dump(tmp_path / "d", lines), tmp_path / "out")
    assert any("out of line with the outputs" in w and "100%" in w for w in result.warnings)


def test_no_answer_skips_the_vote_metrics(tmp_path: Path) -> None:
    lines = [
        {"input": f"p{i // 4}", "output": "just words", "score": float(i % 2), "step": s}
        for s in range(1, 4)
        for i in range(8)
    ]
    out = tmp_path / "out"
    import_run("verl", _dump(tmp_path / "d", lines), out)
    report = analyze(out, metrics=["reasoning.maj_at_n_first", "reasoning.self_consistency_gap"])
    assert not report.metrics
    reasons = {s.metric: s.reason for s in report.skipped}
    assert "answer" in reasons["reasoning.maj_at_n_first"]
    assert "answer" in reasons["reasoning.self_consistency_gap"]


def test_group_filtering_is_said(tmp_path: Path) -> None:
    source = metrics_log(
        tmp_path / "metrics.jsonl", {"actor/grad_norm": 1.0, "train/num_gen_batches": 2}
    )
    import_run("verl-metrics", source, tmp_path / "out")
    provenance = json.loads((tmp_path / "out" / "run.json").read_text())["provenance"]
    assert "only the groups that survived" in provenance["filtering"]


def test_hydra_config_says_what_the_importer_needs(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    run = tmp_path / "outputs" / "run1"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(
        "actor_rollout_ref:\n  actor:\n    use_kl_loss: false\n    grad_clip: 0.5\n"
        "    loss_agg_mode: seq-mean-token-sum\n  rollout:\n    n: 4\n"
    )
    source = metrics_log(run / "metrics.jsonl", {"actor/entropy": 70.0, "actor/kl_loss": 0.01})
    result = import_run("verl-metrics", source, tmp_path / "out")
    steps = table(tmp_path / "out", "steps")
    assert "entropy" not in steps.columns and "kl" not in steps.columns
    assert any("config.yaml" in n for n in result.notes)
    # The actor's gradient clip: grad-spike judges what passed it.
    assert json.loads((tmp_path / "out" / "run.json").read_text())["max_grad_norm"] == 0.5


def test_validation_accuracies_per_data_source_give_l5(tmp_path: Path) -> None:
    """verl's `val-core/<data source>/acc/mean@N` (ray_trainer.py `_val_metrics_update`; a
    data source may hold a slash): each source an ID or OOD split (`ood_sets`, else by name),
    several sources of one split averaged; verl logs no validation size, so completions are
    absent and ood-gap judges on the scatter alone. `val-aux` keys and a `reward` core
    variable are not accuracies."""
    lines = []
    for step in range(1, 41):
        data = {"actor/pg_loss": 0.1, "actor/grad_norm": 0.5, "critic/score/mean": 0.3}
        if step % 4 == 0:
            rise = step / 100
            data |= {
                "val-core/openai/gsm8k/acc/mean@4": 0.3 + rise,
                "val-core/lighteval/MATH/acc/mean@4": 0.2 + rise,
                "val-core/aime_ood/acc/mean@4": 0.1,
                "val-aux/openai/gsm8k/acc/std@4": 0.2,
                "val-core/chat/reward/mean@4": 0.5,
            }
        lines.append(json.dumps({"step": step, "data": data}))
    source = tmp_path / "metrics.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    result = import_run("verl-metrics", source, out)
    steps = table(out, "steps").sort("step")
    at = steps.filter(pl.col("eval_id_accuracy").is_not_null())
    assert at["step"].to_list() == list(range(4, 41, 4))
    assert at["eval_id_accuracy"].to_list() == pytest.approx(
        [0.25 + s / 100 for s in range(4, 41, 4)]
    )
    assert at["eval_ood_accuracy"].to_list() == pytest.approx([0.1] * 10)
    assert "eval_id_completions" not in steps.columns
    note = next(n for n in result.notes if n.startswith("validation data sources"))
    assert "`aime_ood` → eval_ood" in note and "`openai/gsm8k` → eval_id" in note
    assert "`chat`" not in note  # a reward, not an accuracy
    report = analyze(out)
    # Final window (last tenth, at least 3 evals): steps 32, 36, 40.
    assert report.metrics["generalization.ood_gap"].value == pytest.approx(0.15 + 0.36)
    (gap,) = [f for f in report.findings if f.id == "ood-gap"]
    assert gap.evidence["sampling_error"].startswith("step-to-step scatter only")
    # Named by the option: gsm8k is the OOD set now.
    chosen = import_run("verl-metrics", source, tmp_path / "chosen", ood_sets=["openai/gsm8k"])
    assert any("`openai/gsm8k` → eval_ood" in n for n in chosen.notes)
