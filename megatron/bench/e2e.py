"""End-to-end training throughput through ``pretrain_gpt.py``, and the longest trainable sequence.

For each sequence length and U x R split, :func:`run_training` launches
``python -m torch.distributed.run --nproc-per-node N pretrain_gpt.py ...`` on synthetic tokens
(``--mock-data``) for ``--iters`` iterations, reads the per-iteration metrics file the
training loop writes (``--metrics-file``, JSONL, :mod:`megatron.training.observe.metrics`), drops the
first ``--warmup`` iterations and reports, over the rest:

* ``iter_ms``: mean iteration time (the loop's ``step_time_s``), and ``iter_ms_each`` the
  measured iterations one by one (their spread says how far one run's mean can be trusted);
* ``tokens_per_s = global_batch * S / iter_time``;
* ``tflops_per_gpu = model FLOPs per iteration / iter_time / GPUs`` and
  ``mfu = tflops_per_gpu / peak``, the peak being ``--peak-tflops`` or else the one the
  training loop took from its device table (989 TFLOP/s dense bf16 on H100/H200 SXM); n/a on
  the CPU;
* ``peak_mem_gib``: peak ``torch.cuda.max_memory_allocated`` of the logging rank;
* ``peak_host_gib``: peak resident memory (RSS) of the logging rank's process, which holds the
  pinned buffers of ``--recompute-cpu-offload`` and the CPU state of
  ``--optimizer-cpu-offload``.

Model FLOPs are the training loop's count,
:func:`megatron.training.observe.metrics.training_flops_per_iteration`: Megatron-LM's
``num_floating_point_operations`` with causal attention at half::

    FLOPs/iteration = B * S * ( 18*L*H*F  +  12*L*H*q*(1 + g/a)  +  6*L*q*S  +  6*H*V )
                      (SwiGLU MLP)        (QKV + output proj.)    (causal core) (logits)

with ``B`` sequences per iteration, ``L`` layers, hidden ``H``, FFN ``F``, ``a`` heads of dim
``d``, ``q = a*d``, ``g`` KV groups and ``V`` the padded vocabulary; recomputation is not
counted. For the Llama-style 0.85B model this is ``6*N*S + 6*S^2*L*q`` per sequence with
``N = 786,956,288`` parameters taking part in matmuls.

Activation recompute (``--recompute``): ``none``, ``full`` (megatron's
``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``),
``selective`` (``--recompute-granularity selective --recompute-modules mlp``: the MLP is
recomputed, the attention output kept, so no second attention forward), ``lean``
(``--recompute-granularity selective --recompute-modules layernorm swiglu``: only the norm
outputs and the SwiGLU product are recomputed, no matmul), or ``auto``: no
recompute first, and full recompute if that runs out of memory (both outcomes are
recorded).

``--find-max-seq`` doubles the sequence length from ``--start-seq`` (full recompute, or
``--recompute selective``; ``--iters`` iterations each) until a run fails, and reports the
longest that trained with its MFU and GPU / host peaks; an out-of-memory failure ends the
search, any other failure is reported as an error. ``--num-layers N`` runs a slice of the
preset's layers (for :mod:`megatron.bench.depth`, which extrapolates memory and time to full
depth from two slices).

Presets: ``llama-0.85b`` (issue 6's model) and ``llama3-8b`` (Llama-3-8B: 32 layers, hidden
4096, 32 heads / 8 KV heads, FFN 14336, vocabulary 128256, RoPE base 500000, output layer and
loss in chunks of 2048 tokens, whose logits take 2048 * 128256 * 10 bytes = 2.4 GiB).

Peers (``--peers hf,hf-liger``): after this project's runs of a length, the same model is
trained with Hugging Face transformers, plain and with Liger's kernels
(:mod:`megatron.bench.hf_peer`, one GPU, a process each, the same tokens per step and the same
FLOP count), at the recompute setting this project's run of that length ended with (``auto``:
none, then full if that runs out of memory; ``selective`` has no Hugging Face equivalent and
is compared with the peer's ``none``). The report gives each peer's tokens/s, MFU and peak
memory and the ratio of this project's per-GPU tokens/s to the peer's. A peer whose package
is missing is reported as ``missing`` with the install line (``pip install -e .[peers]``).

Rounds (``--rounds N``): each length's runs and its peers' are repeated N times, alternating
(ours, peers, ours, peers, ...), so that a drift of the machine over minutes (clocks, heat)
lands on both sides; each row records its round, ratios are taken within a round, and the
report adds, per length, the ratio of the mean tokens/s over the rounds with the range of the
per-round ratios (run-to-run noise of one run's mean is ~1-3 % on the H200 at 32K).

Ceiling (``--ceiling``, default on CUDA): :mod:`megatron.bench.ceiling` times the step's
matmuls and attention alone for each length, in a process of its own before the training
runs; one-GPU rows then show the ceiling MFU and the share of it reached.

Each run's full log and metrics file stay under ``--log-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron.bench import report
from megatron.bench.cli import (
    BenchConfigError,
    parse_seq_len,
    parse_seq_lens,
    parse_splits,
    seq_label,
)
from megatron.bench.flops import tflops_per_gpu
from megatron.training.launch import free_port
from megatron.usp.kernels import BACKEND_NAMES

REPO_ROOT = Path(__file__).resolve().parents[2]
PROGRESS_PREFIX = "[bench_e2e]"


@dataclass(frozen=True)
class ModelPreset:
    """A Llama-style model (RMSNorm, SwiGLU, RoPE, GQA, untied, no biases) by its flags."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int          # the embedding's rows: a multiple of 128 (no padding)
    # --fused-linear-cross-entropy: the output layer and the loss over chunks of tokens,
    # without full-sequence logits (at 256K tokens and V = 32000: 16 GiB bf16 + 31 GiB fp32)
    fused_loss: bool = False
    loss_chunk_tokens: Optional[int] = None   # --linear-cross-entropy-chunk-tokens
    rotary_base: Optional[int] = None         # --rotary-base (pretrain_gpt.py's default 10000)

    def flops_shape(self, seq_len: int):
        """The training loop's FLOP-count shape (:mod:`megatron.training.observe.metrics`)."""
        from megatron.training.observe.metrics import GPTShape

        return GPTShape(num_layers=self.num_layers, hidden_size=self.hidden_size,
                        ffn_hidden_size=self.ffn_hidden_size,
                        num_attention_heads=self.num_attention_heads,
                        num_query_groups=self.num_query_groups, kv_channels=self.kv_channels,
                        seq_length=seq_len, padded_vocab_size=self.vocab_size, swiglu=True)


