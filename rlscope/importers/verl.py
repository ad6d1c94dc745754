"""verl importers: rollout dumps (`<step>.jsonl`, verl-agent too) and the file logger's metrics."""

from __future__ import annotations

import io
import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import polars as pl

from rlscope.errors import RlscopeError
from rlscope.importers._common import (
    EvalPoints,
    StepRows,
    correct_from_reward,
    correct_rule,
    index_within_step,
    keep_new_steps,
    rename_reserved,
)
from rlscope.importers._jsonl import CHUNK_LINES, LINE, Field, chunks, read_jsonl
from rlscope.importers.options import (
    COMMON_OPTIONS,
    OOD_SETS_OPTION,
    ROLLOUT_OPTIONS,
    SPLIT_OPTION,
    Option,
)
from rlscope.importers.session import Importer, Session, numbered
from rlscope.importers.text import ASSISTANT, WORDS_NOTE, answer_expr, prompt_ids, word_count_expr

TRAJECTORY_KEYS = ("traj_uid", "trajectory_id")
#: verl >= 0.9 dumps the rollout's uid, `{group uid}_{session}_{i}`.
UID = "uid"
#: What verl's math_dapo writes as `pred` when it found no answer.
NO_ANSWER = ("[INVALID]", "")
#: Share of rows whose dumped `pred` may differ from their own output's answer before the
#: extras are called out of line (reward functions normalise answers differently).
PRED_MISMATCH_SHARE = 0.2
LENGTH_KEYS = ("response_length", "response_len")
_CONSUMED = ("input", "output", "score", "step", "acc", "pred", *LENGTH_KEYS)


def _files(source: Path, pattern: str = "*.jsonl") -> list[tuple[int | None, Path]]:
    if source.is_file():
        return numbered([source], lambda p: p.stem)
    files = [p for p in source.glob(pattern) if p.is_file() and not p.name.startswith(".")]
    return numbered(files, lambda p: p.stem)


