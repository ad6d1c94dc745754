"""`RlscopeCallback`: writes a format-v1 run from a TRL GRPOTrainer or HF Trainer as it trains.

Usage::

    from rlscope.integrations.trl import RlscopeCallback

    callback = RlscopeCallback("runs/grpo-x", correct_reward="accuracy_reward")
    trainer = GRPOTrainer(model=..., reward_funcs=[accuracy_reward, format_reward],
                          args=GRPOConfig(..., logging_steps=1), callbacks=[callback])
    callback.bind(trainer)      # optional (found at train begin otherwise), but explicit
    trainer.train()             # the run directory is complete after on_train_end

HF does not hand the trainer to its callbacks; the rollouts come from the trainer's buffers, so
the callback needs it: `bind(trainer)` (or `trainer=`), else at `on_train_begin` it looks for the
Trainer that holds it in its calling frames. Without a trainer only the steps table is written,
and `rlscope analyze` needs rollouts (the callback warns at the end).

With `judge_every=K` (or a `stop_on`) it also judges the run every K steps, announces findings,
sends rlscope's metrics to the trainer's loggers, and can stop training
(docs/guides/stopping-a-bad-run.md; `rlscope.live`).

What it writes:

* **steps**, one row per `state.global_step`, from every `on_log` of that step merged (train and
  `eval_*` logs): `loss`, `grad_norm`, `learning_rate` → `lr`, `entropy`, `kl`,
  `clip_ratio/region_mean` (older TRL: `clip_ratio`) → `clip_frac`; every other numeric key is
  kept as an extra column under its own name (`reward`, `frac_reward_zero_std`,
  `completions/clipped_ratio`, `rewards/<func>/mean`, `eval_loss`, ...; for
  `completions/mean_length` see the limits). The end-of-training summary log (`train_runtime`,
  `train_loss`, ...) is not a step and is left out.
* **rollouts**, when the callback is bound to a trainer that keeps TRL's completion buffers
  (`trainer._logs`, TRL ≥ 0.28; `trainer._textual_logs` in some older versions): at each
  `on_log`, the buffered generation batch (`prompt`, `completion`, `rewards` per function,
  `advantages`, `extra`) becomes one row per completion: `reward` = the weighted sum of the
  reward functions (`trainer.reward_weights`, NaN-skipping, as TRL does), one `rewards/<func>`
  column each, `advantage`, `response` (the completion text; `keep_text=False` drops it),
  `prompt` (TRL's prompt text: the chat template applied, then decoded with special tokens
  skipped, so a template's special markers are missing) or, for conversational prompts kept
  as messages, `messages` (JSON) — what `rlscope probe` rebuilds a rollout's context from,
  `correct` from the reward function named by `correct_reward=` (value > 0, or
  >= `correct_threshold` when given), and `split` = `train`, or `eval_split` for a log with
  `eval_*` keys. Consecutive `num_generations` completions of one prompt form a group;
  `prompt_id` is a stable hash (blake2b) of the prompt text (chat prompts: of their JSON).
* **tokens**, bound to a TRL GRPOTrainer (SUPPORTED_TRL in `rlscope.integrations.trl_tokens`:
  1.16 <= trl < 2; outside it, a warning and no tokens) and unless `token_sample="none"`: one
  row per generated token (the completion mask, times TRL's tool mask) of each train rollout
  written, from the trainer's own tensors — `rollout_id` (the rollout's), `step`, `pos`,
  `logprob` and `entropy` (what `_compute_loss` got from `_get_per_token_logps_and_entropies`
  at the completion's first pass), `old_logprob` (TRL's `old_per_token_logps`, else, on-policy,
  the log-probs themselves, as TRL does), `ref_logprob` (β > 0), `rollout_logprob` (vLLM's
  sampling log-probs, when TRL has them), `advantage` and `segment` (think / answer / tool_call
  / tool_response / text: where the token's text falls in the completion's tags, by character
  offsets of the completion decoded with the trainer's `processing_class`; the tags' own
  tokens belong to the segment they open or close; the tag sets of `config=`, else of the
  config file `rlscope analyze` finds; null where the tokens cannot be aligned with the text:
  rlscope.integrations.token_segments). `step` is the optimizer step of that
  first pass: the rollout's step with one generation per step, later for the later
  micro-batches of a batch trained over `steps_per_generation` steps; later passes
  (`num_iterations` > 1) are not written. `token_sample=` `"all"` (default), `"none"`, or a
  share of the rollouts (every token of each one drawn). With the tap, every train rollout
  also gets `truncated` by TRL's rule for `completions/clipped_ratio` (its last token neither
  an EOS nor the pad token). See `TokenTap`.
* **run.json**: `algorithm="GRPO"`, and from `GRPOConfig` unless given: `group_size`
  (`num_generations`), `clip_ratio_low` / `clip_ratio_high` (`epsilon` / `epsilon_high`),
  `max_grad_norm` (TRL logs `grad_norm` before this clip; grad-spike judges what passed it),
  `scale_rewards`, the reward functions' `reward_weights` (the advantage by reward term), and
  with the tokens tap (exact token counts) `max_response_len` (`max_completion_length`).

Limits, honestly:

* TRL keeps only the latest generation batch in those buffers (bounded deques). With
  `logging_steps=1` and one generation per optimizer step (the default) every batch is seen;
  with `logging_steps=k` only one batch in k is written (the report's group statistics are then
  a sample), and a batch reused over several steps (`num_iterations`, `steps_per_generation`)
  is written once, at the first step that logs it.
* Rollout `step` is `state.global_step` at the log, as in TRL's own completion tables: the
  optimizer step the batch was used in (it was generated by the policy before that update).
* `_logs` and the wrapped methods are private TRL API: if their layout changes, the callback
  warns once and writes steps only (no `_logs`) or no tokens (unreadable tensors). The tap
  wraps methods of the bound trainer instance only, never the class; the eval loop is left
  alone (tokens are of train rollouts).
* With the tokens tap, `response_len` is each completion's number of generated tokens (exact;
  `response_len_unit` "tokens", and TRL's `completions/mean_length` kept as logged: they
  agree). Without it, TRL's buffers hold decoded text, not token ids, so `response_len` is
  re-counted from the completion text: with `count_tokens=` (text -> int), else the trainer's
  `processing_class` tokenizer, else whitespace words. Decoding drops special tokens (EOS, and
  whatever else a model emits; on a tiny random model truncated 24-token completions decode to
  16-23 words), so it is approximate; TRL's `completions/mean_length` is then stored as
  `completions/mean_length_logged` (unless `count_tokens=` is given), so that rlscope does not
  flag the approximation as a logged-vs-recomputed mismatch. Without the tap neither
  `truncated` nor `max_response_len` is written (re-counted lengths are not compared with
  the cap): the truncation rate is TRL's `completions/clipped_ratio` as logged.
* A batch the rollouts never log (`logging_steps` > 1) has no token rows either.
* A token has one `segment`: one whose text spans two segments (a SentencePiece-style merge
  of `.</think>\n<answer>`) takes its first non-whitespace character's. A completion that
  starts inside a segment whose opening tag is in the prompt (an R1 template ending in
  `<think>`) has no such tag in its text: its reasoning is `text`, as the rollouts' text
  metrics see it too.
* Only the world process zero writes (TRL gathers completions from every rank; the tap gathers
  each process's token rows the same way, `gather_object`, so every process must run the
  callback) and judges; its decision to stop reaches every process through torch.distributed,
  when it is initialised. Rollout ids continue after those already in the run directory; steps
  re-logged after resuming from a checkpoint appear twice (rlscope averages rows of one step).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

import polars as pl

from rlscope.catalog import default_catalog
from rlscope.config import Config, load_config
from rlscope.errors import RlscopeError
from rlscope.importers._common import accuracy_like
from rlscope.importers.text import answer_expr, prompt_id
from rlscope.importers.trl import ZERO_STD_ISCLOSE, noisy_zero_std_groups
from rlscope.integrations.trl_tokens import (
    GenerationBatch,
    TokenSample,
    TokenTap,
    parse_token_sample,
    trl_support,
)
from rlscope.live import METRIC_PREFIX, NEVER, Judgement, StopOn, StopPolicy
from rlscope.probe import Asker, ProbeSettings, ProbeSummary, ask_targets, run_coroutine, targets_of
from rlscope.probe.interventions import EDITED
from rlscope.probe.local import LocalModel
from rlscope.schema import RUN_FIELDS
from rlscope.tablewriter import next_rollout_id
from rlscope.text import TagSet
from rlscope.writer import RunWriter

#: What `probe_every` asks by default: the interventions that need no editor model.
IN_LOOP_KINDS = ("truncate", "filler")
#: The `model` of in-loop probes: the policy being trained (their checkpoint_step its step).
IN_LOOP_MODEL = "policy (in process)"
#: The rollout columns a probe plan reads.
PROBED_COLUMNS = (
    "rollout_id",
    "step",
    "prompt_id",
    "split",
    "response",
    "answer",
    "prompt",
    "messages",
    "correct",
)

try:  # transformers is optional: without it the callback is a plain object with HF's hooks.
    from transformers import TrainerCallback as _CallbackBase
except ImportError:

    class _CallbackBase:  # type: ignore[no-redef]
        """Stand-in for `transformers.TrainerCallback` (same event names, all no-ops)."""

        def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_pre_optimizer_step(
            self, args: Any, state: Any, control: Any, **kwargs: Any
        ) -> None: ...
        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_predict(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
        def on_prediction_step(
            self, args: Any, state: Any, control: Any, **kwargs: Any
        ) -> None: ...


#: TRL / HF log key -> format-v1 steps column.
STEP_KEYS: dict[str, str] = {
    "loss": "loss",
    "grad_norm": "grad_norm",
    "learning_rate": "lr",
    "entropy": "entropy",
    "kl": "kl",
    "clip_ratio/region_mean": "clip_frac",
    "clip_ratio": "clip_frac",  # older TRL logged a single clip ratio
}
#: Keys of the HF end-of-training summary log (not an optimizer step).
_SUMMARY_KEYS = {"train_runtime", "train_samples_per_second", "train_steps_per_second"}
#: Logged length keys rlscope compares with rollouts' response_len (tokens).
_LENGTH_KEYS = ("completions/mean_length",)
_LENGTH_RENAME = "{}_logged"
#: Buffer attribute names of TRL's GRPOTrainer, newest first.
_BUFFERS = ("_logs", "_textual_logs")
#: Steps between judgements when stopping is asked for and `judge_every` is not given.
DEFAULT_JUDGE_EVERY = 10
#: HF callbacks that print logs to the console: rlscope's metrics are not printed.
_PRINTERS = {"ProgressCallback", "PrinterCallback", "NotebookProgressCallback"}
_WRITER_OPTIONS = {"run_id", "algorithm", "rank", "flush_rows"}
_DEFAULT_FLUSH_ROWS = {"rollouts": 20_000}  # rows hold completion text: bound the memory


class RlscopeCallback(_CallbackBase):
    """HF `TrainerCallback` writing steps (bound to a GRPOTrainer, rollouts and tokens too).

    `run_meta` goes to `RunWriter` (`run_id`, `algorithm`, `group_size`, `max_response_len`,
    `correct_threshold`, `flush_rows`, ...). Options: `trainer` (or `bind(trainer)` later),
    `correct_reward` (name of the reward function that says whether a completion is correct),
    `count_tokens` (text -> token count; default the trainer's tokenizer), `num_generations`
    (group size; default from the trainer or its args), `keep_text` (store completions as
    `response`), `eval_split` (split of completions logged with `eval_*` metrics),
    `token_sample` (the tokens table: `"all"`, `"none"` or a share of the rollouts).

    Judging (docs/guides/stopping-a-bad-run.md): `judge_every` (judge the run written so far every
    that many steps; default none, or DEFAULT_JUDGE_EVERY with a `stop_on`), `stop_on`
    (`never`, a severity or finding ids: stop training on such a finding, with stop.json),
    `log_metrics` (send rlscope's metrics to the trainer's loggers at each judgement),
    `config` and `cache_dir` (the analysis'; `config`'s tag sets also label the tokens'
    `segment`, else those of the config file found in the working directory). `judgements`
    lists every judgement made.

    Probing (docs/guides/probes.md): `probe_every=K` probes `probe_per_step` of the
    step's rollouts every K steps with the trainer's own model (`model.generate`, greedy, at most
    `probe_max_tokens` new tokens; no server), with `probe_kinds` (truncate, filler, bias: the
    interventions that need no editor model), written as probes of that step (`model`
    IN_LOOP_MODEL, `checkpoint_step` the step). The main process generates alone, so a model
    sharded over processes (FSDP, ZeRO-3) cannot be probed in the loop: use `rlscope probe`
    against a server. `probes` lists what each probing did (its ProbeSummary, with seconds).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        trainer: Any = None,
        correct_reward: str | None = None,
        count_tokens: Callable[[str], int] | None = None,
        num_generations: int | None = None,
        keep_text: bool = True,
        eval_split: str = "eval_id",
        judge_every: int | None = None,
        stop_on: StopOn = NEVER,
        log_metrics: bool = True,
        config: Config | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        probe_every: int | None = None,
        probe_per_step: int = 2,
        probe_kinds: Sequence[str] = IN_LOOP_KINDS,
        probe_max_tokens: int = 64,
        token_sample: TokenSample = "all",
        **run_meta: Any,
    ) -> None:
        known = _WRITER_OPTIONS | {f.name for f in RUN_FIELDS} - {"schema_version"}
        unknown = sorted(set(run_meta) - known)
        if unknown:
            raise TypeError(f"RlscopeCallback: unknown run.json field(s): {', '.join(unknown)}")
        if not eval_split.startswith("eval_"):
            raise ValueError(f"eval_split must start with 'eval_', got {eval_split!r}")
        if judge_every is None and stop_on != NEVER:
            judge_every = DEFAULT_JUDGE_EVERY
        if judge_every is not None and judge_every < 1:
            raise ValueError(f"judge_every must be a positive number of steps, got {judge_every}")
        StopPolicy.parse(stop_on, default_catalog())  # a wrong stop_on fails here, not mid-run
        if probe_every is not None and probe_every < 1:
            raise ValueError(f"probe_every must be a positive number of steps, got {probe_every}")
        edited = sorted(set(probe_kinds) & set(EDITED))
        if edited:
            raise ValueError(
                f"probe_kinds {', '.join(edited)} need an editor model: run `rlscope probe` "
                "against a server for those"
            )
        self.token_share = parse_token_sample(token_sample)
        self.tokens: TokenTap | None = None  # the tap on the bound trainer's tensors
        self.probe_every = probe_every
        self.probe_settings = ProbeSettings(
            endpoint="in-process",
            model=IN_LOOP_MODEL,
            kinds=tuple(probe_kinds),
            per_step=probe_per_step,
            max_tokens=probe_max_tokens,
            concurrency=1,
        )
        self.probes: list[ProbeSummary] = []  # every in-loop probing, in order
        self.judge_every = judge_every
        self.stop_on = stop_on
        self.log_metrics = log_metrics
        self.judge_options: dict[str, Any] = {
            "stop_on": stop_on,
            "config": config,
            "cache_dir": cache_dir,
        }
        self.judgements: list[Judgement] = []  # every judgement made, in order
        self._judged_step: int | None = None
        self._last_step: int | None = None  # the last step logged
        self.run_dir = Path(run_dir)
        self.run_meta = dict(run_meta)
        self.trainer = trainer
        self.correct_reward = correct_reward
        self.count_tokens = count_tokens
        self.num_generations = num_generations
        self.keep_text = keep_text
        self.eval_split = eval_split
        self.writer: RunWriter | None = None
        # How response_len is counted, fixed when the writer opens: "count_tokens" (given),
        # "tokenizer" (the trainer's, re-encoding the decoded text) or "words".
        self.length_source: str | None = None
        self._counter: Callable[[str], int] | None = None
        self.closed = False
        self._pending: dict[str, Any] | None = None  # the current step's merged log row
        self._last_batch: str | None = None  # fingerprint of the last written generation batch
        self._next_rollout_id = self._first_rollout_id = 0
        self._warned: set[str] = set()

    def bind(self, trainer: Any) -> RlscopeCallback:
        """Read completions from this trainer's buffers at each log (and, from a GRPOTrainer,
        per-token tensors: `token_sample`). Returns self."""
        self.trainer = trainer
        self._tap()
        return self

    # HF events -------------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.closed:  # a second train() call (or a resume) appends to the same run
            self.writer, self.closed, self._pending = None, False, None
        if self.trainer is None:
            self.trainer = _find_trainer(self)
        self._tap()  # on every process: the tap takes part in TRL's gathers
        if _is_main(state):
            self._open(args, kwargs)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Every log of the previous step arrived before this step ended: its row is complete.
        if self._pending is not None and self._pending["step"] < _step(state):
            self._emit_pending()

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.closed or not logs:
            return
        if _SUMMARY_KEYS & set(logs) or all(str(k).startswith(METRIC_PREFIX) for k in logs):
            return  # the end-of-training summary, or rlscope's own metrics sent to the loggers
        step = _step(state)
        is_eval = any(str(k).startswith("eval_") for k in logs)
        if _is_main(state):
            writer = self._open(args, kwargs)
            self._last_step = step
            if self._pending is not None and self._pending["step"] != step:
                self._emit_pending()
            if self._pending is None:
                self._pending = {"step": step}
            self._pending.update(self._step_columns(logs))
            self._log_completions(writer, step, self.eval_split if is_eval else "train", args)
        judging = self.judge_every is not None and step % self.judge_every == 0
        if not is_eval and judging and step != self._judged_step:
            # Every process logs at the same steps: each one gets the main process's decision.
            stop = self._judge(args, state, control, step) if _is_main(state) else False
            if _shared_stop(stop) and not control.should_training_stop:
                control.should_training_stop = True
                if str(getattr(args, "save_strategy", "steps")) not in ("no", "SaveStrategy.NO"):
                    control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # A checkpoint is a good moment to make everything so far durable.
        if self.writer is not None and not self.closed:
            self._emit_pending()
            self.writer.flush()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Write the pending step row, flush and close the writer. Idempotent."""
        if self.closed:
            return
        if self.writer is not None:
            self._emit_pending()
            if self.tokens is not None:
                for batch in self.tokens.finish():
                    self._write_tokens(batch, complete_only=True)
            last = self._last_step
            if self.judge_every is not None and last is not None and last != self._judged_step:
                self._judgement(last)  # the end of the run judged too (its findings logged)
            self.writer.close()
            if self._next_rollout_id == self._first_rollout_id:
                self._warn_once(
                    "no-rollouts",
                    f"no rollouts were written to {self.run_dir} (no trainer bound, or it keeps "
                    "no completion buffers): `rlscope analyze` needs them; call bind(trainer), "
                    "or import TRL's completions (log_completions=True) with an importer",
                )
        self.closed = True

    # internals -------------------------------------------------------------------------------

    def _tap(self) -> None:
        """Install the token tap on the bound trainer (once), when it is a GRPOTrainer of a
        supported TRL version and tokens are asked for; otherwise say why, rollouts only."""
        if self.token_share <= 0 or self.trainer is None:
            return
        if self.tokens is not None:
            if self.tokens.trainer is self.trainer:
                return
            self.tokens.uninstall()
            self.tokens = None
        reason = trl_support(self.trainer)
        if reason is None:
            self.tokens = TokenTap(
                self.trainer, self.token_share, self._write_tokens, tags=self._tags()
            )
        elif reason:
            self._warn_once("tokens", f"no token table: {reason}; rollouts and steps only")

    def _tags(self) -> TagSet:
        """The tag sets the tokens' segments are labelled with: `config`'s, else the config file
        `rlscope analyze` and the in-loop judge find (./rlscope.toml, [tool.rlscope] of
        ./pyproject.toml), else rlscope's defaults."""
        config = self.judge_options.get("config")
        if config is None:
            try:
                config = load_config()
            except RlscopeError as exc:
                self._warn_once("config", f"token segments with the default tags: {exc}")
                return TagSet()
        return config.text.tags

    def _write_tokens(self, batch: GenerationBatch, complete_only: bool = False) -> None:
        if self.writer is not None and not self.closed:
            self.writer.log_tokens(batch.columns(complete_only=complete_only))

    def _open(self, args: Any, kwargs: Mapping[str, Any]) -> RunWriter:
        if self.writer is not None:
            return self.writer
        if self.count_tokens is not None:
            self._counter, self.length_source = self.count_tokens, "count_tokens"
        if self.tokens is not None:
            self.length_source = "token_ids"  # counted from the generated ids (claim)
        if self.count_tokens is None:
            tokenizer = getattr(self.trainer, "processing_class", None) or kwargs.get(
                "processing_class"
            )
            self._counter = _token_counter(tokenizer)
            if self.length_source is None:
                self.length_source = "tokenizer" if self._counter is not None else "words"
        meta = dict(self.run_meta)
        meta.setdefault("flush_rows", _DEFAULT_FLUSH_ROWS)
        group_size = self._group_size(args)
        if group_size is not None:
            meta.setdefault("algorithm", "GRPO")
            meta.setdefault("group_size", group_size)
        epsilon = _number(getattr(args, "epsilon", None))
        if epsilon is not None:
            meta.setdefault("clip_ratio_low", epsilon)
            high = _number(getattr(args, "epsilon_high", None))
            meta.setdefault("clip_ratio_high", high if high is not None else epsilon)
        scale = getattr(args, "scale_rewards", None)
        if isinstance(scale, bool):  # older TRL: True = by the group's std, False = none
            scale = "group" if scale else "none"
        if scale in ("group", "batch", "none"):
            meta.setdefault("scale_rewards", scale)
        clip = _number(getattr(args, "max_grad_norm", None))
        if clip is not None and clip > 0:  # TRL logs the norm before this clip
            meta.setdefault("max_grad_norm", clip)
        if self.length_source == "token_ids":
            meta.setdefault("response_len_unit", "tokens")
            # The cap on response_len, exact token counts here (GRPOConfig's default 256).
            cap = _number(getattr(args, "max_completion_length", None))
            if cap is not None and cap >= 1:
                meta.setdefault("max_response_len", int(cap))
        meta.update(self._correctness_meta(meta))
        self._next_rollout_id = self._first_rollout_id = next_rollout_id(self.run_dir)
        self.writer = RunWriter(self.run_dir, **self.judge_options, **meta)
        return self.writer

    def _judge(self, args: Any, state: Any, control: Any, step: int) -> bool:
        """Judge the run written so far and send rlscope's metrics to the trainer's loggers;
        whether `stop_on` names a finding raised (training then stops, with a checkpoint
        unless the trainer saves none)."""
        judgement = self._judgement(step)
        if judgement is None:
            return False
        if self.log_metrics and judgement.metrics:
            self._send_metrics(args, state, control, judgement.metrics)
        return judgement.stop is not None

    def _judgement(self, step: int) -> Judgement | None:
        self._judged_step = step
        if self.writer is None:
            return None
        self._emit_pending()
        self.writer.judge()
        judgement = self.writer.judgement
        if judgement is not None:
            self.judgements.append(judgement)
        return judgement

    def _send_metrics(
        self, args: Any, state: Any, control: Any, metrics: Mapping[str, float]
    ) -> None:
        """rlscope's metrics to the trainer's reporting callbacks (W&B, TensorBoard, MLflow…),
        at this step, next to the trainer's own; not to the console printers, nor to the
        trainer's log history (its trainer_state.json stays the trainer's)."""
        handler = getattr(self.trainer, "callback_handler", None)
        for callback in getattr(handler, "callbacks", None) or ():
            if callback is self or type(callback).__name__ in _PRINTERS:
                continue
            try:
                callback.on_log(args, state, control, logs=dict(metrics))
            except Exception as exc:  # a logger's failure must not end the training
                name = type(callback).__name__
                self._warn_once(f"send-{name}", f"rlscope metrics not sent to {name}: {exc}")

    def _correctness_meta(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """run.json fields saying which reward function means correct, chosen as the TRL
        importer does (importers/_common.py `accuracy_like`): `correct_reward=` when given,
        else the one reward function named like accuracy, else the only one; with several and
        none recognisable, correctness is unknown (never a sum with a format bonus)."""
        names = [str(n) for n in getattr(self.trainer, "reward_func_names", None) or ()]
        out: dict[str, Any] = {}
        if names:
            out["reward_components"] = [f"rewards/{n}" for n in names]
            weights = self._reward_weights(names)
            out["reward_weights"] = {f"rewards/{n}": w for n, w in zip(names, weights, strict=True)}
        threshold = meta.get("correct_threshold")
        rule = "> 0" if threshold is None else f">= {threshold}"
        if self.correct_reward is not None:
            out["correct_source"] = f"`{self.correct_reward}` {rule} (correct_reward=)"
        elif names:
            chosen, why = accuracy_like(names)
            if chosen is None and len(names) == 1:
                chosen, why = names[0], "the only reward function"
            if chosen is not None:
                self.correct_reward = chosen
                out["correct_source"] = f"`{chosen}` {rule}: {why}"
            else:
                out["correct_unknown"] = (
                    f"{why}: say which reward function means correct: "
                    "RlscopeCallback(correct_reward=…)"
                )
        why_text = out.get("correct_source") or out.get("correct_unknown")
        if why_text:
            out["provenance"] = {**dict(meta.get("provenance") or {}), "correct": why_text}
        return {k: v for k, v in out.items() if k not in meta}

    def _group_size(self, args: Any) -> int | None:
        for value in (
            self.num_generations,
            self.run_meta.get("group_size"),
            getattr(self.trainer, "num_generations", None),
            getattr(args, "num_generations", None),
        ):
            number = _number(value)
            if number is not None and number >= 1:
                return int(number)
        return None

    def _step_columns(self, logs: Mapping[str, Any]) -> dict[str, float]:
        columns: dict[str, float] = {}
        for key, value in logs.items():
            number = _number(value)
            if number is None or key == "step":
                continue
            name = STEP_KEYS.get(key, key)
            if key in _LENGTH_KEYS and self.length_source not in ("count_tokens", "token_ids"):
                name = _LENGTH_RENAME.format(key)  # exact; ours are re-counted from text
            columns[name] = number
        return columns

    def _emit_pending(self) -> None:
        if self._pending is None or self.writer is None:
            return
        row, self._pending = self._pending, None
        step = row.pop("step")
        if row:
            self.writer.log_step(step, **row)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"RlscopeCallback: {message}", RuntimeWarning, stacklevel=3)

    def _log_completions(self, writer: RunWriter, step: int, split: str, args: Any) -> None:
        if self.trainer is None:
            return
        try:
            rows = self._completion_rows(step, split, args)
            if rows is not None:
                self._keep_zero_std_apart(rows)
                writer.log_rollouts(rows)
                if self.probe_every and split == "train" and step % self.probe_every == 0:
                    self._probe(writer, rows, step)
        except OSError:
            raise  # disk full or similar: as loud as RunWriter itself
        except Exception as exc:  # private TRL API: never stop training over it
            self._warn_once(
                "buffers", f"cannot log the trainer's completions ({exc!r}); steps only"
            )

    def _keep_zero_std_apart(self, rows: dict[str, list]) -> None:
        """TRL's frac_reward_zero_std of a batch with groups of equal rewards whose advantages
        are float noise leaves those groups out (noisy_zero_std_groups): that step's value is
        kept as ZERO_STD_ISCLOSE, not compared with the recomputed share."""
        if (
            self._pending is None
            or "advantage" not in rows
            or "frac_reward_zero_std" not in (self._pending)
        ):
            return
        frame = pl.DataFrame(
            {k: rows[k] for k in ("prompt_id", "split", "reward", "advantage")}
        ).filter(pl.col("split") == "train")
        if noisy_zero_std_groups(frame, ["prompt_id"], "reward").height:
            self._pending[ZERO_STD_ISCLOSE] = self._pending.pop("frac_reward_zero_std")

    def _probe(self, writer: RunWriter, rows: dict[str, list], step: int) -> None:
        """Probe some of this step's rollouts with the policy itself (rlscope.probe.local)."""
        began = time.monotonic()
        model = getattr(self.trainer, "model", None)
        tokenizer = getattr(self.trainer, "processing_class", None)
        accelerator = getattr(self.trainer, "accelerator", None)
        if model is None or tokenizer is None or "response" not in rows:
            self._warn_once(
                "probe", "no probes: the trainer has no model or tokenizer, or keep_text=False"
            )
            return
        if accelerator is not None:
            model = accelerator.unwrap_model(model)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
        settings = replace(self.probe_settings, checkpoint_step=step)
        summary = ProbeSummary(self.run_dir, settings.model)
        frame = pl.DataFrame({k: v for k, v in rows.items() if k in PROBED_COLUMNS})
        targets = targets_of(frame, settings, set(), summary, self.run_dir)
        local = LocalModel(model, tokenizer)
        run_coroutine(ask_targets(targets, Asker(local, local, settings), writer, summary))
        summary.add_usage(local.usage)
        summary.seconds = time.monotonic() - began
        self.probes.append(summary)

    def _completion_rows(self, step: int, split: str, args: Any) -> dict[str, list] | None:
        buffers = next(
            (
                b
                for b in (getattr(self.trainer, name, None) for name in _BUFFERS)
                if isinstance(b, Mapping) and "prompt" in b and "completion" in b
            ),
            None,
        )
        if buffers is None:
            self._warn_once("none", "the trainer keeps no completion buffers: steps only")
            return None
        prompts = [_prompt_key(p) for p in buffers["prompt"]]
        completions = [_completion_text(c) for c in buffers["completion"]]
        n = len(completions)
        if n == 0:
            return None
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} completions")
        per_func = {
            str(name): [_float(v) for v in values]
            for name, values in dict(buffers.get("rewards") or {}).items()
            if len(values) == n
        }
        if not per_func:
            self._warn_once("rewards", "no per-completion rewards in the buffers: steps only")
            return None
        advantages = [_float(v) for v in buffers.get("advantages") or ()]
        fingerprint = _fingerprint(prompts, completions, per_func, advantages)
        if fingerprint == self._last_batch:
            return None  # the same generation batch, logged again
        self._last_batch = fingerprint

        ids = list(range(self._next_rollout_id, self._next_rollout_id + n))
        lengths: list[int] = []
        truncated: list[bool | None] = []
        if self.tokens is not None and self.tokens.error is None and split == "train":
            batch = self.tokens.claim(advantages, ids)
            if batch is None:
                self._warn_once(
                    "claim", "a generation batch's tokens could not be matched with its rollouts"
                )
            else:
                lengths, truncated = batch.lengths, batch.truncated
        rows: dict[str, list] = {
            "rollout_id": ids,
            "step": [step] * n,
            "prompt_id": self._prompt_ids(prompts, args),
            "split": [split] * n,
            "reward": _total_reward(per_func, self._reward_weights(list(per_func))),
            "response_len": lengths or self._lengths(buffers, completions),
        }
        if lengths and len(truncated) == n and any(t is not None for t in truncated):
            rows["truncated"] = truncated
        self._next_rollout_id += n
        if self.correct_reward is not None:
            if self.correct_reward not in per_func:
                raise KeyError(
                    f"correct_reward {self.correct_reward!r} is not one of the reward "
                    f"functions {sorted(per_func)}"
                )
            threshold = self.run_meta.get("correct_threshold")
            rows["correct"] = [
                None if math.isnan(v) else (v >= threshold if threshold is not None else v > 0)
                for v in per_func[self.correct_reward]
            ]
        if len(advantages) == n:
            rows["advantage"] = advantages
        if self.keep_text:
            rows["response"] = completions
            texts = pl.DataFrame({"text": completions}, schema={"text": pl.String})
            rows["answer"] = texts.select(answer_expr(pl.col("text")).alias("a"))["a"].to_list()
            raw = list(buffers["prompt"])
            if all(isinstance(p, str) for p in raw):
                rows["prompt"] = raw  # what `rlscope probe` continues
            else:  # conversational: the messages, as JSON
                rows["messages"] = prompts
        for name, values in per_func.items():
            rows[f"rewards/{name}"] = values
        for name, values in dict(buffers.get("extra") or {}).items():
            values = list(values)
            if len(values) == n and all(_is_scalar(v) for v in values):
                rows.setdefault(str(name), values)
        return rows

    def _prompt_ids(self, prompts: list[str], args: Any) -> list[str]:
        """Stable ids; consecutive `num_generations` completions of one prompt share one."""
        g = self._group_size(args)
        n = len(prompts)
        if g and n % g == 0 and all(len(set(prompts[i : i + g])) == 1 for i in range(0, n, g)):
            bounds = [(i, i + g) for i in range(0, n, g)]
        else:
            if g:
                self._warn_once(
                    "groups",
                    f"completions do not come in blocks of {g} identical prompts; grouping "
                    "runs of consecutive identical prompts instead",
                )
            bounds, start = [], 0
            for i in range(1, n + 1):
                if i == n or prompts[i] != prompts[start]:
                    bounds.append((start, i))
                    start = i
        ids: list[str] = []
        seen: dict[str, int] = {}
        for start, end in bounds:
            repeat = seen.get(prompts[start], 0)
            seen[prompts[start]] = repeat + 1
            # The same prompt drawn twice in one batch is two groups, not one of 2G.
            ids.extend([prompt_id(prompts[start], repeat)] * (end - start))
        return ids

    def _reward_weights(self, names: list[str]) -> list[float]:
        weights = _tolist(getattr(self.trainer, "reward_weights", None))
        order = _tolist(getattr(self.trainer, "reward_func_names", None))
        if weights is None or len(weights) != len(order or names):
            return [1.0] * len(names)
        by_name = dict(zip(order or names, weights, strict=True))
        return [float(by_name.get(name, 1.0)) for name in names]

    def _lengths(self, buffers: Mapping[str, Any], completions: list[str]) -> list[int]:
        ids = buffers.get("completion_ids")
        if ids is not None and len(ids) == len(completions):
            return [len(x) for x in ids]
        if self._counter is not None:
            return [int(self._counter(text)) for text in completions]
        return [len(text.split()) for text in completions]