MODELS: Dict[str, ModelPreset] = {
    # issue 6: 16 layers, hidden 2048, 16 heads of dim 128, 4 KV groups, FFN 5632, vocab 32000
    "llama-0.85b": ModelPreset(num_layers=16, hidden_size=2048, num_attention_heads=16,
                               num_query_groups=4, kv_channels=128, ffn_hidden_size=5632,
                               vocab_size=32000, fused_loss=True),
    # A few-second CPU smoke model with the same structure.
    # Llama-3-8B (issue 16); a 2048-token loss chunk keeps its 128256-wide logits at 2.4 GiB
    "llama3-8b": ModelPreset(num_layers=32, hidden_size=4096, num_attention_heads=32,
                             num_query_groups=8, kv_channels=128, ffn_hidden_size=14336,
                             vocab_size=128256, fused_loss=True, loss_chunk_tokens=2048,
                             rotary_base=500000),
    "tiny": ModelPreset(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        kv_channels=16, ffn_hidden_size=128, vocab_size=512),
}

RECOMPUTE_CHOICES = ("none", "full", "selective", "lean", "auto")

# Log lines that mean "out of memory" (CUDA caching allocator, NCCL, host).
OOM_MARKERS = ("outofmemoryerror", "out of memory", "cudaerrormemoryallocation",
               "cannot allocate memory")


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

    @property
    def shape(self) -> ModelPreset:
        preset = MODELS[self.model]
        if self.num_layers is None:
            return preset
        return replace(preset, num_layers=self.num_layers)

    def use_cuda(self) -> bool:
        if self.device == "auto":
            import torch

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
    round: int = 1                       # --rounds: which repetition of this length


# --------------------------------------------------------------------------- the command
def global_batch_size(cfg: E2EConfig, spec: RunSpec) -> int:
    """One micro-batch per data-parallel rank: ``mbs * nproc / (U*R)`` sequences."""
    return cfg.micro_batch_size * cfg.nproc_per_node // (spec.ulysses * spec.ring)


def model_flags(shape: ModelPreset) -> List[str]:
    """Megatron-LM flags of a Llama-style model (RMSNorm, SwiGLU, RoPE, GQA, untied, no bias),
    plus ``--fused-linear-cross-entropy`` for the presets that set ``fused_loss``.

    ``--vocab-size`` is one less than the model's vocabulary: the NullTokenizer of
    ``--mock-data`` adds the end-of-document id, so the embedding has exactly
    ``shape.vocab_size`` rows (a multiple of 128: no padding).
    """
    flags = [
        "--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden_size),
        "--ffn-hidden-size", str(shape.ffn_hidden_size),
        "--num-attention-heads", str(shape.num_attention_heads),
        "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(shape.vocab_size - 1),
        "--swiglu",
    ]
    if shape.num_query_groups != shape.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(shape.num_query_groups)]
    if shape.kv_channels * shape.num_attention_heads != shape.hidden_size:
        flags += ["--kv-channels", str(shape.kv_channels)]
    if shape.fused_loss:
        flags += ["--fused-linear-cross-entropy"]
    if shape.loss_chunk_tokens is not None:
        flags += ["--linear-cross-entropy-chunk-tokens", str(shape.loss_chunk_tokens)]
    if shape.rotary_base is not None:
        flags += ["--rotary-base", str(shape.rotary_base)]
    return flags


def recompute_flags(recompute: str) -> List[str]:
    """pretrain_gpt.py flags: none, selective (MLP only) or Megatron's full recompute of
    every layer (``uniform``, one layer per chunk)."""
    if recompute == "none":
        return []
    if recompute == "selective":
        return ["--recompute-granularity", "selective", "--recompute-modules", "mlp"]
    if recompute == "lean":
        return ["--recompute-granularity", "selective", "--recompute-modules", "layernorm",
                "swiglu"]
    if recompute == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"]
    raise ValueError(f"recompute {recompute!r}: a run uses none, selective, lean or full")


def pretrain_args(cfg: E2EConfig, spec: RunSpec, metrics_path: str) -> List[str]:
    """The ``pretrain_gpt.py`` arguments of one run."""
    args = model_flags(cfg.shape) + [
        "--seq-length", str(spec.seq_len), "--max-position-embeddings", str(spec.seq_len),
        "--micro-batch-size", str(cfg.micro_batch_size),
        "--global-batch-size", str(global_batch_size(cfg, spec)),
        "--train-iters", str(spec.iters), "--eval-iters", "0",
        "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "0", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--ulysses-degree", str(spec.ulysses), "--ring-degree", str(spec.ring),
        "--attention-backend", cfg.attention_backend,
        "--mock-data", "--log-interval", "1", "--seed", str(cfg.seed),
        "--metrics-file", metrics_path,
    ] + recompute_flags(spec.recompute)
    if cfg.device != "auto":
        args += ["--device", cfg.device]
    if cfg.peak_tflops is not None:
        args += ["--peak-tflops", str(cfg.peak_tflops)]
    if cfg.use_cuda():
        args += ["--bf16", "--use-distributed-optimizer"]
    return args + list(cfg.extra_args)


