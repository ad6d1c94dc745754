"""The TRL callback's tokens table: the mapping on hand-made arrays, a numpy stand-in for
GRPOTrainer's loop (fast), and genuine TRL runs whose token metrics equal TRL's logs (slow)."""

from __future__ import annotations

import json
import math
from collections import defaultdict, deque
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import polars as pl
import pytest
from conftest import run_trainer
from made_tokenizers import EOS, PAD, byte_level_bpe, reference_segments, word_level
from probe_server import tiny_reasoner_dir
from tokenizers import Tokenizer, models, pre_tokenizers

import rlscope.integrations.trl as trl_integration
from rlscope.analysis import analyze
from rlscope.config import Config
from rlscope.integrations.trl import RlscopeCallback
from rlscope.integrations.trl_tokens import (
    ROW_KEY,
    GenerationBatch,
    RowTokens,
    parse_token_sample,
    sampled_rows,
    token_columns,
    trl_support,
)
from rlscope.text import TagSet, TextSettings, segment_spans

TOKEN_METRICS = ("behavior.entropy", "stability.kl", "stability.clip_frac")


@cache
def _id_tokenizer(size: int = 100_000) -> Tokenizer:
    """A word-level tokenizer whose token i is `t<i>`: what FakeGRPOTrainer's ids decode with."""
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


# --- the mapping ---------------------------------------------------------------------------------


def test_token_sample_is_all_none_or_a_share() -> None:
    assert parse_token_sample("all") == parse_token_sample(True) == 1.0
    assert parse_token_sample("none") == parse_token_sample(None) == parse_token_sample(0) == 0.0
    assert parse_token_sample(0.25) == 0.25
    for wrong in ("some", 1.5, -0.1):
        with pytest.raises(ValueError, match="token_sample"):
            parse_token_sample(wrong)


def test_sampled_rows_are_the_same_on_every_process_and_near_the_share() -> None:
    assert sampled_rows(10, 3, 1.0) == set(range(10)) and sampled_rows(10, 3, 0.0) == set()
    picked = sampled_rows(4000, 7, 0.25)
    assert picked == sampled_rows(4000, 7, 0.25)  # a hash, not a draw
    assert abs(len(picked) / 4000 - 0.25) < 0.03
    assert picked != sampled_rows(4000, 8, 0.25)  # another batch, other rollouts


def test_token_columns_from_hand_made_rows() -> None:
    rows = [
        (
            1,
            RowTokens(
                positions=np.array([0, 1, 2], dtype=np.int32),
                advantage=np.float32(0.5),
                logprob=np.array([-0.1, -0.2, -0.3], np.float32),
                entropy=np.array([1.0, 0.5, 0.25], np.float32),
                ref_logprob=np.array([-0.1, -0.1, -0.1], np.float32),
                step=4,
            ),
        ),
        (
            3,
            RowTokens(
                positions=np.array([0], dtype=np.int32),
                advantage=np.array([-1.5], np.float32),  # per token (B, T) advantages
                logprob=np.array([-2.0], np.float32),
                entropy=np.array([0.1], np.float32),
                ref_logprob=np.array([-1.0], np.float32),
                step=5,
            ),
        ),
    ]
    columns = token_columns(rows, [10, 11, 12, 13])
    assert columns["rollout_id"].tolist() == [11, 11, 11, 13]
    assert columns["step"].tolist() == [4, 4, 4, 5]
    assert columns["pos"].tolist() == [0, 1, 2, 0] and columns["pos"].dtype == np.int32
    assert columns["advantage"].tolist() == [0.5, 0.5, 0.5, -1.5]
    assert columns["logprob"].dtype == np.float32
    assert "old_logprob" not in columns and "rollout_logprob" not in columns  # none had them
    batch = GenerationBatch(1, lengths=[3, 1], advantages=[0.5, -1.5], rows=dict(rows))
    with pytest.raises(ValueError, match="rollout ids"):
        batch.columns()


def test_a_trainer_that_is_not_trls_gets_no_tap() -> None:
    assert trl_support(SimpleNamespace()) == ""  # not a GRPOTrainer: nothing to say
    assert "not a trl" in str(trl_support(FakeGRPOTrainer()))


# --- a numpy stand-in for GRPOTrainer's loop ---------------------------------------------------