def import_verl(session: Session) -> None:
    """verl rollout dumps: a folder of `<step>.jsonl` files, one JSON object a line, as written
    by `trainer.rollout_data_dir` (train) or `trainer.validation_data_dir` (validation; import
    it with `split=eval_id` or `eval_ood`). A single `.jsonl` file works too.

    Read from verl's own writer: verl/trainer/ppo/ray_trainer.py `_dump_generations` (0.5 ->
    main: `input`, `output`, `gts`, `score`, `step` and every reward-extra list of the batch
    length, e.g. math_dapo's `acc`, `pred`, `score`; rows after `balance_batch`'s
    karmarkar_karp reorder, so a group's rows are scattered; 0.9's v1 trainer adds `uid`;
    0.9 writes with json `default=str`, so a bool extra can arrive as "True").

    Fields read (verl's names) -> format v1:
      step      `step`, else the file name `<step>.jsonl`
      prompt_id verl >= 0.9: the group part of `uid` (`{uid}_{session}_{i}` -> `{uid}`);
                before: blake2b-8 hex of `input` (rollouts of one step with identical `input`
                are one group). A prompt drawn twice in a step then merges into one group of
                2n: groups whose size is a multiple (>= 2x) of n are counted in a warning
                (their σ_G pools two draws, and pass@k with k = n is optimistic).
      response  `output`;  reward = `score`
      correct   `acc` when present (a bool, "True"/"False", or a number: acc > 0.5), else
                score > 0 (score >= correct_threshold with that option)
      answer    `pred` when present (math_dapo's "[INVALID]" = none), else extracted from
                `output`: the last <answer>...</answer>, else the last \\boxed{...}, else
                the last `Answer: X` line (DAPO / R1, what math_dapo parses), else `#### N`
                (GSM8K, verl's quickstart); `answer_pattern` replaces these. A `pred` that
                differs from the row's own output's answer on over 20% of rows is warned
                about: verl-recipe's DAPO trainer dumps the extras in the pre-filter order.
      response_len  `response_length` / `response_len` when present; with
                `tokenizer=tokenizer.json`, exact token counts (and truncated = tokens >=
                max_response_len); else whitespace words of `output`, marked in run.json
                (response_len_unit "words") so they are never compared with a token cap or
                with verl's token-based response_length/*: truncation then comes from
                verl's logged response_length/clip_ratio (`metrics=` the file-logger log).
      every other key (`gts`, `reward`, any reward-extra key): an extra column, numbers as
      float64, strings as they are, nested values as JSON text; a key named like a format-v1
      column (e.g. validation's `reward`) is kept as `raw_<key>`.
    rollout_id = split namespace * 10^15 + step * 10^6 + line order within the step.

    verl-agent dumps (one row per environment step) are folded into trajectories when a
    trajectory key is present (option `trajectory_key`, else `traj_uid` or `trajectory_id`):
    one rollout per (step, trajectory) in order of first appearance; actions = the outputs in
    line order, response = the outputs joined with "\\n", reward = sum of `score`,
    response_len = sum of the rows' lengths, prompt = the first row's `input`, correct and
    answer from the last row's `acc` / `pred` (else the rules above on the summed reward and
    the last output), other keys: the last non-null value; `n_env_steps` = rows folded.

    Malformed lines (bad JSON, not an object, `input`/`output`/`score` missing, a field of the
    wrong type, no step) are skipped and counted with file:line examples; `strict=true` stops
    at the first with an error naming file and line. Files are read one at a time.
    Incremental: re-running on a grown folder imports only new step files; a step already
    imported is never re-imported (a changed file is a warning)."""
    opts = session.options
    files = _files(session.source)
    if not files:
        raise RlscopeError(
            f"{session.source}: no *.jsonl files",
            hint="pass verl's trainer.rollout_data_dir (files named <step>.jsonl)",
        )
    state = session.state()
    fields = [
        Field("input", "text", True),
        Field("output", "text", True, ASSISTANT),
        Field("score", "num", True),
        Field("step", "int"),
        Field("acc", "flag"),
        Field("pred", "id"),
        *(Field(k, "num") for k in LENGTH_KEYS),
    ]
    candidates = [opts["trajectory_key"]] if opts["trajectory_key"] else list(TRAJECTORY_KEYS)
    fields += [Field(k, "id") for k in candidates]
    fields.append(Field(UID, "id"))
    counter = _token_counter(opts["tokenizer"])
    files_read = rows_read = 0
    for done, (file_step, path) in enumerate(files, 1):
        status = session.read_status(path, done, len(files))
        if status is None:
            continue
        chunks = list(read_jsonl(path, fields, session.skips, session.warnings))
        frame = pl.concat(chunks, how="diagonal_relaxed") if chunks else pl.DataFrame()
        files_read, rows_read = files_read + 1, rows_read + frame.height
        n_steps = 0
        if frame.height:
            frame = _with_step(frame, file_step, path, session)
            n_steps = frame["step"].n_unique()
            frame = keep_new_steps(frame, path, session, status)
        if frame.height:
            key = state.get("trajectory_key")
            if key is None:
                key = next((k for k in candidates if frame[k].null_count() < frame.height), "")
                state["trajectory_key"] = key
                if key:
                    session.notes.append(f"verl-agent rows folded into trajectories by `{key}`")
            session.add_rollouts(_rollouts(frame, key or None, candidates, session, counter))
        session.file_done(path, n_steps)
        session.checkpoint()
        session.tick(done, len(files))
    if files_read and not rows_read:
        raise RlscopeError(
            f"{session.source}: no rollout could be read from {files_read:,} file(s)",
            hint="every line was malformed (see the skipped-line examples above); "
            "check that these are verl rollout dumps",
        )
    _finish_rollouts(session, counter is not None)
    if opts["metrics"]:
        _import_metrics_files(Path(opts["metrics"]), session)


def _with_step(
    frame: pl.DataFrame, file_step: int | None, path: Path, session: Session
) -> pl.DataFrame:
    if file_step is not None:
        return frame.with_columns(pl.col("step").fill_null(file_step))
    missing = frame.filter(pl.col("step").is_null())
    for line in missing[LINE].to_list():
        session.skips.add(path, line, "missing `step`", "and the file name is not <step>.jsonl")
    return frame.filter(pl.col("step").is_not_null())


