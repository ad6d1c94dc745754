"""The one exception type rlscope raises for bad input, mapped to exit code 2 by the CLI."""

from __future__ import annotations


class RlscopeError(Exception):
    """Bad input, usage or configuration: a message a person can act on, no traceback."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"
