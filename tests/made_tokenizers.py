"""Real tokenizers (the `tokenizers` library) built in the tests, offline, in the kinds the token
segments must handle, and a plain reference of a token's segment to check them against."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rlscope.text import TagSet, segment_spans

PAD, EOS = "<pad>", "<eos>"

#: What the byte-level BPE is trained on: tagged responses whose frequent pairs become merges
#: across the tags' edges (`.</`, ` </`, ` <`), and no character outside ASCII, so that a
#: character outside it is split into byte tokens.
BPE_CORPUS = (
    "<think> 3 + 4 = 7, so the sum is 7.</think>\n<answer> 7 </answer>",
    '<think> I should look it up.</think> <tool_call>{"name": "search", '
    '"arguments": {"q": "capital"}}</tool_call>\n<tool_response> Paris </tool_response>'
    "\n<answer>Paris</answer>",
    "Let me think. <think> the answer is 12.</think><answer>12</answer>",
)


@cache
def byte_level_bpe() -> Tokenizer:
    """A GPT-2 / Qwen-style byte-level BPE (ByteLevel pre-tokenizer with GPT-2's split regex,
    ByteLevel decoder), trained on BPE_CORPUS; `<pad>` and `<eos>` special (ids 0 and 1)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[PAD, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(BPE_CORPUS) * 20, trainer)
    return tokenizer


@cache
def word_level(words: tuple[str, ...]) -> Tokenizer:
    """tests/trainers/trl_lr_collapse.py's kind: one token per whitespace word, no decoder (the
    library joins decoded tokens with spaces); `<pad>` and `<eos>` special."""
    vocab = {token: i for i, token in enumerate([PAD, EOS, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([PAD, EOS])
    return tokenizer


@cache
def metaspace_bpe() -> Tokenizer:
    """A SentencePiece-style BPE (Metaspace ▁ for spaces, the decoder dropping the text's
    leading space): a token decoded alone loses its space."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[PAD, EOS], show_progress=False)
    tokenizer.train_from_iterator(list(BPE_CORPUS) * 20, trainer)
    return tokenizer


def encode(tokenizer: Tokenizer, text: str, eos: bool = True) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return [*ids, tokenizer.token_to_id(EOS)] if eos else ids


def reference_segments(
    tokenizer: Tokenizer, ids: Sequence[int], tags: TagSet | None = None
) -> list[str]:
    """Each token's segment, plainly: token k ends where the longest common prefix of the text
    and the decoded first k + 1 tokens ends (every prefix decoded: quadratic, for tests), and
    takes the segment of its first non-whitespace character, else of its first character,
    `text` past the end."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    per_char = ["text"] * len(text)
    for name, start, end in segment_spans(text, tags):
        per_char[start:end] = [name] * (end - start)
    labels, start = [], 0
    for k in range(len(ids)):
        prefix = tokenizer.decode(list(ids[: k + 1]), skip_special_tokens=True)
        end = 0
        while end < min(len(prefix), len(text)) and prefix[end] == text[end]:
            end += 1
        visible = [i for i in range(start, end) if not text[i].isspace()]
        at = visible[0] if visible else start
        labels.append(per_char[at] if at < len(text) else "text")
        start = end
    return labels
