"""Response text and probes: the vocabulary, and the words of think segments, calls, answers."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from rlscope.synth.scenarios import (
    _BAD_JSON,
    _EMPTY_ANSWER,
    _NO_ANSWER,
    _UNCLOSED,
    CUE,
    LOOP_WORDS,
    MISTAKE_FRACTION,
    POST_CALL_WORDS,
    PROBE_WORDS,
    PROBED_ROLLOUTS,
    RESTATE_SHARE,
    RESTATE_WORDS,
    THINK_WORDS_PER_TOKEN,
    TOOL_RESPONSE_WORDS,
    TOPIC_SHARE,
    TOPIC_WORDS,
    TRUNCATE_FRACTIONS,
    UNFAITHFUL_UNCHANGED,
    VOCAB_SIZE,
    Scenario,
    _zipf,
)
from rlscope.synth.world import _Batch, _call_args, _cat, _s, _when, _World

# Words by frequency rank: reasoning words and operators first, then, after every three
# pronounceable filler words, a number (so a text reads like a worked solution, and any word
# 3-gram statistic is that of the ranks: the words are distinct and hold no whitespace or tag).
_COMMON_WORDS = (
    "the so we is of and to a that it then this for be with as not can let us check each if "
    "number value sum total first next case both equal gives means need find step now which by "
    "from or are one two three half twice more less than at most least all no only also but "
    "because since therefore thus hence wait hmm actually right again compute count add "
    "subtract multiply divide times plus minus over per remainder product difference ratio "
    "factor prime even odd square root area length width side angle point line circle radius "
    "price cost every left remaining after before start end rate speed time hours minutes "
    "days result problem given known unknown assume suppose try another way simplify expand "
    "solve equation term terms sides divisible greater smaller largest smallest integer digits "
    "digit positive negative fraction percent mod into out up down same different possible "
    "cases other set list pair pairs order sequence pattern rule works fails holds correct "
    "wrong mistake recheck verify confirm back substitute get got have has had makes make made "
    "take takes used use using should would could must will was were there here what how many "
    "much why where when while until = + - * /"
)


def _vocabulary(size: int) -> list[str]:
    onsets = (*"bcdfghklmnprstvwz", "br", "cl", "dr", "fl", "gr", "pl", "pr", "st", "tr")
    vowels = (*"aeiou", "ai", "ea", "io")
    syllables = [o + v + c for o in onsets for v in vowels for c in "nrstl"]
    syllables += [o + v for o in onsets for v in "aeiou"]
    order = np.random.default_rng(0).permutation(len(syllables) ** 2)
    fillers = (syllables[i // len(syllables)] + syllables[i % len(syllables)] for i in order)
    words, numbers = _COMMON_WORDS.split(), iter(range(size))
    known = set(words)
    while len(words) < size:
        word = str(next(numbers)) if len(words) % 4 == 3 else next(fillers)
        if word not in known:
            known.add(word)
            words.append(word)
    return words


_VOCAB = pa.array(_vocabulary(VOCAB_SIZE), pa.large_string())


def _words(idx: np.ndarray, sizes: np.ndarray) -> pa.Array:
    """One string per run of `sizes` consecutive words of the flat word-index array `idx`."""
    offsets = pa.array(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
    return pc.binary_join(pa.LargeListArray.from_arrays(offsets, _VOCAB.take(idx)), _s(" "))


def _think_words(
    sc: Scenario, rng: np.random.Generator, world: _World, u: float, b: _Batch
) -> tuple[np.ndarray, np.ndarray]:
    """Each rollout's think word indices (flat) and counts, loops and copies applied."""
    n = b.rows.size
    count = np.maximum(1, np.rint(THINK_WORDS_PER_TOKEN * b.length)).astype(np.int64)
    total = int(count.sum())
    row = np.repeat(np.arange(n), count)
    start = np.cumsum(count) - count
    pos = np.arange(total) - start[row]
    glob = _zipf(rng.random(total))
    topic = rng.random(total) < TOPIC_SHARE
    topic_word = world.vocab[b.rows[row], RESTATE_WORDS[1] + rng.integers(0, TOPIC_WORDS, total)]
    idx = np.where(topic, topic_word, glob)
    restated = np.clip(np.rint(RESTATE_SHARE * count), *RESTATE_WORDS).astype(np.int64)
    restated = np.minimum(restated, np.maximum(count - 3, 0))  # 3+ words of its own
    restate = world.vocab[b.rows[row], np.minimum(pos, RESTATE_WORDS[1] - 1)]
    idx = np.where(pos < restated[row], restate, idx)
    phrase = _zipf(rng.random((n, LOOP_WORDS)))
    # Two samples of the policy agree on a word with probability ~exp(-entropy per word), so a
    # rollout follows its group's first for a geometric number of words after the restatement.
    fork_u = rng.random(n)
    agree = math.exp(-sc.entropy(u) / THINK_WORDS_PER_TOKEN)
    if (b.lead != np.arange(n)).any() and agree > 0:
        shared = np.log(fork_u) / math.log(agree) if agree < 1 else np.full(n, np.inf)
        lead = b.lead[row]
        follows = (lead != row) & (pos >= restated[row]) & (pos < count[lead])
        follows &= pos < restated[row] + np.floor(shared)[row]
        idx = np.where(follows, idx[start[lead] + np.minimum(pos, count[lead] - 1)], idx)
    if (f := sc.loop(u)) > 0:
        loop_start = np.maximum(restated, count - np.rint(f * count).astype(np.int64))[row]
        looped = pos >= loop_start
        idx = np.where(looped, phrase[row, (pos - loop_start) % LOOP_WORDS], idx)
    if (b.src != np.arange(n)).any():
        copied = count[b.src]
        row = np.repeat(np.arange(n), copied)
        pos = np.arange(copied.sum()) - (np.cumsum(copied) - copied)[row]
        idx, count = idx[start[b.src][row] + pos], copied
    return idx, count


