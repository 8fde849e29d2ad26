"""What a failed save tells the user: which directory, how much room it needed, what is safe.

A save can fail part-way (a full disk, a quota, a read-only remount): megatron-core's
writer then raises on every rank alike (its ``save_state_dict_async_finalize`` broadcasts
the failure; the coordinator, rank 0, holds every rank's exception), and the publishing
protocol of :mod:`megatron.training.checkpoint.save_load` guarantees nothing half-written is
ever named by the tracker. This module turns such a failure into one sentence::

    saving iteration 6 to /ckpt/iter_0000006 failed: the disk is full; it needs about
    12.31 GiB (the size of iter_0000004) and /ckpt has 3.20 GiB free. Nothing was published: the last complete checkpoint, /ckpt/iter_0000004, is
    intact and --load /ckpt resumes from it.

:func:`root_os_error` digs the operating system's error out of the wrapped exceptions
(PyTorch's ``CheckpointException`` keeps ``{rank: (exception, traceback)}``); where torch's
writer lost the errno, :func:`out_of_room` recognises a full disk by the room left.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import List, Optional, Tuple

from megatron.errors import UsageError

GIB = float(2**30)

# Errors that mean "the storage cannot take the checkpoint", as opposed to a bug.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                  errno.EPERM, errno.EIO}


class CheckpointSaveError(UsageError, RuntimeError):
    """A save that could not complete. Nothing was published; the message names the
    directory, the room needed, and the last complete checkpoint. ``primary``: this rank
    met the fault itself (it prints the message even when it is not rank 0)."""

    # The command line was fine; the storage failed mid-run (exit 1, as any failed run).
    exit_status = 1

    def __init__(self, message: str, primary: bool = False) -> None:
        super().__init__(message)
        self.primary = primary


def root_os_error(exc: BaseException) -> Optional[Tuple[OSError, Optional[int]]]:
    """The first storage ``OSError`` inside ``exc`` (breadth first through causes,
    contexts and per-rank failures) and the rank it came from when known."""
    todo: List[Tuple[BaseException, Optional[int]]] = [(exc, None)]
    seen = set()
    while todo:
        cur, rank = todo.pop(0)
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in STORAGE_ERRNOS:
            return cur, rank
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):
            for r, value in failures.items():
                first = value[0] if isinstance(value, tuple) else value
                if isinstance(first, BaseException):
                    todo.append((first, r))
        todo += [(e, rank) for e in (cur.__cause__, cur.__context__) if e is not None]
    return None


def directory_bytes(path: str) -> int:
    """Total size of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def free_bytes(path: str) -> Optional[int]:
    """Free bytes of the filesystem holding ``path`` (its nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def size_text(n: int) -> str:
    """Bytes in GiB, or MiB below 1 GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _needed_bytes(previous: Optional[str]) -> Optional[int]:
    return directory_bytes(previous) if previous is not None else None


def out_of_room(root: str, previous: Optional[str], written: int) -> bool:
    """Whether ``root``'s filesystem cannot hold another checkpoint: less free than the
    previous checkpoint's size (or, without one, almost nothing left after ``written``).

    torch's writer loses the errno of a failed write (its zip writer raises "unexpected
    pos"), so a full disk is recognised by the room left, not by the error.
    """
    free = free_bytes(root)
    if free is None:
        return False
    needed = _needed_bytes(previous)
    return free < needed if needed else free < max(16 << 20, written // 100)


def room_sentence(root: str, previous: Optional[str], written: int) -> str:
    """How much the save needs (the previous checkpoint's size, else more than what was
    written before the failure) and how much ``root`` has free."""
    free = free_bytes(root)
    needed = _needed_bytes(previous)
    if needed is not None:
        need = (f"it needs about {size_text(needed)} (the size of "
                f"{os.path.basename(previous)})")
    else:
        need = f"it needs more than the {size_text(written)} written before the failure"
    return need + (f" and {root} has {size_text(free)} free" if free is not None else "")


def safe_sentence(root: str, previous: Optional[str]) -> str:
    if previous is None:
        return ("Nothing was published; there is no earlier complete checkpoint in "
                f"{root}")
    return (f"Nothing was published: the last complete checkpoint, {previous}, is intact "
            f"and --load {root} resumes from it")


def save_failure_message(iteration: int, target: str, root: str, previous: Optional[str],
                         exc: BaseException, written: int) -> Tuple[str, bool]:
    """(message, is_storage_fault) for a save of ``iteration`` into ``target`` that raised
    ``exc``; ``previous`` is the last published checkpoint directory, if any, ``written``
    the bytes the failed save had written."""
    found = root_os_error(exc)
    if found is not None:
        err, rank = found
        where = f" (rank {rank})" if rank is not None else ""
        what = f"[Errno {err.errno}] {os.strerror(err.errno)}{where}"
        full = err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    elif out_of_room(root, previous, written):
        what, full = "the disk is full", True
    else:
        first = " ".join(str(exc).split())[:300]
        return (f"saving iteration {iteration} to {target} failed: {type(exc).__name__}: "
                f"{first}. {safe_sentence(root, previous)}.", False)
    advice = "free some space or pass another --save" if full else "check that --save is writable"
    return (f"saving iteration {iteration} to {target} failed: {what}; "
            f"{room_sentence(root, previous, written)}. {safe_sentence(root, previous)}; "
            f"{advice}.", True)
