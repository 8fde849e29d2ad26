"""What a failed save tells the user: which directory, how much room it needed, what is safe.

A save can fail part-way (a full disk, a quota, a read-only remount): megatron-core's
writer then raises on every rank alike (its ``save_state_dict_async_finalize`` broadcasts
the failure; the coordinator, rank 0, holds every rank's exception), and the publishing
protocol of :mod:`megatron.training.checkpointing` guarantees nothing half-written is
ever named by the tracker. This module turns such a failure into one sentence::

    saving iteration 6 to /ckpt/iter_0000006 failed: [Errno 28] No space left on device
    (rank 1); it needs about 1.3 GiB (the size of iter_0000004) and /ckpt has 0.2 GiB
    free. Nothing was published: the last complete checkpoint, /ckpt/iter_0000004, is
    intact and --load /ckpt resumes from it.

:func:`root_os_error` digs the operating system's error out of the wrapped exceptions
(PyTorch's ``CheckpointException`` keeps ``{rank: (exception, traceback)}``).
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import List, Optional, Tuple

GIB = float(2**30)

# Errors that mean "the storage cannot take the checkpoint", as opposed to a bug.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                  errno.EPERM, errno.EIO}


class CheckpointSaveError(RuntimeError):
    """A save that could not complete. Nothing was published; the message names the
    directory, the room needed, and the last complete checkpoint. ``primary``: this rank
    met the fault itself (it prints the message even when it is not rank 0)."""

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


def room_sentence(root: str, previous: Optional[str], written: int) -> str:
    """How much the save needs (the previous checkpoint's size, else what was written
    before the failure) and how much ``root`` has free."""
    free = free_bytes(root)
    free_text = f"{root} has {free / GIB:.2f} GiB free" if free is not None else ""
    if previous is not None:
        need = (f"it needs about {directory_bytes(previous) / GIB:.2f} GiB (the size of "
                f"{os.path.basename(previous)})")
    else:
        need = f"it needs more than the {written / GIB:.2f} GiB written before the failure"
    return f"{need}{' and ' + free_text if free_text else ''}"


def safe_sentence(root: str, previous: Optional[str]) -> str:
    if previous is None:
        return ("Nothing was published; there is no earlier complete checkpoint in "
                f"{root}")
    return (f"Nothing was published: the last complete checkpoint, {previous}, is intact "
            f"and --load {root} resumes from it")


def save_failure_message(iteration: int, target: str, root: str, previous: Optional[str],
                         exc: BaseException, written: int) -> Tuple[str, bool]:
    """(message, is_storage_fault) for a save of ``iteration`` into ``target`` that raised
    ``exc``; ``previous`` is the last published checkpoint directory, if any."""
    found = root_os_error(exc)
    if found is not None:
        err, rank = found
        where = f" (rank {rank})" if rank is not None else ""
        what = f"[Errno {err.errno}] {os.strerror(err.errno)}{where}"
        advice = "free some space or pass another --save" if err.errno in (
            errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "check that --save is writable"
        return (f"saving iteration {iteration} to {target} failed: {what}; "
                f"{room_sentence(root, previous, written)}. {safe_sentence(root, previous)}; "
                f"{advice}.", True)
    first = " ".join(str(exc).split())[:300]
    return (f"saving iteration {iteration} to {target} failed: {type(exc).__name__}: {first}. "
            f"{safe_sentence(root, previous)}.", False)
