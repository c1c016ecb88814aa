"""Errors of the job layer: a bad spec is the submitter's to fix, bad data the data owner's."""

from __future__ import annotations

from swarmd.errors import LocalError
from swarmd.model.config import ConfigError


class SpecError(ConfigError):
    """The job spec is invalid; `field` is the dotted key (`batch.global_samples`) so the message
    says which line of the TOML to fix."""


class DataError(LocalError, ValueError):
    """The training data does not fit the spec (a token id outside the vocabulary, say)."""
