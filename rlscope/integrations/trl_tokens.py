"""The tokens table from a TRL GRPOTrainer's own tensors: the tap RlscopeCallback installs."""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlscope.integrations.token_segments import NAMES, TokenSegmenter
from rlscope.text import TagSet

#: TRL versions whose GRPOTrainer internals the tap wraps: [low, high). Measured on 1.16.0
#: (trl/trainer/grpo_trainer.py); outside it the callback warns and writes rollouts only.
SUPPORTED_TRL = ((1, 16), (2, 0))
#: GRPOTrainer methods the tap wraps on the bound instance (never on the class).
WRAPPED = ("_generate_and_score_completions", "_compute_loss", "_get_per_token_logps_and_entropies")
#: The key the tap adds to each generation batch: every completion's index in the gathered batch
#: (a list: TRL's shuffle_sequence_dict and split_tensor_dict carry lists along with tensors).
ROW_KEY = "rlscope_row"
#: Generation batches kept waiting for their rollout ids (logging_steps > 1 never logs some).
MAX_PENDING = 8

TokenSample = str | float | bool | None


def parse_token_sample(value: TokenSample) -> float:
    """The share of rollouts whose tokens are written: `all`/True 1, `none`/False/None 0, or a
    share in (0, 1]."""
    if value is None or value is False or value == "none":
        return 0.0
    if value is True or value == "all":
        return 1.0
    if isinstance(value, int | float) and 0.0 <= float(value) <= 1.0:
        return float(value)
    raise ValueError(f"token_sample must be 'all', 'none' or a share in [0, 1], got {value!r}")


def sampled_rows(n: int, seq: int, share: float) -> set[int]:
    """The rows of generation batch `seq` (of `n` completions) whose tokens are written: every
    process computes the same set (a hash of batch and row, not a random draw)."""
    if share >= 1.0:
        return set(range(n))
    if share <= 0.0:
        return set()
    keep = set()
    for i in range(n):
        digest = hashlib.blake2b(f"{seq}:{i}".encode(), digest_size=8).digest()
        if int.from_bytes(digest) / 2**64 < share:
            keep.add(i)
    return keep


def trl_support(trainer: Any) -> str | None:
    """Why the tap cannot read this trainer's tensors (None: it can). Not a GRPOTrainer at all
    (no such methods) is "" — nothing to warn about."""
    if not all(callable(getattr(trainer, name, None)) for name in WRAPPED):
        return ""
    if not any(c.__module__.split(".")[0] == "trl" for c in type(trainer).__mro__):
        return "the trainer is not a trl GRPOTrainer"
    try:
        version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return "the trl version is unknown"
    found = re.match(r"(\d+)\.(\d+)", version)
    parsed = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
    low, high = SUPPORTED_TRL
    if not low <= parsed < high:
        supported = f"{low[0]}.{low[1]} <= trl < {high[0]}.{high[1]}"
        return f"trl {version} is outside the supported {supported}"
    args = getattr(trainer, "args", None)
    if getattr(args, "use_liger_kernel", False):
        return "use_liger_kernel=True computes the loss without per-token log-probs"
    return None


@dataclass
class RowTokens:
    """One completion's tokens: positions kept (its mask), and each per-token value."""

    positions: np.ndarray
    advantage: np.ndarray  # one value, or one per kept position
    old_logprob: np.ndarray | None = None
    ref_logprob: np.ndarray | None = None
    rollout_logprob: np.ndarray | None = None
    logprob: np.ndarray | None = None
    entropy: np.ndarray | None = None
    #: each kept position's segment: an index into token_segments.NAMES, len(NAMES) for null
    #: (tokens not aligned with the text); None: not labelled at all (no tokenizer)
    segment: np.ndarray | None = None
    step: int | None = None  # the optimizer step of its first pass through the loss


