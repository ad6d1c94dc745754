"""The package version (a leaf module: anything may import it without importing the package)."""

from __future__ import annotations

__version__ = "0.1.0"