def _responses(
    sc: Scenario, rng: np.random.Generator, world: _World, u: float, b: _Batch
) -> pl.Series:
    """The response text of each rollout of the batch (see the module docstring)."""
    idx, count = _think_words(sc, rng, world, u, b)
    n = b.rows.size
    has_post = (b.n_calls > 0) & (count >= POST_CALL_WORDS * b.n_calls + 8)
    n_chunks = 1 + np.where(has_post, b.n_calls, 0)
    chunk_first = np.cumsum(n_chunks) - n_chunks
    sizes = np.full(int(n_chunks.sum()), POST_CALL_WORDS)
    sizes[chunk_first] = count - np.where(has_post, POST_CALL_WORDS * b.n_calls, 0)
    chunks = _words(idx, sizes)

    call_offsets = np.concatenate([[0], np.cumsum(b.n_calls)])
    call_row = np.repeat(np.arange(n), b.n_calls)
    call_pos = np.arange(call_offsets[-1]) - call_offsets[:-1][call_row]
    j = b.rows[call_row]
    args = _call_args(j, b.call_k).to_arrow().cast(pa.large_string())
    call = _cat(_s('{"name": "search", "arguments": '), args, _s("}"))
    variant = np.where(
        (b.breaks[call_row] == _BAD_JSON) & (call_pos == 0), b.json_variant[call_row], -1
    )
    if (variant >= 0).any():
        call = _when(variant == 0, _cat(_s('{"name": "search", "arguments": '), args), call)
        call = _when(variant == 1, _cat(_s('{"arguments": '), args, _s("}")), call)
        call = _when(variant == 2, _s('{"name": "search"}'), call)
    result = (
        7919 * j[:, None] + 104729 * b.call_k[:, None] + 331 * np.arange(TOOL_RESPONSE_WORDS)
    ) % VOCAB_SIZE
    post = chunks.take(np.where(has_post[call_row], chunk_first[call_row] + 1 + call_pos, 0))
    calls = _cat(
        _s("<tool_call>"),
        call,
        _s("</tool_call>\n<tool_response>"),
        _words(result.ravel(), np.full(j.size, TOOL_RESPONSE_WORDS)),
        _s("</tool_response>"),
        _when(has_post[call_row], _cat(_s("\n<think>"), post, _s("</think>")), _s("")),
    )
    per_rollout = pa.LargeListArray.from_arrays(pa.array(call_offsets.astype(np.int64)), calls)
    calls_text = _cat(_s("\n"), pc.binary_join(per_rollout, _s("\n")))
    answer = pa.array(b.answer).cast(pa.large_string())
    response = _cat(
        _s("<think>"),
        chunks.take(chunk_first),
        _when(b.breaks == _UNCLOSED, _s(""), _s("</think>")),
        _when(b.n_calls > 0, calls_text, _s("")),
        _when(
            b.breaks == _NO_ANSWER,
            _s(""),
            _when(
                b.breaks == _EMPTY_ANSWER,
                _s("\n<answer></answer>"),
                _cat(_s("\n<answer>"), answer, _s("</answer>")),
            ),
        ),
    )
    return pl.Series("response", response)


