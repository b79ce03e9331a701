"""The package version, read from the installed metadata (pyproject.toml is the one source)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gradstep")
except PackageNotFoundError:  # pragma: no cover - running from a source tree, not installed
    __version__ = "0+unknown"
