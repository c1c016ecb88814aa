"""The installed swarmd's version, in one place below both the CLI and the daemon that report it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """The distribution's version, or "unknown" when run from a tree that was never installed."""
    try:
        return version("swarmd")
    except PackageNotFoundError:
        return "unknown"
