"""``torchrun``, with the exit status of the worker that failed first, and a port check.

``torchrun`` exits 1 whenever a worker fails, whatever the worker's own status: a bad
flag, which ``pretrain_gpt.py`` reports with exit status 2, came out of ``torchrun`` as 1,
followed by a 40-line ``ChildFailedError`` traceback. ``tools/launch.py`` (used by every
script in ``examples/``) takes torchrun's own arguments and runs torchrun's own
``torch.distributed.run.run``; when a worker fails it prints one line naming the rank that
ended the job and how (:func:`root_cause`), and the ranks that lost contact with it, and
exits with that rank's status (1 for a worker killed by a signal).

On SIGTERM or SIGINT torchrun passes the signal on to the workers and stops them; the
launcher then exits 128 + N and says where to read whether they saved (rank 0's "saved
checkpoint" line), which it cannot know itself.

Before starting, a ``--master-port`` given on node 0 must be free: a busy port otherwise
ends in the TCP store's ``EADDRINUSE`` traceback. Without ``--master-port`` on one node,
torchrun picks a free port itself (its ``c10d`` rendezvous on ``localhost:0``).
"""

from __future__ import annotations

import errno
import signal
import socket
import sys
from typing import Dict, List, Optional, Tuple

from megatron.training.peer_faults import PEER_LOST_STATUS


def port_problem(host: str, port: int) -> Optional[str]:
    """Why the rendezvous store cannot listen on ``port`` here, or None.

    Binds like the store does (``SO_REUSEADDR``, all interfaces), so a port held only by
    closed connections in TIME_WAIT counts as free.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"--master-port {port} (MASTER_PORT) is already in use on {host}: "
                        f"another job's rendezvous is listening there; pick a free port "
                        f"(e.g. MASTER_PORT={free_port()}), or on one node leave "
                        f"MASTER_PORT unset and a free one is chosen")
            return f"--master-port {port} (MASTER_PORT) cannot be used: {exc.strerror}"
    return None


def free_port() -> int:
    """A TCP port free on this machine now (for a one-node MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _is_consequence(exitcode: int) -> bool:
    """A rank that lost a peer, or that torchrun stopped (SIGTERM) once another failed."""
    return exitcode in (PEER_LOST_STATUS, -signal.SIGTERM)


def root_cause(failures: Dict[int, Tuple[int, float]]) -> int:
    """The rank whose failure ended the job, from each failed rank's (exit code, time).

    torchrun's own "first failure" compares times in whole seconds, and the ranks it stops,
    or that lose a peer, fail in the same second as the root cause, so a rank that lost a
    peer was often named. A rank's own error (exit status other than
    :data:`PEER_LOST_STATUS`) or a death by a signal other than torchrun's SIGTERM comes
    before those consequences; then the earlier time, then the lower rank.
    """
    return min(failures, key=lambda r: (_is_consequence(failures[r][0]), failures[r][1], r))


def failure_line(name: str, failures: Dict[int, Tuple[int, float]]) -> Tuple[str, int]:
    """(the launcher's one line about a failed job, its exit status)."""
    rank = root_cause(failures)
    code = failures[rank][0]
    others = ", ".join(str(r) for r in sorted(failures) if r != rank)
    if code == PEER_LOST_STATUS:
        lost = sorted(r for r, (c, _) in failures.items() if c == PEER_LOST_STATUS)
        return (f"launch: {name}: rank(s) {', '.join(map(str, lost))} lost contact with "
                f"another rank, which died or stopped answering (their messages are above); "
                f"exit status 1", 1)
    if code > 0:
        how = f"exited with status {code} first (its own message is above)"
    else:
        how = f"was killed by signal {-code} ({signal.Signals(-code).name}) first"
    status = code if code > 0 else 1
    also = f"; rank(s) {others} stopped after it" if others else ""
    return f"launch: {name}: rank {rank} {how}{also}; exit status {status}", status


def main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException  # torch-free --help
    from torch.distributed.elastic.multiprocessing.errors import (  # torch-free launcher until a worker fails
        ChildFailedError,  # torch-free --help
    )
    from torch.distributed.run import parse_args, run  # torch-free --help

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.master_port is not None and args.node_rank == 0 and args.rdzv_backend == "static":
        problem = port_problem(args.master_addr, args.master_port)
        if problem:
            print(f"launch: error: {problem}", file=sys.stderr, flush=True)
            return 2
    try:
        run(args)
    except SignalException as exc:
        # torchrun passed the signal on to the workers and stopped them; whether they saved
        # only they know (with --save they save at the end of their iteration, unless
        # torchrun's 30 s grace ends first).
        name = signal.Signals(exc.sigval).name
        print(f"launch: received {name}; passed it to the workers and stopped them. A save "
              f"they made is announced above by rank 0 (\"saved checkpoint at iteration "
              f"N\"); without that line nothing was saved since the last checkpoint",
              file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        failures = {r: (f.exitcode, f.timestamp) for r, f in exc.failures.items()}
        line, status = failure_line(exc.name, failures)
        print(line, file=sys.stderr, flush=True)
        return status
    return 0
