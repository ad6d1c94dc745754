"""L2 rollout-text and tool metrics against independent pure-Python computations."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlscope.config import load_config
from rlscope.engine import compute
from rlscope.reader import open_run
from rlscope.text import TagSet, TextSettings

WriteRun = Callable[..., Path]
CheckSeries = Callable[..., None]

# ---------------------------------------------------------------- an independent parser

CANON = {
    "think": "think",
    "answer": "answer",
    "tool_call": "call",
    "search": "call",
    "tool_response": "response",
    "information": "response",
}


def reference_format_ok(text: str) -> bool:
    """Balanced, non-nested tags; order think? (call response? think?)* answer; a non-blank
    answer; JSON tool calls with name and arguments. Written as a state machine, not a regex."""
    tokens = re.findall(r"<(/?)(think|answer|tool_call|search|tool_response|information)>", text)
    pairs, open_tag = [], None
    for closing, name in tokens:
        if not closing:
            if open_tag is not None:
                return False
            open_tag = name
        else:
            if open_tag != name:
                return False
            pairs.append(name)
            open_tag = None
    if open_tag is not None:
        return False
    kinds = [CANON[p] for p in pairs]
    state = "start"
    allowed = {
        "start": {"think": "thought", "call": "called", "answer": "done"},
        "thought": {"call": "called", "answer": "done"},
        "called": {"response": "responded", "call": "called", "think": "thought", "answer": "done"},
        "responded": {"call": "called", "think": "thought", "answer": "done"},
        "done": {},
    }
    for kind in kinds:
        if kind not in allowed[state]:
            return False
        state = allowed[state][kind]
    if state != "done":
        return False
    answer = re.search(r"<answer>(.*?)</answer>", text, re.S)
    if answer is None or not answer.group(1).strip():
        return False
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S):
        try:
            call = json.loads(body)
        except ValueError:
            return False
        if not isinstance(call, dict) or call.get("name") is None or "arguments" not in call:
            return False
        if call["arguments"] is None:
            return False
    return True


def words_in(text: str, tags: tuple[str, ...]) -> int | None:
    parts = []
    for tag in tags:
        parts += re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.S)
    if not parts:
        return None
    return sum(len(p.split()) for p in parts)


def reference_repetition(text: str) -> float | None:
    thinks = re.findall(r"<think>(.*?)</think>", text, re.S)
    body = " ".join(thinks) if thinks else text
    body = re.sub(r"</?(think|answer|tool_call|search|tool_response|information)>", " ", body)
    words = body.lower().split()
    if len(words) < 3:
        return None
    grams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    return 1 - len(set(grams)) / len(grams)


def reference_calls(text: str) -> list[str]:
    found = re.findall(r"<(tool_call|search)>(.*?)</\1>", text, re.S)
    return [" ".join(body.split()) for _, body in found]


# ---------------------------------------------------------------- random tagged responses

VOCAB = [f"w{i}" for i in range(12)]


def random_response(rng: np.random.Generator) -> str:
    def phrase(n: int) -> str:
        return " ".join(rng.choice(VOCAB, n))

    parts = []
    if rng.random() < 0.8:
        parts.append(f"<think>{phrase(int(rng.integers(0, 12)))}</think>")
    for _ in range(int(rng.integers(0, 3))):
        query = f"q{int(rng.integers(0, 2))}"
        kind = rng.random()
        if kind < 0.6:
            body = json.dumps({"name": "search", "arguments": {"query": query}})
        elif kind < 0.7:
            body = '{"name": "search"'  # broken JSON
        elif kind < 0.8:
            body = json.dumps({"arguments": {"query": query}})  # no name
        else:
            parts.append(f"<search>{query}</search><information>doc {phrase(2)}</information>")
            continue
        parts.append(f"<tool_call>{body}</tool_call>")
        if rng.random() < 0.8:
            parts.append(f"<tool_response>{phrase(3)}</tool_response>")
    damage = rng.random()
    answer = "" if damage < 0.1 else str(int(rng.integers(0, 5)))
    if damage < 0.9:
        parts.append(f"<answer>{answer}</answer>")
    text = " ".join(parts)
    if 0.9 <= damage < 0.95:
        text = text.replace("</think>", "", 1)
    elif damage >= 0.95:
        text = phrase(6)  # untagged
    return text


def text_run(write_run: WriteRun, seed: int = 0, steps: int = 6) -> tuple[Path, list[dict]]:
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    for step in range(steps):
        for i in range(int(rng.integers(6, 14))):
            text = random_response(rng)
            rows.append(
                {
                    "rollout_id": len(rows),
                    "step": step,
                    "prompt_id": f"p{i % 3}",
                    "reward": float(rng.random() < 0.5),
                    "response_len": 10,
                    "response": None if rng.random() < 0.05 else text,
                }
            )
    batch = {k: [r[k] for r in rows] for k in rows[0]}
    return write_run({"rollouts": batch}), rows


def by_step(rows: list[dict], fn: Callable[[list[dict]], float | None]) -> dict[int, float | None]:
    steps = sorted({r["step"] for r in rows})
    return {s: fn([r for r in rows if r["step"] == s]) for s in steps}


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_text_metrics_match_reference(
    write_run: WriteRun, check_series: CheckSeries, seed: int
) -> None:
    path, rows = text_run(write_run, seed)
    results = compute(open_run(path)).results
    texts = lambda rs: [r["response"] for r in rs if r["response"] is not None]  # noqa: E731

    def format_share(rs: list[dict]) -> float | None:
        t = texts(rs)
        tagged = [
            x
            for x in t
            if re.search(r"</?(think|answer|tool_call|search|tool_response|information)>", x)
        ]
        return mean([float(reference_format_ok(x)) for x in t]) if tagged else None

    check_series(results["behavior.format_ok"], by_step(rows, format_share))
    check_series(
        results["behavior.repetition"],
        by_step(
            rows,
            lambda rs: mean([v for x in texts(rs) if (v := reference_repetition(x)) is not None]),
        ),
    )
    for segment, tags in {
        "think": ("think",),
        "answer": ("answer",),
        "tool_call": ("tool_call", "search"),
        "tool_response": ("tool_response", "information"),
    }.items():
        check_series(
            results[f"behavior.segment_len.{segment}"],
            by_step(
                rows,
                lambda rs, t=tags: mean(
                    [v for x in texts(rs) if (v := words_in(x, t)) is not None]
                ),
            ),
        )

    def redundant(rs: list[dict]) -> float | None:
        calls = [reference_calls(x) for x in texts(rs)]
        total = sum(len(c) for c in calls)
        return sum(len(c) - len(set(c)) for c in calls) / total if total else None

    check_series(results["behavior.redundant_tool_calls"], by_step(rows, redundant))


def test_reference_parser_agrees_on_edge_cases() -> None:
    """The metric's expression and the independent parser agree on hand-written cases."""
    import polars as pl

    from rlscope.text import format_ok

    cases = {
        "<think>a</think><answer>1</answer>": True,
        "<answer>1</answer>": True,
        "<think>a</think>": False,  # no answer
        "<answer> </answer>": False,  # blank answer
        "<think>a<answer>1</answer>": False,  # unclosed think
        "<answer>1</answer><think>a</think>": False,  # wrong order
        "<answer>1</answer><answer>2</answer>": False,  # two answers
        '<tool_call>{"name": "s", "arguments": {}}</tool_call><answer>1</answer>': True,
        '<tool_call>{"name": "s"}</tool_call><answer>1</answer>': False,
        "<search>q</search><information>d</information><think>t</think><answer>1</answer>": True,
        "<think><think>a</think></think><answer>1</answer>": False,  # nested
        "plain": False,
    }
    got = pl.DataFrame({"response": list(cases)}).select(format_ok(TagSet()))["response"]
    for (text, want), value in zip(cases.items(), got.to_list(), strict=True):
        assert reference_format_ok(text) is want, text
        assert value is want, text