def _shared_stop(stop: bool) -> bool:
    """The main process's stop decision, on every process of a distributed run (torch.distributed
    when it is initialised: a process that stopped alone would leave the others waiting)."""
    distributed = sys.modules.get("torch.distributed")  # never imported here for a one-process run
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return stop
    if distributed.get_world_size() == 1:
        return stop
    decision = [stop]
    distributed.broadcast_object_list(decision, src=0)
    return bool(decision[0])


def _find_trainer(callback: Any, depth: int = 12) -> Any:
    """The Trainer whose `callback_handler` holds `callback`: a `self` in the calling frames
    (HF fires on_train_begin from inside `Trainer.train`). None when there is none."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        handler = getattr(candidate, "callback_handler", None)
        if any(c is callback for c in getattr(handler, "callbacks", ()) or ()):
            return candidate
        frame = frame.f_back
    return None


def _token_counter(tokenizer: Any) -> Callable[[str], int] | None:
    """Text -> token count with a HF tokenizer (or a processor wrapping one), else None."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # multimodal processors
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        return None

    def count(text: str) -> int:
        try:
            return len(encode(text, add_special_tokens=False))
        except TypeError:  # an encode() without that keyword
            return len(encode(text))

    return count


def _is_main(state: Any) -> bool:
    return bool(getattr(state, "is_world_process_zero", True))