def _probes(
    sc: Scenario, rng: np.random.Generator, world: _World, u: float, b: _Batch
) -> pl.DataFrame | None:
    """Faithfulness probes of up to PROBED_ROLLOUTS rollouts of the batch (module docstring)."""
    eligible = np.flatnonzero(b.answer >= 0)
    m = min(PROBED_ROLLOUTS, eligible.size)
    if m == 0:
        return None
    chosen = np.sort(rng.choice(eligible, m, replace=False))
    kinds = ["truncate"] * len(TRUNCATE_FRACTIONS) + ["mistake", "paraphrase", "filler", "bias"]
    fractions = [*TRUNCATE_FRACTIONS, MISTAKE_FRACTION, np.nan, np.nan, np.nan]
    per = len(kinds)
    which = np.repeat(chosen, per)
    kind = np.tile(np.array(kinds), m)
    x = np.tile(np.array(fractions), m)
    rows = b.rows[which]
    original = b.answer[which]
    lack = 1.0 - sc.cot_reliance(u)
    y0 = 0.2 + 0.8 * np.nan_to_num(x) ** 1.5
    keep = np.select(
        [kind == "truncate", kind == "mistake", kind == "bias"],
        [
            np.where(x < 1, y0 + lack * (UNFAITHFUL_UNCHANGED - y0), 1.0),
            0.3 + lack * (UNFAITHFUL_UNCHANGED - 0.3),
            1.0 - sc.bias_follow(u),
        ],
        sc.paraphrase_unchanged(u),
    )
    unchanged = rng.random(kind.size) < keep
    candidates = np.column_stack([world.gold[rows], world.distractors[rows, :4]])
    keys = rng.random(candidates.shape)
    keys[candidates == original[:, None]] = 2.0
    other = candidates[np.arange(kind.size), keys.argmin(axis=1)]
    main = world.distractors[rows, 0]
    hint = np.where(original == main, world.distractors[rows, 1], main)
    is_bias = kind == "bias"
    answer = np.where(unchanged, original, np.where(is_bias, hint, other))
    mention = is_bias & (rng.random(kind.size) < sc.bias_mention(u))
    topic = RESTATE_WORDS[1] + rng.integers(0, TOPIC_WORDS, (kind.size, PROBE_WORDS))
    words = world.vocab[rows[:, None], topic]
    answer_text = pa.array(answer).cast(pa.large_string())
    hint_text = pa.array(hint).cast(pa.large_string())
    before, after = CUE.split("{}")
    response = _cat(
        _s("<think>"),
        _when(mention, _cat(_s(before), hint_text, _s(after + " ")), _s("")),
        _words(words.ravel(), np.full(kind.size, PROBE_WORDS)),
        _s("</think>\n<answer>"),
        answer_text,
        _s("</answer>"),
    )
    return pl.DataFrame(
        {
            "rollout_id": b.rollout_id[which],
            "intervention": pl.Series(kinds * m),
            "fraction": pl.Series(x).fill_nan(None),
            "answer": pl.Series(answer_text),
            "hint": pl.Series(_when(is_bias, hint_text, pa.scalar(None, pa.large_string()))),
            "response": pl.Series(response),
        }
    )
