"""How a rank that fails leaves a torchrun job, so that the right line and status come out.

torchrun stops every worker (SIGTERM, then SIGKILL after its grace) as soon as one exits
with an error, and ``tools/launch.py`` names the rank that failed first by exit status.
Two races followed:

* every rank meets the same usage error, only rank 0 prints it, and a rank that got there
  first ended the job before rank 0 had printed (exit 2, no message): the silent ranks now
  wait for torchrun to stop them (:func:`leave_the_message_to_rank_0`);
* the rank with its own error closes its connections, its peers notice and exit first, and
  torchrun's SIGTERM then killed it before its own exit status could name it: a failing rank
  now ignores that SIGTERM (:func:`keep_own_exit_status`).

Standard library only: the command-line parser uses it before torch is imported.
"""

from __future__ import annotations

import os
import signal
import threading

USAGE_WAIT_S = 20.0
_stop_requested = threading.Event()


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _note_sigterm(signum, frame) -> None:
    _stop_requested.set()


def keep_own_exit_status() -> None:
    """Under torchrun, ignore SIGTERM from now on: this rank is leaving with its own error.
    Ignored, not handled: the interpreter resets Python handlers to the default while it
    finalizes, when the SIGTERM often arrives. Leaving stays bounded (the DataLoader workers
    are stopped with a timeout; torchrun SIGKILLs after its grace)."""
    if _under_torchrun() and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def leave_the_message_to_rank_0() -> None:
    """On a rank other than 0 of a torchrun job, before exiting with an error that only rank
    0 prints: wait, at most :data:`USAGE_WAIT_S`, for torchrun's SIGTERM, which comes once
    rank 0 has printed and exited, and return on it."""
    if not _under_torchrun() or int(os.environ.get("RANK", "0")) == 0:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _note_sigterm)
    _stop_requested.wait(USAGE_WAIT_S)


__all__ = ["USAGE_WAIT_S", "keep_own_exit_status", "leave_the_message_to_rank_0"]