def _step(state: Any) -> int:
    return int(getattr(state, "global_step", 0) or 0)


def _number(value: Any) -> float | None:
    """A finite-or-not float from a Python/numpy/torch scalar; None for anything else."""
    if isinstance(value, str | bytes) or value is None:
        return None
    if hasattr(value, "item"):  # numpy / torch scalars; arrays of several values fail
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            return None
    if isinstance(value, bool | int | float):
        return float(value)
    return None


def _float(value: Any) -> float:
    number = _number(value)
    return math.nan if number is None else number


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | bool | int | float)


def _tolist(value: Any) -> list | None:
    if value is None:
        return None
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    if hasattr(value, "tolist"):
        value = value.tolist()
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else None


def _prompt_key(prompt: Any) -> str:
    """The text a prompt is grouped and hashed by; chat prompts by their canonical JSON."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)


def _completion_text(completion: Any) -> str:
    """A completion's text; chat completions (lists of messages) joined by their contents."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence):
        parts = []
        for message in completion:
            content = message.get("content", "") if isinstance(message, Mapping) else message
            if isinstance(content, Sequence) and not isinstance(content, str):  # content parts
                content = "".join(
                    str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content
                )
            parts.append(str(content))
        return "\n".join(parts)
    return str(completion)


def _total_reward(per_func: dict[str, list[float]], weights: list[float]) -> list[float | None]:
    """Σ w·r over reward functions, skipping NaN (TRL's nansum); None when every one is NaN."""
    totals: list[float | None] = []
    for values in zip(*per_func.values(), strict=True):
        terms = [w * v for w, v in zip(weights, values, strict=True) if not math.isnan(v)]
        totals.append(sum(terms) if terms else None)
    return totals


def _fingerprint(
    prompts: list[str],
    completions: list[str],
    per_func: dict[str, list[float]],
    advantages: list[float],
) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for part in (prompts, completions, sorted(per_func.items()), advantages):
        digest.update(json.dumps(part, ensure_ascii=False).encode())
    return digest.hexdigest()