@dataclass
class GenerationBatch:
    """A generation batch as TRL gathered it: every completion's length, advantage and whether
    it hit the length cap (None: unknown), the sampled completions' tokens, and once the
    rollouts are logged their ids."""

    seq: int
    lengths: list[int]
    advantages: list[float]
    rows: dict[int, RowTokens] = field(default_factory=dict)
    rollout_ids: list[int] | None = None
    truncated: list[bool | None] = field(default_factory=list)

    def ready(self) -> bool:
        return self.rollout_ids is not None and all(
            r.logprob is not None for r in self.rows.values()
        )

    def columns(self, *, complete_only: bool = False) -> dict[str, np.ndarray]:
        """Token columns (format-v1 names), rows in batch order; `complete_only` leaves out the
        completions that had no pass through the loss."""
        if self.rollout_ids is None:
            raise ValueError("the batch's rollouts were not logged: no rollout ids")
        rows = [
            (i, r)
            for i, r in sorted(self.rows.items())
            if not complete_only or r.logprob is not None
        ]
        return token_columns(rows, self.rollout_ids)


def token_columns(
    rows: Sequence[tuple[int, RowTokens]], rollout_ids: Sequence[int]
) -> dict[str, np.ndarray]:
    """Concatenate completions' tokens into columns: `rollout_id` (`rollout_ids[i]` of batch
    row i), `step` (each row's, -1 when it had no pass), `pos`, each per-token value present
    in every row, `advantage` (a completion's one value repeated over its tokens) and, when
    some row was labelled, `segment` (null for the rows that were not)."""
    counts = [len(r.positions) for _, r in rows]

    def repeat(values: Sequence[int]) -> np.ndarray:
        return np.repeat(np.asarray(values, dtype=np.int64), counts)

    columns: dict[str, np.ndarray] = {
        "rollout_id": repeat([rollout_ids[i] for i, _ in rows]),
        "step": repeat([-1 if r.step is None else r.step for _, r in rows]),
        "pos": np.concatenate([r.positions for _, r in rows]).astype(np.int32)
        if rows
        else np.zeros(0, dtype=np.int32),
    }
    for name in ("logprob", "old_logprob", "ref_logprob", "rollout_logprob", "entropy"):
        values = [getattr(r, name) for _, r in rows]
        if rows and all(v is not None for v in values):
            columns[name] = np.concatenate(values).astype(np.float32)
    if rows:
        columns["advantage"] = np.concatenate(
            [np.broadcast_to(r.advantage, (n,)) for (_, r), n in zip(rows, counts, strict=True)]
        ).astype(np.float32)
    if any(r.segment is not None for _, r in rows):
        names = np.array([*NAMES, None], dtype=object)  # code len(NAMES): null
        codes = [
            np.full(n, len(NAMES)) if r.segment is None else r.segment
            for (_, r), n in zip(rows, counts, strict=True)
        ]
        columns["segment"] = names[np.concatenate(codes).astype(np.int64)]
    return columns