def launch_command(cfg: E2EConfig, spec: RunSpec, metrics_path: str, port: int) -> List[str]:
    """``python -m torch.distributed.run ... pretrain_gpt.py ...`` for one run."""
    return [sys.executable, "-m", "torch.distributed.run",
            "--nproc-per-node", str(cfg.nproc_per_node),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            cfg.pretrain_script] + pretrain_args(cfg, spec, metrics_path)


# --------------------------------------------------------------------------- one run
def is_oom_log(text: str) -> bool:
    low = text.lower()
    return any(m in low for m in OOM_MARKERS)


def read_metrics(path: str) -> List[dict]:
    """Per-iteration records of a JSONL metrics file (missing file: none)."""
    p = Path(path)
    if not p.exists():
        return []
    records = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue                         # a line cut short by a crash
    return records


def _run_to_end(cmd: List[str], env: dict, log, timeout_s: float) -> Optional[int]:
    """Run ``cmd`` in its own session; its exit code, or None after killing it on timeout.

    torchrun's workers are its children: on timeout the whole session is stopped (SIGTERM,
    then SIGKILL), so no worker is left holding a GPU.
    """
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return None


def run_training(cfg: E2EConfig, spec: RunSpec) -> RunOutcome:
    """Launch one run, wait for it, classify how it ended; the log goes to ``--log-dir``."""
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    metrics = log_dir / f"{spec.name}.metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    log_path = log_dir / f"{spec.name}.log"
    cmd = launch_command(cfg, spec, str(metrics), free_port())
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        rc = _run_to_end(cmd, env, log, cfg.timeout_s)
    records = read_metrics(str(metrics))
    return classify(rc, Path(log_path).read_text(errors="replace"), records, str(log_path), cmd,
                    spec.iters)


def classify(returncode: Optional[int], log_text: str, records: List[dict], log_path: str,
             cmd: List[str], iters: int) -> RunOutcome:
    """ok: exit 0 and every iteration logged; oom / timeout / error otherwise."""
    if returncode is None:
        return RunOutcome("timeout", None, records, log_path, cmd, "timed out (--timeout)")
    if returncode == 0 and _iterations(records) >= iters:
        return RunOutcome("ok", 0, records, log_path, cmd)
    if is_oom_log(log_text):
        return RunOutcome("oom", returncode, records, log_path, cmd, "out of memory")
    note = (f"exit {returncode}, {_iterations(records)}/{iters} iterations logged: "
            + failure_cause(log_text))
    return RunOutcome("error", returncode, records, log_path, cmd, note)


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception)\b(?::|$)")


_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")   # torchrun's per-rank log prefix


def failure_cause(log_text: str) -> str:
    """The line of a failed run's log that says why: a bad-input message
    (``pretrain_gpt.py: error: ...``), else the last exception line of a traceback other than
    torchrun's own ``ChildFailedError`` (which ends every failed log and says nothing), else
    the last three lines."""
    lines = [_RANK_PREFIX.sub("", ln).strip() for ln in log_text.splitlines()]
    lines = [ln for ln in lines if ln]
    for ln in lines:
        if ": error: " in ln and ln.split(": error: ", 1)[0].endswith(".py"):
            return ln[:300]
    causes = [ln for ln in lines if _EXCEPTION_LINE.match(ln) and "ChildFailedError" not in ln]
    if causes:
        return causes[-1][:300]
    return " / ".join(t[:160] for t in lines[-3:])


# --------------------------------------------------------------------------- metrics
def train_steps(records: List[dict]) -> List[dict]:
    """The ``kind == "train"`` records in iteration order, the last one of each iteration.

    Schema of :mod:`megatron.training.observe.metrics`: ``iteration``, ``step_time_s``, ``lm_loss``,
    ``tokens_per_s``, ``tflops_per_gpu``, ``mfu``, ``mem_gib`` (peak allocated so far on the
    logging rank); a resumed run appends, so a later record of an iteration wins.
    """
    last = {r["iteration"]: r for r in records
            if r.get("kind") == "train" and isinstance(r.get("iteration"), int)}
    return [last[i] for i in sorted(last)]


def _iterations(records: List[dict]) -> int:
    return len(train_steps(records))


def _number(record: dict, key: str) -> Optional[float]:
    v = record.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _peak(steps: List[dict], key: str) -> Optional[float]:
    values = [v for v in (_number(r, key) for r in steps) if v is not None]
    return max(values) if values else None


def peak_tflops_of_run(steps: List[dict]) -> Optional[float]:
    """The MFU denominator the training loop used (its device table): tflops / mfu."""
    for r in steps:
        tflops, mfu = _number(r, "tflops_per_gpu"), _number(r, "mfu")
        if tflops and mfu:
            return tflops / mfu
    return None


