"""`rlscope show` and `rlscope rollouts`: the library views, the filter language, the CLI."""

from __future__ import annotations

import builtins
import hashlib
import json
import math
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from conftest import CliResult, run_cli
from rich.console import Console

from rlscope.analysis import analyze
from rlscope.config import Config
from rlscope.errors import RlscopeError
from rlscope.filterlang import BoolOp, Compare, Contains, Not, filter_expr, parse_filter
from rlscope.inspect import rollout, rollouts, word_entropy
from rlscope.reader import open_run
from rlscope.render.rollout import entropy_sparkline, heat_strip, heat_style, render_rollout
from rlscope.synth import generate

WriteRun = Callable[..., Path]

CALL = '{"name": "search", "arguments": {"query": "x"}}'
RESPONSE = (
    "<think>Let me look it up.</think>"
    f"<tool_call>{CALL}</tool_call>"
    "<tool_response>The answer is 42.</tool_response>"
    "<answer>42</answer>"
)
SEGMENTS = [
    ("think", "Let me look it up."),
    ("tool_call", CALL),
    ("tool_response", "The answer is 42."),
    ("answer", "42"),
]
# Rollout 5 (step 1) has 13 tokens, written shuffled over two files among other rollouts'.
ENTROPY_5 = [0.5, 0.25, 2.5, 0.125, 1.0, 0.75, 0.0, 3.0, 1.5, 0.5, 0.25, 2.0, 0.625]
SEGMENT_5 = ["think"] * 6 + ["tool_call"] * 3 + ["tool_response"] * 2 + ["answer"] * 2


def cli(*args: str, env: dict[str, str] | None = None) -> CliResult:
    return run_cli(*args, env=env, columns=160)


def fingerprint(root: Path) -> dict[str, tuple[int, str]]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


ROWS: list[dict[str, Any]] = [
    # rollout_id, step, prompt_id, split, reward, answer, tool_calls, note
    dict(id=0, step=0, prompt="p0", split="train", reward=1.0, answer="42", calls=None),
    dict(id=1, step=0, prompt="p0", split="train", reward=0.0, answer="41", calls=None),
    dict(id=2, step=0, prompt="p1", split="eval_id", reward=0.5, answer=None, calls=["a b"]),
    dict(id=3, step=0, prompt="p1", split="train", reward=-1.0, answer="Forty two", calls=None),
    dict(id=4, step=1, prompt="p2", split="train", reward=2.0, answer="x42y", calls=None),
    dict(
        id=5,
        step=1,
        prompt="p2",
        split="train",
        reward=1.0,
        answer="42",
        calls=None,
    ),
    dict(
        id=6,
        step=1,
        prompt="p3",
        split="eval_ood",
        reward=0.25,
        answer="7",
        calls=['{"name": "lookup", "arguments": {"id": 7}}', "raw call"],
    ),
    dict(id=7, step=1, prompt="p3", split="train", reward=0.0, answer="", calls=None),
]


@pytest.fixture
def basic(write_run: WriteRun) -> Path:
    """Eight rollouts over two steps (one extra column), tokens in two files, probes."""
    rollouts_table = {
        "rollout_id": [r["id"] for r in ROWS],
        "step": [r["step"] for r in ROWS],
        "prompt_id": [r["prompt"] for r in ROWS],
        "split": [r["split"] for r in ROWS],
        "reward": [r["reward"] for r in ROWS],
        "response_len": [13] * len(ROWS),
        "answer": [r["answer"] for r in ROWS],
        "response": [RESPONSE] * len(ROWS),
        "tool_calls": [r["calls"] for r in ROWS],
        "truncated": [False] * len(ROWS),
        "judge_note": [f"note {r['id']}" for r in ROWS],
    }
    order = [7, 2, 11, 0, 5, 9, 1, 12, 3, 10, 6, 4, 8]  # shuffled positions of rollout 5
    first, second = order[:6], order[6:]

    def batch(positions: list[int]) -> dict[str, list[Any]]:
        others = [(4, 1), (6, 1)]  # other rollouts at the same step, same positions
        rows = [(5, 1, p) for p in positions] + [(r, s, p) for r, s in others for p in positions]
        return {
            "rollout_id": [r for r, _, _ in rows],
            "step": [s for _, s, _ in rows],
            "pos": [p for _, _, p in rows],
            "entropy": [ENTROPY_5[p] if r == 5 else 9.0 for r, _, p in rows],
            "segment": [SEGMENT_5[p] if r == 5 else "text" for r, _, p in rows],
            "logprob": [-float(p) / 8 for _, _, p in rows],
        }

    probes = {
        "rollout_id": [5, 5, 5, 0],
        "intervention": ["truncate", "mistake", "bias", "truncate"],
        "fraction": [0.5, 0.25, None, 0.5],
        "answer": ["  42 ", "41", None, "42"],
        "hint": [None, None, "7", None],
    }
    return write_run(
        {"rollouts": rollouts_table, "tokens": [batch(first), batch(second)], "probes": probes}
    )


