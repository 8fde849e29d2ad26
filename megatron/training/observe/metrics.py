"""Training metrics: FLOPs per iteration, MFU, memory, and where they are written.

* model FLOPs per iteration are the one count, :func:`megatron.shapes.dense_training_flops`
  (Megatron-LM's ``num_floating_point_operations`` for a dense GPT with causal attention at
  half; the formula is in :mod:`megatron.shapes.flops`).
* the MFU denominator is the device's dense bf16 peak from the one device table,
  :func:`megatron.planner.hardware.peak_tflops_for_device` (``--peak-tflops`` overrides it;
  on the CPU MFU is reported as n/a without it).
* Memory (:func:`peak_memory_gib`): CUDA max allocated on GPU, peak RSS on the CPU; the
  console shows the maximum over ranks. ``host_mem_gib`` (:func:`peak_host_memory_gib`): the
  process's peak RSS, pinned host buffers of activation and optimizer offload included.
* :class:`MetricsWriter` writes what one logging rank reports: the Megatron-style console
  line every ``--log-interval`` (its lm loss and grad norm are means over the interval's
  applied steps, and say so), one JSON line per iteration (``--metrics-file``, read by
  ``tools/compare_loss.py``) and TensorBoard scalars (``--tensorboard-dir``).

Metrics-file records (one JSON object per line, ``kind`` says which)::

    {"kind": "run", "layout": "TP1 U2 R2 DP1 PP1", "world_size": 4, "args": {...}}
    {"kind": "train", "iteration": 7, "consumed_samples": 56, "lm_loss": 5.12, "grad_norm": 1.3,
     "lr": 3e-4, "step_time_s": 0.21, "tokens_per_s": 2438.1, "tokens_per_s_per_gpu": 609.5,
     "tflops_per_gpu": 0.01, "mfu": null, "mem_gib": 0.61, "host_mem_gib": 2.1,
     "skipped": false}
    {"kind": "valid", "iteration": 10, "lm_loss": 5.01, "ppl": 149.9}

With packed documents (``--reset-attention-mask``) a train record also has
``new_plan_shapes``: the attention shapes this rank's step ran batched for the first time in
the process, on CUDA each one a cuDNN plan build, so steps that built plans can be told from
the steady ones (``tools/bench_e2e.py`` reports both).

A resumed run appends to the file, after dropping the records of iterations past the one it
starts from (:func:`drop_records_after`): those were written by a run that stopped after its
last checkpoint and are trained again, so a resumed run leaves one record per iteration. The
``run`` headers stay, one per start. A run that starts from iteration 0 onto a file that
already holds iterations (another run's) first moves that file aside, whole, to the first free
``PATH.1``, ``PATH.2``, ... (:func:`set_aside`): nothing is deleted.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from megatron.shapes import ModelShape, causal_pairs, training_flops


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA max allocated, or the peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_host_memory_gib()


def peak_host_memory_gib() -> float:
    """Peak resident memory of this process (``getrusage``'s ``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def host_memory_gib() -> Optional[float]:
    """Resident memory of this process now (``/proc/self/statm``; pinned host buffers count,
    they are resident), or None where that file does not exist."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def memory_report(device: torch.device) -> str:
    """One line: this process's GPU memory (allocated now / peak / reserved by PyTorch's
    caching allocator) and host memory (resident now / peak), for the start-up phases."""
    parts = []
    if device.type == "cuda":
        gib = 2**30
        parts.append(f"GPU {torch.cuda.memory_allocated(device) / gib:.1f} GiB allocated "
                     f"(peak {torch.cuda.max_memory_allocated(device) / gib:.1f}, reserved "
                     f"{torch.cuda.memory_reserved(device) / gib:.1f})")
    now = host_memory_gib()
    host = (f"host {'n/a' if now is None else f'{now:.1f}'} GiB resident "
            f"(peak {peak_host_memory_gib():.1f}")
    pinned = pinned_host_gib() if device.type == "cuda" else None
    if pinned is not None:   # blocks PyTorch's pinned allocator holds, in use or cached
        host += f", pinned {pinned:.1f}"
    parts.append(host + ")")
    return ", ".join(parts)


def pinned_host_gib() -> Optional[float]:
    """GiB of pinned host blocks held by PyTorch's caching host allocator (in use or cached
    for reuse; sizes rounded to powers of two), or None where PyTorch does not report it."""
    stats_fn = getattr(torch.cuda, "host_memory_stats", None)
    if stats_fn is None or not torch.cuda.is_available():
        return None
    value = stats_fn().get("allocated_bytes.current")
    return None if value is None else value / 2**30


@dataclass
class StepStats:
    """One iteration's numbers, as the training loop measured them."""

    iteration: int
    consumed_samples: int
    lm_loss: float
    grad_norm: Optional[float]
    lr: float
    step_time_s: float
    skipped: bool
    mem_gib: float
    host_mem_gib: Optional[float] = None
    attention_pairs: Optional[float] = None   # computed by core attention; None: not reported
    # packed documents: shapes this step ran batched for the first time (each a cuDNN plan
    # build on CUDA; packed_documents.batched_shapes), None without documents
    new_plan_shapes: Optional[int] = None


