"""Untrusted text made safe for a terminal: controls, escapes and bidi overrides made visible.

Everything that comes from a run's data is untrusted — run.json fields, file and column names,
prompt ids, rollout text quoted in findings, error messages quoting values. Printed raw, an ESC
sequence could retitle the window, clear the screen, recolour or hide the report, or forge
lines; a bidi override could make text read differently from what it is. `safe_text` is applied
at the renderer boundary (the terminal report and the CLI's messages); the library's data and
the JSON output keep the raw strings (`json.dumps` escapes C0 controls itself).

What is replaced, by a visible Python-style escape (`\\x1b`, `\\x9b`, `\\u202e`, `\\udcff`):

- C0 controls U+0000–U+001F, except `\\n` and `\\t` when `multiline=True`; ESC (U+001B) is
  among them, so every ESC/CSI/OSC sequence is broken at its first byte and its remainder
  shows as plain text (`\\x1b]0;title\\x07` reads literally);
- DEL U+007F and the C1 controls U+0080–U+009F (U+009B is a one-character CSI on some
  terminals);
- bidi embeddings/overrides U+202A–U+202E, isolates U+2066–U+2069, and the marks U+200E,
  U+200F, U+061C;
- in one-line mode (the default) also the line and paragraph separators U+2028, U+2029;
- lone surrogates U+D800–U+DFFF (undecodable bytes in file names, via `surrogateescape`),
  which would otherwise make printing to a UTF-8 stream raise.

`\\r` is always replaced (it would let text overwrite the start of its line). Backslashes are
left alone, so a Windows path stays readable; an escape is therefore not distinguishable from
the same characters typed literally, which is harmless for display.

`safe_text` does not touch Rich markup: print the result as `rich.text.Text` (or with
`markup=False`), never interpolated into a markup string.
"""

from __future__ import annotations

_ALWAYS = (
    {c for c in range(0x20) if c not in (0x09, 0x0A)}
    | {0x7F}
    | set(range(0x80, 0xA0))
    | set(range(0x202A, 0x202F))
    | set(range(0x2066, 0x206A))
    | {0x200E, 0x200F, 0x061C}
)
_ONE_LINE = {0x09, 0x0A, 0x2028, 0x2029}


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


_MULTI_TABLE = {c: _escape(c) for c in _ALWAYS}
_ONE_LINE_TABLE = {**_MULTI_TABLE, **{c: _escape(c) for c in _ONE_LINE}}


def safe_text(s: object, *, multiline: bool = False) -> str:
    """`s` (str()-ed if not a string) with terminal controls replaced by visible escapes.

    One-line fields (ids, names, paths, single messages) use the default; `multiline=True`
    keeps `\\n` and `\\t` for text meant to span lines (an error with its hint, a summary).
    """
    text = s if isinstance(s, str) else str(s)
    text = text.translate(_MULTI_TABLE if multiline else _ONE_LINE_TABLE)
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):
        text = "".join(_escape(ord(ch)) if 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in text)
    return text