# ------------------------------------------------------------------------ one rollout


def test_rollout_view(basic: Path) -> None:
    before = fingerprint(basic)
    view = rollout(basic, 5)
    assert view.rollout_id == 5 and view.run_id == basic.name
    assert view.row["step"] == 1 and view.row["prompt_id"] == "p2" and view.row["answer"] == "42"
    assert view.row["judge_note"] == "note 5", "extra columns are carried"
    assert view.row["correct"] is True, "derived columns are filled in"
    assert [(s.name, s.text) for s in view.segments] == SEGMENTS
    assert view.tool_calls_source == "response"
    assert [(c.name, c.arguments) for c in view.tool_calls] == [("search", {"query": "x"})]
    assert view.tokens["pos"] == list(range(13)), "sorted by position across files"
    assert view.tokens["entropy"] == pytest.approx(ENTROPY_5)
    assert view.tokens["segment"] == SEGMENT_5
    assert view.tokens["logprob"] == pytest.approx([-p / 8 for p in range(13)])
    assert set(view.tokens) == {"pos", "entropy", "segment", "logprob"}
    assert view.tokens_note is None and view.probes_note is None
    probes = [(p.row["intervention"], p.row["fraction"], p.unchanged) for p in view.probes]
    assert probes == [("bias", None, False), ("mistake", 0.25, False), ("truncate", 0.5, True)]
    assert view.probes[0].row["hint"] == "7"
    doc = json.loads(json.dumps(view.to_dict(), allow_nan=False))
    assert doc["rollout"]["judge_note"] == "note 5" and doc["tokens"]["pos"][-1] == 12
    assert fingerprint(basic) == before, "nothing is written into the run directory"


def test_tool_calls_column_wins_over_tags(basic: Path) -> None:
    view = rollout(basic, 6)
    assert view.tool_calls_source == "tool_calls"
    assert [(c.name, c.arguments, c.text) for c in view.tool_calls] == [
        ("lookup", {"id": 7}, '{"name": "lookup", "arguments": {"id": 7}}'),
        (None, None, "raw call"),
    ]


def test_rollout_without_tokens_or_answer(basic: Path, write_run: WriteRun) -> None:
    view = rollout(basic, 0)  # no token rows, one probe
    assert view.tokens == {} and view.tokens_note is not None
    assert "rollout 0 at step 0" in view.tokens_note
    assert [p.unchanged for p in view.probes] == [True]
    assert [p.unchanged for p in rollout(basic, 2).probes] == []
    bare = write_run(
        {
            "rollouts": {
                "rollout_id": [1],
                "step": [0],
                "prompt_id": ["p"],
                "reward": [1.0],
                "response_len": [3],
            }
        }
    )
    view = rollout(bare, 1)
    assert view.segments == () and view.tool_calls == () and view.tool_calls_source is None
    assert view.tokens_note == "the run has no tokens table"
    assert view.probes_note == "the run has no probes table"
    assert view.word_entropy() == ()


def test_unknown_rollout_id_names_run_and_id(basic: Path) -> None:
    with pytest.raises(RlscopeError) as caught:
        rollout(basic, 12345)
    assert "12345" in caught.value.message and basic.name in caught.value.message


def reference_word_entropy(n_words: int, entropy: list[float | None]) -> list[float | None]:
    """Token j belongs to word floor(j·W/T) (word i covers [i·T/W, (i+1)·T/W)); a word with no
    token takes the token its start falls in, floor(i·T/W). Exact rational arithmetic."""
    n_tokens = len(entropy)
    members: dict[int, list[int]] = {i: [] for i in range(n_words)}
    for j in range(n_tokens):
        members[math.floor(Fraction(j * n_words, n_tokens))].append(j)
    out: list[float | None] = []
    for i in range(n_words):
        tokens = members[i] or [math.floor(Fraction(i * n_tokens, n_words))]
        values = [entropy[j] for j in tokens if entropy[j] is not None]
        out.append(sum(values) / len(values) if values else None)  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("n_words", [1, 3, 5, 7, 13, 20, 40])