def summarize(cfg: E2EConfig, spec: RunSpec, outcome: RunOutcome) -> E2EResult:
    """Turn a run into a report row: the mean iteration time after ``--warmup``.

    FLOPs per iteration are the training loop's own count
    (:func:`megatron.training.observe.metrics.training_flops_per_iteration`); MFU uses
    ``--peak-tflops`` or else the peak the training loop itself used (none on the CPU).
    """
    from megatron.training.observe.metrics import training_flops_per_iteration

    gbs = global_batch_size(cfg, spec)
    res = E2EResult(spec.seq_len, spec.ulysses, spec.ring, spec.recompute, cfg.nproc_per_node,
                    gbs, outcome.status, outcome.note, log_path=outcome.log_path,
                    command=" ".join(shlex.quote(c) for c in outcome.command),
                    round=spec.round)
    res.flops_per_iteration = training_flops_per_iteration(cfg.shape.flops_shape(spec.seq_len),
                                                           gbs)
    steps = train_steps(outcome.records)
    if steps:
        res.last_loss = _number(steps[-1], "lm_loss")
    res.num_layers = cfg.shape.num_layers
    res.peak_mem_gib = _peak(steps, "mem_gib")
    res.peak_host_gib = _peak(steps, "host_mem_gib")
    times = [t for t in (_number(r, "step_time_s") for r in steps[cfg.warmup:]) if t]
    if outcome.status != "ok" or not times:
        if outcome.status == "ok":
            res.status, res.note = "error", "no timed iterations after --warmup"
        return res
    res.iterations_measured = len(times)
    seconds = sum(times) / len(times)
    res.iter_ms = 1e3 * seconds
    res.iter_ms_each = [1e3 * t for t in times]
    res.tokens_per_s = gbs * spec.seq_len / seconds
    res.tokens_per_s_per_gpu = res.tokens_per_s / cfg.nproc_per_node
    res.tflops_per_gpu = tflops_per_gpu(res.flops_per_iteration, seconds, cfg.nproc_per_node)
    res.peak_tflops = cfg.peak_tflops or peak_tflops_of_run(steps)
    res.mfu = res.tflops_per_gpu / res.peak_tflops if res.peak_tflops else None
    return res