def test_untagged_run_is_not_judged_on_format(write_run: WriteRun) -> None:
    path = write_run(
        {
            "rollouts": {
                "rollout_id": [0, 1],
                "step": [0, 0],
                "prompt_id": ["p", "p"],
                "reward": [1.0, 0.0],
                "response_len": [3, 3],
                "response": ["just some words", "more words here"],
            }
        }
    )
    computed = compute(open_run(path))
    assert "behavior.format_ok" not in computed.results
    reasons = {s.metric: s.reason for s in computed.skipped}
    assert "no response uses any tag" in reasons["behavior.format_ok"]
    assert computed.results["behavior.repetition"].values == (0.0,)


def test_tool_calls_column_preferred_for_redundancy(
    write_run: WriteRun, check_series: CheckSeries
) -> None:
    calls = [['{"q": 1}', '{"q":  1}', '{"q": 2}'], [], ['{"q": 3}', '{"q": 3}']]
    path = write_run(
        {
            "rollouts": {
                "rollout_id": [0, 1, 2],
                "step": [0, 0, 1],
                "prompt_id": ["p", "p", "q"],
                "reward": [1.0, 0.0, 1.0],
                "response_len": [3, 3, 3],
                "tool_calls": calls,
            }
        }
    )
    results = compute(open_run(path)).results
    # whitespace-normalised: '{"q":  1}' repeats '{"q": 1}'
    check_series(results["behavior.redundant_tool_calls"], {0: 1 / 3, 1: 1 / 2})
    # correct answers per call: step 0 one correct over 3 calls, step 1 one over 2
    check_series(results["behavior.tool_productivity"], {0: 1 / 3, 1: 1 / 2})