def test_word_entropy_alignment(n_words: int) -> None:
    entropy: list[float | None] = [float(j % 5) / 2 for j in range(13)]
    entropy[4] = None
    text = "  " + "\n".join(f"w{i}" for i in range(n_words)) + " "
    heat = word_entropy(text, entropy)
    assert [text[h.start : h.end] for h in heat] == [f"w{i}" for i in range(n_words)]
    got = [h.entropy for h in heat]
    want = reference_word_entropy(n_words, entropy)
    assert got == pytest.approx(want)
    if n_words <= 13:
        assert sum(h.n_tokens for h in heat) == 13, "words partition the tokens"


def test_view_word_entropy_uses_the_response(basic: Path) -> None:
    view = rollout(basic, 5)
    words = re.findall(r"\S+", RESPONSE)
    assert [h.entropy for h in view.word_entropy()] == pytest.approx(
        reference_word_entropy(len(words), list(ENTROPY_5))
    )


def test_heat_scale_and_sparkline() -> None:
    assert heat_style(None) == "dim"
    assert heat_style(0.0) == heat_style(0.2) == "blue"
    assert heat_style(2.0) == heat_style(7.5) == "bold red"
    assert len({heat_style(v) for v in (0.1, 0.3, 0.7, 1.2, 1.7, 2.2)}) == 6
    assert entropy_sparkline([0.0, 1.0, 2.0, 5.0, None]) == "▁▅██ "
    assert len(entropy_sparkline([0.5] * 1000, width=80)) == 80


def colour_console() -> Console:
    return Console(record=True, width=120, force_terminal=True, color_system="truecolor")


def test_heat_strip_styles_each_word(basic: Path) -> None:
    view = rollout(basic, 5)
    heat = view.word_entropy()
    strip = heat_strip(RESPONSE, heat)
    assert strip.plain == RESPONSE
    styled = {(span.start, span.end): span.style for span in strip.spans}
    assert styled == {(h.start, h.end): heat_style(h.entropy) for h in heat}
    hostile = "a \x1b[31mb\u202e [red]c[/]"
    escaped = heat_strip(hostile, word_entropy(hostile, [0.1, 2.5, 0.75]))
    assert escaped.plain == "a \\x1b[31mb\\u202e [red]c[/]"
    assert [span.style for span in escaped.spans] == ["blue", "bold red", "green"]


def test_render_rollout_sections(basic: Path, write_run: WriteRun) -> None:
    console = colour_console()
    render_rollout(rollout(basic, 5), console)
    out = console.export_text()
    for part in ("rollout_id", "judge_note", "── think", "Let me look it up.", "Tool calls"):
        assert part in out
    assert "search" in out and '{"query": "x"}' in out
    assert "alignment is approximate" in out and "T = 13" in out
    assert "max 3.000 at pos 7" in out
    assert "Probes" in out and "truncate" in out and "yes" in out
    console = Console(record=True, width=120, color_system=None)
    render_rollout(rollout(basic, 5), console)
    assert "no heat strip: colour is off" in console.export_text(), "NO_COLOR: no strip"
    console = colour_console()
    render_rollout(rollout(basic, 0), console)
    assert "no heat strip: the tokens table has no rows for rollout 0" in console.export_text()
    no_entropy = write_run(
        {
            "rollouts": {
                "rollout_id": [1],
                "step": [0],
                "prompt_id": ["p"],
                "reward": [1.0],
                "response_len": [2],
                "response": ["a b"],
            },
            "tokens": {"rollout_id": [1, 1], "step": [0, 0], "pos": [1, 0]},
        }
    )
    console = colour_console()
    render_rollout(rollout(no_entropy, 1), console)
    assert "the tokens table has no `entropy` column" in console.export_text()


# ------------------------------------------------------------------------ the filter language


def matching(path: Path, where: str) -> list[int]:
    result = rollouts(path, where=where, limit=100)
    assert result.total == len(result.rows)
    return [row["rollout_id"] for row in result.rows]


def expect(predicate: Callable[[dict[str, Any]], bool]) -> list[int]:
    return [r["id"] for r in ROWS if predicate(r)]