# --------------------------------------------------------------------------- peers
def run_peer(cfg: E2EConfig, peer: str, seq_len: int, recompute: str,
             round_: int = 1) -> E2EResult:
    """Train ``peer`` (:mod:`megatron.bench.hf_peer`) at ``seq_len`` in a process of its own."""
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    name = f"S{seq_len}_{peer}_{recompute}{round_suffix(round_)}"
    out, log_path = log_dir / f"{name}.json", log_dir / f"{name}.log"
    if out.exists():
        out.unlink()
    cmd = [sys.executable, "-m", "megatron.bench.hf_peer", "--peer", peer, "--model", cfg.model,
           "--seq-len", str(seq_len), "--iters", str(cfg.iters), "--warmup", str(cfg.warmup),
           "--recompute", recompute, "--seed", str(cfg.seed), "--out", str(out)]
    if cfg.peak_tflops is not None:
        cmd += ["--peak-tflops", str(cfg.peak_tflops)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        rc = _run_to_end(cmd, env, log, cfg.timeout_s)
    data = json.loads(out.read_text()) if out.exists() else None
    if data is None:
        text = log_path.read_text(errors="replace")
        status = "timeout" if rc is None else "oom" if is_oom_log(text) else "error"
        tail = " / ".join(t.strip()[:160] for t in text.splitlines()[-3:] if t.strip())
        data = {"status": status, "note": f"exit {rc}: {tail}"}
    return peer_result(peer, seq_len, recompute, data, str(log_path),
                       " ".join(shlex.quote(c) for c in cmd), round_)


def peer_result(peer: str, seq_len: int, recompute: str, data: dict, log_path: str,
                command: str, round_: int = 1) -> E2EResult:
    """A report row from a peer's JSON (:class:`megatron.bench.hf_peer.PeerResult` keys)."""
    res = E2EResult(seq_len, 1, 1, recompute, 1, 1, data.get("status", "error"),
                    data.get("note"), log_path=log_path, command=command, stack=peer,
                    round=round_)
    for key in ("iterations_measured", "iter_ms", "tokens_per_s", "tflops_per_gpu", "mfu",
                "peak_mem_gib", "flops_per_iteration", "peak_tflops", "last_loss"):
        if data.get(key) is not None:
            setattr(res, key, data[key])
    steps = data.get("step_times_s") or []
    if res.iterations_measured and len(steps) >= res.iterations_measured:
        res.iter_ms_each = [1e3 * t for t in steps[len(steps) - res.iterations_measured:]]
    res.tokens_per_s_per_gpu = res.tokens_per_s
    return res


def peer_recompute_order(recompute: str) -> List[str]:
    """Recompute settings to try for a peer, in order, given ``--recompute``."""
    if recompute in ("auto", "lean"):
        return ["none", "full"]  # lean: Hugging Face has no elementwise-only recompute
    if recompute == "selective":
        return ["none"]          # Hugging Face has no MLP-only recompute
    return [recompute]


def _compared_pairs(results: Sequence[E2EResult]) -> List[Tuple[E2EResult, E2EResult]]:
    """(ours, peer) for each peer row that trained and each of this project's rows of the
    same length and round that trained, peers in report order."""
    return [(ours, peer)
            for peer in results if peer.stack != "megatron-usp" and peer.status == "ok"
            for ours in results if ours.stack == "megatron-usp" and ours.status == "ok"
            and ours.seq_len == peer.seq_len and ours.round == peer.round]


def peer_ratios(results: Sequence[E2EResult]) -> List[dict]:
    """For each peer row that trained, this project's rows of the same length and round that
    trained: per-GPU tokens/s and peak memory of ours over the peer's."""
    out = []
    for ours, peer in _compared_pairs(results):
        out.append({
            "seq_len": ours.seq_len, "split": f"{ours.ulysses}x{ours.ring}",
            "recompute": ours.recompute, "peer": peer.stack,
            "peer_recompute": peer.recompute, "round": ours.round,
            "tokens_per_s_ratio": ours.tokens_per_s_per_gpu / peer.tokens_per_s_per_gpu,
            "peak_mem_ratio": (ours.peak_mem_gib / peer.peak_mem_gib
                               if ours.peak_mem_gib and peer.peak_mem_gib else None)})
    return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def pooled_ratios(results: Sequence[E2EResult]) -> List[dict]:
    """Over the rounds (``--rounds``): for each length, split and recompute of ours against
    each peer (and its recompute), the ratio of the mean per-GPU tokens/s over the rounds in
    which both trained, the range of the per-round ratios, and our share of the ceiling at
    our mean iteration time. One entry per pair, also for a single round."""
    groups: Dict[tuple, List[Tuple[E2EResult, E2EResult]]] = {}
    for ours, peer in _compared_pairs(results):
        key = (ours.seq_len, ours.ulysses, ours.ring, ours.recompute, peer.stack,
               peer.recompute)
        groups.setdefault(key, []).append((ours, peer))
    out = []
    for (seq_len, u, r, recompute, peer, peer_recompute), pairs in groups.items():
        each = [o.tokens_per_s_per_gpu / p.tokens_per_s_per_gpu for o, p in pairs]
        ours_ms = _mean([o.iter_ms for o, _ in pairs])
        shares = [o.ceiling_share * o.iter_ms for o, _ in pairs if o.ceiling_share]
        out.append({
            "seq_len": seq_len, "split": f"{u}x{r}", "recompute": recompute, "peer": peer,
            "peer_recompute": peer_recompute, "rounds": len(pairs),
            "ours_iter_ms": ours_ms, "peer_iter_ms": _mean([p.iter_ms for _, p in pairs]),
            "tokens_per_s_ratio": (_mean([o.tokens_per_s_per_gpu for o, _ in pairs])
                                   / _mean([p.tokens_per_s_per_gpu for _, p in pairs])),
            "ratio_min": min(each), "ratio_max": max(each),
            # the ceiling is timed once per length: the same ceiling_ms on every round's row
            "ceiling_share": _mean(shares) / ours_ms if shares else None})
    return out


# --------------------------------------------------------------------------- ceiling
def run_ceiling(cfg: E2EConfig) -> Dict[int, dict]:
    """:mod:`megatron.bench.ceiling` for every length, in a process of its own; by length."""
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    out, log_path = log_dir / "ceiling.json", log_dir / "ceiling.log"
    lengths = ",".join(str(s) for s in cfg.seq_lens)
    cmd = [sys.executable, "-m", "megatron.bench.ceiling", "--model", cfg.model,
           "--seq-lens", lengths, "--out", str(out)]
    if cfg.peak_tflops is not None:
        cmd += ["--peak-tflops", str(cfg.peak_tflops)]
    with open(log_path, "w") as log:
        rc = _run_to_end(cmd, dict(os.environ), log, cfg.timeout_s)
    if rc != 0 or not out.exists():
        print(f"{PROGRESS_PREFIX} ceiling measurement failed (log {log_path})", flush=True)
        return {}
    return {int(c["seq_len"]): c for c in json.loads(out.read_text())}


def apply_ceiling(res: E2EResult, ceilings: Dict[int, dict]) -> None:
    """Ceiling MFU and the share of it reached, for rows of one GPU that trained."""
    c = ceilings.get(res.seq_len)
    if c is None or res.gpus != 1 or res.status != "ok" or not res.iter_ms:
        return
    res.ceiling_mfu = c.get("ceiling_mfu")
    res.ceiling_share = c["ceiling_ms"] / res.iter_ms


def ceiling_enabled(cfg: E2EConfig) -> bool:
    return cfg.ceiling == "on" or (cfg.ceiling == "auto" and cfg.use_cuda())


# --------------------------------------------------------------------------- sweeps
Runner = Callable[[E2EConfig, RunSpec], RunOutcome]
PeerRunner = Callable[[E2EConfig, str, int, str, int], E2EResult]


def throughput_sweep(cfg: E2EConfig, runner: Runner = run_training,
                     on_result: Callable[[E2EResult], None] = lambda r: None,
                     peer_runner: PeerRunner = run_peer,
                     ceilings: Optional[Dict[int, dict]] = None) -> List[E2EResult]:
    """Every (length, split), lengths in the given order, then the peers of that length.

    ``--recompute auto``: a run without recompute that runs out of memory is reported and
    repeated with full recompute; longer lengths of that split then start with full
    recompute (they would run out of memory too), saving a failed launch each. Peers follow
    :func:`peer_recompute_order` the same way.
    """
    results: List[E2EResult] = []
    needs_full = set()
    ceilings = ceilings or {}

    def record(res: E2EResult) -> E2EResult:
        apply_ceiling(res, ceilings)
        results.append(res)
        on_result(res)
        return res

    def run(spec: RunSpec) -> E2EResult:
        return record(summarize(cfg, spec, runner(cfg, spec)))

    for seq_len in cfg.seq_lens:
        for round_ in range(1, cfg.rounds + 1):
            for u, r in cfg.splits:
                first = cfg.recompute
                if first == "auto":
                    first = "full" if (u, r) in needs_full else "none"
                res = run(RunSpec(seq_len, u, r, first, cfg.iters, round_))
                if res.status == "oom" and cfg.recompute == "auto" and first == "none":
                    needs_full.add((u, r))
                    run(RunSpec(seq_len, u, r, "full", cfg.iters, round_))
            for peer in cfg.peers:
                for recompute in peer_recompute_order(cfg.recompute):
                    res = record(peer_runner(cfg, peer, seq_len, recompute, round_))
                    if res.status != "oom":
                        break
    return results


def find_max_seq(cfg: E2EConfig, runner: Runner = run_training,
                 on_result: Callable[[E2EResult], None] = lambda r: None
                 ) -> Tuple[List[E2EResult], Dict[str, Optional[int]]]:
    """Double S from ``start_seq`` per split until a run fails (full recompute, or
    ``--recompute selective``; ``none`` and ``auto`` search with full recompute).

    Returns the runs (each with its MFU and GPU / host peaks) and, per split ``"UxR"``, the
    longest length that trained (None if even ``start_seq`` failed).
    """
    recompute = cfg.recompute if cfg.recompute in ("full", "selective") else "full"
    results, longest = [], {}
    for u, r in cfg.splits:
        key, best, seq = f"{u}x{r}", None, cfg.start_seq
        while seq <= cfg.max_seq:
            spec = RunSpec(seq, u, r, recompute, cfg.iters)
            res = summarize(cfg, spec, runner(cfg, spec))
            results.append(res)
            on_result(res)
            if res.status != "ok":
                break
            best, seq = seq, seq * 2
        longest[key] = best
    return results, longest


# --------------------------------------------------------------------------- output
def _who(r: E2EResult) -> str:
    return f"U{r.ulysses}xR{r.ring}" if r.stack == "megatron-usp" else r.stack


def progress_line(r: E2EResult) -> str:
    where = f" round {r.round}" if r.round > 1 else ""
    head = (f"{PROGRESS_PREFIX} S={r.seq_len} {_who(r)}{where} recompute={r.recompute:<4} "
            f"{r.status}")
    if r.status != "ok":
        return f"{head}: {r.note or ''} (log {r.log_path})"
    mfu = "n/a" if r.mfu is None else f"{100 * r.mfu:.1f}%"
    mem = "n/a" if r.peak_mem_gib is None else f"{r.peak_mem_gib:.1f} GiB"
    host = "n/a" if r.peak_host_gib is None else f"{r.peak_host_gib:.1f} GiB"
    spread = ""
    if r.iter_ms_each and len(r.iter_ms_each) > 1:
        spread = f" ({min(r.iter_ms_each):.1f}-{max(r.iter_ms_each):.1f})"
    line = (f"{head}: {r.iter_ms:.1f}{spread} ms/iter, {r.tokens_per_s:,.0f} tokens/s, "
            f"{r.tflops_per_gpu:.1f} TFLOP/s/GPU, MFU {mfu}, peak {mem}, host peak {host}")
    if r.ceiling_share is not None:
        line += (f", {100 * r.ceiling_share:.1f}% of the ceiling "
                 f"({report.fmt(r.ceiling_mfu, pct=True)} MFU)")
    return line


def ratio_line(ratio: dict) -> str:
    mem = ratio["peak_mem_ratio"]
    where = f" round {ratio['round']}" if ratio.get("round", 1) > 1 else ""
    return (f"{PROGRESS_PREFIX} S={ratio['seq_len']} U x R {ratio['split']} "
            f"({ratio['recompute']}) vs {ratio['peer']} ({ratio['peer_recompute']}){where}: "
            f"{ratio['tokens_per_s_ratio']:.3f}x tokens/s per GPU, "
            f"{'n/a' if mem is None else f'{mem:.2f}x'} peak memory")


def pooled_line(p: dict) -> str:
    share = ("" if p["ceiling_share"] is None
             else f", ours at {100 * p['ceiling_share']:.1f}% of the ceiling")
    return (f"{PROGRESS_PREFIX} S={p['seq_len']} U x R {p['split']} ({p['recompute']}) vs "
            f"{p['peer']} ({p['peer_recompute']}) over {p['rounds']} round(s): "
            f"{p['tokens_per_s_ratio']:.3f}x tokens/s per GPU (rounds "
            f"{p['ratio_min']:.3f}-{p['ratio_max']:.3f}x; {p['ours_iter_ms']:.1f} vs "
            f"{p['peer_iter_ms']:.1f} ms/iter){share}")


def _peaks(results: List[E2EResult]) -> str:
    peaks = sorted({r.peak_tflops for r in results if r.peak_tflops})
    return ", ".join(f"{p:g}" for p in peaks) or "n/a"


def _insert_round_column(headers: List[str], rows: List[List[str]],
                         rounds: Sequence[int]) -> None:
    """A "round" column after the first one (tables of a ``--rounds`` run)."""
    headers.insert(1, "round")
    for row, round_ in zip(rows, rounds):
        row.insert(1, str(round_))


COLD_FIRST_STEP = ("--warmup 0: the first iteration is timed, and it includes compiling the "
                   "Triton / Inductor kernels and the first allocations (6-11 s of a 512K "
                   "step on one H200, docs/performance.md 6.5): a lower bound on speed.")


def results_markdown(meta: dict, cfg: E2EConfig, results: List[E2EResult],
                     longest: Optional[Dict[str, Optional[int]]] = None) -> str:
    s = cfg.shape
    title = (f"End to end, {cfg.model} ({s.num_layers} layers, hidden {s.hidden_size}, "
             f"{s.num_attention_heads} heads, {s.num_query_groups} KV groups, FFN "
             f"{s.ffn_hidden_size}, vocab {s.vocab_size}), {cfg.nproc_per_node} processes, "
             f"mean of iterations {cfg.warmup + 1}..{cfg.iters}; MFU against "
             f"{_peaks(results)} TFLOP/s\n\n")
    if cfg.warmup == 0:
        title += COLD_FIRST_STEP + "\n\n"
    headers = ["S", "stack", "U x R", "recompute", "status", "ms/iter", "tokens/s/GPU",
               "TFLOP/s/GPU", "MFU", "peak GiB/GPU", "host peak GiB", "ceiling MFU",
               "share of ceiling"]
    rows = [[seq_label(r.seq_len), r.stack, f"{r.ulysses}x{r.ring}", r.recompute,
             r.status if r.status == "ok" else f"{r.status}: {r.note or ''}"[:80],
             report.fmt(r.iter_ms), report.fmt(r.tokens_per_s_per_gpu, 0),
             report.fmt(r.tflops_per_gpu), report.fmt(r.mfu, pct=True),
             report.fmt(r.peak_mem_gib), report.fmt(r.peak_host_gib),
             report.fmt(r.ceiling_mfu, pct=True), report.fmt(r.ceiling_share, pct=True)]
            for r in results]
    rounds = cfg.rounds > 1
    if rounds:
        _insert_round_column(headers, rows, [r.round for r in results])
    text = title + report.metadata_markdown(meta) + "\n" + report.markdown_table(headers, rows)
    ratios = peer_ratios(results)
    if ratios:
        ratio_rows = [[seq_label(x["seq_len"]), x["split"], x["recompute"], x["peer"],
                       x["peer_recompute"], f"{x['tokens_per_s_ratio']:.3f}x",
                       "n/a" if x["peak_mem_ratio"] is None else f"{x['peak_mem_ratio']:.2f}x"]
                      for x in ratios]
        ratio_headers = ["S", "U x R", "recompute", "peer", "peer recompute",
                         "tokens/s per GPU vs peer", "peak memory vs peer"]
        if rounds:
            _insert_round_column(ratio_headers, ratio_rows, [x["round"] for x in ratios])
        text += "\n" + report.markdown_table(ratio_headers, ratio_rows)
    if rounds and ratios:
        text += ("\nOver the rounds (the ratio of the mean tokens/s; the range of the "
                 "per-round ratios):\n\n" + report.markdown_table(
                     ["S", "U x R", "recompute", "peer", "rounds", "ms/iter ours / peer",
                      "tokens/s per GPU vs peer", "per-round range", "our share of ceiling"],
                     [[seq_label(x["seq_len"]), x["split"], x["recompute"], x["peer"],
                       str(x["rounds"]), f"{x['ours_iter_ms']:.1f} / {x['peer_iter_ms']:.1f}",
                       f"{x['tokens_per_s_ratio']:.3f}x",
                       f"{x['ratio_min']:.3f}-{x['ratio_max']:.3f}x",
                       report.fmt(x["ceiling_share"], pct=True)]
                      for x in pooled_ratios(results)]))
    if longest is not None:
        text += "\nLongest sequence that trained: " + ", ".join(
            f"{k}: {seq_label(v) if v else 'none'}" for k, v in longest.items()) + "\n"
    return text


# --------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_e2e.py",
        description="End-to-end training throughput of pretrain_gpt.py (tokens/s, TFLOP/s per "
                    "GPU, MFU) and the longest trainable sequence. Launches torchrun itself.")
    p.add_argument("--model", default="llama-0.85b", choices=list(MODELS))
    p.add_argument("--num-layers", type=int, default=None,
                   help="run a slice of this many of the preset's layers (FLOPs and MFU count "
                        "the slice); see python -m megatron.bench.depth")
    p.add_argument("--seq-lens", default="32k,64k,128k", help="comma-separated (k = 1024)")
    p.add_argument("--splits", default="2x1,1x2", help="U x R splits, e.g. 2x1,1x2")
    p.add_argument("--nproc-per-node", type=int, default=2, help="processes (GPUs) per run")
    p.add_argument("--iters", type=int, default=10, help="training iterations per run")
    p.add_argument("--warmup", type=int, default=3,
                   help="first iterations left out (with 0 the timed first one includes the "
                        "kernels' compilation)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--recompute", default="auto", choices=list(RECOMPUTE_CHOICES))
    p.add_argument("--attention-backend", default="auto", choices=list(BACKEND_NAMES),
                   help="USP's local attention kernel (pretrain_gpt.py --attention-backend)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense TFLOP/s per GPU for MFU (default: the training loop's "
                        "device table, e.g. 989 on H100/H200; n/a on CPU)")
    p.add_argument("--find-max-seq", action="store_true",
                   help="double S from --start-seq until a run fails (full recompute, or "
                        "--recompute selective); records MFU and GPU / host peaks")
    p.add_argument("--start-seq", default="128k")
    p.add_argument("--max-seq", default="2m", help="stop doubling past this length")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--log-dir", default="runs/bench_e2e",
                   help="per-run logs and metrics files (runs/ is git-ignored)")
    p.add_argument("--pretrain-script", default=str(REPO_ROOT / "pretrain_gpt.py"))
    p.add_argument("--extra-args", default="",
                   help="more pretrain_gpt.py flags as one string, e.g. "
                        "--extra-args='--num-workers 0'")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--markdown", default=None, help="markdown table file")
    p.add_argument("--peers", default="none",
                   help="comma-separated peers trained on one GPU after each length's runs: "
                        "hf (Hugging Face transformers), hf-liger (with Liger's kernels), or "
                        "none; install them with pip install -e .[peers]")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat each length's runs and its peers this many times, alternating "
                        "(ours, peers, ours, ...); ratios per round and over the rounds")
    p.add_argument("--ceiling", default="auto", choices=["auto", "on", "off"],
                   help="time the step's matmuls and attention alone first (the zero-overhead "
                        "ceiling); auto: on CUDA")
    return p


