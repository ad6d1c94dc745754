"""The examples run for real and give sensible reports; the TRL callback without TRL installed."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings
from collections import defaultdict, deque
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import polars as pl
import pytest
from conftest import GENUINE

import rlscope
from rlscope.integrations.trl import STEP_KEYS, RlscopeCallback

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
#: A real TRL 1.16 GRPOTrainer output (completions + trainer_state.json), where available.
TRL_FIXTURE = GENUINE / "trl-tiny-grpo"


def load_example(name: str) -> ModuleType:
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"rlscope_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def table(run: Path, name: str) -> pl.DataFrame:
    files = sorted((run / name).glob("*.parquet"))
    return pl.concat([pl.read_parquet(f) for f in files], how="diagonal_relaxed")


def no_temporary_files(run: Path) -> bool:
    return not [p for p in run.rglob(".*") if p.is_file()]


# --- examples/pytorch_grpo_loop.py -------------------------------------------------------------


def test_pytorch_loop_report(tmp_path: Path) -> None:
    example = load_example("pytorch_grpo_loop")
    steps, prompts, group = 30, 8, 8
    run = example.main(tmp_path / "run", steps=steps, prompts=prompts, group=group)
    report = rlscope.analyze(run)
    m = report.metrics

    assert set(report.run.tables) == {"steps", "rollouts", "tokens"}
    assert report.run.n_steps == steps
    assert report.run.n_rollouts == steps * prompts * group
    assert report.run.n_groups == steps * prompts
    rollouts = table(run, "rollouts")
    assert report.run.n_tokens == rollouts["response_len"].sum()
    assert rollouts["rollout_id"].n_unique() == rollouts.height

    # Recomputed from tokens, and equal to what the loop logged from the same arrays.
    for metric_id in ("stability.kl", "behavior.entropy", "stability.clip_frac"):
        result = m[metric_id]
        assert result.logged is not None, metric_id
        assert result.value == pytest.approx(result.logged.value, rel=1e-4, abs=1e-7)
    assert 0.005 < m["stability.kl"].value < 0.1
    assert 0 < m["stability.clip_frac"].value < 0.05
    assert m["stability.ppo_kl"].value is not None
    entropy = m["behavior.entropy"].values
    assert 0.3 < entropy[-1] < entropy[0] < 1.5  # declining, not collapsed
    assert m["behavior.entropy_p80"].value > m["behavior.entropy"].value
    assert 16 <= m["behavior.response_len"].value <= 64

    pass1, passk = m["signal.pass_at_1"], m["signal.pass_at_k"]
    assert passk.extra["k"] == group
    assert 0 < pass1.value <= passk.value <= 1
    assert sum(pass1.values[-5:]) > sum(pass1.values[:5])  # the fake policy learns
    assert m["signal.effective_prompt_frac"].value is not None
    assert not [f for f in report.findings if f.severity == "critical"], report.findings
    assert "logged-metric-mismatch" not in {f.id for f in report.findings}
    assert no_temporary_files(run)


def test_pytorch_loop_cli(tmp_path: Path) -> None:
    out = tmp_path / "cli-run"
    result = run_script("pytorch_grpo_loop", str(out), "--steps", "3", "--prompts", "2")
    assert "rlscope analyze" in result.stdout
    assert table(out, "rollouts").height == 3 * 2 * 8
    assert json.loads((out / "run.json").read_text())["group_size"] == 8


# --- examples/trl_callback.py ------------------------------------------------------------------


def test_trl_callback_example(tmp_path: Path) -> None:
    example = load_example("trl_callback")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the example must not trip any of the callback's warnings
        run = example.main(tmp_path / "run", steps=12)
    steps = table(run, "steps").sort("step")
    assert steps["step"].to_list() == list(range(1, 13))  # one row per step, summary left out
    for column in ("loss", "grad_norm", "lr", "entropy", "kl", "clip_frac"):
        assert steps[column].null_count() == 0, column
    for extra in ("clip_ratio/low_mean", "num_tokens", "reward", "frac_reward_zero_std", "epoch"):
        assert extra in steps.columns, extra
    assert "completions/mean_length_logged" in steps.columns  # re-counted lengths: not compared
    assert steps.filter(pl.col("step") == 6)["eval_reward"].item() is not None  # merged eval log
    for gone in ("learning_rate", "clip_ratio/region_mean", "train_runtime", "train_loss"):
        assert gone not in steps.columns, gone

    rollouts = table(run, "rollouts")
    sizes = rollouts.group_by("step", "split", "prompt_id").len()["len"].unique().to_list()
    assert sizes == [8]
    counts = dict(rollouts.group_by("split").len().iter_rows())
    assert counts == {"train": 12 * 32, "eval_id": 2 * 32}
    meta = json.loads((run / "run.json").read_text())
    assert (meta["algorithm"], meta["group_size"], meta["clip_ratio_high"]) == ("GRPO", 8, 0.28)

    report = rlscope.analyze(run)
    m = report.metrics
    assert m["signal.reward"].logged is not None
    assert m["signal.reward"].value == pytest.approx(m["signal.reward"].logged.value)
    assert m["signal.zero_std_frac"].value == pytest.approx(m["signal.zero_std_frac"].logged.value)
    assert 0 < m["signal.pass_at_1"].value <= m["signal.pass_at_k"].value <= 1
    assert m["behavior.entropy"].value == pytest.approx(0.9 - 0.3 * 11 / 12)  # logged, last 3
    assert m["stability.kl"].value is not None
    assert report.run.n_groups == 12 * 4
    assert no_temporary_files(run)


# --- RlscopeCallback ---------------------------------------------------------------------------


def make_trainer(size: int = 8, g: int = 4, names: tuple[str, ...] = ("acc", "fmt")) -> Any:
    trainer = SimpleNamespace(num_generations=g, reward_func_names=list(names))
    trainer._logs = {
        "prompt": deque(maxlen=size),
        "completion": deque(maxlen=size),
        "rewards": defaultdict(lambda: deque(maxlen=size)),
        "advantages": deque(maxlen=size),
    }
    return trainer


def fill(trainer: Any, prompts: list[str], rewards: dict[str, list[float]]) -> None:
    n = len(prompts)
    trainer._logs["prompt"].extend(prompts)
    trainer._logs["completion"].extend(f"answer number {i} here" for i in range(n))
    trainer._logs["advantages"].extend(float(i % 3 - 1) for i in range(n))
    for name, values in rewards.items():
        trainer._logs["rewards"][name].extend(values)


def events(callback: RlscopeCallback, main: bool = True) -> Any:
    args = SimpleNamespace(num_generations=4, epsilon=0.2, epsilon_high=None, max_grad_norm=1.0)
    state = SimpleNamespace(global_step=0, is_world_process_zero=main)

    def fire(event: str, step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            state.global_step = step
        getattr(callback, event)(args, state, SimpleNamespace(), **kwargs)

    return fire


def test_callback_steps_merge_and_map(tmp_path: Path) -> None:
    callback = RlscopeCallback(tmp_path / "run", run_id="unit")
    fire = events(callback)
    fire("on_train_begin")
    fire("on_step_end", 1)
    fire("on_log", 1, logs={"loss": 0.5, "learning_rate": 1e-6, "grad_norm": 2, "custom": 3})
    fire("on_log", 1, logs={"eval_loss": 0.7, "eval_runtime": 1.0, "note": "text is dropped"})
    fire("on_step_end", 2)
    fire("on_log", 2, logs={"loss": 0.4, "clip_ratio/region_mean": 0.1, "kl": 0.01, "step": 99})
    fire("on_log", 2, logs={"train_runtime": 5.0, "train_loss": 0.45})
    with pytest.warns(RuntimeWarning, match="no rollouts"):
        fire("on_train_end")
    steps = table(tmp_path / "run", "steps").sort("step")
    assert steps["step"].to_list() == [1, 2]
    assert steps["lr"].to_list() == [1e-6, None]
    assert steps["clip_frac"].to_list() == [None, 0.1]
    assert steps["grad_norm"].dtype == pl.Float64 and steps["custom"].to_list() == [3.0, None]
    assert steps["eval_loss"].to_list() == [0.7, None]
    assert not {"note", "learning_rate", "train_loss", "train_runtime"} & set(steps.columns)
    assert set(STEP_KEYS.values()) <= {"loss", "grad_norm", "lr", "entropy", "kl", "clip_frac"}
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["run_id"] == "unit" and meta["max_grad_norm"] == 1.0
    assert callback.closed and callback.writer is not None and callback.writer._closed
    fire("on_log", 3, logs={"loss": 1.0})  # after the end: ignored, no error
    callback.close()  # idempotent
    assert table(tmp_path / "run", "steps").height == 2


def test_callback_rollouts_grouped_and_deduplicated(tmp_path: Path) -> None:
    trainer = make_trainer()
    trainer.reward_weights = [1.0, 0.5]
    callback = RlscopeCallback(tmp_path / "run", trainer=trainer, correct_reward="acc")
    fire = events(callback)
    fire("on_train_begin")
    fill(trainer, ["p1"] * 4 + ["p2"] * 4, {"acc": [1, 0, 0, 1, 0, 0, 0, 0], "fmt": [1] * 8})
    fire("on_log", 1, logs={"loss": 0.1})
    fire("on_log", 2, logs={"loss": 0.2})  # the same batch (num_iterations=2): written once
    # The same prompt twice in one batch is two groups; a NaN reward is skipped (nansum).
    fill(trainer, ["p3"] * 4 + ["p3"] * 4, {"acc": [1, 1, 0, 0, 1, 1, 1, 1], "fmt": [math.nan] * 8})
    fire("on_log", 3, logs={"loss": 0.3})
    fire("on_train_end")

    rollouts = table(tmp_path / "run", "rollouts").sort("rollout_id")
    assert rollouts["rollout_id"].to_list() == list(range(16))
    assert rollouts["step"].to_list() == [1] * 8 + [3] * 8
    p1 = hashlib.blake2b(b"p1", digest_size=8).hexdigest()
    p3 = hashlib.blake2b(b"p3", digest_size=8).hexdigest()
    assert rollouts["prompt_id"].to_list()[:4] == [p1] * 4
    assert rollouts["prompt_id"].to_list()[8:] == [p3] * 4 + [f"{p3}#2"] * 4  # as the importer
    assert rollouts["reward"].to_list()[:4] == [1.5, 0.5, 0.5, 1.5]  # acc + 0.5 * fmt
    assert rollouts["reward"].to_list()[8:12] == [1.0, 1.0, 0.0, 0.0]
    assert rollouts["correct"].to_list()[:4] == [True, False, False, True]
    assert rollouts["response_len"].to_list()[:2] == [4, 4]  # whitespace words: no tokenizer
    assert rollouts["advantage"].to_list()[:3] == [-1.0, 0.0, 1.0]
    assert rollouts["response"][0] == "answer number 0 here"
    assert rollouts["rewards/fmt"].to_list()[:2] == [1.0, 1.0]
    assert rollouts["split"].unique().to_list() == ["train"]
    assert callback.length_source == "words"
    assert no_temporary_files(tmp_path / "run")

    report = rlscope.analyze(tmp_path / "run")
    assert report.run.n_groups == 4
    assert report.metrics["signal.pass_at_k"].value is not None


def test_callback_tokenizer_eval_split_and_resume(tmp_path: Path) -> None:
    class Tokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return list(range(len(text)))  # one token per character

    trainer = make_trainer(names=("acc",))
    callback = RlscopeCallback(tmp_path / "run", trainer=trainer, keep_text=False)
    fire = events(callback)
    fire("on_train_begin", processing_class=Tokenizer())
    fill(trainer, ["q"] * 8, {"acc": [1.0] * 8})
    fire("on_log", 4, logs={"eval_loss": 1.0})
    fire("on_train_end")
    assert callback.length_source == "tokenizer"
    first = table(tmp_path / "run", "rollouts")
    assert first["split"].unique().to_list() == ["eval_id"]
    assert first["response_len"][0] == len("answer number 0 here")
    assert "response" not in first.columns

    # A second training session (a resume) appends, with rollout ids after the existing ones.
    again = RlscopeCallback(tmp_path / "run", trainer=trainer, count_tokens=len)
    fire = events(again)
    fire("on_train_begin")
    fill(trainer, ["r"] * 8, {"acc": [0.0] * 8})
    fire("on_log", 5, logs={"loss": 0.1, "completions/mean_length": 20.0})
    fire("on_train_end")
    rollouts = table(tmp_path / "run", "rollouts")
    assert rollouts["rollout_id"].sort().to_list() == list(range(16))
    assert "completions/mean_length" in table(tmp_path / "run", "steps").columns  # count_tokens

    # The same callback through a second train() call: reopened, still the tokenizer's counts.
    fire = events(callback)
    fire("on_train_begin", processing_class=Tokenizer())
    fill(trainer, ["s"] * 8, {"acc": [1.0] * 8})
    fire("on_log", 6, logs={"loss": 0.1, "completions/mean_length": 20.0})
    fire("on_train_end")
    assert callback.length_source == "tokenizer"
    assert table(tmp_path / "run", "rollouts")["rollout_id"].max() == 23
    assert "completions/mean_length_logged" in table(tmp_path / "run", "steps").columns


def test_callback_finds_its_trainer(tmp_path: Path) -> None:
    callback = RlscopeCallback(tmp_path / "run")

    class Handler:
        def __init__(self, callbacks: list[Any]) -> None:
            self.callbacks = callbacks

        def call_event(self, event: str, args: Any, state: Any, control: Any) -> None:
            for cb in self.callbacks:
                getattr(cb, event)(args, state, control)

    class Trainer:  # HF fires on_train_begin from inside Trainer.train
        def __init__(self) -> None:
            self.callback_handler = Handler([callback])
            self.num_generations = 4

        def train(self) -> None:
            state = SimpleNamespace(global_step=0, is_world_process_zero=True)
            self.callback_handler.call_event("on_train_begin", SimpleNamespace(), state, None)

    trainer = Trainer()
    trainer.train()
    assert callback.trainer is trainer
    assert RlscopeCallback(tmp_path / "other").bind(trainer).trainer is trainer


def test_callback_misaligned_groups_and_other_ranks(tmp_path: Path) -> None:
    trainer = make_trainer(size=6, names=("acc",))
    callback = RlscopeCallback(tmp_path / "run", trainer=trainer)
    fire = events(callback)
    fill(trainer, ["a", "a", "a", "b", "b", "b"], {"acc": [1, 0, 1, 0, 0, 1]})
    with pytest.warns(RuntimeWarning, match="blocks of 4"):
        fire("on_log", 1, logs={"loss": 0.0})
    fire("on_train_end")
    groups = table(tmp_path / "run", "rollouts").group_by("prompt_id").len()["len"].to_list()
    assert groups == [3, 3]

    # Ranks other than world process zero write nothing, not even run.json.
    other = RlscopeCallback(tmp_path / "rank1", trainer=trainer)
    fire = events(other, main=False)
    fire("on_train_begin")
    fire("on_log", 1, logs={"loss": 0.0})
    fire("on_train_end")
    assert not (tmp_path / "rank1").exists()


def test_callback_survives_unexpected_buffers(tmp_path: Path) -> None:
    trainer = make_trainer(names=("acc",))
    trainer._logs["prompt"].extend(["only one prompt"])
    trainer._logs["completion"].extend(["a", "b"])
    callback = RlscopeCallback(tmp_path / "run", trainer=trainer)
    fire = events(callback)
    with pytest.warns(RuntimeWarning, match="cannot log"):
        fire("on_log", 1, logs={"loss": 0.0})
    with pytest.warns(RuntimeWarning, match="no rollouts"):
        fire("on_train_end")
    assert table(tmp_path / "run", "steps").height == 1


def test_callback_rejects_unknown_run_meta(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="group_sise"):
        RlscopeCallback(tmp_path, group_sise=8)
    with pytest.raises(ValueError, match="eval_"):
        RlscopeCallback(tmp_path, eval_split="validation")


@pytest.mark.parametrize(
    ("fixture", "size"),
    [(TRL_FIXTURE, 32), (GENUINE / "trl-float-noise", 64)],
    ids=["tiny", "noise"],
)
def test_callback_replays_a_real_trl_run(tmp_path: Path, fixture: Path, size: int) -> None:
    """TRL's completion tables are written from the same `_logs` buffers the callback reads:
    replaying them (with trainer_state.json's log history) must reproduce TRL's own numbers.
    Where a step's equal-reward groups carry float-noise advantages (trl-float-noise: TRL's
    float32 std of 8 x 0.4125 is ~3e-8, not within isclose's 1e-8 of 0), TRL's
    frac_reward_zero_std leaves them out: that step's value is kept apart, not compared."""
    names = ("accuracy_reward", "format_reward")
    trainer = make_trainer(size=size, g=8, names=names)
    callback = RlscopeCallback(tmp_path / "run", trainer=trainer, correct_reward="accuracy_reward")
    fire = events(callback)
    fire("on_train_begin")
    (state_file,) = sorted(fixture.glob("trainer_state.json")) or sorted(
        fixture.glob("checkpoint-*/trainer_state.json")
    )
    state = json.loads(state_file.read_text())
    for entry in state["log_history"]:
        step = entry["step"]
        path = fixture / "completions" / f"completions_{step:05d}.parquet"
        if path.exists():
            batch = pl.read_parquet(path)
            for key, column in (("prompt", "prompt"), ("completion", "completion")):
                trainer._logs[key].extend(batch[column].to_list())
            trainer._logs["advantages"].extend(batch["advantage"].to_list())
            for name in names:
                trainer._logs["rewards"][name].extend(batch[name].to_list())
        fire("on_step_end", step)
        fire("on_log", step, logs=entry)
    fire("on_train_end")

    report = rlscope.analyze(tmp_path / "run")
    logged_steps = [e["step"] for e in state["log_history"] if "loss" in e]
    assert report.run.n_steps == len(logged_steps)
    steps = pl.read_parquet(tmp_path / "run" / "steps" / "*.parquet")
    kept_apart = "frac_reward_zero_std_isclose" in steps.columns
    assert kept_apart == (fixture.name == "trl-float-noise")
    for metric_id in ("signal.reward", "signal.zero_std_frac"):
        result = report.metrics[metric_id]
        if result.logged is None:  # every step's zero-σ share kept apart
            assert metric_id == "signal.zero_std_frac" and kept_apart
            continue
        pairs = dict(zip(result.logged.steps, result.logged.values, strict=True))
        for step, value in zip(result.steps, result.values, strict=True):
            if step in pairs:
                assert value == pytest.approx(pairs[step], abs=1e-6), (metric_id, step)
    assert report.metrics["signal.pass_at_k"].extra["k"] == 8
    assert "logged-metric-mismatch" not in {f.id for f in report.findings}


# --- examples/verl_import.py -------------------------------------------------------------------


def test_verl_example_writes_verl_formats(tmp_path: Path) -> None:
    example = load_example("verl_import")
    outputs = example.write_fake_verl_outputs(tmp_path / "verl", steps=4, prompts=2, n=4)
    assert sorted(p.name for p in outputs.rollout_dir.iterdir()) == [
        f"{s}.jsonl" for s in (1, 2, 3, 4)
    ]
    lines = [json.loads(x) for x in (outputs.rollout_dir / "2.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 4
    assert set(lines[0]) == {"input", "output", "gts", "score", "step", "acc", "pred"}
    assert {x["step"] for x in lines} == {2}
    assert [x["input"] for x in lines[:4]] == [lines[0]["input"]] * 4  # n samples consecutive
    val = [json.loads(x) for x in (outputs.validation_dir / "4.jsonl").read_text().splitlines()]
    assert all(v["reward"] == v["score"] for v in val)
    metrics = [json.loads(x) for x in outputs.metrics_file.read_text().splitlines()]
    assert [x["step"] for x in metrics] == [1, 2, 3, 4]
    assert "actor/entropy" in metrics[0]["data"]


def test_verl_example_imports(tmp_path: Path) -> None:
    example = load_example("verl_import")
    if not example.importers_available():
        pytest.skip("rlscope.importers.import_run is not available yet: only the dump is tested")
    run = example.main(tmp_path / "verl", steps=8)
    assert run is not None
    splits = dict(table(run, "rollouts").group_by("split").len().iter_rows())
    assert splits == {"train": 8 * 4 * 8, "eval_id": 2 * 4}  # validation every 4 steps, n=1
    report = rlscope.analyze(run)
    assert report.run.run_id == "verl"
    m = report.metrics
    assert report.run.n_groups == 8 * 4
    assert 0 < m["signal.pass_at_1"].value <= m["signal.pass_at_k"].value <= 1
    assert m["signal.pass_at_k"].extra["k"] == 8
    assert m["behavior.entropy"].value == pytest.approx(0.9 - 0.3 * 7 / 8)  # actor/entropy, last 3
    assert m["signal.reward"].logged is not None  # critic/score/mean beside the recomputation


# --- importing without transformers ------------------------------------------------------------


def _python(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        check=True,
    )
    return result.stdout.strip()


def test_trl_integration_imports_without_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"  # as if not installed
        "import rlscope.integrations.trl as m\n"
        "base = m.RlscopeCallback.__mro__[1]\n"
        "print(base.__module__, all(hasattr(base, e) for e in "
        "('on_log', 'on_step_end', 'on_train_end', 'on_train_begin', 'on_save')))"
    )
    assert _python(code) == "rlscope.integrations.trl True"
    # `import rlscope` alone never imports the integrations (nor transformers).
    code = "import sys, rlscope; print('rlscope.integrations.trl' in sys.modules)"
    assert _python(code) == "False"


def test_trl_integration_subclasses_trainer_callback_when_available(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("class TrainerCallback:\n    pass\n")
    code = (
        "import transformers, rlscope.integrations.trl as m\n"
        "print(issubclass(m.RlscopeCallback, transformers.TrainerCallback))"
    )
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    assert _python(code, PYTHONPATH=path) == "True"


def test_scale_out_example_maps_token_files_on_a_process_pool(tmp_path: Path) -> None:
    """The Scaling-out recipe with its no-cluster engine (Ray and Dask use the same mapper
    signature): the report matches the in-process analysis."""
    from rlscope.synth import generate

    run = generate(tmp_path / "run", "healthy", steps=12, prompts_per_step=8, seed=3, text=False)
    example = load_example("scale_out")
    mapped = example.analyze_on(str(run), "process", use_cache=False)
    local = rlscope.analyze(str(run), use_cache=False)
    assert mapped.run.token_files_read == local.run.token_files_read >= 1
    assert mapped.metrics.keys() == local.metrics.keys()
    for metric_id, result in local.metrics.items():
        assert mapped.metrics[metric_id].value == pytest.approx(result.value, rel=1e-9)
    assert [f.id for f in mapped.findings] == [f.id for f in local.findings]
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "scale_out.py"), str(run), "--engine", "process"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "RLSCOPE_CACHE_DIR": str(tmp_path / "cache")},
    ).stdout
    assert "token rows, 1 file(s) reduced" in out