def _rollouts(
    frame: pl.DataFrame,
    key: str | None,
    candidates: list[str],
    session: Session,
    counter: Callable[[list[str]], list[int]] | None = None,
) -> pl.DataFrame:
    opts = session.options
    state = session.state()
    threshold = opts["correct_threshold"]
    has_length = any(frame[k].null_count() < frame.height for k in LENGTH_KEYS)
    length = pl.coalesce(*(pl.col(k) for k in LENGTH_KEYS)).round().cast(pl.Int32)
    if counter is not None:
        tokens = pl.Series("_tokens", counter(frame["output"].fill_null("").to_list()), pl.Int32)
        frame = frame.with_columns(pl.coalesce(length, tokens).alias("_len"))
    else:
        frame = frame.with_columns(
            pl.coalesce(length, word_count_expr(pl.col("output"))).alias("_len")
        )
        if not has_length or frame["_len"].null_count():
            state["words"] = True
    if counter is not None:
        session.notes.append("response_len = tokens of `output` (the tokenizer option)")
    else:
        session.notes.append(
            "response_len from `response_length`/`response_len`"
            + (", words where a row has neither" if frame["_len"].null_count() else "")
            if has_length
            else WORDS_NOTE
        )
    answer = answer_expr(pl.col("output"), opts["answer_pattern"])
    # verl's math_dapo writes pred "[INVALID]" when it found no answer: no answer.
    pred = pl.when(pl.col("pred").is_in(NO_ANSWER)).then(None).otherwise(pl.col("pred"))
    frame = frame.with_columns(pred.alias("pred"), answer.alias("_own_answer"))
    _check_pred(frame, session)
    if frame["acc"].null_count() < frame.height:
        session.notes.append("correct from `acc` (bool, or acc > 0.5)")
    if frame["acc"].null_count():
        session.notes.append(f"correct = {correct_rule(threshold, 'score')} (no `acc`)")
    if frame["pred"].null_count() < frame.height:
        session.notes.append("answer from `pred`")
    if frame["pred"].null_count():
        session.notes.append(
            "answer extracted from `output` (<answer>, else \\boxed{}, else `Answer: X` / `#### N`)"
        )
    skip = (*_CONSUMED, LINE, "_len", "_own_answer", UID, *candidates)
    extras = [c for c in frame.columns if c not in skip]
    frame, extras = rename_reserved(frame, extras, session, "verl")
    numeric = [c for c in extras if frame.schema[c].is_numeric() and c not in ("gts", "reward")]
    state["reward_components"] = list(
        dict.fromkeys([*state.get("reward_components", []), *numeric])
    )
    if key is None:
        frame = index_within_step(frame)
        uid = frame[UID] if frame[UID].null_count() < frame.height else None
        if uid is not None:  # verl >= 0.9: `{uid}_{session}_{i}`; the group is `{uid}`
            state["groups"] = "uid"
            group = uid.fill_null("").str.replace(r"_[^_]*_[^_]*$", "")
            ids = prompt_ids(group).alias("prompt_id")
        else:
            ids = prompt_ids(frame["input"])
        out = frame.select(
            "step",
            ids,
            pl.col("input").alias("prompt"),
            pl.col("score").alias("reward"),
            pl.coalesce("acc", correct_from_reward(pl.col("score"), threshold)).alias("correct"),
            pl.col("_len").alias("response_len"),
            pl.coalesce("pred", "_own_answer").alias("answer"),
            pl.col("output").alias("response"),
            "_index",
            *extras,
        )
        _count_merged_groups(out, session)
    else:
        out = _fold(frame, key, extras, threshold)
    out = out.with_columns(pl.lit(opts["split"]).alias("split"))
    if counter is not None and opts["max_response_len"] is not None:
        out = out.with_columns(
            (pl.col("response_len") >= opts["max_response_len"]).alias("truncated")
        )
    return out.with_columns(session.rollout_ids(out, "_index")).drop("_index")


