"""``torchrun``, with the exit status of the worker that failed first, and a port check.

``torchrun`` exits 1 whenever a worker fails, whatever the worker's own status: a bad
flag, which ``pretrain_gpt.py`` reports with exit status 2, came out of ``torchrun`` as 1,
followed by a 40-line ``ChildFailedError`` traceback. ``tools/launch.py`` (used by every
script in ``examples/``) takes torchrun's own arguments and runs torchrun's own
``torch.distributed.run.run``; when a worker fails it prints one line naming the rank and
status of the first failure (the root cause; the others are stopped by torchrun) and exits
with that status (1 for a worker killed by a signal).

Before starting, a ``--master-port`` given on node 0 must be free: a busy port otherwise
ends in the TCP store's ``EADDRINUSE`` traceback. Without ``--master-port`` on one node,
torchrun picks a free port itself (its ``c10d`` rendezvous on ``localhost:0``).
"""

from __future__ import annotations

import errno
import socket
import sys
from typing import List, Optional


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


def main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException  # torch-free --help
    from torch.distributed.elastic.multiprocessing.errors import (
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
        # torchrun passed the signal on to the workers (SIGTERM: they save when --save is
        # set) and stopped them; its own traceback says nothing more.
        print(f"launch: received signal {exc.sigval}; the workers were stopped (with --save "
              f"they saved at the end of their iteration)", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        status = failure.exitcode if failure.exitcode > 0 else 1
        how = (f"exited with status {failure.exitcode}" if failure.exitcode > 0
               else f"was killed by signal {-failure.exitcode}")
        print(f"launch: {exc.name}: rank {rank} {how} first (its own message is above); "
              f"exit status {status}", file=sys.stderr, flush=True)
        return status
    return 0
