"""Nothing a training process starts outlives it: a guard process per rank (Linux).

Why: megatron-core's checkpoint writer starts helper processes: a multiprocessing
``Manager`` (spawned once, kept for the life of the rank, ~300 MB) and, on GPUs, forked
writers during each save (``megatron/core/dist_checkpointing/strategies/filesystem_async.py``).
DataLoader workers are forked too (or, with ``--optimizer-cpu-offload``, forked by a fork
server the rank starts: still its descendants). When the rank exits normally they are shut
down; when the rank, or torchrun above it, is killed with SIGKILL nothing runs in the rank,
and those processes lived on (11 of them, 18 minutes later, in a probe).

How: :func:`start_guard` (called by ``pretrain_gpt.py`` first thing) starts this file as a
small stdlib-only process in its own session, so a signal to the rank's process group
does not reach it. Every :data:`POLL_S` seconds (0.5) it records the rank's descendants (pid
and start time, from ``/proc``); when the rank is gone (the guard was re-parented) it
SIGKILLs every recorded descendant still alive and, when the rank led its own session
(torchrun starts each worker with ``start_new_session=True``), every process left in the
rank's process group. When the launcher that started the rank (torchrun's agent,
``TORCHELASTIC_RUN_ID`` in the environment) dies first, the guard kills the rank's group
itself, the rank included: torchrun is no longer there to stop it. The guard then exits.
Processes are matched by pid *and* start time, so a reused pid is never killed.

A rank that is stopped (SIGSTOP, Ctrl-Z) cannot act on the SIGTERM with which torchrun
stops a failed job; torchrun would SIGKILL it only after its 30 s grace. The guard kills it
once a termination signal has been pending for :data:`STOPPED_GRACE_S`, with one line
naming the rank.

The guard costs one idle Python process (~10 MB) per rank. Outside Linux it is not started.
:func:`children_ignore_stop_signals` is the other half: helpers are started immune to the
group-wide SIGTERM and SIGINT, so that the rank alone decides (it saves and exits);
:func:`stop_with_the_rank` lets the rank itself still stop its DataLoader workers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, Iterable, List, Optional, Tuple

POLL_S = 0.5
STOPPED_GRACE_S = 2.0
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
Key = Tuple[int, int]  # (pid, start time in clock ticks since boot)


def _stat(pid: int) -> Optional[Tuple[str, int, int, int]]:
    """(state, ppid, pgrp, start time) of ``pid`` from /proc, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def _processes() -> Dict[int, Tuple[str, int, int, int]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def _alive(key: Key) -> bool:
    st = _stat(key[0])
    return st is not None and st[0] != "Z" and st[3] == key[1]


def descendants(procs: Dict[int, Tuple[str, int, int, int]], root: int) -> List[Key]:
    """Every process below ``root`` in ``procs`` (pid -> (state, ppid, pgrp, start))."""
    children: Dict[int, List[int]] = {}
    for pid, (_, ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append((pid, procs[pid][3]))
        todo.extend(children.get(pid, []))
    return out


def _kill(keys: Iterable[Key]) -> int:
    killed = 0
    for key in keys:
        if _alive(key):
            try:
                os.kill(key[0], signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def _group_members(pgid: int, exclude: int) -> List[Key]:
    return [(pid, st[3]) for pid, st in _processes().items()
            if st[2] == pgid and pid != exclude and st[0] != "Z"]


def _pending_stop(pid: int) -> bool:
    """Whether SIGTERM or SIGINT waits, undelivered, for ``pid`` (its pending masks)."""
    bits = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("SigPnd:", "ShdPnd:")):
                    bits |= int(line.split()[1], 16)
    except (OSError, ValueError):
        return False
    return any(bits >> (int(sig) - 1) & 1 for sig in STOP_SIGNALS)


def _kill_if_stopped_too_long(rank_pid: int, since: Optional[float]) -> Optional[float]:
    """SIGKILL the rank when it has been stopped with a termination signal pending for
    :data:`STOPPED_GRACE_S`; returns when that state was first seen (None: not in it)."""
    st = _stat(rank_pid)
    if st is None or st[0] != "T" or not _pending_stop(rank_pid):
        return None
    now = time.monotonic()
    if since is None:
        return now
    if now - since >= STOPPED_GRACE_S:
        rank = os.environ.get("RANK", "?")
        print(f"guard: rank {rank} (pid {rank_pid}) is stopped (SIGSTOP) and was asked to "
              f"terminate {STOPPED_GRACE_S:.0f} s ago; killing it", file=sys.stderr, flush=True)
        os.kill(rank_pid, signal.SIGKILL)
    return since


def guard(rank_pid: int, own_session: bool, launcher: Optional[Key]) -> None:
    """The guard's loop (see the module docstring); returns when the rank is gone."""
    me = os.getpid()
    seen: Dict[int, int] = {}
    stopped_since: Optional[float] = None
    while os.getppid() == rank_pid:
        if launcher is not None and not _alive(launcher):
            if own_session:
                os.killpg(rank_pid, signal.SIGKILL)
            else:
                rank = _stat(rank_pid)
                _kill([(rank_pid, rank[3])] if rank else [])
            break
        procs = _processes()
        seen.update((pid, start) for pid, start in descendants(procs, rank_pid) if pid != me)
        stopped_since = _kill_if_stopped_too_long(rank_pid, stopped_since)
        time.sleep(POLL_S)
    # The rank is gone: what it started goes too. Repeat while anything is found (a
    # process being killed may have forked).
    for _ in range(20):
        found = [k for k in seen.items() if _alive(k)]
        if own_session:
            found += _group_members(rank_pid, me)
        if not _kill(found):
            return
        time.sleep(0.05)


@contextlib.contextmanager
def children_ignore_stop_signals():
    """Block SIGTERM and SIGINT in this thread while helper processes are started
    (megatron-core's checkpoint writer Manager and writers, DataLoader workers): they
    inherit the blocked mask across fork and exec.

    torchrun's shutdown and Slurm's time limit send SIGTERM (torchrun passes a Ctrl-C on as
    SIGINT) to every process of a worker's group; the helpers died of it at once, so the
    save the rank then made failed ("Broken pipe" from the dead Manager) and the next batch
    failed (a dead DataLoader worker). With the mask only the rank acts on the signal: it
    finishes the iteration, saves and exits, and its helpers end with it (or by its guard).
    A signal arriving meanwhile stays pending for this thread or is taken by another thread
    of the rank; either way the rank's handler runs.
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_with_the_rank(rank_pid: int, worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn`` (bind ``rank_pid`` with ``functools.partial``): the
    worker, started under :func:`children_ignore_stop_signals`, exits on a SIGTERM or
    SIGINT sent by the rank ``rank_pid`` (the DataLoader's shutdown, multiprocessing's exit
    handler) or arriving once the rank is gone, and ignores one sent by anyone else (the
    group-wide signal of torchrun or Slurm: the rank decides).

    Why: with the signals only blocked, a rank leaving through an error sent its workers
    SIGTERM from multiprocessing's exit handler and then joined them with no timeout, so
    it never exited. The signals stay blocked; a thread takes them with ``sigwaitinfo``,
    which tells who sent each. An exception the worker reports once the rank is gone ends it
    quietly (:func:`quiet_once_the_rank_is_gone`).
    """
    del worker_id
    sys.excepthook = quiet_once_the_rank_is_gone(rank_pid, sys.excepthook)
    if not hasattr(signal, "sigwaitinfo"):
        return

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            if info.si_pid == rank_pid or _stat(rank_pid) is None:
                os._exit(0)

    threading.Thread(target=wait, name="stop-with-the-rank", daemon=True).start()


RANK_GONE_WAIT_S = 2.0


def rank_gone(rank_pid: int, wait_s: float = 0.0) -> bool:
    """Whether the rank ``rank_pid``, this process's parent, has exited (this process was
    re-parented, or the rank is gone or a zombie), waiting up to ``wait_s`` for it."""
    deadline = time.monotonic() + wait_s
    while True:
        st = _stat(rank_pid)
        if os.getppid() != rank_pid or st is None or st[0] in ("Z", "X"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def quiet_once_the_rank_is_gone(rank_pid: int, previous):
    """A ``sys.excepthook`` for the rank's DataLoader workers: an exception reported while
    the rank is gone ends the worker quietly; any other goes to ``previous``.

    Why: a worker serves the file descriptors of the tensors it hands to the rank from a
    thread of multiprocessing's ``resource_sharer``, which reports its errors through
    ``sys.excepthook``. A rank killed while it fetched one left that thread a
    ``ConnectionResetError`` whose traceback landed in the job's output after the
    launcher's one line, before the guard ended the worker. The kernel closes the rank's
    sockets a moment before it re-parents the rank's children, so the hook waits up to
    :data:`RANK_GONE_WAIT_S` for the rank to be gone before it decides."""

    def hook(exc_type, exc, tb) -> None:
        if rank_gone(rank_pid, RANK_GONE_WAIT_S):
            os._exit(0)
        previous(exc_type, exc, tb)

    return hook


def start_guard() -> Optional[subprocess.Popen]:
    """Start this process's guard (Linux only); None elsewhere or when /proc is missing."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc/self"):
        return None
    me = os.getpid()
    own_session = os.getsid(0) == me
    launcher = ""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        parent = _stat(os.getppid())
        if parent is not None:
            launcher = f"{os.getppid()}:{parent[3]}"
    cmd = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(me),
           "1" if own_session else "0", launcher]
    # stderr stays the rank's: the guard's one line about a stopped rank goes there.
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            close_fds=True, start_new_session=True)


def main(argv: List[str]) -> None:
    rank_pid, own_session = int(argv[0]), argv[1] == "1"
    launcher = None
    if len(argv) > 2 and argv[2]:
        pid, start = argv[2].split(":")
        launcher = (int(pid), int(start))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the rank, not its guard
    guard(rank_pid, own_session, launcher)


if __name__ == "__main__":
    main(sys.argv[1:])