FILTERS: list[tuple[str, Callable[[dict[str, Any]], bool]]] = [
    ("reward == 1", lambda r: r["reward"] == 1),
    ("reward != 1.0", lambda r: r["reward"] != 1),
    ("reward < 0.5", lambda r: r["reward"] < 0.5),
    ("reward <= 0.5", lambda r: r["reward"] <= 0.5),
    ("reward > 0.5", lambda r: r["reward"] > 0.5),
    ("reward >= -1", lambda r: r["reward"] >= -1),
    ("reward>-1", lambda r: r["reward"] > -1),
    ("reward >= 1e0", lambda r: r["reward"] >= 1),
    ("step == 1", lambda r: r["step"] == 1),
    ("correct == true", lambda r: r["reward"] > 0),
    ("correct != TRUE", lambda r: not r["reward"] > 0),
    ('split == "train"', lambda r: r["split"] == "train"),
    ("split != 'train'", lambda r: r["split"] != "train"),
    ('prompt_id >= "p2"', lambda r: r["prompt"] >= "p2"),
    ('answer == "42"', lambda r: r["answer"] == "42"),
    ('answer != "42"', lambda r: r["answer"] is not None and r["answer"] != "42"),
    ("answer == null", lambda r: r["answer"] is None),
    ("answer != null", lambda r: r["answer"] is not None),
    ('answer contains "42"', lambda r: r["answer"] is not None and "42" in r["answer"]),
    ('answer contains "."', lambda r: False),  # literal, not a regex
    ('tool_calls contains "lookup"', lambda r: any("lookup" in c for c in r["calls"] or [])),
    ("tool_calls == null", lambda r: r["calls"] is None),
    ('`judge_note` == "note 3"', lambda r: r["id"] == 3),
    ("reward > 0 and step == 0", lambda r: r["reward"] > 0 and r["step"] == 0),
    ("reward < 0 or reward > 1", lambda r: r["reward"] < 0 or r["reward"] > 1),
    (
        'step == 0 or split == "train" and reward > 0.5',  # and binds tighter than or
        lambda r: r["step"] == 0 or (r["split"] == "train" and r["reward"] > 0.5),
    ),
    (
        '(step == 0 or split == "train") and reward > 0.5',
        lambda r: (r["step"] == 0 or r["split"] == "train") and r["reward"] > 0.5,
    ),
    ("not (reward > 0.5)", lambda r: not r["reward"] > 0.5),
    (
        '((answer contains "4")) AND NOT (step == 1 Or reward < 0)',
        lambda r: "4" in (r["answer"] or "") and not (r["step"] == 1 or r["reward"] < 0),
    ),
    ('response contains "<tool_call>"', lambda r: True),
    ('answer == "Forty two"', lambda r: r["id"] == 3),
    (r'answer == "say \"hi\""', lambda r: False),
]


@pytest.mark.parametrize(("where", "predicate"), FILTERS, ids=[f for f, _ in FILTERS])
def test_filter_matches_python(basic: Path, where: str, predicate: Callable[..., bool]) -> None:
    assert matching(basic, where) == expect(predicate)


def test_parse_filter_tree() -> None:
    assert parse_filter('a == 1 or b contains "x" and not c != null') == BoolOp(
        "or",
        Compare("a", "==", 1),
        BoolOp("and", Contains("b", "x"), Not(Compare("c", "!=", None))),
    )
    assert parse_filter(r"x == 'it\'s'") == Compare("x", "==", "it's")
    assert parse_filter("x >= -2.5e1") == Compare("x", ">=", -25.0)
    assert parse_filter("`weird col` == false") == Compare("weird col", "==", False)


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("", "empty filter"),
        ("   ", "empty filter"),
        ("reward >", "expected a value"),
        ("reward > > 1", "expected a value"),
        ("reward 1", "expected a comparison"),
        ("reward = 1", "compare with `==`"),
        ("reward >> 1", "expected a value"),
        ("(reward > 1", "expected `)`"),
        ("reward > 1)", "unexpected `)`"),
        ("reward > 1 and", "expected a column name"),
        ("1 < reward", "expected a column name"),
        ("reward > 'open", "unterminated string"),
        ("reward > 1; step == 0", "unexpected character ';'"),
        ("answer contains 42", "needs a quoted string"),
        ("and == 1", "expected a column name"),
        ("reward > 1 step == 0", "unexpected `step`"),
        ("(" * 500 + "reward > 1" + ")" * 500, "nested deeper"),
        ("not " * 500 + "reward > 1", "nested deeper"),
        ("reward > 1 or " * 2000 + "step == 0", "longer than"),
    ],
)
def test_filter_syntax_errors(basic: Path, where: str, message: str) -> None:
    with pytest.raises(RlscopeError) as caught:
        rollouts(basic, where=where)
    assert message in caught.value.message, caught.value.message


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ('reward == "1"', "holds number values"),
        ("answer == 42", "holds string values"),
        ("correct == 1", "holds boolean values"),
        ("correct > false", "use == or !="),
        ('reward contains "1"', "`contains` needs a text column"),
        ("tool_calls == 'a'", "use contains"),
        ("reward < null", "use == null or != null"),
    ],
)
def test_filter_type_errors(basic: Path, where: str, message: str) -> None:
    with pytest.raises(RlscopeError) as caught:
        rollouts(basic, where=where)
    assert message in caught.value.message, caught.value.message