class Throughput:
    """Rates of a step from its wall time: tokens/s of the whole job and per device,
    model TFLOP/s per device and MFU (None without a peak).

    The FLOPs are :func:`megatron.shapes.training_flops` of the step's tokens and of the
    attention pairs its core attention computed: the pairs the batches reported (packed
    documents: the sum of ``n^2/2`` over their documents), else ``S^2/2`` per sequence of a
    dense causal batch. ``flops_count`` in every record says which: ``count`` (what the
    batches count: ``"documents"``, ``"dense causal"``, and the sliding window if layers use
    one) when pairs were reported, else ``"dense causal"``.
    """

    def __init__(self, shape: ModelShape, seq_length: int, global_batch_size: int,
                 world_size: int, peak_tflops: Optional[float], count: str = "documents"
                 ) -> None:
        self.shape = shape
        self.count = count
        self.tokens_per_iter = global_batch_size * seq_length
        self.dense_pairs = causal_pairs(seq_length, global_batch_size)
        self.world_size = world_size
        self.peak_tflops = peak_tflops

    def of(self, step_time_s: float, attention_pairs: Optional[float] = None
           ) -> Dict[str, Optional[float]]:
        t = max(step_time_s, 1e-9)
        pairs = attention_pairs if attention_pairs else self.dense_pairs
        flops = training_flops(self.shape, self.tokens_per_iter, pairs)
        tflops = flops / t / self.world_size / 1e12
        mfu = tflops / self.peak_tflops if self.peak_tflops else None
        tokens_per_s = self.tokens_per_iter / t
        return {"tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / self.world_size,
                "tflops_per_gpu": tflops, "mfu": mfu,
                "flops_count": self.count if attention_pairs else "dense causal"}


def _fmt_mfu(mfu: Optional[float]) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


