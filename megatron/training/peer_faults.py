"""A collective that failed because another rank died or stopped answering.

gloo raises a plain ``RuntimeError`` for both ("Connection closed by peer", "Timed out
waiting 60000ms for recv operation"), NCCL a ``torch.distributed.DistBackendError``; neither
says which rank. A rank that meets one exits with :data:`PEER_LOST_STATUS` after one line,
so that ``tools/launch.py`` can tell these ranks from the one that failed first (a rank
killed by a signal, or one that exited with its own error) and name that one.

Standard library only: ``megatron.training.launch`` reads the status without the loop.
"""

from __future__ import annotations

import re
from typing import Optional

PEER_LOST_STATUS = 3

# Words of gloo's and NCCL's errors for a peer that is gone or silent.
_PEER_WORDS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting",
               "NCCL communicator was aborted", "Watchdog caught collective")


class PeerLostError(RuntimeError):
    """This rank's collective failed: another rank died or stopped answering."""

    exit_status = PEER_LOST_STATUS
    primary = True  # every rank that meets it says so: it may be the only one left


def peer_failure_text(exc: BaseException) -> Optional[str]:
    """The first line of the communication error inside ``exc`` (its causes and contexts),
    without gloo's source-file prefix; None when ``exc`` is not one."""
    seen = set()
    todo = [exc]
    while todo:
        cur = todo.pop(0)
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        text = str(cur)
        if type(cur).__name__ == "DistBackendError" or any(w in text for w in _PEER_WORDS):
            first = text.strip().splitlines()[0] if text.strip() else type(cur).__name__
            first = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\]\s*", "", first)
            return first.split(". This is typically")[0][:300]   # gloo's generic advice
        todo += [cur.__cause__, cur.__context__]
    return None


def peer_lost(exc: BaseException, rank: int, timeout_minutes: int) -> Optional[PeerLostError]:
    """A :class:`PeerLostError` naming this rank and what it met, or None when ``exc`` is
    not a communication failure."""
    text = peer_failure_text(exc)
    if text is None:
        return None
    return PeerLostError(f"rank {rank} lost contact with another rank: {text} "
                         f"(--distributed-timeout-minutes {timeout_minutes}); another rank "
                         f"died or stopped answering, tools/launch.py names it")


__all__ = ["PEER_LOST_STATUS", "PeerLostError", "peer_failure_text", "peer_lost"]