def test_filter_unknown_column_lists_valid_ones(basic: Path) -> None:
    with pytest.raises(RlscopeError) as caught:
        rollouts(basic, where="rewards > 0 and step == 0")
    assert "unknown column `rewards`" in caught.value.message
    hint = caught.value.hint or ""
    assert "did you mean reward" in hint
    for column in ("rollout_id", "step", "reward", "answer", "judge_note", "correct"):
        assert column in hint


@pytest.mark.parametrize(
    "where",
    [
        "__import__('os').system('touch {sentinel}')",
        "reward > 0 or __import__(\"os\").system('touch {sentinel}')",
        "eval('1') == 1",
        "reward.__class__ == 1",
        "`__import__('os').system('touch {sentinel}')` == 1",
        "open('{sentinel}', 'w')",
        "reward > 0 and exec('x')",
        "[x for x in ()]",
        "reward > 0 # comment",
        "lambda: 1",
        "pl.col('reward') > 0",
    ],
)
def test_filter_rejects_code(
    basic: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    sentinel = tmp_path / "pwned"
    called: list[str] = []
    monkeypatch.setattr(builtins, "eval", lambda *a, **k: called.append("eval"))
    monkeypatch.setattr(builtins, "exec", lambda *a, **k: called.append("exec"))
    with pytest.raises(RlscopeError):
        rollouts(basic, where=where.format(sentinel=sentinel))
    assert not sentinel.exists() and not called


def test_filter_expr_is_a_polars_expression(basic: Path) -> None:
    schema = open_run(basic).scan("rollouts").collect_schema()
    expr = filter_expr("reward > 0.5", schema)
    frame = open_run(basic).scan("rollouts").filter(expr).select("rollout_id").collect()
    assert sorted(frame["rollout_id"].to_list()) == [0, 4, 5]


def test_list_order_limit_and_total(basic: Path) -> None:
    result = rollouts(basic, where="reward >= 0", limit=3)
    assert result.total == 7 and [r["rollout_id"] for r in result.rows] == [0, 1, 2]
    assert result.columns == (
        "rollout_id",
        "step",
        "prompt_id",
        "split",
        "reward",
        "correct",
        "response_len",
        "answer",
    )
    everything = rollouts(basic, limit=0)
    assert everything.total == 8 and everything.rows == ()


# ------------------------------------------------------------------------ --finding


@pytest.fixture
def broken_format(write_run: WriteRun) -> Path:
    """10 steps × 8 rollouts; rollouts 4-7 of every step break the format (no answer tag)."""
    good = "<think>ok</think><answer>1</answer>"
    bad = "<think>ok</think> and no answer"
    rows = [(step * 8 + i, step, i) for step in range(10) for i in range(8)]
    return write_run(
        {
            "rollouts": {
                "rollout_id": [r for r, _, _ in rows],
                "step": [s for _, s, _ in rows],
                "prompt_id": [f"p{i // 4}" for _, _, i in rows],
                "reward": [float(i % 2) for _, _, i in rows],
                "response_len": [10 + i for _, _, i in rows],
                "truncated": [False for _ in rows],
                "response": [bad if i >= 4 else good for _, _, i in rows],
                "answer": [None if i >= 4 else "1" for _, _, i in rows],
            }
        }
    )


def test_finding_that_fires(broken_format: Path) -> None:
    full = analyze(broken_format, config=Config())
    (finding,) = [f for f in full.findings if f.id == "format-violations"]
    named = finding.evidence["rollout_ids"]
    assert named and all(r % 8 >= 4 for r in named), "only broken rollouts are named"
    result = rollouts(broken_format, finding="format-violations", config=Config())
    ids = [r["rollout_id"] for r in result.rows]
    assert ids == sorted(named) and result.total == len(named) and result.message is None
    assert [(r["step"], r["rollout_id"]) for r in result.rows] == sorted(
        (r["step"], r["rollout_id"]) for r in result.rows
    )
    latest = max(r["step"] for r in result.rows)
    both = rollouts(
        broken_format, finding="format-violations", where=f"step == {latest}", config=Config()
    )
    assert [r["rollout_id"] for r in both.rows] == [i for i in ids if i // 8 == latest]


def test_finding_that_did_not_fire(broken_format: Path) -> None:
    result = rollouts(broken_format, finding="truncation", config=Config())
    assert result.rows == () and result.total == 0
    assert result.message == "finding `truncation` did not fire on this run"
    skipped = rollouts(broken_format, finding="tool-cap-saturation", config=Config())
    assert skipped.rows == () and "could not be checked" in (skipped.message or "")
    disabled = Config(findings={"format-violations": {"enabled": False}}, source="x.toml")
    off = rollouts(broken_format, finding="format-violations", config=disabled)
    assert off.rows == () and off.message == "finding `format-violations` is disabled in x.toml"


def test_unknown_finding_id(broken_format: Path) -> None:
    with pytest.raises(RlscopeError) as caught:
        rollouts(broken_format, finding="no-such-finding")
    assert "unknown finding id" in caught.value.message
    assert "rlscope metrics" in (caught.value.hint or "")
    with pytest.raises(RlscopeError) as caught:
        rollouts(broken_format, finding="behavior.format_ok")
    assert "a metric id, not a finding id" in caught.value.message


def test_grad_spike_finding(tmp_path: Path) -> None:
    run = generate(
        tmp_path / "gs", "grad-spike", steps=30, prompts_per_step=8, tokens=False, text=False
    )
    (finding,) = [f for f in analyze(run, config=Config()).findings if f.id == "grad-spike"]
    want = sorted(
        item["rollout_id"] for items in finding.evidence["rollouts"].values() for item in items
    )
    result = rollouts(run, finding="grad-spike", config=Config())
    assert want and [r["rollout_id"] for r in result.rows] == want
    assert {r["step"] for r in result.rows} <= set(finding.evidence["steps"])


# ------------------------------------------------------------------------ the real CLI


def test_cli_show(basic: Path) -> None:
    before = fingerprint(basic)
    result = cli("show", str(basic), "5", env={"NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr
    for part in ("── think", "Let me look it up.", "── answer", "Tool calls", "Probes"):
        assert part in result.stdout
    assert "no heat strip: colour is off" in result.stdout
    doc = json.loads(
        cli("show", str(basic), "5", "--format", "json").stdout,
        parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"),
    )
    assert doc["rollout_id"] == 5 and doc["tokens"]["pos"] == list(range(13))
    assert [s["segment"] for s in doc["segments"]] == [s for s, _ in SEGMENTS]
    missing = cli("show", str(basic), "999")
    assert missing.returncode == 2 and "999" in missing.stderr
    assert "Traceback" not in missing.stderr and missing.stdout == ""
    assert cli("show", str(basic / "nope"), "1").returncode == 2
    assert cli("show", str(basic), "5", "--format", "xml").returncode == 2
    assert cli("show", str(basic), "five").returncode == 2
    assert fingerprint(basic) == before


def test_cli_rollouts(broken_format: Path, tmp_path: Path) -> None:
    result = cli("rollouts", str(broken_format), "--finding", "format-violations")
    assert result.returncode == 0, result.stderr
    assert "rollout(s) matched" in result.stdout and "rollout_id" in result.stdout
    result = cli("rollouts", str(broken_format), "--filter", "step >= 8", "--limit", "3")
    assert result.returncode == 0, result.stderr
    assert "16 rollout(s) matched, showing the first 3" in result.stdout
    doc = json.loads(
        cli("rollouts", str(broken_format), "--filter", "step == 9", "--format", "json").stdout
    )
    assert doc["total"] == 8 and [r["rollout_id"] for r in doc["rollouts"]] == list(range(72, 80))
    quiet = cli("rollouts", str(broken_format), "--finding", "truncation")
    assert quiet.returncode == 0 and "did not fire" in quiet.stdout
    for bad in (
        ["--finding", "nope"],
        ["--filter", "__import__('os').system('touch x')"],
        ["--filter", "reward > 1 and"],
        ["--filter", "nosuch == 1"],
        ["--limit", "-1"],
    ):
        failed = cli("rollouts", str(broken_format), *bad)
        assert failed.returncode == 2, (bad, failed.stdout, failed.stderr)
        assert "error:" in failed.stderr.lower() and "Traceback" not in failed.stderr
    unknown = cli("rollouts", str(broken_format), "--filter", "nosuch == 1")
    assert "unknown column `nosuch`" in unknown.stderr and "response_len" in unknown.stderr


# ------------------------------------------------------------------------ hostile text

HOSTILE = "pre \x1b[31mRED \x1b]8;;http://x\x07link\x1b]8;;\x07 \u202eevil [bold red]x[/] post"
BIDI = re.compile("[\u202a-\u202e\u2066-\u2069]")
SGR = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def hostile(write_run: WriteRun) -> Path:
    response = (
        f'<think>{HOSTILE}</think><tool_call>{{"name": "{HOSTILE[:10]}", '
        f'"arguments": {{"q": "[red]z[/]"}}}}</tool_call><answer>{HOSTILE}</answer>'
    )
    return write_run(
        {
            "rollouts": {
                "rollout_id": [1, 2],
                "step": [0, 0],
                "prompt_id": [HOSTILE, "[link=http://x]p[/link]"],
                "reward": [1.0, 0.0],
                "response_len": [4, 4],
                "answer": [HOSTILE, "\x9b31m"],
                "response": [response, HOSTILE],
                "\x1b[5mcol": ["v\x1b[7m", "w"],
            },
            "tokens": {
                "rollout_id": [1] * 4,
                "step": [0] * 4,
                "pos": [0, 1, 2, 3],
                "entropy": [0.1, 3.0, 1.0, 0.4],
            },
            "probes": {
                "rollout_id": [1],
                "intervention": [HOSTILE],
                "answer": [HOSTILE],
                "hint": ["\u202e7"],
            },
        }
    )


def assert_clean(text: str, *, allowed: re.Pattern[str] | None = None) -> None:
    rest = allowed.sub("", text) if allowed else text
    bad = [ch for ch in rest if (ord(ch) < 0x20 and ch not in "\n\t") or 0x7F <= ord(ch) < 0xA0]
    assert not bad, f"raw controls reached the terminal: {bad!r}"
    assert not BIDI.search(rest), "a bidi override reached the terminal"


def test_hostile_text_is_escaped(hostile: Path) -> None:
    shown = cli("show", str(hostile), "1", env={"NO_COLOR": "1", "COLUMNS": "400"})
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "\x1b" not in out and "\x07" not in out
    assert_clean(out)
    assert "\\x1b[31mRED" in out and "\\x1b]8;;http://x\\x07link" in out
    assert "\\u202eevil" in out and "[bold red]x[/]" in out and "[red]z[/]" in out
    assert "\\x1b[5mcol" in out and "v\\x1b[7m" in out
    listed = cli("rollouts", str(hostile), env={"NO_COLOR": "1", "COLUMNS": "400"})
    assert listed.returncode == 0, listed.stderr
    assert "\x1b" not in listed.stdout and "\\x9b31m" in listed.stdout
    assert "[link=http://x]p[/link]" in listed.stdout
    assert_clean(listed.stdout)
    for args in (["show", str(hostile), "1"], ["rollouts", str(hostile)]):
        raw = cli(*args, "--format", "json").stdout
        assert raw.isascii() and "\x1b" not in raw
        json.loads(raw)


def test_hostile_text_with_colour_forced(hostile: Path) -> None:
    """On a colour terminal only rlscope's own SGR styling reaches the output."""
    for args in (
        ["show", str(hostile), "1"],
        ["show", str(hostile), "2"],
        ["rollouts", str(hostile)],
    ):
        result = cli(*args, env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
        assert result.returncode == 0, result.stderr
        assert SGR.search(result.stdout) or args[0] == "rollouts"
        assert_clean(result.stdout, allowed=SGR)
        assert "\\x1b[31mRED" in SGR.sub("", result.stdout)
        if args[1:] == [str(hostile), "1"]:
            assert "alignment is approximate" in result.stdout, "the heat strip is drawn"