class FakeGRPOTrainer:
    """What TRL 1.16's GRPOTrainer does with a generation batch, in numpy (grpo_trainer.py):
    `_generate_and_score_completions` returns right-padded completions, their mask, the
    advantages and the reference (and, off-policy, old) log-probs and fills `_logs`;
    `_prepare_inputs` shuffles the batch and splits it into steps_per_generation micro-batches,
    trained num_iterations times; `_compute_loss` asks
    `_get_per_token_logps_and_entropies(compute_entropy=True)` and logs the masked means of
    entropy, k3 and the clipped share, as TRL's `entropy`, `kl`, `clip_ratio/region_mean`.
    Completion i of batch b has token ids 100·(b·rows + i) + pos, and the policy's log-prob
    and entropy are functions of the id and of the updates done. Its `processing_class` is a
    word-level tokenizer of those ids (`t<id>`).

    With `tokenizer` and `texts` (the text mode), completion i is instead a random one of
    `texts` encoded by that real tokenizer, EOS appended, cut at `max_completion_length`
    tokens (then without EOS), its text decoded from those ids as TRL decodes it; the ids
    are kept in `generated`, in rollout order, and `eos_token_ids` says which id ends one."""

    def __init__(
        self,
        per_generation: int = 1,
        iterations: int = 1,
        prompts: int = 4,
        group: int = 4,
        tokenizer: Tokenizer | None = None,
        texts: Sequence[str] = (),
        max_completion_length: int = 6,
    ) -> None:
        self.rows = prompts * group * per_generation
        self.args = SimpleNamespace(
            steps_per_generation=per_generation,
            num_generations=group,
            generation_batch_size=self.rows,
            epsilon=0.2,
            epsilon_high=0.2,
            max_completion_length=max_completion_length,
        )
        self.texts = list(texts)
        self.processing_class = tokenizer if tokenizer is not None else _id_tokenizer()
        self.generated: list[list[int]] = []
        if tokenizer is not None:
            self._tokenizer = tokenizer
            self.eos_token_ids = [tokenizer.token_to_id(EOS)]
        self.num_iterations = iterations
        self.model = SimpleNamespace(training=True)
        self.state = SimpleNamespace(global_step=0, is_world_process_zero=True)
        self.accelerator = SimpleNamespace(process_index=0, num_processes=1, is_main_process=True)
        self.reward_func_names = ["accuracy_reward"]
        self.reward_weights = [1.0]
        self._logs: dict[str, Any] = {
            "prompt": deque(maxlen=self.rows),
            "completion": deque(maxlen=self.rows),
            "rewards": defaultdict(lambda: deque(maxlen=self.rows)),
            "advantages": deque(maxlen=self.rows),
        }
        self._step = 0
        self._batches = 0
        self._chunks: list[dict[str, Any]] = []
        self.updates = 0
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.rng = np.random.default_rng(0)

    def policy(self, ids: np.ndarray) -> np.ndarray:
        return -0.05 * (1 + ids % 7) - 0.3 * self.updates * (ids % 3 - 1)

    def _completions(self, n: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """Token ids (n, width), each completion's length, its text."""
        width = self.args.max_completion_length
        if not self.texts:
            lengths = self.rng.integers(1, width + 1, size=n)
            base = 100 * (self._batches * n + np.arange(n))
            ids = base[:, None] + np.arange(width)[None, :]
            return ids, lengths, [f"completion {b}" for b in base]
        tokenizer = self.processing_class
        eos = tokenizer.token_to_id(EOS)
        rows = [
            [*tokenizer.encode(self.texts[k]).ids, eos][:width]
            for k in self.rng.integers(0, len(self.texts), size=n)
        ]
        self.generated.extend(rows)
        ids = np.full((n, width), tokenizer.token_to_id(PAD), dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        texts = tokenizer.decode_batch(rows, skip_special_tokens=True)
        return ids, np.array([len(r) for r in rows]), texts

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        n = self.rows
        ids, lengths, texts = self._completions(n)
        mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
        batch = self._batches
        self._batches += 1
        rewards = self.rng.integers(0, 2, size=n).astype(np.float32)
        grouped = rewards.reshape(-1, self.args.num_generations)
        std = grouped.std(axis=1, ddof=1, keepdims=True)
        advantages = ((grouped - grouped.mean(axis=1, keepdims=True)) / (std + 1e-4)).ravel()
        for i in range(n):
            self._logs["prompt"].append(f"prompt {i // self.args.num_generations} of batch {batch}")
            self._logs["completion"].append(texts[i])
            self._logs["rewards"]["accuracy_reward"].append(float(rewards[i]))
            self._logs["advantages"].append(float(advantages[i]))
        output = {
            "prompt_ids": np.zeros((n, 2), dtype=np.int64),
            "completion_ids": ids,
            "completion_mask": mask,
            "advantages": advantages.astype(np.float32),
            "ref_per_token_logps": (-0.05 * (1 + ids % 7)).astype(np.float32),
        }
        if self.args.steps_per_generation * self.num_iterations > 1:  # TRL: old log-probs kept
            output["old_per_token_logps"] = self.policy(ids).astype(np.float32)
        return output

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: np.ndarray, *_: Any, compute_entropy: bool = False, **__: Any
    ) -> tuple[np.ndarray, np.ndarray | None, None]:
        logps = self.policy(input_ids).astype(np.float32)
        entropies = (0.5 + 1e-4 * input_ids).astype(np.float32) if compute_entropy else None
        return logps, entropies, None

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> float:
        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, inputs["completion_ids"], compute_entropy=True
        )
        assert entropies is not None
        mask = inputs["completion_mask"].astype(np.float64)
        old = inputs.get("old_per_token_logps", logps)
        ratio = np.exp(logps.astype(np.float64) - old)
        advantage = inputs["advantages"][:, None]
        clipped = ((ratio < 0.8) & (advantage < 0)) | ((ratio > 1.2) & (advantage > 0))
        d = inputs["ref_per_token_logps"].astype(np.float64) - logps
        for name, values in (
            ("entropy", entropies),
            ("kl", np.exp(d) - d - 1),
            ("clip_ratio/region_mean", clipped),
        ):
            self.metrics[name].append(float((values * mask).sum() / mask.sum()))
        return 0.0

    def training_step(self) -> None:
        """One optimizer step of one micro-batch (`_prepare_inputs`, `compute_loss`)."""
        per_generation = self.args.steps_per_generation
        if self._step % (per_generation * self.num_iterations) == 0:
            batch = self._generate_and_score_completions(None)
            order = self.rng.permutation(self.rows)
            batch = {
                k: [v[i] for i in order] if isinstance(v, list) else v[order]
                for k, v in batch.items()
            }
            size = self.rows // per_generation
            self._chunks = [
                {k: v[c * size : (c + 1) * size] for k, v in batch.items()}
                for c in range(per_generation)
            ]
        self._compute_loss(None, self._chunks[self._step % per_generation])
        self._step += 1
        self.updates += 1


