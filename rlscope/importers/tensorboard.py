"""TensorBoard importer: event files (`events.out.tfevents.*`) -> the steps table."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl

from rlscope.errors import RlscopeError
from rlscope.importers import trl as trl_importer
from rlscope.importers._common import StepRows
from rlscope.importers._tags import (
    TAGS,
    Resolved,
    all_zero_rows,
    binary_accuracy,
    config_fields,
    resolve,
    with_mapping,
)
from rlscope.importers.options import COMMON_OPTIONS, OOD_SETS_OPTION
from rlscope.importers.session import Importer, Session

#: The optional extra that brings the event-file reader.
EXTRA = "tensorboard"
EVENT_GLOB = "*tfevents*"
#: transformers' TensorBoardCallback `add_text("args", ...)`: torch's SummaryWriter stores the
#: tag as `<tag>/text_summary`, tensorboardX as it is.
ARGS_TAGS = ("args/text_summary", "args")
#: transformers' rewrite_logs puts a Trainer's `eval_` keys under `eval/`.
EVAL = "eval/"
#: Trainer.evaluate's own keys of an eval set of a dict (`metric_key_prefix=f"eval_{name}"`).
SET_KEY = re.compile(r"^eval/(.+)_(loss|runtime|samples_per_second|steps_per_second)$")
#: Tags of TRL's per-reward-function statistics (`binary_accuracy` reads them).
REWARD_KEYS = ("rewards/", "train/rewards/")


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


def _scalars(
    path: Path, loader: Any, skipped: dict[str, int], texts: dict[str, str]
) -> Iterator[tuple[int, str, float]]:
    """(step, tag, value) of every scalar summary in one event file. Simple values (torch,
    tensorboardX) and one-element tensors (TF2, `tensorboard.summary`) are scalars; text
    summaries of the Trainer's arguments (ARGS_TAGS) go to `texts` by tag (the last one read);
    other summaries (histograms, images, other text) are counted in `skipped`."""
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
                    text = _text(value) if value.tag in ARGS_TAGS else None
                    if text is not None:
                        texts[value.tag] = text
                        continue
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


def _text(value: Any) -> str | None:
    """A text summary's string (`add_text`: a string tensor of the `text` plugin)."""
    if value.WhichOneof("value") != "tensor" or value.metadata.plugin_data.plugin_name != "text":
        return None
    strings = value.tensor.string_val
    return strings[0].decode("utf-8", "replace") if len(strings) == 1 else None


def _add_to_call(calls: list[dict[str, float]], step: int, tag: str, value: float) -> None:
    """An eval/ event into the log call it came in: transformers' TensorBoardCallback.on_log
    writes a call's keys one after another, an eval set's own keys (`eval/<name>_loss`,
    `_runtime`, ...: Trainer.evaluate's) before TRL's unnamed ones. A call ends where the step
    changes, a key repeats, or another set's own keys begin."""
    current = calls[-1] if calls else None
    own = SET_KEY.match(tag)
    if current is not None and current["step"] == step and tag not in current:
        sets = {m.group(1) for k in current if isinstance(k, str) and (m := SET_KEY.match(k))}
        unnamed = any(k != "step" and not SET_KEY.match(k) for k in current)
        if own is None or (sets <= {own.group(1)} and not unnamed):
            current[tag] = value
            return
    calls.append({"step": step, tag: value})


def _eval_sets(
    calls: list[dict[str, float]],
    per_file: list[tuple[Path, dict[int, dict[str, float]]]],
    session: Session,
    resolved: Resolved,
) -> None:
    """A dict of eval sets (trl_importer.eval_set_calls on the eval/ log calls): each set's
    TRL keys renamed by the set in the steps rows, and its accuracy and size as L5 columns."""
    if not calls:
        return
    accuracy = next((k for k, v in resolved.mapping.items() if v == "correct_rate"), None)
    evals = trl_importer.EvalSets.of_config(
        accuracy.removeprefix("train/") if accuracy else None,
        session,
        {"num_generations": session.meta.get("group_size")},
    )
    frame = trl_importer.eval_set_calls(pl.DataFrame(calls), EVAL, "step", evals)
    if not evals.points.points:
        return
    session.notes += evals.notes()
    per_step: dict[int, dict[str, float]] = {}
    for row in frame.iter_rows(named=True):
        step = int(row.pop("step"))
        per_step.setdefault(step, {}).update({k: v for k, v in row.items() if v is not None})
    l5 = evals.points.columns()
    for _, by_step in per_file:
        for step, row in by_step.items():
            if step in per_step:
                for key in [k for k in row if k.startswith(EVAL)]:
                    del row[key]
                row.update(per_step[step])
            row.update(l5.get(step, {}))