def parse_peers(text: str) -> List[str]:
    """``hf,hf-liger`` -> ["hf", "hf-liger"]; ``none`` or empty -> []."""
    from megatron.bench.hf_peer import PEERS

    names = [p.strip() for p in text.split(",") if p.strip() and p.strip() != "none"]
    unknown = [p for p in names if p not in PEERS]
    if unknown:
        raise BenchConfigError(f"--peers {text!r}: unknown {unknown}; choose from "
                               f"{list(PEERS)} or none, e.g. --peers hf,hf-liger")
    if len(set(names)) != len(names):
        raise BenchConfigError(f"--peers {text!r} names a peer twice")
    return names


def config_from_args(ns: argparse.Namespace) -> E2EConfig:
    seq_lens = parse_seq_lens(ns.seq_lens)
    splits = parse_splits(ns.splits)
    start = parse_seq_len(ns.start_seq, "--start-seq")
    stop = parse_seq_len(ns.max_seq, "--max-seq")
    return E2EConfig(
        seq_lens=seq_lens, model=ns.model, num_layers=ns.num_layers, splits=splits,
        nproc_per_node=ns.nproc_per_node,
        iters=ns.iters, warmup=ns.warmup, micro_batch_size=ns.micro_batch_size,
        recompute=ns.recompute, attention_backend=ns.attention_backend, device=ns.device,
        peak_tflops=ns.peak_tflops, find_max_seq=ns.find_max_seq, start_seq=start,
        max_seq=stop, timeout_s=ns.timeout, log_dir=ns.log_dir,
        pretrain_script=ns.pretrain_script, extra_args=shlex.split(ns.extra_args),
        seed=ns.seed, out=ns.out, markdown=ns.markdown, peers=parse_peers(ns.peers),
        ceiling=ns.ceiling, rounds=ns.rounds)