def _train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int, **options: Any
) -> tuple[Path, FakeGRPOTrainer, dict[int, dict[str, float]]]:
    """Drive RlscopeCallback through `steps` of the fake trainer, in HF's event order."""
    trainer = FakeGRPOTrainer(
        options.pop("per_generation", 1),
        options.pop("iterations", 1),
        **options.pop("size", {}),
        **options.pop("fake", {}),
    )
    monkeypatch.setattr(trl_integration, "trl_support", lambda _: None)
    run = tmp_path / "run"
    callback = RlscopeCallback(run, correct_reward="accuracy_reward", **options).bind(trainer)
    trainer.callback_handler = SimpleNamespace(callbacks=[callback])  # as HF's Trainer holds it
    args, control = trainer.args, SimpleNamespace(should_training_stop=False)
    callback.on_train_begin(args, trainer.state, control)
    logged: dict[int, dict[str, float]] = {}
    for step in range(1, steps + 1):
        trainer.training_step()
        trainer.state.global_step = step
        callback.on_step_end(args, trainer.state, control)
        logs = {k: float(np.mean(v)) for k, v in trainer.metrics.items()}
        trainer.metrics.clear()
        logged[step] = logs
        callback.on_log(args, trainer.state, control, logs={"loss": 0.0, **logs})
    callback.on_train_end(args, trainer.state, control)
    return run, trainer, logged