@pytest.mark.parametrize(
    ("names", "correct"),
    [(("acc", "fmt"), "acc"), (("only",), "only"), (("foo", "bar"), None)],
)
def test_callback_chooses_correctness_like_the_importer(
    tmp_path: Path, names: tuple[str, ...], correct: str | None
) -> None:
    trainer = make_trainer(names=names)
    callback = RlscopeCallback(tmp_path / "run", trainer=trainer)
    fire = events(callback)
    fire("on_train_begin")
    fill(trainer, ["p1"] * 4 + ["p2"] * 4, {n: [1, 0, 0, 1, 0, 0, 0, 0] for n in names})
    fire("on_log", 1, logs={"loss": 0.1})
    fire("on_train_end")
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["reward_components"] == [f"rewards/{n}" for n in names]
    report = rlscope.analyze(tmp_path / "run")
    assert f"signal.reward.{names[0]}" in report.metrics
    if correct is None:
        assert "correct" not in table(tmp_path / "run", "rollouts").columns
        assert "correct_reward=" in meta["correct_unknown"]
        assert "signal.pass_at_1" not in report.metrics
    else:
        assert meta["correct_source"].startswith(f"`{correct}`")
        assert report.metrics["signal.pass_at_1"].value is not None


@pytest.mark.slow
def test_scale_out_example_on_a_local_dask_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token map run by a real engine: a dask.distributed LocalCluster of two worker
    processes (the `scale` extra), reached the way a user reaches theirs (DASK_SCHEDULER). The
    report equals the in-process one, and the chunks really went to the cluster."""
    pytest.importorskip("distributed")
    from distributed import LocalCluster

    from rlscope.synth import generate
    from rlscope.tokenscan import limits

    run = generate(tmp_path / "run", "healthy", steps=30, prompts_per_step=8, seed=5, text=False)
    (single,) = (run / "tokens").glob("*.parquet")
    tokens = pl.read_parquet(single)
    single.unlink()
    chunked = tokens.with_columns(third=pl.col("step") // 10)
    for n, part in enumerate(chunked.partition_by("third", include_key=False)):
        part.write_parquet(run / "tokens" / f"part-{n}.parquet")  # three token files
    example = load_example("scale_out")
    sent: list[int] = []

    def counted(task: Any, chunks: list[Any]) -> Any:
        sent.append(len(chunks))
        return example.dask_map(task, chunks)

    monkeypatch.setattr(limits, "CHUNK_BYTES", 1)  # a chunk per token file: several tasks
    monkeypatch.setitem(example.ENGINES, "dask", counted)
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as cluster:
        monkeypatch.setenv("DASK_SCHEDULER", cluster.scheduler_address)
        mapped = example.analyze_on(str(run), "dask", use_cache=False)
    local = rlscope.analyze(str(run), use_cache=False)
    assert sent == [3] and local.run.token_files_read == 3
    assert mapped.metrics.keys() == local.metrics.keys()
    for metric_id, result in local.metrics.items():
        assert mapped.metrics[metric_id].value == pytest.approx(result.value, rel=1e-9)
    assert [f.id for f in mapped.findings] == [f.id for f in local.findings]
