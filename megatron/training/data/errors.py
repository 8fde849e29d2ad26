"""The data pipeline's input error, below the modules that check files and flags."""

from __future__ import annotations

from megatron.errors import UsageError


class DataConfigError(UsageError, ValueError):
    """Bad data input found at start-up. The message names the flag or file, and a fix."""


__all__ = ["DataConfigError"]
