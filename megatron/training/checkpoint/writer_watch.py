"""A checkpoint writer process that dies ends the save with an error, not a hang.

megatron-core's writer forks helper processes for each save and waits for each to mark
its task done (``write_preloaded_data_multiproc``: ``count_queue.join()``, no timeout). A
writer that dies without doing so (killed, or out of memory) left the rank waiting there
for ever, and its peers waiting for it until the distributed timeout.

:func:`writers_watched` watches the rank's children that appear during the save. A child
that has exited with a signal or a non-zero status while still unreaped (a zombie: its
parent has not joined it yet) is a writer that died mid-write: the watcher interrupts the
main thread with ``SIGUSR1``, whose handler raises :class:`WriterDiedError` out of the
blocked wait. Linux only (``/proc``); elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Optional, Set

POLL_S = 0.2


class WriterDiedError(RuntimeError):
    """A checkpoint writer process of this rank died before finishing its files."""


def _children(pid: int) -> Set[int]:
    out = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.update(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def death_of(pid: int) -> Optional[str]:
    """How child ``pid`` died ("killed by signal 9 (SIGKILL)", "exited with status 1"), or
    None while it runs, once it exited cleanly, or once it was reaped. Reaps nothing."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return f"killed by signal {info.si_status} ({signal.Signals(info.si_status).name})"
    return f"exited with status {info.si_status}" if info.si_status else None


@contextlib.contextmanager
def writers_watched():
    """Raise :class:`WriterDiedError` in the main thread, within :data:`POLL_S`, when a child
    process started inside the block dies uncleanly. Only in the main thread on Linux."""
    if (threading.current_thread() is not threading.main_thread()
            or not os.path.isdir("/proc/self/task")):
        yield
        return
    me, before = os.getpid(), _children(os.getpid())
    done = threading.Event()
    died = []

    def watch() -> None:
        while not done.wait(POLL_S):
            for pid in sorted(_children(me) - before):
                how = death_of(pid)
                if how is not None:
                    died.append(f"a checkpoint writer process (pid {pid}) {how} mid-write")
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
                    return

    def interrupt(signum, frame) -> None:
        if died:
            raise WriterDiedError(died[0])

    previous = signal.signal(signal.SIGUSR1, interrupt)
    watcher = threading.Thread(target=watch, name="checkpoint-writer-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGUSR1, previous)


__all__ = ["WriterDiedError", "death_of", "writers_watched"]
