"""Each generated token's segment from its ids, a real tokenizer and rlscope.text's tags: the
segment spans of a text, then tokenizers of the kinds the TRL callback meets (byte-level BPE,
word-level without a decoder, SentencePiece-style Metaspace), checked token by token against
a plain reference that decodes every prefix."""

from __future__ import annotations

import numpy as np
import pytest
from made_tokenizers import (
    EOS,
    byte_level_bpe,
    encode,
    metaspace_bpe,
    reference_segments,
    word_level,
)

from rlscope.integrations.token_segments import NAMES, TokenSegmenter, decoders
from rlscope.integrations.trl_tokens import RowTokens, token_columns
from rlscope.text import TagSet, parse_segments, segment_spans

RESPONSE = "<think> 3 + 4 = 7, so the sum is 7.</think>\n<answer> 7 </answer>"


def labels(segmenter: TokenSegmenter, ids: list[int]) -> list[str] | None:
    (codes,) = segmenter([ids])
    return None if codes is None else [NAMES[c] for c in codes]


# --- spans of text -------------------------------------------------------------------------------


def test_segment_spans_hold_their_tags_and_an_unclosed_tag_runs_on() -> None:
    text = "Hi <think>a</think> <search>q</search><information>d</information><answer>4</answer>"
    assert [(s, text[a:b]) for s, a, b in segment_spans(text)] == [
        ("think", "<think>a</think>"),
        ("tool_call", "<search>q</search>"),
        ("tool_response", "<information>d</information>"),
        ("answer", "<answer>4</answer>"),
    ]
    # Cut at the length cap inside the reasoning: still reasoning, to the end of the text.
    cut = "x <think> so far <tool_call>{"
    assert [(s, cut[a:b]) for s, a, b in segment_spans(cut)] == [
        ("think", "<think> so far "),
        ("tool_call", "<tool_call>{"),
    ]
    assert parse_segments(cut) == [("text", "x "), ("think", " so far "), ("tool_call", "{")]
    # Closing by the same name only; the configured tags.
    assert segment_spans("<think>a</answer>") == [("think", 0, 17)]
    mine = TagSet(think=("reasoning",))
    assert segment_spans("<reasoning>r</reasoning><think>t</think>", mine) == [("think", 0, 24)]
    assert parse_segments(RESPONSE) == [
        ("think", " 3 + 4 = 7, so the sum is 7."),
        ("answer", " 7 "),
    ]


# --- tokens of real tokenizers -------------------------------------------------------------------


def test_byte_level_bpe_tokens_across_a_tag_edge_go_with_what_they_carry() -> None:
    """The trained merges `.</` (a sentence's end and a closing tag), ` </` and `><` straddle
    tag edges: each token is labelled by its first non-whitespace character, so tags belong
    to the segment they open or close, a newline between segments is text, EOS past the end is
    text. The tokens decoded one by one add up to the text: no incremental decoding."""
    tokenizer = byte_level_bpe()
    segmenter = TokenSegmenter(tokenizer)
    ids = encode(tokenizer, RESPONSE)
    got = labels(segmenter, ids)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert {".</", " </", "\n"} <= set(pieces)  # the straddling tokens are there
    by_piece = dict(zip(pieces, got or [], strict=True))
    assert by_piece[".</"] == "think" and by_piece[" </"] == "answer"
    assert by_piece["\n"] == "text" and got is not None and got[-1] == "text"  # EOS
    assert got == reference_segments(tokenizer, ids)
    other = encode(tokenizer, "Let me think. <think> the answer is 12.</think><answer>12</answer>")
    pieces = [tokenizer.decode([i]) for i in other]
    got = labels(segmenter, other)
    assert got == reference_segments(tokenizer, other)
    assert got is not None and got[pieces.index(" <")] == "think"  # ` <` opens the think
    assert got[pieces.index("><")] == "think"  # `>` closes it, `<` opens the answer
    assert segmenter.fallback == 0 and segmenter.failed == 0


