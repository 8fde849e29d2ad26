"""``--profile``: torch.profiler over a window of training iterations.

Megatron-LM's flags (``--profile``, ``--profile-step-start``, ``--profile-step-end``,
``--profile-ranks``), with torch.profiler (Megatron-LM's ``--use-pytorch-profiler`` path) and
``--profile-dir``. On each profiled rank the window is iterations ``[start, end)`` (1-based, as
logged); when it closes, the rank writes ``rank<N>_iters<start>-<end - 1>.txt`` (kernel table:
where device time goes) and ``.json`` (Chrome trace: compute and NCCL streams side by side)
through :func:`finish`.

The capture helpers (:func:`start`, :func:`finish`, :func:`profile_call`) also serve the
benchmarks (``tools/bench_attention.py --profile-dir``). Two outputs per capture, in ``out_dir``:
``<stem>.txt``, the operator/kernel table (``key_averages``) sorted by device time on CUDA and
by CPU time otherwise, preceded by the capture's wall time; ``<stem>.json``, a Chrome trace
(chrome://tracing or https://ui.perfetto.dev) showing the compute and NCCL streams side by side.
"""

from __future__ import annotations

import os
import time
from typing import Callable, List, Optional

import torch
from torch.profiler import ProfilerActivity, profile

ROW_LIMIT = 40


def activities(device: torch.device) -> List[ProfilerActivity]:
    """CPU always; CUDA kernels too on a CUDA device."""
    acts = [ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


def start(device: torch.device) -> profile:
    """An entered profiler (call :func:`finish` to stop it and write the files)."""
    prof = profile(activities=activities(device), record_shapes=False, with_stack=False)
    prof.__enter__()
    return prof


def finish(prof: profile, device: torch.device, out_dir: str, stem: str, write: bool,
           wall_s: float, row_limit: int = ROW_LIMIT) -> None:
    """Stop ``prof``; when ``write``, save ``<stem>.txt`` and ``<stem>.json`` in ``out_dir``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prof.__exit__(None, None, None)
    if not write:
        return
    os.makedirs(out_dir, exist_ok=True)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=row_limit)
    with open(os.path.join(out_dir, f"{stem}.txt"), "w") as fh:
        fh.write(f"{stem}: wall {wall_s * 1e3:.2f} ms for the profiled region\n{table}\n")
    prof.export_chrome_trace(os.path.join(out_dir, f"{stem}.json"))


def profile_call(fn: Callable[[], object], device: torch.device, out_dir: str, stem: str,
                 write: bool = True) -> None:
    """Run ``fn`` once under the profiler (after a device sync) and write the two files."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prof = start(device)
    t0 = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    del result
    finish(prof, device, out_dir, stem, write, wall)



class StepProfiler:
    """Call :meth:`before` and :meth:`after` around every training iteration.

    Profiles iterations ``start`` to ``end - 1`` (1-based) when ``enabled``, writing the
    kernel table and the Chrome trace into ``out_dir``.
    """

    def __init__(self, enabled: bool, start: int, end: int, out_dir: Optional[str], rank: int,
                 device: torch.device) -> None:
        self.enabled = enabled
        self.start, self.end = start, end
        self.out_dir, self.rank, self.device = out_dir, rank, device
        self._prof = None
        self._t0: Optional[float] = None
        self.written: Optional[str] = None

    @property
    def stem(self) -> str:
        return f"rank{self.rank}_iters{self.start}-{self.end - 1}"

    def before(self, iteration: int) -> None:
        """``iteration`` is about to run."""
        if self.enabled and iteration == self.start and self._prof is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._prof = start(self.device)
            self._t0 = time.perf_counter()

    def after(self, iteration: int) -> bool:
        """``iteration`` has run; True when this closed the window and wrote the files."""
        if self._prof is None or iteration + 1 < self.end:
            return False
        self.close()
        return True

    def close(self) -> None:
        """Stop and write (also for a window cut short by the end of training)."""
        if self._prof is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self._t0
        finish(self._prof, self.device, self.out_dir, self.stem, True, wall)
        self._prof = None
        self.written = f"{self.out_dir}/{self.stem}"
