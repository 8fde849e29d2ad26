"""What ``tools/bench_e2e.py`` runs and what it reports: its configuration, one run's
specification and outcome, and a row of the report."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from megatron.bench.models import MODELS, BenchModel
from megatron.shapes import ModelShape

REPO_ROOT = Path(__file__).resolve().parents[3]
PROGRESS_PREFIX = "[bench_e2e]"


RECOMPUTE_CHOICES = ("none", "full", "selective", "lean", "auto")

# The two FLOP counts (megatron.shapes.flops): every sequence a dense causal one, or the
# pairs of the documents actually trained (--docs).
DENSE_COUNT, USEFUL_COUNT = "dense causal", "useful (documents)"


@dataclass
class E2EConfig:
    """The command-line flags of ``tools/bench_e2e.py``, parsed."""

    seq_lens: List[int]
    model: str = "llama-0.85b"
    num_layers: Optional[int] = None     # a slice of the preset's layers (None: all)
    splits: List[Tuple[int, int]] = field(default_factory=lambda: [(2, 1), (1, 2)])
    nproc_per_node: int = 2
    iters: int = 10
    warmup: int = 3
    micro_batch_size: int = 1
    recompute: str = "auto"
    attention_backend: str = "auto"
    device: str = "auto"                 # auto | cuda | cpu
    peak_tflops: Optional[float] = None
    find_max_seq: bool = False
    start_seq: int = 131072
    max_seq: int = 2 * 1024 * 1024
    timeout_s: float = 3600.0
    log_dir: str = "runs/bench_e2e"
    pretrain_script: str = str(REPO_ROOT / "pretrain_gpt.py")
    extra_args: List[str] = field(default_factory=list)
    seed: int = 1234
    out: Optional[str] = None
    markdown: Optional[str] = None
    peers: List[str] = field(default_factory=list)
    ceiling: str = "auto"                # auto (on CUDA) | on | off
    rounds: int = 1                      # each length's runs and peers, repeated, alternating
    docs: Optional[str] = None           # --docs: a document mix (packed documents), or dense

    @property
    def bench_model(self) -> BenchModel:
        """The preset with its benchmark choices, cut to ``--num-layers``."""
        return MODELS[self.model].sliced(self.num_layers)

    @property
    def shape(self) -> ModelShape:
        return self.bench_model.shape

    def use_cuda(self) -> bool:
        if self.device == "auto":
            import torch  # torch-free module

            return torch.cuda.is_available()
        return self.device == "cuda"


@dataclass(frozen=True)
class RunSpec:
    """One training run: a length, a split and a recompute setting."""

    seq_len: int
    ulysses: int
    ring: int
    recompute: str            # none | full
    iters: int
    round: int = 1            # --rounds: which repetition of this length
    # with a ceiling on one GPU: one more iteration after the measured ones, profiled, whose
    # GEMM kernels' device time the ceiling's share takes where it beats the ceiling's own
    profile_step: bool = False

    @property
    def train_iters(self) -> int:
        """Iterations the run trains: the measured ones, plus the profiled one."""
        return self.iters + 1 if self.profile_step else self.iters

    def profile_dir(self, log_dir: str) -> str:
        return os.path.join(log_dir, f"{self.name}_profile")

    def profile_trace(self, log_dir: str) -> str:
        """The Chrome trace ``--profile`` writes for the profiled iteration (rank 0)."""
        k = self.train_iters
        return os.path.join(self.profile_dir(log_dir), f"rank0_iters{k}-{k}.json")

    @property
    def name(self) -> str:
        return (f"S{self.seq_len}_U{self.ulysses}xR{self.ring}_{self.recompute}"
                f"{round_suffix(self.round)}")


def round_suffix(round_: int) -> str:
    """File-name suffix of a run's log: none for the first round, ``_r2`` ... after it."""
    return "" if round_ == 1 else f"_r{round_}"


@dataclass
class RunOutcome:
    """What a launched run left behind."""

    status: str               # ok | oom | error | timeout
    returncode: Optional[int]
    records: List[dict]
    log_path: str
    command: List[str]
    note: Optional[str] = None
    attention_pairs: Optional[List[float]] = None   # --docs: per iteration, from the first
    documents: Optional[List[int]] = None           # --docs: per iteration
    step_gemm_ms: Optional[float] = None            # the profiled iteration's GEMM kernels


@dataclass
class E2EResult:
    """One row of the report (per-GPU figures are per GPU of the run)."""

    seq_len: int
    ulysses: int
    ring: int
    recompute: str
    gpus: int
    global_batch_size: int
    status: str
    note: Optional[str] = None
    iterations_measured: int = 0
    iter_ms: Optional[float] = None
    iter_ms_each: Optional[List[float]] = None   # the measured iterations, in order
    # packed documents: the measured iterations that ran no attention shape batched for the
    # first time (no cuDNN plan build), their count and mean; None without the loop's record
    steady_iterations: Optional[int] = None
    iter_ms_steady: Optional[float] = None
    iter_steady: Optional[List[bool]] = None     # per measured iteration: built no plan
    # with --ceiling: the steady iterations' ceiling (their own documents) over their mean
    ceiling_share_steady: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops_per_gpu: Optional[float] = None
    mfu: Optional[float] = None
    peak_mem_gib: Optional[float] = None
    peak_host_gib: Optional[float] = None
    num_layers: Optional[int] = None
    flops_per_iteration: Optional[float] = None
    peak_tflops: Optional[float] = None
    last_loss: Optional[float] = None
    log_path: Optional[str] = None
    command: Optional[str] = None
    stack: str = "megatron-usp"          # megatron-usp | hf | hf-liger
    tokens_per_s_per_gpu: Optional[float] = None
    ceiling_mfu: Optional[float] = None  # one-GPU rows, with --ceiling
    ceiling_share: Optional[float] = None
    # the ceiling's GEMMs (timed alone) and the same GEMMs' device time in a profiled training
    # iteration; the share counts the lower (the ceiling module, --ceiling)
    ceiling_gemm_ms: Optional[float] = None
    step_gemm_ms: Optional[float] = None
    round: int = 1                       # --rounds: which repetition of this length
    docs: Optional[str] = None           # --docs mix (None: dense sequences)
    flops_count: str = DENSE_COUNT       # which attention pairs the FLOPs count
    attention_pairs: Optional[float] = None      # per iteration, mean of the measured ones
    documents_per_iteration: Optional[float] = None
    attention_path: Optional[str] = None  # peers: how transformers ran attention


def global_batch_size(cfg: E2EConfig, spec: RunSpec) -> int:
    """One micro-batch per data-parallel rank: ``mbs * nproc / (U*R)`` sequences."""
    return cfg.micro_batch_size * cfg.nproc_per_node // (spec.ulysses * spec.ring)