def _token_counter(path: str | None) -> Callable[[list[str]], list[int]] | None:
    """Exact token counts from the model's `tokenizer.json` (the optional `tokenizers`
    library; no network), or None without the option."""
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise RlscopeError(
            "the tokenizer option needs the `tokenizers` library",
            hint='pip install tokenizers pyyaml  (from a clone of rlscope: pip install ".[verl]")',
        ) from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise RlscopeError(f"{path}: not a tokenizer.json ({exc})") from None

    def count(texts: list[str]) -> list[int]:
        return [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

    return count


def _check_pred(frame: pl.DataFrame, session: Session) -> None:
    """verl-recipe's DAPO trainer dumps score/acc/pred in the pre-filter order, so rows carry
    another row's reward: seen as a dumped `pred` that differs from the answer in the row's own
    output. Counted across files; the warning comes at the end (`_finish_rollouts`)."""
    both = frame.filter(pl.col("pred").is_not_null() & pl.col("_own_answer").is_not_null())
    state = session.state()
    state["pred_rows"] = state.get("pred_rows", 0) + both.height
    differ = both.filter(pl.col("pred").str.strip_chars() != pl.col("_own_answer")).height
    state["pred_differ"] = state.get("pred_differ", 0) + differ


def _count_merged_groups(out: pl.DataFrame, session: Session) -> None:
    """Without a group uid, a prompt drawn twice in one step (balance_batch scatters rows, so
    line order cannot split them) merges into one group of k·n: counted for a warning."""
    state = session.state()
    if state.get("groups") == "uid":
        return
    sizes = out.group_by("step", "prompt_id").len()["len"]
    n = session.options["n"] or (int(sizes.mode().sort()[-1]) if sizes.len() else None)
    if n and n > 1:
        state["n"] = n
        merged = int(((sizes >= 2 * n) & (sizes % n == 0)).sum())
        state["merged_groups"] = state.get("merged_groups", 0) + merged
        state["groups_seen"] = state.get("groups_seen", 0) + sizes.len()


def _finish_rollouts(session: Session, tokens: bool) -> None:
    """run.json fields and the warnings that need every file: words or tokens, groups,
    reward extras out of line with the outputs."""
    state, meta, opts = session.state(), session.meta, session.options
    provenance = dict(meta.get("provenance") or {})
    if state.get("words") and not tokens:
        meta["response_len_unit"] = "words"
        provenance["response_len"] = (
            "whitespace words of `output` (verl's dump has no token count; "
            "`-X tokenizer=tokenizer.json` counts tokens): never compared with max_response_length "
            "or verl's token-based response_length/*"
        )
    elif tokens:
        meta["response_len_unit"] = "tokens"
        provenance["response_len"] = "tokens of `output` by the model's tokenizer.json"
    if state.get("groups") == "uid":
        provenance["groups"] = "verl's group uid (`{uid}_{session}_{i}`, verl >= 0.9)"
    else:
        provenance["groups"] = (
            "identical `input` within a step (verl < 0.9 dumps no group uid; balance_batch "
            "reorders rows, so line order cannot split a prompt drawn twice)"
        )
        merged, seen = state.get("merged_groups", 0), state.get("groups_seen", 0)
        if merged:
            session.warnings.append(
                f"{merged:,} of {seen:,} groups hold a multiple (>= 2x) of n = {state['n']} "
                "rollouts: the same prompt drawn more than once in a step, merged into one group "
                "(their σ_G and pass@k are over the merged group: pass@k with k = n is then "
                "optimistic and σ_G pools two draws; verl >= 0.9 dumps a uid that separates them)"
            )
    if state.get("n"):
        meta.setdefault("group_size", state["n"])
    rows, differ = state.get("pred_rows", 0), state.get("pred_differ", 0)
    if rows and differ / rows > PRED_MISMATCH_SHARE:
        session.warnings.append(
            f"`pred` differs from the answer in the row's own `output` on {differ / rows:.0%} of "
            f"{rows:,} rows: the reward extras (score, acc, pred) are out of line with the "
            "outputs (verl-recipe's DAPO trainer dumps them in the pre-filter order), so "
            "rewards and correctness belong to other rows"
        )
    if state.get("reward_components"):
        meta["reward_components"] = state["reward_components"]
    if opts["max_response_len"] is not None and not tokens:
        provenance["truncation"] = (
            "not derived: max_response_len counts tokens and response_len counts words here; "
            "verl's logged response_length/clip_ratio (`-X metrics=`) is used instead"
        )
    if provenance:
        meta["provenance"] = provenance


def _fold(
    frame: pl.DataFrame, key: str, extras: list[str], threshold: float | None
) -> pl.DataFrame:
    frame = frame.sort(LINE).with_columns(
        pl.coalesce(pl.col(key), pl.lit("_line") + pl.col(LINE).cast(pl.String)).alias("_traj")
    )
    folded = frame.group_by("step", "_traj", maintain_order=True).agg(
        pl.col("input").first().alias("prompt"),
        pl.col("output").alias("actions"),
        pl.col("output").str.join("\n").alias("response"),
        pl.col("output").last().alias("_last_output"),
        pl.col("score").sum().alias("reward"),
        pl.col("_len").sum().cast(pl.Int32).alias("response_len"),
        pl.col("acc").drop_nulls().last().alias("_acc"),
        pl.col("pred").drop_nulls().last().alias("_pred"),
        pl.col(LINE).first().alias(LINE),
        pl.len().cast(pl.Int32).alias("n_env_steps"),
        pl.col(key).first().alias(key),
        *(pl.col(c).drop_nulls().last().alias(c) for c in extras),
    )
    folded = index_within_step(folded)
    return folded.select(
        "step",
        prompt_ids(folded["prompt"]),
        "prompt",
        "reward",
        pl.coalesce("_acc", correct_from_reward(pl.col("reward"), threshold)).alias("correct"),
        "response_len",
        pl.coalesce("_pred", answer_expr(pl.col("_last_output"))).alias("answer"),
        "response",
        "actions",
        "n_env_steps",
        key,
        "_index",
        *extras,
    )


# --- verl-metrics -------------------------------------------------------------------------

METRIC_NAMES = {
    "actor/grad_norm": "grad_norm",
    "actor/pg_clipfrac": "clip_frac",
    "actor/pg_loss": "loss",
    "actor/lr": "lr",
}


def import_verl_metrics(session: Session) -> None:
    """verl's file logger (`trainer.logger=[file]`): JSON lines `{"step": N, "data": {...}}`,
    one file (or a folder of *.jsonl) -> the steps table only.

    Mapping: actor/grad_norm -> grad_norm, actor/pg_clipfrac -> clip_frac, actor/pg_loss ->
    loss, actor/lr -> lr (verl/workers/actor/dp_actor.py `update_policy`, mean over
    micro-batches). A null grad_norm or pg_loss (the orjson writer's NaN) is kept as NaN: the
    divergence finding reads it.
      kl        `actor/kl_loss` only where verl computed a KL loss: use_kl_loss (option, else
                the run's .hydra/config.yaml, else "some step is non-zero"); a series that
                is 0.0 at every step (KL loss off, the default since 0.7) is "not logged",
                kept as the extra column actor/kl_loss. Its estimator is kl_loss_type
                (core_algos.py `kl_penalty`: k1, k2, k3 = low_var_kl, clamped to [-10, 10]).
                Scale by release: 0.5 the per-token KL averaged over micro-batches; 0.6
                divided by the gradient-accumulation steps; 0.7 multiplied by mini-batches x
                epochs (verl PR #5766): `verl_version` says which, `kl_loss_scale` undoes it.
                Without a KL loss, `actor/reward_kl_penalty` (k1, KL applied in the reward).
      entropy   `actor/entropy` only with loss_agg_mode token-mean (core_algos.py
                `agg_loss`); seq-mean-token-sum makes it a per-sequence sum (~70 where the
                token mean is 1.4): kept as the extra column actor/entropy.
      eval      `val-core/<data source>/acc/mean@N` (ray_trainer.py `_val_metrics_update`:
                the accuracy of one validation data source, when the reward function
                returns `acc`) -> `eval_id_accuracy` / `eval_ood_accuracy` (`ood_sets`, else
                a source named with the word `ood` is OOD; several sources of a split are
                averaged), read by rlscope's L5 metrics when there are no eval rollouts.
                verl logs no validation set size, so their sampling error is unknown.
    run.json `max_grad_norm` = the Hydra config's `actor_rollout_ref.actor.grad_clip` (the
    logged actor/grad_norm is the norm before that clip: dp_actor.py `_optimizer_step`).
      mismatch  the training–inference mismatch verl computes from rollout_log_probs is kept
                under its own names and read by rlscope's stability.mismatch_* metrics when
                there are no tokens: `rollout_corr/k3_kl`, `rollout_corr/kl` (token-means,
                trainer/ppo/rollout_corr_helper.py `compute_offpolicy_metrics`, 0.6.1 on,
                with algorithm.rollout_correction) and `training/rollout_probs_diff_mean`
                (mean |p_actor - p_rollout|, utils/debug/metrics.py `calculate_debug_metrics`,
                0.4 on).
      critic    PPO with a critic (algorithm.adv_estimator=gae): `critic/vf_explained_var`
                (metric_utils.py `compute_data_metrics`), `critic/vf_loss`,
                `critic/vf_clipfrac` (workers/critic/dp_critic.py `update_critic`) and the KL
                controller's `actor/reward_kl_penalty_coeff` (ray_trainer.py
                `apply_kl_penalty`) are kept under their own names and read by rlscope's
                stability.explained_variance, value_loss, value_clip_frac and kl_coef.
    Every other numeric key is an extra column under its own name (`actor/ppo_kl`,
    `critic/score/mean`, `response_length/mean`, `response_length/clip_ratio`, ...:
    metric_utils.py `compute_data_metrics`, token-based); rlscope reads the logged reward,
    length and truncation from them when it has no rollouts, and compares the ones it
    recomputes (never word counts with token figures). DAPO's `train/num_gen_batches` means
    group filtering was on: the provenance says the dump holds only surviving groups.
    Non-numeric values (strings, lists, booleans) are dropped and counted in the notes.
    Several lines of one step (a resumed run) merge, later keys winning.

    Combine it with the `verl` importer into one OUT: run.json is kept (the later import only
    adds fields it lacks, e.g. group_size) and import.json keeps one entry per format.
    Malformed lines (bad JSON, no integer `step`, `data` not an object) are skipped and
    counted; `strict=true` stops at the first. A log that grew is read again and only steps
    after the last imported one are added."""
    _import_metrics_files(session.source, session)


def _import_metrics_files(source: Path, session: Session) -> None:
    files = _files(source)
    if not files:
        raise RlscopeError(f"{source}: no *.jsonl metrics file")
    settings = _settings(source, session)
    clip = settings["grad_clip"]
    if isinstance(clip, int | float) and not isinstance(clip, bool) and clip > 0:
        session.meta.setdefault("max_grad_norm", float(clip))
    evals = EvalPoints(session.options["ood_sets"])
    for done, (_, path) in enumerate(files, 1):
        status = session.read_status(path, done, len(files))
        if status is None:
            continue
        rows = StepRows(METRIC_NAMES)
        steps: set[int] = set()
        for step, data in _metric_records(path, session):
            steps.add(step)
            if session.already("steps", step, this_call=False):
                session.skip_step("steps", step)
                continue
            rows.add(
                step,
                {k: math.nan if v is None and k in NAN_WHEN_NULL else v for k, v in data.items()},
            )
            _validation_accuracies(step, data, evals)
        rows.note(session, str(path))
        for step, columns in evals.columns().items():
            rows.add(step, columns)
        evals.points.clear()
        session.add_steps(_interpreted(rows.sorted_rows(), settings, session))
        session.file_done(path, len(steps))
        session.checkpoint()
        session.tick(done, len(files))
    session.notes += evals.note("validation data sources")


#: Logged as null by verl's orjson writer when the value was NaN: a divergence, kept as NaN.
NAN_WHEN_NULL = ("actor/grad_norm", "actor/pg_loss")
KL_LOSS, REWARD_KL = "actor/kl_loss", "actor/reward_kl_penalty"
CRITIC_LOSS = "critic/vf_loss"
ENTROPY = "actor/entropy"
#: Keys verl-recipe's DAPO trainer logs when dynamic sampling (group filtering) is on.
FILTER_KEYS = ("train/num_gen_batches", "batch/solve_none", "batch/solve_all")


def _settings(source: Path, session: Session) -> dict[str, Any]:
    """What the importer needs of the run's config: the options, else the run's saved Hydra
    config (`.hydra/config.yaml` beside the source or up to three folders above; needs PyYAML),
    else verl's defaults."""
    opts = session.options
    config: dict[str, Any] = {}
    for folder in [source if source.is_dir() else source.parent, *source.resolve().parents[:3]]:
        found = folder / ".hydra" / "config.yaml"
        if found.is_file():
            config = _hydra(found, session)
            break
    actor = config.get("actor_rollout_ref", {}).get("actor", {}) if config else {}
    rollout = config.get("actor_rollout_ref", {}).get("rollout", {}) if config else {}

    def pick(option: str, configured: Any) -> Any:
        return opts[option] if opts.get(option) is not None else configured

    return {
        "version": opts["verl_version"],
        "use_kl_loss": pick("use_kl_loss", actor.get("use_kl_loss")),
        "kl_loss_type": pick("kl_loss_type", actor.get("kl_loss_type")) or "low_var_kl",
        "loss_agg_mode": pick("loss_agg_mode", actor.get("loss_agg_mode")) or "token-mean",
        "kl_loss_scale": opts["kl_loss_scale"],
        "n": rollout.get("n"),
        # dp_actor.py `_optimizer_step`: actor/grad_norm is clip_grad_norm_'s norm before this clip.
        "grad_clip": actor.get("grad_clip"),
        "max_response_length": config.get("data", {}).get("max_response_length")
        if config
        else None,
    }


def _hydra(path: Path, session: Session) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:
        session.notes.append(f"{path}: found but not read (needs PyYAML); pass -o options")
        return {}
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        session.warnings.append(f"{path}: not readable YAML ({exc}); ignored")
        return {}
    session.notes.append(f"verl config read from {path}")
    return loaded if isinstance(loaded, dict) else {}


def _interpreted(
    rows: list[dict[str, Any]], settings: dict[str, Any], session: Session
) -> list[dict[str, Any]]:
    """`kl` and `entropy` only where verl's numbers mean that (see import_verl_metrics)."""
    provenance = dict(session.meta.get("provenance") or {})
    version = settings["version"] or "unknown"
    if session.algorithm is None and any(CRITIC_LOSS in r for r in rows):
        session.algorithm = "PPO"
        provenance["algorithm"] = (
            "PPO with a learned critic: critic/vf_loss is logged (algorithm.adv_estimator=gae)"
        )
    kl_values = [r[KL_LOSS] for r in rows if KL_LOSS in r]
    measured = [v for v in kl_values if math.isfinite(v) and v != 0]
    use = settings["use_kl_loss"]
    kl_on = bool(measured) if use is None else bool(use) and bool(measured)
    scale = settings["kl_loss_scale"] or 1.0
    if kl_on:
        for row in rows:
            if KL_LOSS in row:
                row["kl"] = row.pop(KL_LOSS) * scale
        estimator = settings["kl_loss_type"]
        how = {
            "0.6": "divided by the gradient-accumulation steps in 0.6 (pass -X kl_loss_scale=N "
            "to undo)",
            "0.7": "multiplied by mini-batches x epochs in 0.7 (verl PR #5766; pass "
            "-X kl_loss_scale=1/N to undo)",
        }.get(version, "the per-token KL, mean over micro-batches")
        provenance["kl"] = (
            f"actor/kl_loss ({estimator}), verl {version}: {how}"
            + (f"; x{scale:g}" if scale != 1.0 else "")
            + " (verl/workers/actor/dp_actor.py update_policy)"
        )
    elif any(REWARD_KL in r for r in rows):
        for row in rows:
            if REWARD_KL in row:
                row["kl"] = row.pop(REWARD_KL)
        provenance["kl"] = "actor/reward_kl_penalty: k1 KL applied through the reward"
    elif kl_values:
        provenance["kl"] = (
            "not logged: actor/kl_loss is 0.0 at every step (KL loss off, verl's default since "
            "0.7); kept as the extra column actor/kl_loss, never read as the KL"
        )
    mode = settings["loss_agg_mode"]
    if mode == "token-mean":
        for row in rows:
            if ENTROPY in row:
                row["entropy"] = row.pop(ENTROPY)
        if any("entropy" in r for r in rows):
            provenance["entropy"] = "actor/entropy, token-mean (nats per token)"
    elif any(ENTROPY in r for r in rows):
        provenance["entropy"] = (
            f"actor/entropy is agg_loss(entropy, mask, '{mode}') (core_algos.py agg_loss): not "
            "nats per token, kept as the extra column actor/entropy"
        )
    filtering = sorted({k for r in rows for k in r if k.startswith(FILTER_KEYS)})
    if filtering:
        provenance["filtering"] = (
            f"the log has {', '.join(filtering[:3])}: group filtering (DAPO dynamic sampling) "
            "was on, so the rollout dump holds only the groups that survived it; its zero-σ "
            "share is after filtering (near 0 by construction), not the policy's"
        )
    if provenance:
        session.meta["provenance"] = provenance
    return rows


def _metric_records(path: Path, session: Session):
    """(step, data) per valid line: Polars per chunk when every value is numeric, else
    line by line (which also finds the malformed lines)."""
    for numbers, lines, partial in chunks(path, CHUNK_LINES):
        fast = _metric_fast(lines)
        if fast is not None:
            yield from fast
            continue
        for i, (number, line) in enumerate(zip(numbers, lines, strict=True)):
            try:
                obj = json.loads(line)
            except ValueError as exc:
                if partial and i == len(lines) - 1:
                    session.warnings.append(f"{path}:{number}: incomplete last line, not read")
                    continue
                session.skips.add(path, number, "bad JSON", str(exc).split(":")[0])
                continue
            if not isinstance(obj, dict):
                session.skips.add(path, number, "not a JSON object")
                continue
            step, data = obj.get("step"), obj.get("data")
            if isinstance(step, float) and step.is_integer():
                step = int(step)
            if step is None:
                session.skips.add(path, number, "missing `step`")
            elif isinstance(step, bool) or not isinstance(step, int):
                session.skips.add(path, number, "wrong type for `step`", type(step).__name__)
            elif data is None:
                session.skips.add(path, number, "missing `data`")
            elif not isinstance(data, dict):
                session.skips.add(path, number, "wrong type for `data`", type(data).__name__)
            else:
                yield step, data


def _metric_fast(lines: list[bytes]) -> list[tuple[int, dict[str, Any]]] | None:
    try:
        raw = pl.read_ndjson(io.BytesIO(b"\n".join(lines)), infer_schema_length=None)
    except Exception:
        return None
    if raw.height != len(lines) or "step" not in raw.columns or "data" not in raw.columns:
        return None
    if not raw.schema["step"].is_integer() or not isinstance(raw.schema["data"], pl.Struct):
        return None
    if raw["step"].null_count() or raw["data"].null_count():
        return None
    data = raw["data"].struct.unnest()
    if not all(d.is_numeric() or isinstance(d, pl.Null) for d in data.schema.values()):
        return None
    records = []
    for step, row in zip(raw["step"].to_list(), data.iter_rows(named=True), strict=True):
        records.append(
            (step, {k: v for k, v in row.items() if v is not None or k in NAN_WHEN_NULL})
        )
    return records


#: verl's validation accuracy of one data source (ray_trainer.py `_val_metrics_update`: the
#: core variable is `acc` when the reward function returns it, the mean over the source's
#: samples at the largest n; `val-core/<source>/reward/...` when it does not, not an accuracy).
VAL_ACCURACY = re.compile(r"^val-core/(.+)/acc/mean@(\d+)$")


def _validation_accuracies(step: int, data: Mapping[str, Any], evals: EvalPoints) -> None:
    """The step's `val-core/<data source>/acc/mean@N` keys as eval points of that source (verl
    logs no validation set size: their sampling error is unknown)."""
    for key, value in data.items():
        match = VAL_ACCURACY.match(key)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if match and number and math.isfinite(value):
            evals.add(step, match.group(1), float(value), None)


METRIC_OPTIONS: tuple[Option, ...] = (
    Option(
        "verl_version",
        "str",
        None,
        "verl release that wrote the log (0.5, 0.6, 0.7, 0.9, main): how actor/kl_loss is scaled",
    ),
    Option(
        "use_kl_loss",
        "bool",
        None,
        "actor.use_kl_loss (default: the Hydra config, else "
        "on when actor/kl_loss is non-zero at some step)",
    ),
    Option("kl_loss_type", "str", None, "actor.kl_loss_type: k1, k2, k3/low_var_kl"),
    Option(
        "loss_agg_mode",
        "str",
        None,
        "actor.loss_agg_mode (default token-mean): "
        "actor/entropy is nats per token only with token-mean",
    ),
    Option(
        "kl_loss_scale",
        "float",
        None,
        "multiply actor/kl_loss by this to get the "
        "per-token KL (e.g. the gradient-accumulation steps for verl 0.6)",
    ),
)

VERL = Importer(
    name="verl",
    summary="verl rollout dumps: <step>.jsonl files (trainer.rollout_data_dir), verl-agent too",
    options=(
        SPLIT_OPTION,
        Option(
            "trajectory_key",
            "str",
            None,
            "key of verl-agent rows naming their trajectory (default: traj_uid or "
            "trajectory_id when present)",
        ),
        Option("n", "int", None, "rollouts per prompt (rollout.n; default: the modal group size)"),
        Option(
            "tokenizer",
            "str",
            None,
            "path to the model's tokenizer.json: exact token "
            "counts (needs the `tokenizers` library, `pip install tokenizers`; no network)",
        ),
        Option(
            "answer_pattern",
            "str",
            None,
            "regex whose group 1 is the final answer "
            "(default: <answer>, \\boxed{}, `Answer: X`, `#### N`)",
        ),
        Option(
            "metrics",
            "str",
            None,
            "verl's file-logger metrics JSONL of the same run: imported into the steps table",
        ),
        *METRIC_OPTIONS,
        OOD_SETS_OPTION,
        *ROLLOUT_OPTIONS,
        *COMMON_OPTIONS,
    ),
    tables=("rollouts",),
    default_algorithm="GRPO",
    run=import_verl,
)

VERL_METRICS = Importer(
    name="verl-metrics",
    summary="verl file-logger metrics JSONL ({step, data}) -> steps table",
    options=(*METRIC_OPTIONS, OOD_SETS_OPTION, *COMMON_OPTIONS),
    tables=("steps",),
    default_algorithm="GRPO",
    run=import_verl_metrics,
)
