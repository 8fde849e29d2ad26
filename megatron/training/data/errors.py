"""The data pipeline's errors, below the modules that check files, flags and batches."""

from __future__ import annotations

from megatron.errors import UsageError


class DataConfigError(UsageError, ValueError):
    """Bad data input found at start-up. The message names the flag or file, and a fix."""


class BatchMismatchError(UsageError, RuntimeError):
    """Ranks that must read the same micro-batch (a TP x CP group) read different ones.

    Found during training (exit status 1, as any failed run); the lowest rank of the group
    is ``primary`` and prints the one line, since rank 0 may not be in the group."""

    exit_status = 1

    def __init__(self, message: str, primary: bool = False) -> None:
        super().__init__(message)
        self.primary = primary


__all__ = ["BatchMismatchError", "DataConfigError"]