def validate_config(cfg: E2EConfig) -> None:
    """Flag checks before anything is launched."""
    if not Path(cfg.pretrain_script).exists():
        raise BenchConfigError(f"--pretrain-script {cfg.pretrain_script} does not exist; "
                               f"point it at the repository's pretrain_gpt.py")
    if cfg.num_layers is not None and not 1 <= cfg.num_layers <= MODELS[cfg.model].num_layers:
        raise BenchConfigError(f"--num-layers {cfg.num_layers}: a slice of {cfg.model} has 1 to "
                               f"{MODELS[cfg.model].num_layers} layers")
    if cfg.iters <= cfg.warmup or cfg.warmup < 0:
        raise BenchConfigError(f"--iters {cfg.iters} must exceed --warmup {cfg.warmup} "
                               f"(>= 0); try --iters {cfg.warmup + 5}")
    if not cfg.splits:
        raise BenchConfigError("--splits is empty; try --splits 2x1,1x2")
    for u, r in cfg.splits:
        if cfg.nproc_per_node % (u * r):
            raise BenchConfigError(
                f"--splits {u}x{r}: U*R = {u * r} must divide --nproc-per-node "
                f"{cfg.nproc_per_node}; try --splits {cfg.nproc_per_node}x1")
    if cfg.rounds < 1:
        raise BenchConfigError(f"--rounds {cfg.rounds}: at least 1 (try --rounds 2 to "
                               f"alternate two runs of each stack)")
    if cfg.rounds > 1 and cfg.find_max_seq:
        raise BenchConfigError("--rounds repeats throughput runs; it cannot run with "
                               "--find-max-seq (drop one of them)")
    if cfg.peers and cfg.find_max_seq:
        raise BenchConfigError("--peers compares throughput; it cannot run with "
                               "--find-max-seq (drop one of them)")
    if cfg.find_max_seq and cfg.start_seq > cfg.max_seq:
        raise BenchConfigError(f"--start-seq {cfg.start_seq} exceeds --max-seq {cfg.max_seq}; "
                               f"try --max-seq {2 * cfg.start_seq}")
    lengths = [cfg.start_seq] if cfg.find_max_seq else cfg.seq_lens
    flag = "--start-seq" if cfg.find_max_seq else "--seq-lens"
    for s in lengths:
        for u, r in cfg.splits:
            if s % (2 * u * r):
                raise BenchConfigError(f"{flag}: {s} must be divisible by 2*U*R = {2 * u * r} "
                                       f"for --splits {u}x{r}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``tools/bench_e2e.py``: run the sweep (or the search), print and write the results."""
    parser = build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config_from_args(parser.parse_args(args_list))
        validate_config(cfg)
    except BenchConfigError as exc:
        parser.error(str(exc))
    if cfg.warmup == 0:
        print(f"{PROGRESS_PREFIX} note: {COLD_FIRST_STEP}", flush=True)
    # The device is described after the runs: this process must not take GPU memory (a CUDA
    # context) while they train.
    meta = report.run_metadata(["tools/bench_e2e.py"] + args_list, None, cfg.nproc_per_node)
    payload = {"tool": "bench_e2e", "schema_version": report.SCHEMA_VERSION, "metadata": meta,
               "config": dict(asdict(cfg), shape=asdict(cfg.shape),
                              splits=[f"{u}x{r}" for u, r in cfg.splits]),
               "flops_formula": "B*S*(18*L*H*F + 12*L*H*q*(1+g/a) + 6*L*q*S + 6*H*V) "
                                "(Megatron-LM, causal attention at half)",
               "results": []}
    done: List[E2EResult] = []

    def on_result(res: E2EResult) -> None:
        print(progress_line(res), flush=True)
        done.append(res)
        payload["results"] = [asdict(r) for r in done]
        _write(cfg, payload, meta, done, None)

    longest = None
    if cfg.find_max_seq:
        _, longest = find_max_seq(cfg, on_result=on_result)
        payload["longest_seq"] = longest
        print(f"{PROGRESS_PREFIX} longest sequence that trained: {longest}", flush=True)
    else:
        ceilings = run_ceiling(cfg) if ceiling_enabled(cfg) else {}
        payload["ceilings"] = list(ceilings.values())
        throughput_sweep(cfg, on_result=on_result, ceilings=ceilings)
        payload["peer_ratios"] = peer_ratios(done)
        for ratio in payload["peer_ratios"]:
            print(ratio_line(ratio), flush=True)
        payload["pooled_ratios"] = pooled_ratios(done)
        if cfg.rounds > 1:
            for pooled in payload["pooled_ratios"]:
                print(pooled_line(pooled), flush=True)
    meta["device"] = report.device_description(_device(cfg))
    _write(cfg, payload, meta, done, longest)
    return 0


def _device(cfg: E2EConfig):
    import torch

    return torch.device("cuda", 0) if cfg.use_cuda() else torch.device("cpu")


def _write(cfg: E2EConfig, payload: dict, meta: dict, results: List[E2EResult],
           longest: Optional[Dict[str, Optional[int]]]) -> None:
    if cfg.out:
        report.write_json(cfg.out, payload)
    if cfg.markdown:
        report.write_text(cfg.markdown, results_markdown(meta, cfg, results, longest))