def _trainer_args(texts: dict[str, str], session: Session) -> None:
    """run.json fields from transformers' Trainer arguments, which its TensorBoardCallback
    writes once as the text summary `args` (integration_utils.py `on_train_begin`:
    `add_text("args", args.to_json_string())`; TRL's GRPOConfig among them)."""
    text = next((texts[tag] for tag in ARGS_TAGS if tag in texts), None)
    try:
        config = json.loads(text) if text is not None else None
    except ValueError:
        return
    if isinstance(config, dict):
        provenance = config_fields(config, session, "the Trainer's `args` text summary")
        if provenance:
            session.meta["provenance"] = {**session.meta.get("provenance", {}), **provenance}


def import_tensorboard(session: Session) -> None:
    """TensorBoard event files (`events.out.tfevents.*`, in DIR or any folder below it, or one
    such file) -> the steps table only. Needs the `tensorboard` package
    (`pip install tensorboard`). Every file's scalars are read with TensorBoard's
    own `EventFileLoader` (no sampling); several values of one tag at one step (a resumed run,
    several files) keep the last one read.

    {MAPPING}

    run.json from the Trainer's arguments where its TensorBoardCallback wrote them (the text
    summary `args`: group size = num_generations, clip ratios = epsilon / epsilon_high,
    max_response_len = max_completion_length, max_grad_norm), as for W&B's config.
    A dict of eval sets (TRL through transformers' TensorBoardCallback: each set's call writes
    its own `eval/<name>_runtime`, ... before TRL's unnamed `eval/...` keys, key after key):
    each call's events are told apart by that order, TRL's keys renamed `eval/<name>_<key>`,
    and each set's accuracy and size go to the L5 columns as the `trl` importer reads them
    (`ood_sets`, else `ood` in a set's name).
    Histograms, images and other text are skipped and counted in the notes. The step is the
    event's step (verl's global step, the Trainer's and OpenRLHF's global_step). A source with
    no event file, or whose files hold no scalar, is an error."""
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
    texts: dict[str, str] = {}
    all_calls: list[dict[str, float]] = []
    any_scalar = False
    for done, path in enumerate(files, 1):
        status = session.read_status(path, done, len(files))
        if status is None:
            any_scalar = True  # imported before
            continue
        by_step: dict[int, dict[str, float]] = {}
        calls: list[dict[str, float]] = []  # the file's eval/ events as log calls, in order
        for step, tag, value in _scalars(path, loader, skipped, texts):
            by_step.setdefault(step, {})[tag] = value
            if tag.startswith(EVAL):
                _add_to_call(calls, step, tag, value)
        any_scalar = any_scalar or bool(by_step)
        per_file.append((path, by_step))
        all_calls += calls
        session.tick(done, len(files))
    if not any_scalar:
        raise RlscopeError(
            f"{session.source}: the event files hold no scalar value",
            hint="rlscope reads scalars (add_scalar / tf.summary.scalar)",
        )
    _trainer_args(texts, session)
    resolved = resolve(all_zero_rows((r for _, rows in per_file for r in rows.values()), TAGS))
    rewards = [
        {k: v for k, v in row.items() if k.startswith(REWARD_KEYS)}
        for _, rows in per_file
        for row in rows.values()
    ]
    binary_accuracy(pl.DataFrame(rewards), resolved)
    _eval_sets(all_calls, per_file, session, resolved)
    mapping = resolved.mapping
    session.notes += resolved.notes
    if resolved.provenance:
        session.meta["provenance"] = {**session.meta.get("provenance", {}), **resolved.provenance}
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


import_tensorboard.__doc__ = with_mapping(import_tensorboard.__doc__)


def _finite_or_nan(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """NaN/inf stay NaN (a non-finite loss or grad norm is a divergence, not a missing value)."""
    return [
        {k: (v if not isinstance(v, float) or math.isfinite(v) else math.nan) for k, v in r.items()}
        for r in rows
    ]


TENSORBOARD = Importer(
    name="tensorboard",
    summary="TensorBoard event files (verl, transformers/TRL, OpenRLHF tags) -> steps table",
    options=(OOD_SETS_OPTION, *COMMON_OPTIONS),
    tables=("steps",),
    default_algorithm="GRPO",
    run=import_tensorboard,
)
