"""What a run prints besides its own log lines: warnings once, in one line each.

megatron-core warns at import and at every model build when TransformerEngine or Apex is
missing ("Falling back to Torch optimizers", "Falling back to Torch Norm", ...), once per
rank, each as two lines (the message and the ``warnings.warn(`` source line). A run of four
ranks printed ~56 such lines before its first iteration. :func:`install_console_filters`
(``pretrain_gpt.py`` calls it before importing megatron-core) makes each distinct warning
appear once per process as one line, and megatron-core's and torch's warnings and
megatron-core's log records appear on rank 0 only: they are the same on every rank (they
describe the installation, not the rank).

Nothing is hidden: every distinct message is still shown once (rank 0 for the libraries',
every rank for the others).
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Callable, Optional, Set, TextIO, Tuple

_MCORE_LOGGER = "megatron.core"
# Libraries whose warnings describe the installation, the same on every rank.
_LIBRARIES = (("/megatron/core/", "megatron-core"), ("/site-packages/torch/", "torch"))


def _library(filename: str) -> str:
    """"megatron-core" or "torch" when ``filename`` belongs to one, else ""."""
    path = filename.replace("\\", "/")
    return next((name for part, name in _LIBRARIES if part in path), "")


class OnceWarningPrinter:
    """A ``warnings.showwarning`` replacement: one line per distinct (category, message);
    megatron-core's and torch's only when ``show_megatron_core`` (rank 0)."""

    def __init__(self, show_megatron_core: bool, stream: Optional[TextIO] = None) -> None:
        self.show_megatron_core = show_megatron_core
        self.stream = stream
        self.seen: Set[Tuple[str, str]] = set()

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        library = _library(str(filename))
        if library and not self.show_megatron_core:
            return
        key = (category.__name__, str(message))
        if key in self.seen:
            return
        self.seen.add(key)
        source = library or f"{filename}:{lineno}"
        text = " ".join(str(message).split())  # one line, whatever the message holds
        stream = file or self.stream or sys.stderr
        try:
            stream.write(f"{category.__name__} ({source}): {text}\n")
        except (OSError, ValueError):
            pass  # a closed stream must not turn a warning into an error


class OnceLogFilter(logging.Filter):
    """Drops repeats of a log message, and megatron-core's records on ranks other than 0."""

    def __init__(self, show_megatron_core: bool) -> None:
        super().__init__()
        self.show_megatron_core = show_megatron_core
        self.seen: Set[Tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(_MCORE_LOGGER) and not self.show_megatron_core:
            return False
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def install_console_filters(rank: int) -> Callable[[], None]:
    """Warnings once, one line each; megatron-core's warnings and logs on rank 0 only.

    Call before megatron-core is imported (its fallback warnings fire at import). The
    handlers of the root logger (``logging.basicConfig``'s) get the log filter. Returns a
    function that restores the previous ``warnings.showwarning`` and removes the filters.
    """
    show = rank == 0
    previous = warnings.showwarning
    printer = OnceWarningPrinter(show)
    warnings.showwarning = printer
    log_filter = OnceLogFilter(show)
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(log_filter)

    def restore() -> None:
        warnings.showwarning = previous
        for handler in handlers:
            handler.removeFilter(log_filter)

    return restore
