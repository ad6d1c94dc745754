"""One rollout (`rlscope show`) and lists of rollouts (`rlscope rollouts`) for the terminal or JSON.

All data text (responses, answers, prompt ids, tool calls, column names) goes through
`safe_text` into `Text(...)`, never into a markup string.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from rich.cells import cell_len
from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rlscope.inspect import RolloutList, RolloutView, WordHeat
from rlscope.render.sanitize import safe_text

HEADER_COLUMNS = (
    "rollout_id",
    "step",
    "prompt_id",
    "split",
    "reward",
    "correct",
    "advantage",
    "response_len",
    "answer",
)
#: Shown in their own sections, not in the header.
BODY_COLUMNS = ("response", "tool_calls")
SEGMENT_STYLE = {
    "think": "magenta",
    "answer": "bold green",
    "tool_call": "cyan",
    "tool_response": "blue",
    "text": "dim",
}
#: Fixed entropy scale (nats): upper bound of each bin and its colour.
HEAT_BINS = (
    (0.25, "blue"),
    (0.5, "cyan"),
    (1.0, "green"),
    (1.5, "yellow"),
    (2.0, "dark_orange"),
    (math.inf, "bold red"),
)
HEAT_MAX = 2.0
BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 80
ANSWER_WIDTH = 40
CELL_WIDTH = 200


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else "—"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _cell(value: Any, width: int = CELL_WIDTH, style: str = "") -> Text:
    """One-line data text: truncated, controls escaped, never markup."""
    return Text(safe_text(_clip(_fmt(value), width)), style=style)


def heat_style(entropy: float | None) -> str:
    """The colour of an entropy value on the fixed scale (dim when undefined)."""
    if entropy is None:
        return "dim"
    return next(style for bound, style in HEAT_BINS if entropy < bound)


def entropy_sparkline(values: Sequence[float | None], width: int = SPARK_WIDTH) -> str:
    """Per-position entropy in `width` buckets (bucket means) on the fixed 0 … ≥2 nats scale;
    a bucket without a value is a space."""
    n = len(values)
    if n == 0:
        return ""
    width = min(width, n)
    out = []
    for b in range(width):
        bucket = values[b * n // width : (b + 1) * n // width]
        finite = [float(v) for v in bucket if v is not None and math.isfinite(float(v))]
        if not finite:
            out.append(" ")
            continue
        level = min(max(sum(finite) / len(finite), 0.0), HEAT_MAX) / HEAT_MAX
        out.append(BLOCKS[round(level * (len(BLOCKS) - 1))])
    return "".join(out)


def _header(view: RolloutView) -> Panel:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for column in HEADER_COLUMNS:
        if column in view.row:
            grid.add_row(Text(column, style="bold"), _cell(view.row[column]))
    for column, value in view.row.items():
        if column not in HEADER_COLUMNS and column not in BODY_COLUMNS:
            grid.add_row(Text(safe_text(column), style="bold"), _cell(value))
    title = Text.assemble(
        "rlscope show  ", (safe_text(view.run_id), "bold"), f"  rollout {view.rollout_id}"
    )
    return Panel(grid, title=title, title_align="left")


def _response(view: RolloutView) -> list[RenderableType]:
    if view.response is None:
        return [Text("no response text (the rollouts table has no `response`)", style="dim")]
    parts: list[RenderableType] = [Text("Response", style="bold underline")]
    for segment in view.segments:
        style = SEGMENT_STYLE.get(segment.name, "bold")
        parts.append(Text(f"── {safe_text(segment.name)}", style=style))
        body = segment.text.strip("\n")
        parts.append(Padding(Text(safe_text(body, multiline=True)), (0, 0, 0, 2), expand=False))
    if not view.segments:
        parts.append(Text("(empty)", style="dim"))
    return parts


def _tool_calls(view: RolloutView) -> list[RenderableType]:
    if not view.tool_calls:
        return []
    source = "the `tool_calls` column" if view.tool_calls_source == "tool_calls" else "the tags"
    parts: list[RenderableType] = [
        Text.assemble(("Tool calls", "bold underline"), (f"  (from {source})", "dim"))
    ]
    for i, call in enumerate(view.tool_calls, 1):
        line = Text(f"  {i}. ", style="dim")
        if call.name is not None:
            arguments = json.dumps(call.arguments, ensure_ascii=False)
            line.append(safe_text(call.name), style="bold cyan")
            line.append(" ")
            line.append(safe_text(_clip(arguments, 2 * CELL_WIDTH)))
        else:
            line.append(safe_text(_clip(call.text, 2 * CELL_WIDTH)))
        parts.append(line)
    return parts


def heat_strip(response: str, heat: Sequence[WordHeat]) -> Text:
    """The response with each word styled by its mean entropy (`heat_style`); text between
    words unstyled; controls escaped."""
    strip = Text()
    last = 0
    for word in heat:
        strip.append(safe_text(response[last : word.start], multiline=True))
        strip.append(
            safe_text(response[word.start : word.end], multiline=True),
            style=heat_style(word.entropy),
        )
        last = word.end
    return strip


def _legend() -> Text:
    legend = Text("entropy (nats): ", style="dim")
    lower = 0.0
    for bound, style in HEAT_BINS:
        label = f"≥{lower:g}" if math.isinf(bound) else f"{lower:g}–{bound:g}"
        legend.append(f"■ {label}  ", style=style)
        lower = bound
    legend.append("■ no value", style="dim")
    return legend


def _entropy(view: RolloutView, colour: bool = True) -> list[RenderableType]:
    parts: list[RenderableType] = [Text("Token entropy", style="bold underline")]
    if not view.tokens:
        parts.append(Text(f"no heat strip: {safe_text(view.tokens_note or '')}", style="dim"))
        return parts
    if "entropy" not in view.tokens:
        parts.append(Text("no heat strip: the tokens table has no `entropy` column", style="dim"))
        return parts
    entropy = view.tokens["entropy"]
    finite = [float(v) for v in entropy if v is not None and math.isfinite(float(v))]
    if not finite:
        parts.append(
            Text(
                f"no heat strip: all {len(entropy):,} entropy values of this rollout are missing",
                style="dim",
            )
        )
        return parts
    heat = view.word_entropy()
    response = view.response
    if response is None or not heat:
        parts.append(Text("no heat strip: no response text to align the tokens with", style="dim"))
    elif not colour:
        parts.append(
            Text(
                "no heat strip: colour is off (NO_COLOR, or not a terminal); the sparkline below "
                "and --format json carry the entropies",
                style="dim",
            )
        )
    else:
        parts.append(Padding(heat_strip(response, heat), (0, 0, 0, 2), expand=False))
        parts.append(_legend())
        parts.append(
            Text(
                f"alignment is approximate: the tokens table has no token strings, so word i of "
                f"W = {len(heat):,} covers tokens [i·T/W, (i+1)·T/W) of T = {len(entropy):,} "
                "by position, coloured by their mean entropy",
                style="dim",
            )
        )
    positions = view.tokens.get("pos", [])
    worst = max(
        (
            (float(v), p)
            for v, p in zip(entropy, positions, strict=False)
            if v is not None and math.isfinite(float(v))
        ),
        default=None,
    )
    spark = Text("  ")
    spark.append(entropy_sparkline(entropy), style="blue")
    parts.append(spark)
    summary = (
        f"per position {positions[0]}–{positions[-1]}, 0 ▁ … █ ≥{HEAT_MAX:g} nats; mean "
        f"{sum(finite) / len(finite):.3f}"
    )
    if worst is not None:
        summary += f", max {worst[0]:.3f} at pos {worst[1]}"
    length = view.row.get("response_len")
    if isinstance(length, int) and length != len(entropy):
        summary += f"; {len(entropy):,} token rows for a response_len of {length:,}"
    parts.append(Text(summary, style="dim"))
    return parts


def _probes(view: RolloutView) -> list[RenderableType]:
    if view.probes_note:
        return [Text(f"no probes: {safe_text(view.probes_note)}", style="dim")]
    if not view.probes:
        return [Text("no probes of this rollout", style="dim")]
    table = Table(title="Probes", title_justify="left", title_style="bold underline")
    for column in ("#", "intervention", "fraction", "answer", "hint", "unchanged"):
        table.add_column(Text(column), no_wrap=True, overflow="ellipsis")
    texts: list[RenderableType] = []
    for number, probe in enumerate(view.probes, 1):
        unchanged = probe.unchanged
        table.add_row(
            Text(str(number)),
            _cell(probe.row.get("intervention"), ANSWER_WIDTH),
            _cell(probe.row.get("fraction")),
            _cell(probe.row.get("answer"), ANSWER_WIDTH),
            _cell(probe.row.get("hint"), ANSWER_WIDTH),
            Text(
                "—" if unchanged is None else "yes" if unchanged else "no",
                style="dim" if unchanged is None else "green" if unchanged else "red",
            ),
        )
        response = probe.row.get("response")
        if response:
            by = [str(probe.row[k]) for k in ("model", "checkpoint_step") if probe.row.get(k)]
            label = f"#{number}" + (f" ({', step '.join(by)})" if by else "") + ": "
            texts.append(Text(label, style="bold").append(safe_text(str(response))))
    return [table, *texts]


def render_rollout(view: RolloutView, console: Console) -> None:
    """Header, response by segment, tool calls, token entropy heat strip, probes."""
    parts: list[RenderableType] = [_header(view)]
    colour = not console.no_color and console.color_system is not None
    for rendered in (_response(view), _tool_calls(view), _entropy(view, colour), _probes(view)):
        if rendered:
            parts += [Text(""), *rendered]
    console.print(Group(*parts))


def render_rollout_json(view: RolloutView) -> str:
    # ASCII-only: C1 controls and bidi overrides in data cannot reach a terminal raw.
    return json.dumps(view.to_dict(), indent=2, ensure_ascii=True, allow_nan=False, default=str)


FREE_COLUMNS = ("prompt_id", "answer")
PADDING = 2


def _list_table(listing: RolloutList, width: int) -> Table:
    """One line per rollout: the short columns at their natural width, prompt_id and answer
    sharing what is left (clipped with an ellipsis)."""
    cells = {
        c: [safe_text(_clip(_fmt(row.get(c)), ANSWER_WIDTH)) for row in listing.rows]
        for c in listing.columns
    }
    natural = {c: max([cell_len(c), *(cell_len(v) for v in cells[c])]) for c in listing.columns}
    fixed = sum(n for c, n in natural.items() if c not in FREE_COLUMNS)
    free = [c for c in listing.columns if c in FREE_COLUMNS]
    budget = max(8 * len(free), width - fixed - PADDING * (len(listing.columns) - 1))
    widths = {c: natural[c] for c in free}
    if sum(widths.values()) > budget:
        for i, column in enumerate(free):
            share = budget // (len(free) - i)
            widths[column] = min(natural[column], max(8, share))
            budget -= widths[column]
    table = Table(box=None, pad_edge=False, padding=(0, PADDING))
    for column in listing.columns:
        numeric = column in ("rollout_id", "step", "reward", "response_len")
        size = widths.get(column, natural[column])
        table.add_column(
            Text(safe_text(column)),
            justify="right" if numeric else "left",
            no_wrap=True,
            overflow="ellipsis",
            min_width=size,
            max_width=size,
        )
    for i in range(len(listing.rows)):
        table.add_row(*(Text(cells[c][i]) for c in listing.columns))
    return table


def render_rollout_list(listing: RolloutList, console: Console) -> None:
    """A table of the matching rollouts and how many matched."""
    parts: list[RenderableType] = []
    if listing.message:
        parts.append(Text(safe_text(listing.message)))
    for note in listing.notes:
        parts.append(Text(safe_text(note), style="dim"))
    if listing.rows:
        parts.append(_list_table(listing, console.width))
    if listing.message is None:
        matched = f"{listing.total:,} rollout(s) matched"
        if listing.total > len(listing.rows):
            matched += f", showing the first {len(listing.rows):,} (--limit to change)"
        parts.append(Text(matched, style="bold" if listing.total else "yellow"))
    if listing.rows:
        parts.append(
            Text(f"`rlscope show {safe_text(listing.run_path)} ID` opens one.", style="dim")
        )
    console.print(Group(*parts))


def render_rollout_list_json(listing: RolloutList) -> str:
    return json.dumps(listing.to_dict(), indent=2, ensure_ascii=True, allow_nan=False, default=str)
