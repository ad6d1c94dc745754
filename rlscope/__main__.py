"""`python -m rlscope` runs the CLI."""

from __future__ import annotations

from rlscope.cli import main

main()
