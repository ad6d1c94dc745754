"""Each generated token's segment (think / answer / tool_call / tool_response / text), from the
token ids, the trainer's own tokenizer and the tag sets of rlscope.text.

A completion is decoded as the trainer decodes it (skip_special_tokens: TRL's completion text,
the rollout's `response`), split into segments by `rlscope.text.segment_spans`, and every token
gets the segment of the characters it decodes to. Byte-level BPE tokens need not end on a
character, a tag or a word: each token's character span comes from decoding, never from
re-encoding the text (a policy's tokens need not be the canonical encoding of its text).

* Spans: token k covers characters [end(k-1), end(k)) of the text, end(k) being how much of the
  text the tokens up to k decode to. Fast path: the tokens decoded one by one (one batched
  call for a batch's distinct ids) add up to the text exactly, and end(k) is the running sum
  of their lengths; this holds for byte-level BPE (GPT-2, Qwen, Llama 3) on text whose
  characters no token splits. Otherwise (a character split over tokens, a decoder that
  joins tokens with spaces or strips a leading one) the text is decoded incrementally: the
  tokens since the last committed point decoded with the tokens before them as context, a
  new piece committed once it no longer ends in an incomplete character (U+FFFD), as
  streaming detokenizers do; the committed pieces must add up to the text. A completion
  whose pieces do not is left unlabelled (null `segment`, counted in `failed`).
* Labels: a token takes the segment of its first non-whitespace character; a token of
  whitespace only takes its first character's; a token that decodes to nothing (an
  incomplete character, completed by a later token; a special token such as EOS) takes the
  segment of the character at its position, `text` past the end of the text. So a token
  straddling a boundary (` <answer` after reasoning, `>\\n` after a closing tag, `.</` ending
  a sentence before `</think>`) goes with the tag or word it carries, not with the
  whitespace, and the tags' own tokens belong to the segment they open or close, as
  rlscope.text's segments include their tags (and as tests/shapes.py labels them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlscope.text import SEGMENTS, TagSet, segment_spans

#: The tokens table's `segment` values: rlscope.text.SEGMENTS, then `text` (outside any tag).
NAMES = (*SEGMENTS, "text")
TEXT = NAMES.index("text")
#: U+FFFD: what a decoder gives for the bytes of a character not yet complete.
INCOMPLETE = "\ufffd"
#: Whether a code point is whitespace (str.isspace), for code points up to U+3000, the last.
_SPACE = np.array([chr(c).isspace() for c in range(0x3001)], dtype=bool)

Decode = Callable[[Sequence[int]], str]
DecodeBatch = Callable[[Sequence[Sequence[int]]], list[str]]


def decoders(tokenizer: Any) -> tuple[Decode, DecodeBatch]:
    """`decode` and `decode_batch` (special tokens skipped) of a transformers tokenizer or
    processor (`decode` / `batch_decode`, what TRL decodes completions with) or of a
    `tokenizers.Tokenizer` (`decode` / `decode_batch`)."""
    if callable(getattr(tokenizer, "batch_decode", None)):

        def decode(ids: Sequence[int]) -> str:
            return str(tokenizer.decode(list(ids), skip_special_tokens=True))

        def batch(seqs: Sequence[Sequence[int]]) -> list[str]:
            return list(tokenizer.batch_decode([list(s) for s in seqs], skip_special_tokens=True))

        return decode, batch
    if callable(getattr(tokenizer, "decode_batch", None)):
        return (
            lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)),
            lambda seqs: list(
                tokenizer.decode_batch([list(s) for s in seqs], skip_special_tokens=True)
            ),
        )
    raise TypeError(f"{type(tokenizer).__name__} has no decode/batch_decode")


def char_segments(text: str, tags: TagSet) -> np.ndarray:
    """The segment (index into NAMES) of every character of `text`."""
    codes = np.full(len(text), TEXT, dtype=np.int8)
    for name, start, end in segment_spans(text, tags):
        codes[start:end] = NAMES.index(name)
    return codes


def token_segments(text: str, ends: np.ndarray, tags: TagSet) -> np.ndarray:
    """The segment (index into NAMES) of each token, from the text and each token's end offset
    (`ends`, non-decreasing, the last at most len(text)): the rule of the module docstring."""
    chars = char_segments(text, tags)
    n = len(text)
    # next_visible[i]: the first non-whitespace character at or after i (n: none)
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    visible = ~_SPACE[np.where(points < _SPACE.size, points, 0)]
    index = np.where(visible, np.arange(n), n)
    next_visible = np.append(np.minimum.accumulate(index[::-1])[::-1], n)
    starts = np.concatenate(([0], ends[:-1])).astype(np.int64)
    ends = ends.astype(np.int64)
    first = next_visible[np.minimum(starts, n)]
    at = np.where(first < ends, first, starts)  # a visible character of its own, else its start
    padded = np.append(chars, np.int8(TEXT))  # position n: past the end of the text
    return padded[np.minimum(at, n)]


def incremental_ends(decode: Decode, ids: Sequence[int], text: str) -> np.ndarray | None:
    """Each token's end offset in `text` by incremental decoding (the module docstring); None
    when the committed pieces do not add up to `text`."""
    ends = np.zeros(len(ids), dtype=np.int64)
    done = 0  # characters of text committed
    start = read = 0  # context tokens [start, read), tokens from read not committed yet
    before = ""  # decode(ids[start:read])
    for k in range(len(ids)):
        now = decode(ids[start : k + 1])
        if len(now) > len(before) and now.startswith(before) and not now.endswith(INCOMPLETE):
            piece = now[len(before) :]
            if text[done : done + len(piece)] != piece:
                return None
            done += len(piece)
            start, read = read, k + 1
            before = decode(ids[start:read])
        ends[k] = done
    return ends if done == len(text) else None


@dataclass
class TokenSegmenter:
    """Segments of completions' tokens with one tokenizer and tag set (the module docstring).
    `failed` counts the completions left unlabelled, `fallback` those decoded incrementally."""

    tokenizer: Any
    tags: TagSet = field(default_factory=TagSet)
    failed: int = 0
    fallback: int = 0

    def __post_init__(self) -> None:
        self._decode, self._decode_batch = decoders(self.tokenizer)

    def __call__(self, completions: Sequence[Sequence[int]]) -> list[np.ndarray | None]:
        """Per completion (its token ids, EOS included), each token's segment as an index into
        NAMES; None for a completion whose tokens could not be aligned with its text."""
        seqs = [np.asarray(c, dtype=np.int64) for c in completions]
        if not seqs:
            return []
        texts = self._decode_batch([s.tolist() for s in seqs])
        flat = np.concatenate(seqs)
        unique, inverse = np.unique(flat, return_inverse=True)
        pieces = self._decode_batch([[int(i)] for i in unique])
        lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))[inverse]
        out: list[np.ndarray | None] = []
        offset = 0
        for seq, text in zip(seqs, texts, strict=True):
            where = inverse[offset : offset + len(seq)]
            ends: np.ndarray | None = np.cumsum(lengths[offset : offset + len(seq)])
            offset += len(seq)
            if "".join(pieces[i] for i in where) != text:
                self.fallback += 1
                ends = incremental_ends(self._decode, seq.tolist(), text)
            if ends is None:
                self.failed += 1
                out.append(None)
            else:
                out.append(token_segments(text, ends, self.tags))
        return out
