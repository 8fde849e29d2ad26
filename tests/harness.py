"""Run a function on N gloo ranks on the CPU, for multi-process tests.

``run_on_ranks(fn, world_size, *args)`` forks ``world_size`` processes, initialises
``torch.distributed`` with the gloo backend on a free loopback port, calls
``fn(rank, world_size, *args)`` on each, and tears everything down. A rank that raises
sends its traceback back; the parent then stops the others and fails the test with
every failing rank's traceback. A run that outlives ``timeout`` seconds is killed and
reported as a hang, so a collective mismatch fails a test instead of stalling CI.

``fn`` must be a module-level function (it is looked up by reference after fork).

``run_under_triton_interpreter(code)`` runs a Triton kernel test script in a fresh process
under Triton's CPU interpreter (the environment variable must be set before Triton loads).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from tests.helpers import free_port

DEFAULT_TIMEOUT_S = 240.0


def run_under_triton_interpreter(code: str, timeout: float = 300.0) -> str:
    """Run ``code`` in a fresh interpreter with ``TRITON_INTERPRET=1`` (Triton kernels on the
    CPU) and the repository importable; assert it exits 0 and return its stdout."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).parents[1]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


JOIN_WAIT_S = 30.0


def _joined(dist, world_size, wait):
    """Count this rank as past ``init_process_group``, or (``wait``) wait until every rank is.

    Rank 0 hosts the TCP store that gloo's connection set-up reads peers' addresses from, and
    ``init_process_group`` returns on one rank while others may still be connecting; a rank 0
    whose ``fn`` needs no collective would otherwise exit (closing the store) under them:
    "Connection closed by peer" in their ``connectFullMesh``. The wait is bounded, for runs
    in which a rank never got that far.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        if not wait:
            store.add("harness/joined", 1)
            return
        deadline = time.monotonic() + JOIN_WAIT_S
        while store.add("harness/joined", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - no process group, or the store is gone already
        pass


def _worker(fn, rank, world_size, port, queue, args, kwargs):
    import torch  # torch-free module
    import torch.distributed as dist  # torch-free module

    torch.set_num_threads(1)
    status = ("ok", rank, None)
    try:
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )
        _joined(dist, world_size, wait=False)
        fn(rank, world_size, *args, **kwargs)
    except BaseException:  # noqa: BLE001 - report everything, including assertion errors
        status = ("error", rank, traceback.format_exc())
    finally:
        if rank == 0:
            _joined(dist, world_size, wait=True)
        try:
            from megatron.usp.parallel_state import (
                destroy_usp_parallel,  # megatron-core on first use
            )

            destroy_usp_parallel()
        except Exception:  # noqa: BLE001
            pass
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    queue.put(status)
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> None:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Raises ``AssertionError`` with the tracebacks of the failing ranks, or naming the
    ranks that did not finish within ``timeout`` seconds.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, queue, args, kwargs), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = {}
    errors = []
    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            status, rank, tb = queue.get(timeout=min(remaining, 1.0))
        except Exception:  # queue.Empty
            if any(p.exitcode not in (None, 0) for p in procs):
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                errors.append(f"ranks {dead} died (exit codes {[procs[i].exitcode for i in dead]})")
                break
            continue
        results[rank] = status
        if status == "error":
            errors.append(f"--- rank {rank} ---\n{tb}")
            # Give the peers a moment to report their own errors, then stop them.
            grace = time.monotonic() + 5.0
            while len(results) < world_size and time.monotonic() < grace:
                try:
                    s2, r2, tb2 = queue.get(timeout=0.5)
                except Exception:
                    continue
                results[r2] = s2
                if s2 == "error":
                    errors.append(f"--- rank {r2} ---\n{tb2}")
            break
    missing = [r for r in range(world_size) if r not in results]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    if errors:
        raise AssertionError(f"{len(errors)} rank(s) failed:\n" + "\n".join(errors))
    if missing:
        raise AssertionError(
            f"ranks {missing} did not finish within {timeout:.0f}s (a hang or a collective "
            f"mismatch)"
        )