def drop_records_after(path: str, iteration: int) -> int:
    """Rewrite the metrics file ``path`` without its records of iterations after
    ``iteration`` and without lines that are not JSON (a line cut off by a killed process);
    returns how many lines went. A missing file stays missing; a file with nothing to drop
    is left as it is. The rewrite goes to a temporary file renamed over ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return 0
    kept = [line for line in lines if _record_kept(line, iteration)]
    if len(kept) == len(lines):
        return 0
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
    os.replace(tmp, path)
    return len(lines) - len(kept)


def set_aside(path: str) -> Optional[str]:
    """Move the metrics file ``path`` to the first free ``path.N`` (N = 1, 2, ...) when it
    holds records of iterations (a run's, not only headers); returns where it went, or None
    when there was nothing to keep."""
    try:
        with open(path, encoding="utf-8") as f:
            has_iterations = any(_line_iteration(line)[1] is not None for line in f)
    except FileNotFoundError:
        return None
    if not has_iterations:
        return None
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    os.replace(path, f"{path}.{n}")
    return f"{path}.{n}"


def _line_iteration(line: str) -> Tuple[bool, Optional[int]]:
    """(whether the line is a whole JSON record, its iteration: None for a header)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return False, None                 # a line cut off by a killed process
    it = rec.get("iteration") if isinstance(rec, dict) else None
    return True, (it if isinstance(it, int) and not isinstance(it, bool) else None)


def _record_kept(line: str, iteration: int) -> bool:
    whole, it = _line_iteration(line)
    return whole and (it is None or it <= iteration)


class MetricsWriter:
    """Console, JSONL and TensorBoard output of the logging rank (the others pass
    ``enabled=False`` and every call is a no-op). ``start_iteration``: the iteration the
    run starts from (the loaded checkpoint's, else 0); the metrics file's records after it
    are dropped before the first write."""

    def __init__(self, enabled: bool, train_iters: int, log_interval: int,
                 throughput: Throughput, metrics_file: Optional[str] = None,
                 tensorboard_dir: Optional[str] = None, stream=None,
                 start_iteration: int = 0) -> None:
        self.enabled = enabled
        self.train_iters = train_iters
        self.log_interval = log_interval
        self.throughput = throughput
        self.stream = stream or sys.stdout
        self._jsonl = None
        self._tb = None
        self._window: list = []
        if not enabled:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            kept = set_aside(metrics_file) if start_iteration == 0 else None
            if kept:
                print(f"metrics file {metrics_file}: this run starts at iteration 0; the "
                      f"records already there were moved to {kept}", file=self.stream,
                      flush=True)
            dropped = drop_records_after(metrics_file, start_iteration)
            if dropped:
                print(f"metrics file {metrics_file}: dropped {dropped} line(s) of iterations "
                      f"after {start_iteration}, where this run starts (they are trained "
                      f"again)", file=self.stream, flush=True)
            self._jsonl = open(metrics_file, "a", encoding="utf-8")
        if tensorboard_dir:
            self._tb = _tensorboard_writer(tensorboard_dir)

    # ----------------------------------------------------------------- records
    def _record(self, obj: Dict) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(obj) + "\n")
            self._jsonl.flush()

    def run_header(self, layout: str, world_size: int, args: Dict) -> None:
        if self.enabled:
            self._record({"kind": "run", "layout": layout, "world_size": world_size,
                          "time": time.time(), "args": args})

    def train_step(self, st: StepStats, max_mem_gib: Optional[float] = None) -> None:
        """Record one iteration; print the interval's averages every ``log_interval``."""
        if not self.enabled:
            return
        rates = self.throughput.of(st.step_time_s, st.attention_pairs)
        self._record({"kind": "train", "iteration": st.iteration,
                      "consumed_samples": st.consumed_samples, "lm_loss": st.lm_loss,
                      "grad_norm": st.grad_norm, "lr": st.lr, "step_time_s": st.step_time_s,
                      **rates, "mem_gib": st.mem_gib, "host_mem_gib": st.host_mem_gib,
                      "skipped": st.skipped,
                      **({} if st.new_plan_shapes is None
                         else {"new_plan_shapes": st.new_plan_shapes})})
        self._window.append(st)
        if st.iteration % self.log_interval == 0 or st.iteration == self.train_iters:
            self._print_interval(max_mem_gib if max_mem_gib is not None else st.mem_gib)
            self._window = []

    def _print_interval(self, mem_gib: float) -> None:
        win = self._window
        last = win[-1]
        done = [s for s in win if not s.skipped]
        loss = sum(s.lm_loss for s in done) / len(done) if done else float("nan")
        norms = [s.grad_norm for s in done if s.grad_norm is not None]
        step_time = sum(s.step_time_s for s in win) / len(win)
        reported = [s.attention_pairs for s in win if s.attention_pairs]
        pairs = sum(reported) / len(reported) if len(reported) == len(win) else None
        rates = self.throughput.of(step_time, pairs)
        line = (
            f" iteration {last.iteration:8d}/{self.train_iters:8d} |"
            f" consumed samples: {last.consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {1000 * step_time:.1f} |"
            f" tokens/s: {rates['tokens_per_s']:.1f} (per GPU {rates['tokens_per_s_per_gpu']:.1f}) |"
            f" throughput per GPU (TFLOP/s/GPU): {rates['tflops_per_gpu']:.2f} |"
            f" MFU: {_fmt_mfu(rates['mfu'])} ({rates['flops_count']}) |"
            f" learning rate: {last.lr:.6E} |"
            # Means over the interval's applied steps (Megatron-LM's convention), labelled so:
            # the metrics file and tools/compare_loss.py use each iteration's own value.
            f" lm loss (mean of {len(done)} iter{'' if len(done) == 1 else 's'}): {loss:.6E} |"
            f" grad norm (mean): {(sum(norms) / len(norms)) if norms else float('nan'):.3f} |"
            f" number of skipped iterations: {len(win) - len(done):3d} |"
            f" mem (GiB): {mem_gib:.2f} |"
        )
        print(line, file=self.stream, flush=True)
        if self._tb is not None:
            it = last.iteration
            self._tb.add_scalar("lm loss", loss, it)
            self._tb.add_scalar("learning-rate", last.lr, it)
            if norms:
                self._tb.add_scalar("grad-norm", norms[-1], it)
            self._tb.add_scalar("throughput/tokens_per_s", rates["tokens_per_s"], it)
            self._tb.add_scalar("throughput/tflops_per_gpu", rates["tflops_per_gpu"], it)
            if rates["mfu"] is not None:
                self._tb.add_scalar("throughput/mfu", rates["mfu"], it)
            self._tb.add_scalar("memory/max_gib", mem_gib, it)
            self._tb.flush()

    def validation(self, iteration: int, lm_loss: float) -> None:
        if not self.enabled:
            return
        ppl = math.exp(min(20.0, lm_loss))
        self._record({"kind": "valid", "iteration": iteration, "lm_loss": lm_loss, "ppl": ppl})
        bar = "-" * 80
        print(f"{bar}\n validation loss at iteration {iteration} | lm loss value: "
              f"{lm_loss:.6E} | lm loss PPL: {ppl:.6E} |\n{bar}", file=self.stream, flush=True)
        if self._tb is not None:
            self._tb.add_scalar("lm loss validation", lm_loss, iteration)
            self._tb.add_scalar("lm loss validation ppl", ppl, iteration)
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _tensorboard_writer(log_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard
    except ImportError as exc:
        raise ImportError(
            f"--tensorboard-dir needs the tensorboard package: pip install tensorboard "
            f"({exc})") from None
    return SummaryWriter(log_dir=log_dir, max_queue=1000)
