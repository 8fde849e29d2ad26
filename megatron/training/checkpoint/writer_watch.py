"""A checkpoint write that dies or stops making progress ends the save with an error.

A rank's checkpoint write has no time limit of its own: on GPUs megatron-core forks writer
processes for each save and waits for them with no timeout (``write_preloaded_data_multiproc``:
``count_queue.join()``); on the CPU the rank writes its files itself
(:mod:`~megatron.training.checkpoint.shard_writer`). A writer that died (killed, out of
memory) or hung left the rank waiting for ever, and its peers waiting for it until the
distributed timeout.

:func:`writers_watched` watches the write from a thread, every :data:`POLL_S` seconds:

* a child process started inside the block that exited with a signal or a non-zero status
  while still unreaped (a zombie: its parent has not joined it yet) is a writer that died
  mid-write: :class:`WriterDiedError`;
* with ``stall_s``, a write that made no progress for ``stall_s`` seconds is stuck: no CPU
  time and no bytes written by the writers (the main thread, the block's children, and the
  serving threads of the given helper processes) and no growth of the files being written.
  The live writer processes are killed (nothing stuck outlives the save), then
  :class:`WriterStuckError`.

Either error is raised in the main thread by interrupting it with ``SIGUSR1``, whose
handler raises out of the blocked wait (and again as the block ends, if code inside it
caught the error). A main thread that does not leave the block within :data:`GRACE_S` after
that (blocked in a call that does not return on a signal) cannot raise: the watcher prints
``last_words`` and ends the process with status 1. Linux only (``/proc``); elsewhere, or
outside the main thread, it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence, Set, Tuple

POLL_S = 0.2
GRACE_S = 10.0
EXIT_STATUS = 1   # a failed save's exit status (faults.CheckpointSaveError)


class WriterDiedError(RuntimeError):
    """A checkpoint writer process of this rank died before finishing its files."""


class WriterStuckError(RuntimeError):
    """This rank's checkpoint write made no progress for the bound."""


def stall_bound_s(distributed_timeout_minutes: float) -> float:
    """How long a checkpoint write may go without progress: half the distributed timeout,
    so that the stuck rank says so before its peers, waiting in the save's next collective,
    give up on it at the full timeout (10 minutes by default: 300 s)."""
    return distributed_timeout_minutes * 60.0 / 2


@dataclass
class Progress:
    """When a progress sample last changed (:meth:`idle_s`); pure bookkeeping."""

    sample: Any = None
    since: float = 0.0

    def idle_s(self, sample: Any, now: float) -> float:
        """Seconds since the sample last changed, ``sample`` seen at ``now``."""
        if sample != self.sample:
            self.sample, self.since = sample, now
        return now - self.since


def stuck_text(rank: int, writers: Sequence[int], own_pid: int, bound_s: float) -> str:
    """The stuck writer named: rank ``rank``'s live writer processes ``writers`` (killed by
    then), or the rank's own process ``own_pid`` when it writes its files itself; idle for
    ``bound_s`` seconds."""
    if writers:
        pids = ", ".join(str(p) for p in writers)
        s = "es" if len(writers) > 1 else ""
        who = f"rank {rank}'s checkpoint writer process{s} (pid {pids}, forked by pid {own_pid})"
        end = f"; {'they were' if s else 'it was'} killed"
    else:
        who, end = f"rank {rank}'s checkpoint write (in its own process, pid {own_pid})", ""
    return f"{who} made no progress for {bound_s:g} s (no CPU time, no bytes written){end}"


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


def _task_work(proc_dir: str) -> Optional[Tuple[int, int]]:
    """(CPU clock ticks, bytes written by write calls) of the task at ``proc_dir``
    (``/proc/PID`` or ``/proc/PID/task/TID``), None when it is gone or a zombie."""
    try:
        with open(f"{proc_dir}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"{proc_dir}/io") as f:
            wchar = next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[11]) + int(fields[12]), wchar   # utime + stime


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def serving_work(pid: int) -> Optional[Tuple[int, int, int]]:
    """(CPU clock ticks, bytes written, threads) of process ``pid``'s threads other than its
    main one, None when it is gone or a zombie. A multiprocessing ``Manager`` serves each
    connection in a thread of its own, while its main thread only wakes once a second to
    see whether it should stop: those wake-ups, charged a clock tick now and then, are not
    work on the write."""
    if _task_work(f"/proc/{pid}") is None:
        return None
    try:
        tasks = [t for t in os.listdir(f"/proc/{pid}/task") if t != str(pid)]
    except OSError:
        return None
    work = [w for w in (_task_work(f"/proc/{pid}/task/{t}") for t in tasks) if w is not None]
    return sum(w[0] for w in work), sum(w[1] for w in work), len(work)


