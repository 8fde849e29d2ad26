"""torch.profiler captures for the benchmarks and the training loop, written as files.

Two outputs per capture, in ``out_dir``:

* ``<stem>.txt``: the operator/kernel table (``key_averages``), sorted by device time on CUDA
  (self time of each kernel: where the GPU spends its time) and by CPU time otherwise, top
  ``row_limit`` rows, preceded by the capture's wall time;
* ``<stem>.json``: a Chrome trace (open in chrome://tracing or https://ui.perfetto.dev) that
  shows the compute and NCCL streams side by side, which is where overlap (or its absence)
  is visible.

Used by ``tools/bench_attention.py --profile-dir`` (one forward+backward per distributed case)
and by ``pretrain_gpt.py --profile`` (:class:`megatron.training.profiling.StepProfiler`).
"""

from __future__ import annotations

import os
import time
from typing import Callable, List

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