def test_segment_tokens_and_entropy(write_run: WriteRun, check_series: CheckSeries) -> None:
    rng = np.random.default_rng(3)
    rollout, step, pos, segment, entropy = [], [], [], [], []
    for rid in range(12):
        n = int(rng.integers(4, 20))
        cut = int(rng.integers(0, n))
        rollout += [rid] * n
        step += [rid // 4] * n
        pos += list(range(n))
        segment += ["think"] * cut + ["answer"] * (n - cut)
        entropy += list(rng.gamma(0.6, 1.0, n))
    path = write_run(
        {
            "rollouts": {
                "rollout_id": list(range(12)),
                "step": [r // 4 for r in range(12)],
                "prompt_id": "p",
                "reward": 1.0,
                "response_len": 5,
            },
            "tokens": {
                "rollout_id": rollout,
                "step": step,
                "pos": pos,
                "segment": segment,
                "entropy": np.array(entropy, dtype=np.float32),
            },
        }
    )
    results = compute(open_run(path)).results
    ent32 = np.array(entropy, dtype=np.float32).astype(np.float64)
    seg, st, rid = np.array(segment), np.array(step), np.array(rollout)
    for name in ("think", "answer"):
        tokens, ent = {}, {}
        for s in range(3):
            mask = (seg == name) & (st == s)
            tokens[s] = mask.sum() / len(set(rid[mask])) if mask.any() else None
            ent[s] = float(ent32[mask].mean()) if mask.any() else None
        check_series(results[f"behavior.segment_len.{name}"], tokens)
        check_series(results[f"behavior.entropy.{name}"], ent, rel=1e-6)


def test_custom_tags_from_config(
    tmp_path: Path, write_run: WriteRun, check_series: CheckSeries
) -> None:
    (tmp_path / "rlscope.toml").write_text('[tags]\nthink = ["reasoning"]\njson_calls = []\n')
    settings = load_config(search_from=tmp_path).text
    assert settings.tags.think == ("reasoning",)
    path = write_run(
        {
            "rollouts": {
                "rollout_id": [0, 1],
                "step": [0, 0],
                "prompt_id": ["p", "p"],
                "reward": [1.0, 0.0],
                "response_len": [3, 3],
                "response": [
                    "<reasoning>a b c</reasoning><answer>1</answer>",
                    "<think>a b</think><answer>1</answer>",  # think is not a tag any more
                ],
            }
        }
    )
    results = compute(open_run(path), text=settings).results
    check_series(results["behavior.segment_len.think"], {0: 3.0})
    check_series(results["behavior.format_ok"], {0: 1.0})


@pytest.mark.parametrize(
    "toml, message",
    [
        ('[tags]\nthinking = ["x"]\n', "unknown key"),
        ("[tags]\nthink = []\n", "at least one"),
        ('[tags]\nthink = "think"\n', "list of tag names"),
        ('[tags]\nthink = ["a b"]\n', "tag name"),
        ('[probes]\ncue_pattern = "(unclosed"\n', "not a valid regex"),
        ("[probes]\ncue = 1\n", "unknown key"),
    ],
)
def test_bad_text_config(tmp_path: Path, toml: str, message: str) -> None:
    from rlscope.errors import RlscopeError

    (tmp_path / "rlscope.toml").write_text(toml)
    with pytest.raises(RlscopeError, match=message):
        load_config(search_from=tmp_path)


def test_default_settings_are_the_documented_ones() -> None:
    settings = TextSettings()
    assert settings.tags.tool_call == ("tool_call", "search")
    assert settings.tags.tool_response == ("tool_response", "information")


@pytest.mark.parametrize(
    "scenario",
    [
        "diversity-collapse",  # per-rollout findings with example rollouts
        "dead-prompts",  # per-group findings, pass@k
        "self-consistency-headroom",
        "ood-gap",  # eval splits
    ],
)
def test_rollout_levels_in_step_ranges_give_the_one_pass_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scenario: str
) -> None:
    """The per-group and per-rollout levels and the group sizes computed a few steps at a
    time (their range limits forced to under two steps of rollouts, so every step is a range
    of its own, and to three steps' worth): every metric (pass@k, eval splits, extremes...)
    and finding, with its example rollouts, is the one-range answer; the rows kept for
    examples are the final window's train rollouts only, without the MinHash signature; no
    per-group frame is kept."""
    from rlscope import engine, sources
    from rlscope.analysis import analyze
    from rlscope.synth import generate

    run = tmp_path / "run"
    generate(run, scenario, steps=20, prompts_per_step=4, group_size=6, tokens=False, seed=3)
    whole = analyze(run, use_cache=False).to_dict()
    computed = compute(open_run(run))
    recent = computed.aggregates[engine.ROLLOUT_LEVEL]
    assert set(recent["split"].to_list()) == {"train"}
    steps = sorted(set(open_run(run).scan("rollouts").collect()["step"].to_list()))
    assert len(steps) == 20
    assert sorted(set(recent["step"].to_list())) == steps[-3:]  # the final window of 20 steps
    assert not [c for c in recent.columns if c.startswith("minhash_")]
    assert engine.GROUP_LEVEL not in computed.aggregates
    sizes = computed.aggregates[engine.SIZES_LEVEL]  # a row per (split, step, size) only
    assert sizes.height == sizes.select("split", "step", "n").n_unique() < 2 * 20 * 2
    for chunk in (4 * 6 + 5, 3 * 4 * 6):
        for limit in ("ROLLOUT_CHUNK", "GROUP_CHUNK", "SIZES_CHUNK"):
            monkeypatch.setattr(sources, limit, chunk)
        ranged = analyze(run, use_cache=False).to_dict()
        assert_json_close(ranged["metrics"], whole["metrics"])
        assert_json_close(ranged["findings"], whole["findings"])


def assert_json_close(
    a: Any, b: Any, where: str = "", rel: float = 1e-9, absolute: float = 1e-12
) -> None:
    """Equal JSON, floats up to summation order (`rel` relative, default 1e-9)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (where, a.keys() ^ b.keys())
        for key in a:
            assert_json_close(a[key], b[key], f"{where}/{key}", rel, absolute)
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_json_close(x, y, f"{where}[{i}]", rel, absolute)
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=rel, abs_tol=absolute), (where, a, b)
    else:
        assert a == b, (where, a, b)
