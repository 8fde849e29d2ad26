"""The one base class for errors a user causes and can fix.

Floor 0: imports nothing of the project, so every room (usp, layers, memory, planner,
training, bench, tools) can derive its own input errors from :class:`UsageError`, and an
entry point catches them all with one ``except UsageError``.
"""

from __future__ import annotations


class UsageError(Exception):
    """Bad input the user can fix: a flag, a file, a layout.

    The message is one line that names the flag or file at fault and a valid value. Every
    subclass keeps its historical builtin base too (``class XError(UsageError, ValueError)``),
    so existing ``except ValueError`` / ``except RuntimeError`` clauses still catch it.

    ``exit_status`` is what an entry point exits with when it reports the error: 2 (bad
    input, as argparse does); a subclass may say otherwise.
    """

    exit_status = 2


__all__ = ["UsageError"]