def to_ids(value: Any) -> np.ndarray:
    """Token ids (a torch tensor on any device, or array-like) as int64 numpy."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=np.int64)


def to_numpy(value: Any) -> np.ndarray:
    """A torch tensor (any dtype or device) or array-like as float32 numpy, detached."""
    if hasattr(value, "detach"):
        value = value.detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float32)


class TokenTap:
    """Wraps a GRPOTrainer's `_generate_and_score_completions`, `_compute_loss` and
    `_get_per_token_logps_and_entropies` on the instance (trl/trainer/grpo_trainer.py, TRL
    1.16) to keep each completion's per-token tensors:

    * at generation (train mode): `completion_mask` (times `tool_mask`: the model's own tokens),
      `advantages`, `old_per_token_logps`, `ref_per_token_logps`, `sampling_per_token_logps`
      when TRL computed them, gathered from every process in TRL's order (process 0's
      completions first, as `_logs` holds them);
    * at a completion's first pass through `_compute_loss`: the log-probs and entropies
      `_get_per_token_logps_and_entropies(compute_entropy=True)` returned for it (the policy
      of that optimizer step, `train_step`). Without `old_per_token_logps` TRL uses those
      log-probs, detached, as the old ones (on-policy): so does the tap.

    Also at generation, on each process for its own completions: each sampled completion's
    token `segment` (think / answer / tool_call / tool_response / text) from its
    `completion_ids`, decoded with the trainer's tokenizer (`processing_class`, as TRL decodes
    the completion text) and split with `tags` (rlscope.integrations.token_segments: tags
    belong to the segment they open or close; null where the tokens cannot be aligned with
    the text), and every completion's `truncated`: TRL's own rule for
    `completions/clipped_ratio`, its last token neither an EOS (`eos_token_ids`) nor the pad
    token (None when the trainer has no `eos_token_ids`).

    A token's `step` is that optimizer step: its rollout's step (the step that logged the batch)
    with one optimizer step per generation (TRL's default), later for the later micro-batches
    of a batch trained over steps_per_generation > 1 steps; so a step's token metrics cover
    the tokens TRL's logged `entropy`, `kl` and `clip_ratio/*` of that step averaged over.
    Later passes (num_iterations > 1) are not written. `claim` ties a batch to the rollout ids
    the callback gave the same completions; `emit` receives each batch once every sampled
    completion has had its first pass. Only the main process keeps batches; every process
    takes part in the gathers (torch.distributed collectives, as TRL's own).
    """

    def __init__(
        self,
        trainer: Any,
        share: float,
        emit: Callable[[GenerationBatch], None],
        gather: Callable[[list], list] | None = None,
        tags: TagSet | None = None,
    ) -> None:
        self.trainer = trainer
        self.share = share
        self.emit = emit
        #: labels tokens with their segment (None: the trainer has no tokenizer to decode with)
        self.segmenter: TokenSegmenter | None = None
        tokenizer = getattr(trainer, "processing_class", None)
        try:
            self.segmenter = TokenSegmenter(tokenizer, tags or TagSet())
        except TypeError:
            warnings.warn(
                "RlscopeCallback: the trainer's processing_class cannot decode token ids: "
                "tokens without a segment",
                RuntimeWarning,
                stacklevel=3,
            )
        self._warned_unaligned = False
        self.batches: list[GenerationBatch] = []
        self._gather = gather
        self._seq = 0
        self._keep: set[int] = set()
        self._capturing = False
        self._captured: tuple[Any, Any] | None = None
        self.error: str | None = None
        self._originals = {name: getattr(trainer, name) for name in WRAPPED}
        trainer._generate_and_score_completions = self._generated
        trainer._compute_loss = self._loss
        trainer._get_per_token_logps_and_entropies = self._logps

    def uninstall(self) -> None:
        for name in WRAPPED:
            self.trainer.__dict__.pop(name, None)

    # wrapped methods ---------------------------------------------------------------------------

    def _generated(self, inputs: Any) -> Any:
        output = self._originals["_generate_and_score_completions"](inputs)
        if self.error is None and self._training() and isinstance(output, dict):
            self._guard(self._record_batch, output)
        return output

    def _logps(self, *args: Any, **kwargs: Any) -> Any:
        result = self._originals["_get_per_token_logps_and_entropies"](*args, **kwargs)
        if self._capturing and kwargs.get("compute_entropy"):
            self._captured = (result[0], result[1])
        return result

    def _loss(self, model: Any, inputs: Any) -> Any:
        rows = inputs.get(ROW_KEY) if isinstance(inputs, Mapping) else None
        if rows is None or self.error is not None or not self._training():
            return self._originals["_compute_loss"](model, inputs)
        first = self._first_pass()
        self._capturing, self._captured = first, None
        try:
            loss = self._originals["_compute_loss"](model, inputs)
        finally:
            self._capturing = False
        if first:
            self._guard(self._record_pass, inputs, list(rows))
        return loss

    # internals ---------------------------------------------------------------------------------

    def _guard(self, method: Callable[..., None], *args: Any) -> None:
        try:
            method(*args)
        except Exception as exc:  # private TRL API: never stop training over it
            self.error = repr(exc)
            warnings.warn(
                f"RlscopeCallback: cannot read the trainer's per-token tensors ({exc!r}); "
                "no more token rows",
                RuntimeWarning,
                stacklevel=3,
            )

    def _training(self) -> bool:
        return bool(getattr(getattr(self.trainer, "model", None), "training", False))

    def _first_pass(self) -> bool:
        """Whether this micro-batch is its completions' first pass: TRL trains a generation
        batch over steps_per_generation micro-batches, num_iterations times (`_prepare_inputs`
        counts them in `_step`); the same on every process."""
        step = getattr(self.trainer, "_step", None)
        per_generation = getattr(getattr(self.trainer, "args", None), "steps_per_generation", 1)
        iterations = getattr(self.trainer, "num_iterations", 1) or 1
        if not isinstance(step, int) or not isinstance(per_generation, int):
            return True  # the main process keeps each completion's first values only
        return step % (per_generation * iterations) < per_generation

    def _accelerator(self) -> tuple[int, int, bool]:
        acc = getattr(self.trainer, "accelerator", None)
        index = int(getattr(acc, "process_index", 0) or 0)
        processes = int(getattr(acc, "num_processes", 1) or 1)
        return index, processes, bool(getattr(acc, "is_main_process", True))

    def _gathered(self, local: list) -> list:
        if self._gather is not None:
            return self._gather(local)
        if self._accelerator()[1] == 1:
            return local
        from accelerate.utils import gather_object  # only ever under torch.distributed

        return list(gather_object(local))

    def _record_batch(self, output: dict) -> None:
        mask = to_numpy(output["completion_mask"])
        if output.get("tool_mask") is not None:
            mask = mask * to_numpy(output["tool_mask"])
        n = mask.shape[0]
        index, processes, main = self._accelerator()
        first = index * n  # TRL's process_slice: each process holds len(prompts) completions
        self._seq += 1
        self._keep = sampled_rows(n * processes, self._seq, self.share)
        advantages = to_numpy(output["advantages"])
        per_token = {
            name: to_numpy(output[key]) if output.get(key) is not None else None
            for name, key in (
                ("old_logprob", "old_per_token_logps"),
                ("ref_logprob", "ref_per_token_logps"),
                ("rollout_logprob", "sampling_per_token_logps"),
            )
        }
        ids = to_ids(output["completion_ids"])
        sizes = (to_numpy(output["completion_mask"]) > 0).sum(axis=1)  # unpadded lengths
        truncated = self._truncated(ids, sizes)
        kept = [i for i in range(n) if first + i in self._keep]
        segments = self._segments(kept, [ids[i, : sizes[i]] for i in kept])
        local = []
        for i in range(n):
            positions = np.flatnonzero(mask[i] > 0).astype(np.int32)
            advantage = advantages[i] if advantages.ndim == 1 else advantages[i, positions]
            row: dict[str, Any] = {
                "index": first + i,
                "length": len(positions),
                "advantage": float(np.mean(advantage)) if advantage.size else 0.0,
                "truncated": truncated[i],
            }
            if first + i in self._keep:
                codes = segments.get(i)
                row["tokens"] = RowTokens(
                    positions=positions,
                    advantage=np.asarray(advantage, dtype=np.float32),
                    segment=None if codes is None else codes[positions],
                    **{k: v[i, positions] for k, v in per_token.items() if v is not None},
                )
            local.append(row)
        output[ROW_KEY] = [first + i for i in range(n)]
        gathered = sorted(self._gathered(local), key=lambda r: r["index"])
        if not main:
            return
        batch = GenerationBatch(
            self._seq,
            lengths=[r["length"] for r in gathered],
            advantages=[r["advantage"] for r in gathered],
            rows={r["index"]: r["tokens"] for r in gathered if "tokens" in r},
            truncated=[r["truncated"] for r in gathered],
        )
        self.batches.append(batch)
        unclaimed = [b for b in self.batches if b.rollout_ids is None]
        if len(unclaimed) > MAX_PENDING:
            self.batches.remove(unclaimed[0])

    def _truncated(self, ids: np.ndarray, sizes: np.ndarray) -> list[bool | None]:
        """Per completion, TRL's `is_truncated` (grpo_trainer.py, `completions/clipped_ratio`):
        its last token is neither an EOS nor the pad token. A completion whose mask is all 0
        was masked by mask_truncated_completions, which masks truncated ones only."""
        eos = getattr(self.trainer, "eos_token_ids", None)
        tokenizer = getattr(self.trainer, "_tokenizer", None)
        if not isinstance(eos, Sequence) or tokenizer is None:
            return [None] * len(sizes)
        ends = {int(t) for t in eos if t is not None}
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is not None:
            ends.add(int(pad))
        return [
            bool(size == 0 or int(row[size - 1]) not in ends)
            for row, size in zip(ids, sizes, strict=True)
        ]

    def _segments(self, rows: list[int], completions: list[np.ndarray]) -> dict[int, np.ndarray]:
        """The token segments of these rows' completions (RowTokens.segment's codes; a
        completion not aligned with its text all null, with a warning the first time; empty
        without a segmenter). A failure of the segmenter warns once and stops labelling, the
        tokens go on."""
        if self.segmenter is None or not completions:
            return {}
        try:
            labelled = self.segmenter([c.tolist() for c in completions])
        except Exception as exc:  # decoding is the tokenizer's: never lose the tokens over it
            self.segmenter = None
            warnings.warn(
                f"RlscopeCallback: cannot label the tokens' segments ({exc!r}); tokens "
                "without a segment from now on",
                RuntimeWarning,
                stacklevel=3,
            )
            return {}
        if self.segmenter.failed and not self._warned_unaligned:
            self._warned_unaligned = True
            warnings.warn(
                "RlscopeCallback: a completion's tokens could not be aligned with its decoded "
                "text: its tokens' segment is null (TokenTap.segmenter.failed counts them)",
                RuntimeWarning,
                stacklevel=3,
            )
        null = len(NAMES)
        return {
            row: np.full(len(ids), null, dtype=np.int8) if codes is None else codes
            for row, ids, codes in zip(rows, completions, labelled, strict=True)
        }

    def _record_pass(self, inputs: Mapping[str, Any], rows: list[int]) -> None:
        if self._captured is None:
            raise RuntimeError("_compute_loss did not compute per-token entropies")
        logps, entropies = (to_numpy(t) for t in self._captured)
        self._captured = None
        mask = to_numpy(inputs["completion_mask"])
        if inputs.get("tool_mask") is not None:
            mask = mask * to_numpy(inputs["tool_mask"])
        local = []
        for i, row in enumerate(rows):
            if row in self._keep:
                positions = np.flatnonzero(mask[i] > 0)
                local.append((row, logps[i, positions], entropies[i, positions]))
        gathered = self._gathered(local)
        if not self._accelerator()[2] or not self.batches:
            return
        batch = self.batches[-1]  # the batch being trained is the latest generated
        step = int(getattr(getattr(self.trainer, "state", None), "global_step", 0) or 0) + 1
        for row, logprob, entropy in gathered:
            tokens = batch.rows.get(row)
            if tokens is None or tokens.logprob is not None:
                continue
            tokens.logprob, tokens.entropy, tokens.step = logprob, entropy, step
            if tokens.old_logprob is None:  # on-policy: TRL's old log-probs are these, detached
                tokens.old_logprob = logprob
        self.emit_ready()

    # the callback's side -----------------------------------------------------------------------

    def claim(self, advantages: Sequence[float], rollout_ids: list[int]) -> GenerationBatch | None:
        """Tie the latest unclaimed batch of these completions (same count, same advantages)
        to their rollout ids and return it (its `lengths` in tokens, `truncated`); None when
        none matches."""
        n = len(rollout_ids)
        for batch in reversed(self.batches):
            if batch.rollout_ids is not None or len(batch.lengths) != n:
                continue
            if advantages and not np.allclose(
                batch.advantages, advantages, rtol=1e-5, atol=1e-6, equal_nan=True
            ):
                continue
            batch.rollout_ids = rollout_ids
            # Older unclaimed batches were never logged (logging_steps > 1): nothing to tie.
            self.batches = [b for b in self.batches if b.seq >= batch.seq or b.rollout_ids]
            self.emit_ready()
            return batch
        return None

    def emit_ready(self) -> None:
        """Hand every batch whose sampled completions all had their first pass to `emit`."""
        ready = [b for b in self.batches if b.ready()]
        self.batches = [b for b in self.batches if not b.ready()]
        for batch in ready:
            if batch.rows:
                self.emit(batch)

    def finish(self) -> list[GenerationBatch]:
        """The claimed batches still waiting (training stopped before their last pass), each
        cut to the completions that had it; nothing is kept after."""
        waiting = [b for b in self.batches if b.rollout_ids is not None]
        self.batches = []
        for batch in waiting:
            batch.rows = {i: r for i, r in batch.rows.items() if r.logprob is not None}
        return [b for b in waiting if b.rows]
