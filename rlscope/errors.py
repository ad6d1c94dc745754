"""The one exception type rlscope raises for bad input, mapped to exit code 2 by the CLI."""

from __future__ import annotations

from collections.abc import Iterable
from difflib import get_close_matches


class RlscopeError(Exception):
    """Bad input, usage or configuration: a message a person can act on, no traceback."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


def did_you_mean(name: str, candidates: Iterable[str], otherwise: str) -> str:
    """The hint for an unknown `name`: up to five candidates that contain it, share its last
    dotted part, or are spelled alike; `otherwise` when none is close."""
    pool = list(dict.fromkeys(candidates))
    lowered = name.lower()
    last = lowered.rsplit(".", 1)[-1]
    close = [c for c in pool if lowered in c.lower()]
    close += [c for c in pool if last and last in c.lower() and c not in close]
    close += [c for c in get_close_matches(name, pool, n=5) if c not in close]
    return f"did you mean {', '.join(close[:5])}?" if close else otherwise