def _tables(run: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    tokens = pl.read_parquet(run / "tokens" / "*.parquet")
    rollouts = pl.read_parquet(run / "rollouts" / "*.parquet")
    return tokens, rollouts


def test_each_completion_gets_its_own_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rollout's token rows: as many as its generated tokens (= response_len), at
    positions 0.., with its own advantage, and the log-prob/entropy of its own token ids
    (the fake's completion text names the ids' base), although TRL shuffled the batch."""
    run, trainer, _ = _train(tmp_path, monkeypatch, 4)
    tokens, rollouts = _tables(run)
    assert rollouts.height == 4 * trainer.rows and tokens["rollout_id"].n_unique() == 4 * 16
    per = tokens.group_by("rollout_id").agg(
        pl.len().alias("n"),
        pl.col("pos").min().alias("first"),
        pl.col("pos").max().alias("last"),
        pl.col("advantage").first().alias("token_advantage"),
    )
    joined = rollouts.join(per, on="rollout_id", how="left")
    assert (joined["n"] == joined["response_len"]).all()
    assert (joined["first"] == 0).all() and (joined["last"] == joined["response_len"] - 1).all()
    assert joined["token_advantage"].to_numpy() == pytest.approx(joined["advantage"].to_numpy())
    base = rollouts.select("rollout_id", pl.col("response").str.slice(11).cast(pl.Int64))
    ids = tokens.join(base, on="rollout_id").select(
        "entropy", "step", "rollout_id", (pl.col("response") + pl.col("pos")).alias("id")
    )
    assert ids["entropy"].to_numpy() == pytest.approx(0.5 + 1e-4 * ids["id"].to_numpy())
    assert (ids["step"] == ids.join(rollouts, on="rollout_id")["step_right"]).all()
    steps = pl.read_parquet(run / "steps" / "*.parquet")
    assert "completions/mean_length_logged" not in steps.columns  # exact: kept as logged
    assert json.loads((run / "run.json").read_text())["response_len_unit"] == "tokens"


@pytest.mark.parametrize(("per_generation", "iterations"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_token_metrics_equal_what_the_trainer_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_generation: int, iterations: int
) -> None:
    """rlscope's token entropy, k3 KL and clip fraction per step equal the trainer's own
    masked means of the tokens it trained on at that step (one micro-batch a step), whenever
    that is a completion's first pass; a batch trained over several steps puts each
    micro-batch's tokens at the step that trained it, and later passes are not written."""
    steps = 8
    run, _, logged = _train(
        tmp_path, monkeypatch, steps, per_generation=per_generation, iterations=iterations
    )
    tokens, rollouts = _tables(run)
    assert tokens["rollout_id"].n_unique() == rollouts.height  # each completion once
    report = analyze(run, metrics=TOKEN_METRICS)
    first_passes = [
        s for s in range(1, steps + 1) if (s - 1) % (per_generation * iterations) < per_generation
    ]
    assert sorted(tokens["step"].unique().to_list()) == first_passes
    keys = ("entropy", "kl", "clip_ratio/region_mean")
    for metric_id, key in zip(TOKEN_METRICS, keys, strict=True):
        result = report.metrics[metric_id]
        assert "token" in result.source, result.source
        got = dict(zip(result.steps, result.values, strict=True))
        for step in first_passes:
            assert got[step] == pytest.approx(logged[step][key], abs=1e-6), (metric_id, step)
    clip = report.metrics["stability.clip_frac"]
    if per_generation > 1:  # the later micro-batch meets a policy one update on: clipping
        assert max(v for v in clip.values if v is not None) > 0
    else:
        assert all(v == 0 for v in clip.values)


def test_the_in_loop_judge_reads_the_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """judge_every: each judgement flushes the token rows and computes the token-only metrics
    (the entropy of the forking tokens) from them."""
    _, trainer, _ = _train(tmp_path, monkeypatch, 4, judge_every=2)
    (callback,) = trainer.callback_handler.callbacks
    assert [j.step for j in callback.judgements] == [2, 4]
    for judgement in callback.judgements:
        assert judgement.error is None and judgement.files["tokens"][0] >= 1
        assert "rlscope/behavior.entropy_p80" in judgement.metrics


def test_token_sample_writes_a_share_of_rollouts_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, _, _ = _train(tmp_path / "a", monkeypatch, 6, token_sample=0.25)
    tokens, rollouts = _tables(run)
    share = tokens["rollout_id"].n_unique() / rollouts.height
    assert 0.1 < share < 0.45
    lengths = tokens.group_by("rollout_id").len().join(rollouts, on="rollout_id")
    assert (lengths["len"] == lengths["response_len"]).all()  # a sampled rollout: all its tokens
    assert rollouts["response_len"].sum() > tokens.height  # exact lengths for every rollout
    run, _, _ = _train(tmp_path / "b", monkeypatch, 2, token_sample="none")
    assert not (run / "tokens").exists()


def test_a_run_stopped_mid_batch_keeps_the_tokens_that_were_trained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch trained over two steps, stopped after the first: the first micro-batch's tokens
    are written at close, the rest (never trained) are not."""
    run, _, _ = _train(tmp_path, monkeypatch, 3, per_generation=2)
    tokens, rollouts = _tables(run)
    assert sorted(tokens["step"].unique().to_list()) == [1, 2, 3]
    last = rollouts.filter(pl.col("step") == 3)
    assert (
        tokens.filter(pl.col("rollout_id").is_in(last["rollout_id"].implode()))[
            "rollout_id"
        ].n_unique()
        == len(last) // 2
    )


#: Completions of the text mode: tags, an answer, a tool call and its response, text outside
#: tags, and one long enough to be cut at the cap inside its reasoning.
TEXTS = (
    "<think> 3 + 4 = 7, so the sum is 7.</think>\n<answer> 7 </answer>",
    '<think> I should look it up.</think> <tool_call>{"name": "search", '
    '"arguments": {"q": "capital"}}</tool_call>\n<tool_response> Paris </tool_response>'
    "\n<answer>Paris</answer>",
    "Let me think. <think> the answer is 12.</think><answer>12</answer>",
    "<think> the sum is " + " + ".join(map(str, range(3, 25))) + ", so the sum is",
)


def test_each_token_gets_its_segment_and_each_rollout_its_truncation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Text mode, a real byte-level BPE, completions cut at 64 tokens: every token's `segment`
    is the reference's for its completion's ids (tokens across a tag's edge, tags, EOS), the
    entropy by segment per step is the mean of the trainer's entropies of the tokens so
    labelled, `truncated` is TRL's rule (no EOS at the end), the cap is run.json's
    max_response_len and the truncation rate per step the truncated share."""
    tokenizer = byte_level_bpe()
    fake = {"tokenizer": tokenizer, "texts": TEXTS, "max_completion_length": 64}
    run, trainer, _ = _train(tmp_path, monkeypatch, 4, fake=fake)
    tokens, rollouts = _tables(run)
    generated = trainer.generated
    assert rollouts["rollout_id"].to_list() == list(range(len(generated)))
    expected = pl.DataFrame(
        {
            "rollout_id": [r for r, ids in enumerate(generated) for _ in ids],
            "pos": [p for ids in generated for p in range(len(ids))],
            "expected": [s for ids in generated for s in reference_segments(tokenizer, ids)],
        },
        schema_overrides={"pos": pl.Int32},
    )
    joined = tokens.join(expected, on=["rollout_id", "pos"], how="full", coalesce=True)
    assert joined.height == tokens.height == expected.height
    assert (joined["segment"] == joined["expected"]).all()
    assert set(tokens["segment"]) == {"think", "answer", "tool_call", "tool_response", "text"}
    eos = tokenizer.token_to_id(EOS)
    cut = [ids[-1] != eos for ids in generated]
    assert rollouts["truncated"].to_list() == cut and 0 < sum(cut) < len(cut)
    assert json.loads((run / "run.json").read_text())["max_response_len"] == 64
    report = analyze(run)
    means = tokens.group_by("step", "segment").agg(pl.col("entropy").cast(pl.Float64).mean())
    for segment in ("think", "answer", "tool_call", "tool_response"):
        result = report.metrics[f"behavior.entropy.{segment}"]
        mine = means.filter(pl.col("segment") == segment).sort("step")
        assert result.steps == tuple(mine["step"]) and len(result.steps) == 4, segment
        assert result.values == pytest.approx(mine["entropy"].to_list(), abs=1e-9), segment
    rate = rollouts.group_by("step").agg(pl.col("truncated").mean()).sort("step")
    truncation = report.metrics["behavior.truncation_rate"]
    assert "truncated" in truncation.source
    assert truncation.values == pytest.approx(rate["truncated"].to_list())


def test_the_tags_of_the_working_directory_config_label_the_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No `config=`: the callback labels with the tags of ./rlscope.toml, the file `rlscope
    analyze` reads from the same place; `config=` wins over it."""
    tokenizer = word_level(("<reasoning>", "</reasoning>", "<think>", "</think>", "7"))
    fake = {"tokenizer": tokenizer, "texts": ["<reasoning> 7 </reasoning> <think> 7 </think>"]}
    fake["max_completion_length"] = 8
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rlscope.toml").write_text('[tags]\nthink = ["reasoning"]\n')
    run, _, _ = _train(tmp_path / "a", monkeypatch, 1, fake=fake)
    by_pos = _tables(run)[0].filter(pl.col("rollout_id") == 0).sort("pos")["segment"]
    assert by_pos.to_list() == ["think"] * 3 + ["text"] * 4
    config = Config(text=TextSettings(tags=TagSet(think=("think",))))
    run, _, _ = _train(tmp_path / "b", monkeypatch, 1, fake=fake, config=config)
    by_pos = _tables(run)[0].filter(pl.col("rollout_id") == 0).sort("pos")["segment"]
    assert by_pos.to_list() == ["text"] * 3 + ["think"] * 3 + ["text"]


def test_tokens_that_cannot_be_aligned_get_a_null_segment_not_a_guess(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Completions ending in a genuine U+FFFD after a character split over byte tokens (see
    test_token_segments): their tokens are written with a null segment and a warning, and
    the entropy by segment is skipped with its reason, not 0."""
    fake = {"tokenizer": byte_level_bpe(), "texts": ["<think> é </think> \ufffd"]}
    fake["max_completion_length"] = 64
    with pytest.warns(RuntimeWarning, match="could not be aligned"):
        run, _, _ = _train(tmp_path, monkeypatch, 2, fake=fake)
    tokens, rollouts = _tables(run)
    assert tokens.height == rollouts["response_len"].sum() > 0
    assert tokens["segment"].null_count() == tokens.height
    report = analyze(run)
    assert "behavior.entropy.think" not in report.metrics
    skipped = {s.metric: s.reason for s in report.skipped}
    assert "no token labelled `think`" in skipped["behavior.entropy.think"]


def test_a_trainer_without_a_tokenizer_writes_tokens_without_segments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = FakeGRPOTrainer()
    trainer.processing_class = None  # type: ignore[assignment]
    monkeypatch.setattr(trl_integration, "trl_support", lambda _: None)
    with pytest.warns(RuntimeWarning, match="cannot decode token ids"):
        callback = RlscopeCallback(tmp_path / "run", correct_reward="accuracy_reward")
        callback.bind(trainer)
    state, control = trainer.state, SimpleNamespace(should_training_stop=False)
    callback.on_train_begin(trainer.args, state, control)
    trainer.training_step()
    state.global_step = 1
    callback.on_log(trainer.args, state, control, logs={"loss": 0.0})
    callback.close()
    tokens, rollouts = _tables(tmp_path / "run")
    assert tokens.height == rollouts["response_len"].sum() and "segment" not in tokens.columns
    assert "truncated" not in rollouts.columns  # no eos_token_ids: TRL's rule unknown


def test_the_tap_never_breaks_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors the tap cannot read (here: no completion_mask) warn once; training goes on and
    rollouts are written with their lengths re-counted from text."""
    trainer = FakeGRPOTrainer()
    original = trainer._generate_and_score_completions

    def broken(inputs: Any) -> dict[str, Any]:
        output = original(inputs)
        output["completion_mask_renamed"] = output.pop("completion_mask")
        return output

    trainer._generate_and_score_completions = broken  # type: ignore[method-assign]
    monkeypatch.setattr(trl_integration, "trl_support", lambda _: None)
    run = tmp_path / "run"
    callback = RlscopeCallback(run, correct_reward="accuracy_reward").bind(trainer)
    state, control = trainer.state, SimpleNamespace(should_training_stop=False)
    callback.on_train_begin(trainer.args, state, control)
    with pytest.warns(RuntimeWarning, match="per-token tensors"):
        out = trainer._generate_and_score_completions(None)
    assert ROW_KEY not in out
    callback.on_log(trainer.args, state, control, logs={"loss": 0.0})
    callback.close()
    assert not (run / "tokens").exists() and (run / "rollouts").is_dir()


# --- genuine TRL runs (slow) ---------------------------------------------------------------------


def _genuine(
    tmp_path: Path, mode: str, steps: int, monkeypatch: pytest.MonkeyPatch, **env: str
) -> tuple[Path, dict[str, Any]]:
    """tests/trainers/trl_lr_collapse.py with the callback writing tmp_path/run (`env`: the
    trainer's TRAINER_* settings); the run directory and the trainer's summary line."""
    out, run = tmp_path / "trainer", tmp_path / "run"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    done = run_trainer("trl_lr_collapse.py", out, mode, str(steps), "--judge", run, "never", "1000")
    return run, json.loads(done.stdout.strip().splitlines()[-1])


def _steps(run: Path) -> pl.DataFrame:
    return pl.read_parquet(run / "steps" / "*.parquet").sort("step")


@pytest.mark.slow
def test_a_genuine_trl_run_gets_the_token_layer_and_it_equals_trls_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Healthy, 50 steps, one generation per step (TRL's default): the token entropy and k3
    KL per step equal TRL's logged `entropy` and `kl` (both masked token means over the step's
    one micro-batch: grpo_trainer.py `_compute_loss`, global_masked_mean), the clip fraction is
    0 as logged (on-policy), each rollout's response_len is its token count, and the token
    metrics are filled (measured: |Δ entropy| and |Δ kl| < 1e-6)."""
    run, _ = _genuine(tmp_path, "healthy", 50, monkeypatch)
    report = analyze(run)
    steps = _steps(run)
    for metric_id, key in zip(TOKEN_METRICS, ("entropy", "kl", "clip_frac"), strict=True):
        result = report.metrics[metric_id]
        assert "token" in result.source, (metric_id, result.source)
        logged = dict(zip(steps["step"], steps[key], strict=True))
        for step, value in zip(result.steps, result.values, strict=True):
            assert value == pytest.approx(logged[step], abs=2e-6), (metric_id, step)
        assert len(result.steps) == 50
    for metric_id in ("behavior.entropy_p80", "behavior.entropy_adv_cov"):
        assert report.metrics[metric_id].values, metric_id
    tokens, rollouts = _tables(run)
    counts = tokens.group_by("rollout_id").len().join(rollouts, on="rollout_id", how="right")
    assert (counts["len"] == counts["response_len"]).all()
    mean_length = rollouts.group_by("step").agg(pl.col("response_len").mean()).sort("step")
    assert mean_length["response_len"].to_list() == pytest.approx(
        steps["completions/mean_length"].to_list()
    )
    assert not [f for f in report.findings if f.id == "logged-metric-mismatch"]
    # Truncation judged from the tap's per-completion flags, TRL's own rule: its logged share.
    assert json.loads((run / "run.json").read_text())["max_response_len"] == 4
    truncation = report.metrics["behavior.truncation_rate"]
    assert "rollouts.truncated" in truncation.source and len(truncation.steps) == 50
    clipped = dict(zip(steps["step"], steps["completions/clipped_ratio"], strict=True))
    for step, value in zip(truncation.steps, truncation.values, strict=True):
        assert value == pytest.approx(clipped[step], abs=1e-12), step
    assert max(truncation.values) > 0  # a filler word makes a 4-token answer: no room for EOS


def _vocabulary_labels(model_dir: Path, ids: list[int], response: str) -> list[str]:
    """Each token's segment from the tiny reasoner's vocabulary itself, apart from the writer's
    decoding: a token's text is its vocabulary entry with the byte-level space `Ġ` as " " (a
    special token's, EOS, empty), and must add up to TRL's decoded completion; its segment is
    that of its first non-whitespace character in rlscope.text.segment_spans (else of its
    first character; `text` when it has none)."""
    vocabulary = json.loads((model_dir / "tokenizer.json").read_text())
    special = {t["id"] for t in vocabulary["added_tokens"] if t["special"]}
    entries = {i: t for t, i in vocabulary["model"]["vocab"].items()}
    pieces = ["" if i in special else entries[i].replace("Ġ", " ") for i in ids]
    assert "".join(pieces) == response
    spans = segment_spans(response)
    labels, at = [], 0
    for piece in pieces:
        first = at + (len(piece) - len(piece.lstrip())) if piece.strip() else at
        labels.append(next((s for s, a, b in spans if a <= first < b), "text"))
        at += len(piece)
    return labels


@pytest.mark.slow
def test_a_genuine_trl_run_gets_the_entropy_of_each_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny reasoner (tests/trainers/tiny_reasoner.py: `<think> … </think> <answer> …
    </answer>`, a word-level vocabulary in the byte-level alphabet, `Ġ12`) trained by
    GRPOTrainer with the callback (trl_probe.py, no probing), 10 steps, completions cut at 16
    tokens (most `Add` chains, in their reasoning or answer). The trainer script dumps every
    completion's ids; each token's segment from the vocabulary entries of those ids and the
    tag spans of TRL's decoded completion (`_vocabulary_labels`, not the writer's decoding)
    equals the table's; the entropy by segment `analyze` reports equals the per-step mean of
    the table's entropies so labelled; the all-token mean still equals TRL's logged `entropy`
    (measured: |Δ| < 1e-8); the truncation rate equals TRL's completions/clipped_ratio, and
    the tokens of reasoning cut by the cap are think tokens."""
    model_dir = tiny_reasoner_dir()
    monkeypatch.setenv("TRAINER_MAX_COMPLETION_LENGTH", "16")
    monkeypatch.setenv("TRAINER_DUMP_IDS", str(tmp_path / "ids.jsonl"))
    run = tmp_path / "run"
    run_trainer("trl_probe.py", model_dir, run, 10, 0)
    dumped = [json.loads(line) for line in (tmp_path / "ids.jsonl").read_text().splitlines()]
    tokens, rollouts = _tables(run)
    steps = _steps(run)
    assert json.loads((run / "run.json").read_text())["max_response_len"] == 16
    assert rollouts["rollout_id"].to_list() == list(range(len(dumped))) == list(range(320))
    expected = pl.DataFrame(
        {
            "rollout_id": [r for r, ids in enumerate(dumped) for _ in ids],
            "pos": [p for ids in dumped for p in range(len(ids))],
            "expected": [
                label
                for ids, response in zip(dumped, rollouts["response"], strict=True)
                for label in _vocabulary_labels(model_dir, ids, response)
            ],
        },
        schema_overrides={"pos": pl.Int32},
    )
    joined = tokens.join(expected, on=["rollout_id", "pos"], how="full", coalesce=True)
    assert joined.height == tokens.height == expected.height
    assert (joined["segment"] == joined["expected"]).all()
    cut = rollouts.filter(pl.col("truncated") & ~pl.col("response").str.contains("</think>"))
    assert cut.height > 0  # cut inside the reasoning: its tokens are think, to the end
    in_cut = tokens.filter(pl.col("rollout_id").is_in(cut["rollout_id"].implode()))
    assert (in_cut["segment"] == "think").all()

    report = analyze(run)
    means = joined.group_by("step", "expected").agg(pl.col("entropy").cast(pl.Float64).mean())
    for segment in ("think", "answer"):
        result = report.metrics[f"behavior.entropy.{segment}"]
        mine = means.filter(pl.col("expected") == segment).sort("step")
        assert result.steps == tuple(range(1, 11)) == tuple(mine["step"]), segment
        assert result.values == pytest.approx(mine["entropy"].to_list(), abs=1e-9), segment
    for segment in ("tool_call", "tool_response"):  # none in this task: skipped, not 0
        assert f"behavior.entropy.{segment}" not in report.metrics
    entropy = report.metrics["behavior.entropy"]
    logged = dict(zip(steps["step"], steps["entropy"], strict=True))
    for step, value in zip(entropy.steps, entropy.values, strict=True):
        assert value == pytest.approx(logged[step], abs=1e-7), step
    truncation = report.metrics["behavior.truncation_rate"]
    assert truncation.values == pytest.approx(steps["completions/clipped_ratio"].to_list())
    assert min(truncation.values) > 0


@pytest.mark.slow
def test_a_batch_trained_over_two_steps_clips_as_trl_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """steps_per_generation=2 at the too-high learning rate: each generation batch is trained
    over two steps, the second half by a policy one (large) update on, so tokens clip. Per
    step the token clip fraction (TRL's rule from logprob, old_logprob, advantage) and entropy
    equal TRL's logged clip_ratio/region_mean and entropy; the k3 KL equals the logged `kl`
    at the on-policy steps, and at the off-policy ones TRL logs k3 weighted by the ratio
    (use_bias_correction_kl, True by default) — equal to the tokens' Σ k3·r / n."""
    run, _ = _genuine(tmp_path, "too-high", 10, monkeypatch, TRAINER_STEPS_PER_GENERATION="2")
    steps = _steps(run)
    report = analyze(run, metrics=TOKEN_METRICS)
    clip = report.metrics["stability.clip_frac"]
    assert "ratio" in clip.source and max(v or 0 for v in clip.values) > 0.01
    for metric_id, key in (("stability.clip_frac", "clip_frac"), ("behavior.entropy", "entropy")):
        logged = dict(zip(steps["step"], steps[key], strict=True))
        result = report.metrics[metric_id]
        assert result.steps == tuple(range(1, 11))
        for step, value in zip(result.steps, result.values, strict=True):
            assert value == pytest.approx(logged[step], abs=2e-6), (metric_id, step)
    tokens = pl.read_parquet(run / "tokens" / "*.parquet")
    f = pl.col
    d = (f("ref_logprob") - f("logprob")).cast(pl.Float64)
    ratio = (f("logprob").cast(pl.Float64) - f("old_logprob").cast(pl.Float64)).exp()
    weighted = tokens.group_by("step").agg(((d.exp() - d - 1) * ratio).mean().alias("kl"))
    logged_kl = dict(zip(steps["step"], steps["kl"], strict=True))
    for step, value in weighted.iter_rows():
        assert value == pytest.approx(logged_kl[step], rel=1e-4, abs=1e-6), step
    kl = report.metrics["stability.kl"]
    for step, value in zip(kl.steps, kl.values, strict=True):
        if step % 2 == 1:  # the first micro-batch of each batch: on-policy, r = 1
            assert value == pytest.approx(logged_kl[step], rel=1e-4, abs=1e-6), step
    assert math.isfinite(sum(v or 0 for v in kl.values))


@pytest.mark.slow
def test_under_torchrun_the_main_process_writes_every_process_tokens(tmp_path: Path) -> None:
    """Two processes (torchrun, gloo), each generating its own 64 completions a step: the
    main process writes the tokens of all 128, gathered as TRL gathers the completions, each
    under its rollout's id (its token count = response_len, its advantage the rollout's), and
    the token entropy and k3 KL equal TRL's logged ones, reduced over both processes."""
    out, run = tmp_path / "trainer", tmp_path / "run"
    run_trainer(
        "trl_lr_collapse.py", out, "healthy", "10", "--judge", run, "never", "1000", processes=2
    )
    tokens, rollouts = _tables(run)
    assert rollouts.height == 10 * 128 and tokens["rollout_id"].n_unique() == rollouts.height
    per = tokens.group_by("rollout_id").agg(pl.len(), pl.col("advantage").first())
    joined = rollouts.join(per, on="rollout_id")
    assert (joined["len"] == joined["response_len"]).all()
    assert joined["advantage_right"].to_numpy() == pytest.approx(joined["advantage"].to_numpy())
    assert tokens["segment"].null_count() == 0  # each process labelled its own (no tags: text)
    steps = _steps(run)
    report = analyze(run, metrics=TOKEN_METRICS)
    for metric_id, key in zip(TOKEN_METRICS[:2], ("entropy", "kl"), strict=True):
        logged = dict(zip(steps["step"], steps[key], strict=True))
        result = report.metrics[metric_id]
        assert len(result.steps) == 10
        for step, value in zip(result.steps, result.values, strict=True):
            assert value == pytest.approx(logged[step], abs=2e-6), (metric_id, step)
