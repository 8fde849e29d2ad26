"""``--profile``: torch.profiler over a window of training iterations.

Megatron-LM's flags (``--profile``, ``--profile-step-start``, ``--profile-step-end``,
``--profile-ranks``), with torch.profiler (Megatron-LM's ``--use-pytorch-profiler`` path) and
``--profile-dir``. On each profiled rank the window is iterations ``[start, end)`` (1-based, as
logged); when it closes, the rank writes ``rank<N>_iters<start>-<end - 1>.txt`` (kernel table:
where device time goes) and ``.json`` (Chrome trace: compute and NCCL streams side by side)
through :mod:`megatron.usp.bench.profile`.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from megatron.usp.bench import profile as capture


class StepProfiler:
    """Call :meth:`before` and :meth:`after` around every training iteration."""

    def __init__(self, args, rank: int, device: torch.device) -> None:
        self.enabled = bool(args.profile) and rank in args.profile_ranks
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.out_dir, self.rank, self.device = args.profile_dir, rank, device
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
            self._prof = capture.start(self.device)
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
        capture.finish(self._prof, self.device, self.out_dir, self.stem, True, wall)
        self._prof = None
        self.written = f"{self.out_dir}/{self.stem}"
