"""Timing and memory measurement for the benchmarks, on CUDA or on the CPU.

* On CUDA every timed iteration sits between two CUDA events on the current stream, after a
  barrier over the ranks that run the case; on the CPU ``time.perf_counter`` is read around
  the iteration (CPU ops are synchronous).
* A distributed case is as fast as its slowest rank: per-iteration times are reduced with MAX
  over the case's group before the median is taken.
* Peak memory is ``torch.cuda.max_memory_allocated`` after a reset at the start of the case
  (None on the CPU, where there is no allocator statistic to read).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

GIB = float(1 << 30)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """Barrier over ``group`` (the default group when None); no-op outside a process group."""
    if not dist.is_initialized():
        return
    if device.type == "cuda" and dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def time_iterations(
    fn: Callable[[], object],
    *,
    warmup: int,
    iters: int,
    device: torch.device,
    group: Optional[dist.ProcessGroup] = None,
    distributed: bool = True,
) -> List[float]:
    """Run ``fn`` ``warmup`` times untimed, then ``iters`` times timed; milliseconds per run.

    Args:
        fn: one iteration; its return value is dropped at once (freeing its graph).
        device: where ``fn`` runs (CUDA events on CUDA, ``perf_counter`` otherwise).
        group: the ranks that run ``fn`` together; a barrier over them precedes each timed
            iteration and the returned times are the MAX over them, iteration by iteration.
        distributed: False for work that only this rank runs (no barrier, no reduction).

    Returns:
        ``iters`` times in milliseconds (take the median: :func:`median_ms`).
    """
    if iters < 1:
        raise ValueError(f"--iters must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    use_events = device.type == "cuda"
    marks = []
    for _ in range(iters):
        if distributed:
            barrier(group, device)
        if use_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            marks.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            marks.append((t0, time.perf_counter()))
    synchronize(device)
    if use_events:
        times = [s.elapsed_time(e) for s, e in marks]
    else:
        times = [(t1 - t0) * 1e3 for t0, t1 in marks]
    if distributed and dist.is_initialized():
        buf = torch.tensor(times, dtype=torch.float64,
                           device=device if dist.get_backend(group) == "nccl" else "cpu")
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
        times = buf.tolist()
    return times


def median_ms(times: List[float]) -> float:
    return float(statistics.median(times))


def median_ms_alone(fn: Callable[[], object], *, warmup: int, iters: int,
                    device: Optional[torch.device] = None) -> float:
    """Median time of ``fn`` run by this rank alone (no barrier, no reduction); ``device``
    defaults to the current CUDA device (the kernel benchmarks)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return median_ms(time_iterations(fn, warmup=warmup, iters=iters, device=device,
                                     distributed=False))


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window on ``device`` (nothing to do on the CPU)."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> Optional[float]:
    """Peak bytes allocated on ``device`` since :func:`reset_peak_memory`, in GiB (CPU: None)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) / GIB


def free_memory(device: torch.device) -> None:
    """Drop unreachable tensors and return cached blocks, so the next case starts clean."""
    gc.collect()
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.empty_cache()


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a device out-of-memory error (any torch version)."""
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
