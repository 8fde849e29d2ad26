"""The command line's error, below every flag module so each can raise it."""

from __future__ import annotations

from megatron.errors import UsageError


class ArgumentsError(UsageError, ValueError):
    """A bad or conflicting flag. The message names the flag and suggests a valid value."""


__all__ = ["ArgumentsError"]
