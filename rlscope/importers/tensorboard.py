"""TensorBoard importer: event files (`events.out.tfevents.*`) -> the steps table."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlscope.errors import RlscopeError
from rlscope.importers._common import StepRows
from rlscope.importers.options import COMMON_OPTIONS
from rlscope.importers.session import Importer, Session

#: The optional extra that brings the event-file reader.
EXTRA = "tensorboard"
EVENT_GLOB = "*tfevents*"

#: verl: `trainer.logger=[tensorboard]` writes every metric with `add_scalar(key, value, step)`
#: under the same names as its file logger (verl/utils/tracking.py, `_TensorboardAdapter.log`).
VERL_TAGS = {
    "actor/pg_loss": "loss",
    "actor/grad_norm": "grad_norm",
    "actor/lr": "lr",
    "actor/pg_clipfrac": "clip_frac",
    "actor/entropy": "entropy",
    "actor/kl_loss": "kl",  # only when not identically 0 (the KL loss is off by default)
    "critic/score/mean": "reward",
    "response_length/mean": "response_len",
    "response_length/clip_ratio": "truncation_rate",
}
#: transformers' TensorBoardCallback (transformers/integrations/integration_utils.py,
#: `TensorBoardCallback.on_log` after `rewrite_logs`): the trainer's log keys under `train/`
#: (`eval_*` under `eval/`), at `state.global_step`; TRL's GRPOTrainer logs these keys.
TRL_TAGS = {
    "train/loss": "loss",
    "train/grad_norm": "grad_norm",
    "train/learning_rate": "lr",
    "train/reward": "reward",
    "train/kl": "kl",
    "train/entropy": "entropy",
    "train/clip_ratio/region_mean": "clip_frac",
    "train/completions/mean_length": "response_len",
    "train/completions/clipped_ratio": "truncation_rate",
}
#: OpenRLHF's PPO trainer (openrlhf/trainer/ppo_trainer.py, `save_logs_and_checkpoints`):
#: `add_scalar(f"train/{k}", v, global_step)` for its status dict.
OPENRLHF_TAGS = {
    "train/policy_loss": "loss",
    "train/actor_lr": "lr",
    "train/ppo_clip_ratio": "clip_frac",
    "train/response_length": "response_len",
    # train/kl and train/reward: the same tags as TRL's, with the same meaning.
}
TAGS: dict[str, str] = {**VERL_TAGS, **TRL_TAGS, **OPENRLHF_TAGS}
#: Tags read as the KL only when some step logged a non-zero value.
ZERO_MEANS_OFF = ("actor/kl_loss",)


def _loader() -> Any:
    try:
        from tensorboard.backend.event_processing.event_file_loader import (  # type: ignore
            EventFileLoader,
        )
    except ImportError:
        raise RlscopeError(
            "reading TensorBoard event files needs the `tensorboard` package",
            hint=f"pip install tensorboard  (from a clone of rlscope: pip install '.[{EXTRA}]')",
        ) from None
    return EventFileLoader


def event_files(source: Path) -> list[Path]:
    """The event files under `source` (or `source` itself), oldest first by name (TensorBoard
    names them `events.out.tfevents.<time>.<host>...`, so a restart sorts after)."""
    if source.is_file():
        return [source]
    found = [p for p in source.rglob(EVENT_GLOB) if p.is_file()]
    return sorted(found, key=lambda p: (p.name, p.as_posix()))


def _scalars(path: Path, loader: Any, skipped: dict[str, int]) -> Iterator[tuple[int, str, float]]:
    """(step, tag, value) of every scalar summary in one event file. Simple values (torch,
    tensorboardX) and one-element tensors (TF2, `tensorboard.summary`) are scalars; other
    summaries (histograms, images, text) are counted in `skipped`."""
    try:
        events = iter(loader(str(path)).Load())
        while True:
            try:
                event = next(events)
            except StopIteration:
                return
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                number = _number(value)
                if number is None:
                    skipped[value.tag] = skipped.get(value.tag, 0) + 1
                    continue
                yield int(event.step), value.tag, number
    except RlscopeError:
        raise
    except Exception as exc:  # a corrupt record: what was read before it is kept
        raise RlscopeError(f"{path}: not a readable TensorBoard event file ({exc})") from None


def _number(value: Any) -> float | None:
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        return float(value.simple_value)
    if kind == "tensor":
        plugin = value.metadata.plugin_data.plugin_name
        if plugin not in ("", "scalars"):
            return None
        from tensorboard.util import tensor_util  # type: ignore

        try:
            array = tensor_util.make_ndarray(value.tensor)
        except Exception:
            return None
        if array.size != 1 or array.dtype.kind not in "fiub":
            return None
        return float(array.reshape(-1)[0])
    return None


def import_tensorboard(session: Session) -> None:
    """TensorBoard event files (`events.out.tfevents.*`, in DIR or any folder below it, or one
    such file) -> the steps table only. Needs the `tensorboard` package
    (`pip install tensorboard`). Every file's scalars are read with TensorBoard's
    own `EventFileLoader` (no sampling); several values of one tag at one step (a resumed run,
    several files) keep the last one read.

    Mapping (tag -> steps column), per trainer, from the code that writes the tags:

      verl (`trainer.logger=[tensorboard]`; verl/utils/tracking.py `_TensorboardAdapter.log`,
      the same names as its file logger): actor/pg_loss -> loss, actor/grad_norm -> grad_norm,
      actor/lr -> lr, actor/pg_clipfrac -> clip_frac, actor/entropy -> entropy (as logged: with
      loss_agg_mode other than token-mean it is not a token mean), critic/score/mean -> reward,
      response_length/mean -> response_len (tokens), response_length/clip_ratio ->
      truncation_rate, actor/kl_loss -> kl only when some step logged a non-zero value (with
      the KL loss off, verl's default since 0.7, it logs 0.0 at every step: kept as the extra
      column `actor/kl_loss`, never read as the KL).

      transformers / TRL (`report_to="tensorboard"`; transformers/integrations/
      integration_utils.py `TensorBoardCallback.on_log`, which prefixes `train/`): train/loss
      -> loss, train/grad_norm -> grad_norm, train/learning_rate -> lr, train/reward -> reward,
      train/kl -> kl, train/entropy -> entropy, train/clip_ratio/region_mean -> clip_frac,
      train/completions/mean_length -> response_len, train/completions/clipped_ratio ->
      truncation_rate.

      OpenRLHF (`--use_tensorboard`; openrlhf/trainer/ppo_trainer.py, `add_scalar(f"train/{k}",
      v, global_step)`): train/policy_loss -> loss, train/actor_lr -> lr, train/ppo_clip_ratio
      -> clip_frac, train/response_length -> response_len, train/kl -> kl, train/reward ->
      reward.

    Every other scalar tag is an extra column under its own name (`eval/...`, `critic/...`,
    `actor/ppo_kl`, ...; a tag named like a format-v1 column becomes `raw_<tag>`). Histograms,
    images and text are skipped and counted in the notes. The step is the event's step
    (verl's global step, the Trainer's global_step). A source with no event file, or whose
    files hold no scalar, is an error."""
    loader = _loader()
    files = event_files(session.source)
    if not files:
        raise RlscopeError(
            f"{session.source}: no TensorBoard event file (events.out.tfevents.*)",
            hint="pass the log folder the trainer wrote (e.g. verl's tensorboard_log/..., "
            "the Trainer's logging_dir)",
        )
    per_file: list[tuple[Path, dict[int, dict[str, float]]]] = []
    skipped: dict[str, int] = {}
    any_scalar = False
    for done, path in enumerate(files, 1):
        status = session.read_status(path, done, len(files))
        if status is None:
            any_scalar = True  # imported before
            continue
        by_step: dict[int, dict[str, float]] = {}
        for step, tag, value in _scalars(path, loader, skipped):
            by_step.setdefault(step, {})[tag] = value
        any_scalar = any_scalar or bool(by_step)
        per_file.append((path, by_step))
        session.tick(done, len(files))
    if not any_scalar:
        raise RlscopeError(
            f"{session.source}: the event files hold no scalar value",
            hint="rlscope reads scalars (add_scalar / tf.summary.scalar)",
        )
    mapping = dict(TAGS)
    for tag in ZERO_MEANS_OFF:
        seen = [v for _, rows in per_file for r in rows.values() if (v := r.get(tag)) is not None]
        if seen and all(v == 0.0 for v in seen):
            del mapping[tag]
            session.notes.append(
                f"{tag} is 0 at every step: the KL loss is off (verl's default since 0.7), so "
                f"it is kept as the extra column `{tag}`, not read as the KL"
            )
    mapped = [t for t in mapping if any(t in r for _, rows in per_file for r in rows.values())]
    if mapped:
        session.notes.append(
            "tags read as steps columns: " + ", ".join(f"{t} -> {mapping[t]}" for t in mapped)
        )
    for path, by_step in per_file:
        rows = StepRows(mapping)
        for step in sorted(by_step):
            if session.already("steps", step, this_call=False):
                session.skip_step("steps", step)
                continue
            rows.add(step, by_step[step])
        session.add_steps(_finite_or_nan(rows.sorted_rows()))
        session.file_done(path, len(by_step))
        session.checkpoint()
    if skipped:
        tags = ", ".join(f"`{t}`" for t in sorted(skipped)[:5])
        session.notes.append(
            f"{sum(skipped.values()):,} non-scalar summaries skipped (tags {tags}"
            f"{' ...' if len(skipped) > 5 else ''})"
        )


def _finite_or_nan(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """NaN/inf stay NaN (a non-finite loss or grad norm is a divergence, not a missing value)."""
    return [
        {k: (v if not isinstance(v, float) or math.isfinite(v) else math.nan) for k, v in r.items()}
        for r in rows
    ]


TENSORBOARD = Importer(
    name="tensorboard",
    summary="TensorBoard event files (verl, transformers/TRL, OpenRLHF tags) -> steps table",
    options=COMMON_OPTIONS,
    tables=("steps",),
    default_algorithm="GRPO",
    run=import_tensorboard,
)