def test_a_character_split_over_byte_tokens_is_decoded_incrementally() -> None:
    """Characters the BPE never saw are one token per UTF-8 byte: decoded alone they give
    U+FFFD, so the pieces do not add up and the incremental decoding finds each token's span;
    the bytes of `ü` inside the answer are answer tokens."""
    tokenizer = byte_level_bpe()
    segmenter = TokenSegmenter(tokenizer)
    text = "<think> naïve café 🙂 so 7.</think>\n<answer>ü</answer>"
    ids = encode(tokenizer, text)
    assert "\ufffd" in tokenizer.decode([ids[6]])  # a byte of ï, alone
    got = labels(segmenter, ids)
    assert got == reference_segments(tokenizer, ids)
    umlaut = next(k for k in range(len(ids)) if "ü" in tokenizer.decode(ids[: k + 1]))
    assert got is not None and got[umlaut - 1 : umlaut + 1] == ["answer", "answer"]
    assert segmenter.fallback == 1 and segmenter.failed == 0


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda: word_level(("<think>", "</think>", "<answer>", "</answer>", "7", "so")),
            id="word-level-joined-by-spaces",
        ),
        pytest.param(metaspace_bpe, id="metaspace-leading-space-dropped"),
    ],
)
def test_decoders_that_join_or_strip_are_decoded_incrementally(make: object) -> None:
    """trl_lr_collapse.py's word-level tokenizer has no decoder (the library joins tokens with
    spaces: one token decoded alone has no space), a SentencePiece-style one drops the
    leading space of a token decoded alone: both need the incremental decoding, and both
    agree with the reference, whole tags inside one Metaspace token included."""
    tokenizer = make()  # type: ignore[operator]
    segmenter = TokenSegmenter(tokenizer)
    text = "<think> 7 so 7 </think> <answer> 7 </answer> so"
    ids = encode(tokenizer, text)
    got = labels(segmenter, ids)
    assert got == reference_segments(tokenizer, ids)
    assert got is not None and set(got) == {"think", "answer", "text"}
    assert segmenter.fallback == 1 and segmenter.failed == 0


def test_tokens_that_cannot_be_aligned_are_left_unlabelled() -> None:
    """A completion ending in a genuine U+FFFD, with a character split over tokens before it:
    the pieces do not add up and the incremental decoding never commits the last character,
    so that completion's tokens get no segment (null), counted; the others are labelled."""
    tokenizer = byte_level_bpe()
    segmenter = TokenSegmenter(tokenizer)
    broken = encode(tokenizer, "<think> é </think> \ufffd", eos=False)
    fine = encode(tokenizer, RESPONSE)
    got = segmenter([broken, fine])
    assert got[0] is None and got[1] is not None and segmenter.failed == 1
    rows = [
        (0, RowTokens(np.arange(len(broken), dtype=np.int32), np.float32(1.0), segment=None)),
        (1, RowTokens(np.arange(len(fine), dtype=np.int32), np.float32(1.0), segment=got[1])),
    ]
    column = token_columns(rows, [10, 11])["segment"]
    assert column[: len(broken)].tolist() == [None] * len(broken)
    assert column[len(broken) :].tolist() == reference_segments(tokenizer, fine)


def test_the_configured_tags_and_either_tokenizer_api() -> None:
    """A run's own tag names (config [tags]) label the tokens; a transformers-style tokenizer
    (decode / batch_decode) and a `tokenizers.Tokenizer` (decode / decode_batch) both work."""
    tokenizer = word_level(("<reasoning>", "</reasoning>", "<answer>", "</answer>", "7"))
    ids = encode(tokenizer, "<reasoning> 7 </reasoning> <answer> 7 </answer>")
    mine = TagSet(think=("reasoning",))
    expected = ["think"] * 3 + ["answer"] * 3 + ["text"]
    assert labels(TokenSegmenter(tokenizer, mine), ids) == expected
    assert labels(TokenSegmenter(tokenizer), ids) == ["text"] * 3 + ["answer"] * 3 + ["text"]

    class TransformersStyle:  # the two methods TRL decodes with, on the same real tokenizer
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

        def batch_decode(self, seqs: list[list[int]], skip_special_tokens: bool = False) -> list:
            return tokenizer.decode_batch(seqs, skip_special_tokens=skip_special_tokens)

    assert labels(TokenSegmenter(TransformersStyle(), mine), ids) == expected
    with pytest.raises(TypeError, match="decode"):
        decoders(object())
    assert tokenizer.token_to_id(EOS) == ids[-1]