def progress_sample(main_tid: int, processes: Iterable[int], files: Iterable[str],
                    helpers: Iterable[int] = ()) -> Tuple:
    """What changes while a write progresses: the work of this process's main thread, of
    ``processes`` (the writers) and of the serving threads of ``helpers``
    (:func:`serving_work`), and the sizes of the files written."""
    me = os.getpid()
    work = [(0, _task_work(f"/proc/{me}/task/{main_tid}"))]
    work += [(pid, _task_work(f"/proc/{pid}")) for pid in sorted(processes)]
    work += [(pid, serving_work(pid)) for pid in sorted(helpers)]
    return tuple(work), tuple(_file_size(f) for f in files)


def _alive(pids: Iterable[int]) -> List[int]:
    return [pid for pid in sorted(pids) if _task_work(f"/proc/{pid}") is not None]


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@contextlib.contextmanager
def writers_watched(stall_s: Optional[float] = None, files: Sequence[str] = (),
                    helpers: Sequence[int] = (), rank: int = 0,
                    last_words: Optional[Callable[[BaseException], str]] = None):
    """Raise :class:`WriterDiedError` in the main thread, within :data:`POLL_S`, when a child
    process started inside the block dies uncleanly, and (``stall_s``) raise
    :class:`WriterStuckError` once the write made no progress for ``stall_s`` seconds,
    after killing the block's live children. ``files``: the files the block writes;
    ``helpers``: server processes whose serving threads' work is the write's too
    (megatron-core's results queue is served by a ``Manager`` process, which unpickles what
    the writers put there; the first time, that means importing torch); ``rank`` names the
    writer in the message; ``last_words(error)``: the line printed when the main thread cannot be interrupted
    (then the process exits with status 1). Only in the main thread on Linux."""
    if (threading.current_thread() is not threading.main_thread()
            or not os.path.isdir("/proc/self/task")):
        yield
        return
    me, before = os.getpid(), _children(os.getpid())
    main_tid = threading.get_native_id()
    done = threading.Event()
    failed: List[BaseException] = []

    def fail(exc: BaseException) -> None:
        failed.append(exc)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        if done.wait(GRACE_S):
            return
        try:
            line = last_words(exc) if last_words is not None else str(exc)
        except Exception:  # noqa: BLE001 - the process ends either way; say what is known
            line = str(exc)
        print(line, file=sys.stderr, flush=True)
        os._exit(EXIT_STATUS)

    def watch() -> None:
        progress = Progress()
        while not done.wait(POLL_S):
            writers = _children(me) - before
            for pid in sorted(writers):
                how = death_of(pid)
                if how is not None:
                    return fail(WriterDiedError(
                        f"a checkpoint writer process (pid {pid}) {how} mid-write"))
            if stall_s is None:
                continue
            sample = progress_sample(main_tid, writers, files, helpers)
            if progress.idle_s(sample, time.monotonic()) >= stall_s:
                live = _alive(writers)
                _kill(live)
                return fail(WriterStuckError(stuck_text(rank, live, me, stall_s)))

    def interrupt(signum, frame) -> None:
        if failed and not done.is_set():
            raise failed[0]

    previous = signal.signal(signal.SIGUSR1, interrupt)
    watcher = threading.Thread(target=watch, name="checkpoint-writer-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGUSR1, previous)
    if failed:   # the block caught the error (megatron-core's writer reports an Exception
        raise failed[0]   # as the file's result and returns): it still ends the save


__all__ = ["GRACE_S", "Progress", "WriterDiedError", "WriterStuckError", "death_of",
           "progress_sample", "serving_work", "stall_bound_s", "stuck_text", "writers_watched"]
