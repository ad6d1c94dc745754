"""Trainer names -> steps columns and run.json: one mapping for TensorBoard, W&B and MLflow."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from rlscope.binary import BINARY_RATIO, bernoulli_ratio, outside_unit_range
from rlscope.importers._common import RESERVED_STEPS, accuracy_like
from rlscope.importers.session import Session

#: verl: `Tracking.log(data, step=global_steps)` sends one dict to every logger under the same
#: names (verl/utils/tracking.py: `_TensorboardAdapter.log` add_scalar, `wandb.log`, and
#: `_MlflowLoggingAdapter.log` with its key sanitising, undone by the MLflow importer).
VERL_TAGS = {
    "actor/pg_loss": "loss",
    "actor/grad_norm": "grad_norm",
    "actor/lr": "lr",
    "actor/pg_clipfrac": "clip_frac",
    "actor/entropy": "entropy",
    "actor/kl_loss": "kl",  # only when not identically 0 (the KL loss is off by default)
    # use_kl_in_reward: the k1 KL applied through the reward (ray_trainer.py apply_kl_penalty),
    # read as the KL when actor/kl_loss is absent or 0 at every step
    "actor/reward_kl_penalty": "kl",
    "critic/score/mean": "reward",
    "response_length/mean": "response_len",
    "response_length/clip_ratio": "truncation_rate",
}
#: transformers' Trainer log keys (`log_history`, and what its MLflowCallback logs as they are,
#: transformers/integrations/integration_utils.py `MLflowCallback.on_log`); TRL's GRPOTrainer
#: logs these.
TRL_NAMES = {
    "loss": "loss",
    "grad_norm": "grad_norm",
    "learning_rate": "lr",
    "reward": "reward",
    "kl": "kl",
    "entropy": "entropy",
    "clip_ratio/region_mean": "clip_frac",
    "completions/mean_length": "response_len",
    "completions/clipped_ratio": "truncation_rate",
    # vLLM with importance-sampling correction (grpo_trainer.py, TRL 0.23 on): under its own
    # name, which stability.mismatch_abs_logp reads
    "sampling/sampling_logp_difference/mean": "sampling/sampling_logp_difference/mean",
}
#: The same under `train/` (`eval_*` under `eval/`): `rewrite_logs` in integration_utils.py,
#: used by its TensorBoardCallback and WandbCallback.
TRL_TAGS = {f"train/{k}": v for k, v in TRL_NAMES.items()}
#: OpenRLHF (openrlhf/utils/logging_utils.py since v0.9.1, `WandbLogger.log_train` and
#: `TensorboardLogger.log_train`: `train/<key>` for the status dict of ppo_trainer.py
#: `train_step`; before, the same keys from ppo_trainer.py `save_logs_and_checkpoints`).
OPENRLHF_TAGS = {
    "train/policy_loss": "loss",
    "train/actor_lr": "lr",
    "train/actor_grad_norm": "grad_norm",  # v0.9.6 on (ray/ppo_actor.py training_step)
    "train/ppo_clip_ratio": "clip_frac",
    # token-mean old_log_probs - log_probs (models/loss.py PolicyLoss.forward): what
    # stability.ppo_kl reads as `ppo_kl`
    "train/ppo_kl": "ppo_kl",
    # token-mean entropy, logged when actor.entropy_coef is set (ray/ppo_actor.py)
    "train/entropy_loss": "entropy",
    "train/response_length": "response_len",
    # v0.9.8 on: the rollout batch before dynamic batching (ppo_trainer.py
    # _compute_rollout_stats); else the per-sample `truncated` flag's mean (v0.9.9 on)
    "train/rollout/truncated_rate": "truncation_rate",
    "train/truncated": "truncation_rate",
    # the critic (ray/ppo_critic.py training_step), under the names stability.value_loss,
    # critic_grad_norm and critic_lr read
    "train/critic_loss": "critic_loss",
    "train/critic_grad_norm": "critic_grad_norm",
    "train/critic_lr": "critic_lr",
    # train/kl and train/reward: the same tags as TRL's, with the same meaning.
}
TAGS: dict[str, str] = {**VERL_TAGS, **TRL_TAGS, **OPENRLHF_TAGS}
#: Keys read as the KL only when some step logged a non-zero value, and why a series of zeros
#: is not a KL of 0.
ZERO_MEANS_OFF = {
    "actor/kl_loss": "the KL loss is off (verl's default since 0.7)",
    "train/kl": "OpenRLHF logs 0 when it has no reference model (init_kl_coef 0)",
}
#: Keys naming one column: the first present (and not all-zero above) is read, the others stay
#: extra columns under their own names.
PREFERRED = (
    ("actor/kl_loss", "actor/reward_kl_penalty"),
    ("train/rollout/truncated_rate", "train/truncated"),
)


@dataclass
class Resolved:
    """The mapping for one run (source key -> steps column), with what to say about it."""

    mapping: dict[str, str]
    notes: list[str] = field(default_factory=list)
    provenance: dict[str, str] = field(default_factory=dict)


def resolve(all_zero: Mapping[str, bool], names: Mapping[str, str] = TAGS) -> Resolved:
    """The mapping for a run whose keys are `all_zero` (key -> every value logged is 0), from
    `names`: ZERO_MEANS_OFF keys that are 0 at every step are left out, then one key per
    PREFERRED group, then one key per column (the first in `names`' order)."""
    out = Resolved({})
    off = {k for k in ZERO_MEANS_OFF if all_zero.get(k)}
    dropped: set[str] = set(off)
    for group in PREFERRED:
        present = [k for k in group if k in all_zero and k in names and k not in off]
        dropped.update(present[1:])
    for key, column in names.items():
        if key in all_zero and key not in dropped and column not in out.mapping.values():
            out.mapping[key] = column
    for key in sorted(off):
        out.notes.append(
            f"{key} is 0 at every step: {ZERO_MEANS_OFF[key]}, so it is kept as the extra "
            f"column `{key}`, not read as the KL"
        )
    kl = next((k for k, c in out.mapping.items() if c == "kl"), None)
    if kl == "actor/reward_kl_penalty":
        out.provenance["kl"] = (
            "actor/reward_kl_penalty: the k1 KL applied through the reward (verl "
            "use_kl_in_reward; ray_trainer.py apply_kl_penalty)"
            + ("; actor/kl_loss is 0 at every step" if "actor/kl_loss" in off else "")
        )
    elif kl is not None:
        out.provenance["kl"] = f"{kl} as logged"
    elif off:
        out.provenance["kl"] = "not computed: " + "; ".join(
            f"{k} is 0.0 at every step ({ZERO_MEANS_OFF[k]}), kept as the extra column {k}"
            for k in sorted(off)
        )
    truncation = next((k for k, c in out.mapping.items() if c == "truncation_rate"), None)
    if truncation is not None:
        out.provenance["truncation"] = f"{truncation} as logged"
    mapped = list(out.mapping)
    if mapped:
        out.notes.append(
            "keys read as steps columns: " + ", ".join(f"{k} -> {out.mapping[k]}" for k in mapped)
        )
    return out


def all_zero_rows(rows: Iterable[Mapping[str, float]], keys: Iterable[str]) -> dict[str, bool]:
    """For each of `keys` logged in `rows`: whether every value is 0 (NaN counts as not 0)."""
    out: dict[str, bool] = {}
    wanted = set(keys)
    for row in rows:
        for key in wanted.intersection(row):
            value = row[key]
            out[key] = out.get(key, True) and value == 0.0 and not math.isnan(value)
    return out


def all_zero_frame(frame: pl.DataFrame, keys: Iterable[str]) -> dict[str, bool]:
    """The same for the columns of a frame (nulls: not logged at that step)."""
    present = [k for k in keys if k in frame.columns]
    if not present:
        return {}
    row = frame.select((pl.col(k).drop_nulls() == 0.0).all().alias(k) for k in present).row(
        0, named=True
    )
    logged = frame.select(pl.col(k).is_not_null().any().alias(k) for k in present).row(
        0, named=True
    )
    return {k: bool(row[k]) for k in present if logged[k]}


#: Per-reward-function means and standard deviations TRL logs (grpo_trainer.py
#: `_generate_and_score_completions`: `rewards/{name}/mean`, `rewards/{name}/std`, nanmean and
#: nanstd over the generation batch), under `train/` where transformers' callbacks rewrite keys.
REWARD_MEAN = re.compile(r"^((?:train/)?rewards/)([^/]+)/mean$")


def binary_accuracy(frame: pl.DataFrame, resolved: Resolved) -> None:
    """Map the accuracy reward's logged mean to `correct_rate` (pass@1 without rollouts) when
    one reward function is named like accuracy (importers._common.accuracy_like) and its logged
    mean and std are those of a 0/1 reward at every step: a steps-only run then judges the task
    outcome, not the mean reward. Said in the provenance, or why not."""
    found = {m.group(2): m for k in frame.columns if (m := REWARD_MEAN.match(k))}
    name, why = accuracy_like(found)
    if name is None or "correct_rate" in resolved.mapping.values():
        return
    mean_key = found[name].group(0)
    std_key = f"{found[name].group(1)}{name}/std"
    if std_key not in frame.columns:
        return
    both = frame.select(
        pl.col(mean_key).cast(pl.Float64).alias("p"), pl.col(std_key).cast(pl.Float64).alias("s")
    ).drop_nulls()
    p, s = pl.col("p"), pl.col("s")
    # Each step: the reward leaves [0, 1] (no 0/1 reward's mean and std: a range break, judged
    # by accuracy-out-of-range), or is inside with a 0/1 reward's spread, or with less (values
    # strictly between 0 and 1: partial credit, or a 0/s reward with s < 1).
    kinds = both.select(
        outside_unit_range(p, s).alias("breaks"),
        bernoulli_ratio(p, s).alias("ratio"),
    ).filter(~pl.col("breaks"))
    lo, hi = BINARY_RATIO
    ratios = kinds["ratio"].drop_nulls()
    breaks = both.height - kinds.height
    binary = ratios.len() >= 3 and bool(ratios.is_between(lo, hi).all())
    if binary:
        resolved.mapping[mean_key] = "correct_rate"
        resolved.mapping[std_key] = "correct_rate_std"
        resolved.notes.append(f"{mean_key} -> correct_rate (a 0/1 accuracy reward's mean)")
        resolved.provenance["correct_rate"] = (
            f"{mean_key}: the mean of `{name}` ({why}), a 0/1 reward (its logged std² is "
            "p(1 − p) at every step"
            + (
                f" but {breaks} where its values left [0, 1]: those left out of pass@1 and "
                "named by accuracy-out-of-range"
                if breaks
                else ""
            )
            + "): pass@1"
        )
    else:
        resolved.provenance["correct_rate"] = (
            f"not read: `{name}` is named like accuracy but its logged mean and std are not a "
            "0/1 reward's (a scaled or partial-credit reward): the task outcome is judged on "
            "the mean reward"
        )


def binary_accuracy_key(frame: pl.DataFrame) -> str | None:
    """`rewards/<fn>/mean` of the 0/1 accuracy reward `binary_accuracy` reads in `frame`, the
    key its evaluation metrics carry after the eval prefix; None without one."""
    resolved = Resolved({})
    binary_accuracy(frame, resolved)
    key = next((k for k, v in resolved.mapping.items() if v == "correct_rate"), None)
    return key.removeprefix("train/") if key else None


def mapped_once(
    state: dict[str, Any], frame: pl.DataFrame, names: Mapping[str, str], config: Mapping[str, Any]
) -> list[str]:
    """Resolve the run's key mapping from `frame` at its first import and keep it in `state`
    (the import's record: re-imports map the same way); the notes of that resolution."""
    if "mapping" in state:
        return []
    resolved = resolve(all_zero_frame(frame, names), names)
    binary_accuracy(frame, resolved)
    entropy_by_config(resolved, config)
    state["mapping"], state["provenance"] = resolved.mapping, resolved.provenance
    return list(resolved.notes)


def step_columns(frame: pl.DataFrame, mapping: Mapping[str, str]) -> pl.DataFrame:
    """Source keys renamed to steps columns (`mapping`), other keys carrying a format-v1 name
    kept as `raw_<key>`, and non-finite values NaN (a non-finite loss or grad norm is a
    divergence, not a missing value)."""
    renames = {k: v for k, v in mapping.items() if k in frame.columns}
    renames.update(
        {
            k: f"raw_{k}"
            for k in frame.columns
            if k != "step" and k not in mapping and k in RESERVED_STEPS
        }
    )
    frame = frame.rename(renames)
    floats = [c for c, t in frame.schema.items() if c != "step" and t.is_float()]
    if not floats:
        return frame
    # only the columns holding an infinity are rewritten (a rewrite copies the column)
    found = frame.select(pl.col(c).is_infinite().any() for c in floats).row(0)
    return frame.with_columns(
        pl.when(pl.col(c).is_infinite()).then(math.nan).otherwise(pl.col(c)).alias(c)
        for c, any_inf in zip(floats, found, strict=True)
        if any_inf
    )


#: The mapping in words, for the docs of the importers that use it (`rlscope formats NAME`).
MAPPING_DOC = """\
Mapping (source key -> steps column), per trainer, from the code that writes the keys:

  verl (verl/utils/tracking.py `Tracking.log`, the same names for every logger): actor/pg_loss
  -> loss, actor/grad_norm -> grad_norm, actor/lr -> lr, actor/pg_clipfrac -> clip_frac,
  actor/entropy -> entropy (as logged: with loss_agg_mode other than token-mean it is not a
  token mean), critic/score/mean -> reward, response_length/mean -> response_len (tokens),
  response_length/clip_ratio -> truncation_rate, actor/kl_loss -> kl only when some step
  logged a non-zero value (with the KL loss off, verl's default since 0.7, it logs 0.0 at
  every step: kept as the extra column `actor/kl_loss`, never read as the KL; where the run's
  config says actor.loss_agg_mode is not token-mean, actor/entropy stays an extra column too,
  W&B and MLflow only); without it
  (absent or all 0), actor/reward_kl_penalty -> kl (use_kl_in_reward: the k1 KL applied
  through the reward, ray_trainer.py `apply_kl_penalty`).

  transformers / TRL (transformers/integrations/integration_utils.py `rewrite_logs`, used by
  `TensorBoardCallback.on_log` and `WandbCallback.on_log`: the Trainer's log keys under
  `train/`, `eval_*` as `eval/*`): train/loss -> loss, train/grad_norm -> grad_norm,
  train/learning_rate -> lr, train/reward -> reward, train/kl -> kl, train/entropy -> entropy,
  train/clip_ratio/region_mean -> clip_frac, train/completions/mean_length -> response_len,
  train/completions/clipped_ratio -> truncation_rate, train/sampling/sampling_logp_difference/
  mean -> sampling/sampling_logp_difference/mean (vLLM importance sampling, TRL 0.23 on: read
  by stability.mismatch_abs_logp).

  OpenRLHF (openrlhf/utils/logging_utils.py `WandbLogger.log_train` /
  `TensorboardLogger.log_train` since v0.9.1, `train/<key>` for the status dict of
  ppo_trainer.py `train_step`; flag `--logger.tensorboard_dir` since v0.10.2, `--use_tensorboard`
  before; up to v0.9.0 ppo_trainer.py wrote TensorBoard only when W&B was off):
  train/policy_loss -> loss, train/actor_lr -> lr, train/actor_grad_norm -> grad_norm (v0.9.6
  on), train/ppo_clip_ratio -> clip_frac, train/ppo_kl -> ppo_kl (token-mean old - new
  log-prob, models/loss.py PolicyLoss.forward), train/entropy_loss -> entropy (a token mean, logged
  when actor.entropy_coef is set), train/response_length -> response_len, train/reward ->
  reward, train/kl -> kl only when some step logged a non-zero value (without a reference
  model, init_kl_coef 0, it is 0.0 at every step: "not computed", kept as the extra column
  train/kl), train/rollout/truncated_rate -> truncation_rate (v0.9.8 on, the whole rollout
  batch), else train/truncated (v0.9.9 on, the per-sample flag's mean), train/critic_loss ->
  critic_loss, train/critic_grad_norm -> critic_grad_norm, train/critic_lr -> critic_lr (the
  critic, ray/ppo_critic.py `training_step`; read by stability.value_loss, critic_grad_norm,
  critic_lr).

Every other numeric key is an extra column under its own name (`eval/...`, `critic/...`,
`actor/ppo_kl`, `train/rollout/reward_mean`, ...; a key named like a format-v1 column becomes
`raw_<key>`). run.json `provenance` says which key the KL and the truncation rate were read
from, or why the KL was not."""


#: Where the run's config says what run.json wants, per trainer (first found wins): verl's
#: Hydra config (verl/trainer/config/ppo_trainer.yaml), TRL's GRPOConfig (transformers'
#: WandbCallback.setup logs `args.to_dict()`), OpenRLHF's arguments (cli/train_ppo_ray.py,
#: `--rollout.n_samples_per_prompt` since v0.10.2, `--n_samples_per_prompt` before).
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "group_size": (
        "actor_rollout_ref.rollout.n",
        "num_generations",
        "rollout.n_samples_per_prompt",
        "n_samples_per_prompt",
    ),
    "clip_ratio_low": (
        "actor_rollout_ref.actor.clip_ratio_low",
        "actor_rollout_ref.actor.clip_ratio",
        "epsilon",
        "actor.eps_clip_low_high.0",
        "actor.eps_clip",
        "eps_clip_low_high.0",
        "eps_clip",
    ),
    "clip_ratio_high": (
        "actor_rollout_ref.actor.clip_ratio_high",
        "epsilon_high",
        "actor.eps_clip_low_high.1",
        "eps_clip_low_high.1",
    ),
    "max_response_len": (
        "data.max_response_length",
        "max_completion_length",
        "rollout.max_new_tokens",
        "generate_max_len",
    ),
    "max_grad_norm": ("actor_rollout_ref.actor.grad_clip", "max_grad_norm", "actor.max_norm"),
    "algorithm": ("algorithm.adv_estimator", "algo.advantage.estimator", "advantage_estimator"),
}
#: Advantage estimators (verl's AdvantageEstimator, OpenRLHF's choices) as run.json algorithms.
ALGORITHMS = {
    "gae": "PPO",
    "grpo": "GRPO",
    "group_norm": "GRPO",
    "dr_grpo": "Dr. GRPO",
    "rloo": "RLOO",
    "reinforce": "REINFORCE++",
    "reinforce_plus_plus": "REINFORCE++",
    "reinforce_baseline": "REINFORCE++-baseline",
    "reinforce_plus_plus_baseline": "REINFORCE++-baseline",
    "remax": "ReMax",
}
INTEGER_FIELDS = ("group_size", "max_response_len")
FLOAT_FIELDS = ("clip_ratio_low", "clip_ratio_high", "max_grad_norm")


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
    """`a.b.0` in nested dicts and lists (or a top-level key spelled `a.b`)."""
    if dotted in config:
        return config[dotted]
    node: Any = config
    for part in dotted.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def config_fields(config: Mapping[str, Any], session: Session, what: str) -> dict[str, str]:
    """run.json fields from a run's config, each from the first of its CONFIG_KEYS present
    (fields the importer already knows, e.g. group_size from the rollouts, are kept); said in
    a note, and returned as the provenance entry."""
    used = []
    for name, keys in CONFIG_KEYS.items():
        for key in keys:
            value = _lookup(config, key)
            if name == "algorithm" and isinstance(value, str) and value:
                value = ALGORITHMS.get(value, value)
            elif name in INTEGER_FIELDS:
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
                value = value if ok else None
            elif not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                value = None
            if value is None:
                continue
            if name == "algorithm":
                if session.algorithm is None:
                    session.algorithm = str(value)
                    used.append(f"{name} = {key} ({value})")
            elif name not in session.meta:
                session.meta[name] = float(value) if name in FLOAT_FIELDS else value
                used.append(f"{name} = {key} ({value})")
            break
    if not used:
        return {}
    text = f"run.json from {what}: " + ", ".join(used)
    session.notes.append(text)
    return {"config": text}


def entropy_by_config(resolved: Resolved, config: Mapping[str, Any]) -> None:
    """verl's actor/entropy is nats per token only with loss_agg_mode token-mean (core_algos.py
    `agg_loss`): with another mode in the run's config it stays the extra column."""
    mode = _lookup(config, "actor_rollout_ref.actor.loss_agg_mode")
    if resolved.mapping.get("actor/entropy") == "entropy" and mode not in (None, "token-mean"):
        del resolved.mapping["actor/entropy"]
        resolved.provenance["entropy"] = (
            f"actor/entropy is agg_loss(entropy, mask, '{mode}') (the run's config; "
            "core_algos.py agg_loss): not nats per token, kept as the extra column actor/entropy"
        )


def with_mapping(doc: str | None) -> str:
    """An importer's doc with `{MAPPING}` replaced by MAPPING_DOC."""
    import inspect

    return inspect.cleandoc(doc or "").replace("{MAPPING}", MAPPING_DOC)
