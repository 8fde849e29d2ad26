"""Command-line arguments of ``pretrain_gpt.py``: Megatron-LM's flag names, grouped, validated.

Every flag Megatron-LM has keeps Megatron-LM's name and meaning; Megatron-USP adds
``--ulysses-degree``, ``--ring-degree`` (integers or ``auto``), ``--attention-backend``,
``--device``, ``--metrics-file``, ``--peak-tflops``, ``--skip-nan-steps``,
``--fused-linear-cross-entropy`` and a few more, each documented in ``--help``. Deliberate
differences from Megatron-LM, all visible in ``--help``:

* ``--hidden-dropout`` and ``--attention-dropout`` default to 0 (USP attention has no
  attention dropout; Llama-style pretraining uses none).
* ``--context-parallel-size`` is derived as U*R; when given it must equal U*R.
* ``--num-query-groups`` without ``--group-query-attention`` is an error, not ignored.

:func:`validate_args` runs on every rank before any process group exists and raises
:class:`ArgumentsError` (or the layout's :class:`~megatron.usp.parallel_dims.USPConfigError`) naming
the flag and a valid value, so bad input never reaches a collective. It returns the run's
:class:`~megatron.training.cli.config.RunConfig` (the derived values: the layout,
``ffn_hidden_size``, ``kv_channels``, ...) and writes nothing onto the namespace.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron.shapes import ModelShape, default_ffn_hidden_size, padded_vocab_size
from megatron.training.cli.config import RunConfig
from megatron.training.cli.document_args import add_document_args, document_flags_problem
from megatron.training.cli.errors import ArgumentsError
from megatron.training.cli.fp8_args import add_fp8_args, fp8_options
from megatron.training.cli.memory_args import add_memory_args, validate_memory_args
from megatron.training.cli.pretrained_args import add_pretrained_args
from megatron.training.cli.rope_args import add_rope_args, rope_scaling_from_args
from megatron.training.cli.window_args import add_window_args, window_from_args
from megatron.training.data.errors import DataConfigError
from megatron.training.exit_paths import leave_the_message_to_rank_0
from megatron.usp.backend_names import (
    BACKEND_NAMES,
    FUSED_KERNEL_CHOICES,
    FusedKernelsUnavailable,
    backend_problem,
    resolve_fused_kernels,
)
from megatron.usp.parallel_dims import ParallelDims, USPConfigError

DEFAULT_LOSS_CHUNK_TOKENS = 8192
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def _degree(value: str):
    """``--ulysses-degree`` / ``--ring-degree``: a positive integer or ``auto``."""
    if value == "auto":
        return value
    try:
        out = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither an integer nor 'auto'") from None
    return out


def _chunks(value: str):
    """``--usp-overlap-chunks``: a positive integer or ``auto``."""
    out = _degree(value)
    if out != "auto" and out < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be >= 1 (1 turns the pipeline off)")
    return out


# --------------------------------------------------------------------------- parser
class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default when it has a meaningful one (not None, not a switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or default is None or isinstance(default, bool)
                or default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model", "GPT shape (Megatron-LM names; Llama-style via "
                                           "--swiglu --normalization RMSNorm "
                                           "--position-embedding-type rope)")
    g.add_argument("--num-layers", type=int, default=None, help="transformer layers (required)")
    g.add_argument("--hidden-size", type=int, default=None, help="model width (required)")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP width; default 4*hidden, or Megatron's SwiGLU default "
                        "int(8*hidden/3 / 64)*64 with --swiglu")
    g.add_argument("--num-attention-heads", type=int, default=None,
                   help="query heads (required)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups KV heads")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="KV heads with --group-query-attention")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="head dimension; default hidden/heads")
    g.add_argument("--seq-length", type=int, default=None,
                   help="tokens per sample (required); divisible by 2*U*R")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="position table size; default --seq-length")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=("learned_absolute", "rope", "yarn", "none"),
                   help="rope for Llama-style models; yarn: RoPE with YaRN scaling (the "
                        "--yarn-* flags)")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of the head dimension RoPE rotates")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated SiLU)")
    g.add_argument("--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"),
                   help="RMSNorm for Llama-style models")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of the norms")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in the linear layers (Llama-style)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate input embedding and output layer weights")
    g.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="dropout after attention and MLP (Megatron-LM's default is 0.1)")
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="must be 0: USP attention has no attention dropout")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="std of the normal weight initialisation")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times TP")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="the model's vocabulary before padding: the ids of --tokenizer-type "
                        "NullTokenizer (--mock-data); with --tokenizer-model, the embedding "
                        "rows, at least the tokenizer's length (default: that length)")
    add_pretrained_args(g)
    add_rope_args(g)
    add_window_args(g)


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "parallelism", "grid order TP -> Ulysses -> Ring -> DP -> PP; the data-parallel size "
                       "is derived: world / (TP * U * R * PP)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP")
    g.add_argument("--ulysses-degree", type=_degree, default=1,
                   help="U: DeepSpeed-Ulysses all-to-all sequence parallelism (or 'auto' with "
                        "--ring-degree auto: the layout planner chooses)")
    g.add_argument("--ring-degree", type=_degree, default=1,
                   help="R: load-balanced ring attention (or 'auto')")
    g.add_argument("--context-parallel-size", type=int, default=None,
                   help="optional; must equal U*R (megatron-core's name for the CP size)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism inside the TP group: norms, dropout and "
                        "residuals hold 1/TP of each CP rank's tokens (all-gather before QKV / "
                        "FC1, reduce-scatter after the projections). Silently off at TP = 1, "
                        "as in Megatron-LM. --seq-length / (U*R) must be divisible by TP")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1: optimizer state sharded over DP x CP (megatron-core's "
                        "DistributedOptimizer)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap the DP x CP gradient reduction with backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="overlap the distributed optimizer's parameter all-gather with forward")
    g.add_argument("--attention-backend", default="auto", choices=BACKEND_NAMES,
                   help="local attention kernel of USP attention")
    g.add_argument("--fused-kernels", default="auto", choices=FUSED_KERNEL_CHOICES,
                   help="kernels for RMSNorm, SwiGLU and RoPE: usp (this project's Triton "
                        "kernels; plain PyTorch math on the CPU), liger (Liger's Triton "
                        "kernels, pip install liger-kernel), compile (torch.compile of the "
                        "plain ops), torch (plain PyTorch / megatron-core's own), or auto (usp "
                        "on CUDA, else torch)")
    g.add_argument("--gradient-accumulation-fusion", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="the weight-gradient GEMMs of QKV, the projection, FC1 and FC2 add into "
                        "the float32 gradient buffer (Megatron-LM's default, there through apex; "
                        "here with PyTorch): no bf16 weight gradient, one pass over the buffer "
                        "less. --no-gradient-accumulation-fusion: megatron-core's separate "
                        "addition")
    g.add_argument("--usp-overlap-chunks", type=_chunks, default="auto",
                   help="head chunks pipelining USP's all-to-alls with attention: 1 (off), a "
                        "divisor of the KV heads per Ulysses rank, or auto (2 when only one of "
                        "U and R is > 1 and each chunk keeps >= 8 query heads per rank)")
    g.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto: CUDA when available, else CPU (gloo, float32)")
    g.add_argument("--distributed-backend", default=None, choices=("nccl", "gloo"),
                   help="default: nccl on CUDA, gloo on CPU")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="collective timeout; a checkpoint write that makes no progress for "
                        "half of it fails the save (the last checkpoint stays intact)")
    g.add_argument("--hardware", default=None,
                   help="planner hardware preset for 'auto' degrees (default: from the GPU "
                        "name; see tools/plan_parallel.py --help)")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="for 'auto' degrees; default: torchrun's LOCAL_WORLD_SIZE")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "data", "without --data-path and --mock-data, the built-in default corpus and its "
                "SentencePiece tokenizer are used (built at first use)")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="dataset prefix(es) from tools/preprocess_data.py, optionally "
                        "weighted: 0.7 PREFIX_A 0.3 PREFIX_B")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights")
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens, no files")
    g.add_argument("--tokenizer-type", default=None,
                   choices=("SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer"),
                   help="default: SentencePieceTokenizer (NullTokenizer with --mock-data)")
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model file or Hugging Face tokenizer directory")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    g.add_argument("--data-cache-path", default=None, help="megatron-core sample-index cache")
    g.add_argument("--corpus-cache-dir", default=None,
                   help="where the default corpus is built (default ~/.cache/megatron-usp)")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on EOD predictions")
    g.add_argument("--batch-agreement-interval", type=int, default=1, metavar="N",
                   help="every N-th micro-batch the TP and context-parallel ranks that must "
                        "read the same micro-batch compare a 64-bit hash of its token ids, "
                        "segment ids and chunk assignment (one int64 all-gather on the host, "
                        "gloo); a mismatch stops the run naming the ranks. 0 turns it off")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="positions (RoPE) restart after each EOD token (Megatron-LM's meaning)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="attention confined to the EOD-delimited documents of a packed sequence "
                        "(megatron/training/data/documents.py)")
    add_document_args(g)


# megatron-core's recompute_modules that apply to a dense GPT (the MoE / MLA ones do not),
# plus "swiglu". "layernorm" and "swiglu" are implemented by this project's layer spec
# (megatron.layers.fused_linears), the others by megatron-core.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "swiglu")
SPEC_RECOMPUTE_MODULES = ("layernorm", "swiglu")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per step; default micro * DP. Gradient accumulation "
                        "steps = global / (micro * DP)")
    g.add_argument("--train-iters", type=int, default=None, help="optimizer steps (required)")
    g.add_argument("--bf16", action="store_true",
                   help="bfloat16 with float32 main params (GPU only; CPU runs float32)")
    add_fp8_args(g)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="float32 gradient buffers (accumulation over micro-batches) and "
                        "DP x CP reduction with --bf16: the default, as in Megatron-LM; "
                        "accepted for Megatron-LM command lines")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16, accumulate gradients over micro-batches and reduce "
                        "them over DP x CP in bfloat16 instead of float32 (Megatron-LM's "
                        "name). Saves 2 bytes per parameter of gradient buffer and halves "
                        "the gradient all-reduce / reduce-scatter traffic (2 instead of 4 "
                        "bytes per parameter); costs accuracy: every accumulation and "
                        "reduction step rounds to bf16 (8-bit mantissa), so the error grows "
                        "with the micro-batches per rank and the DP x CP size (one H200, 4 "
                        "micro-batches: loss +0.6 %% over steps 100-200; docs/numerics.md)")
    g.add_argument("--optimizer", default="adam", choices=("adam", "sgd"),
                   help="adam is AdamW (decoupled weight decay), as in Megatron-LM")
    g.add_argument("--weight-decay", type=float, default=0.01,
                   help="decoupled weight decay (not on biases and norms)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip; 0: off")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="with --optimizer sgd")
    g.add_argument("--recompute-granularity", default=None, choices=("full", "selective"),
                   help="activation recompute")
    g.add_argument("--recompute-method", default=None, choices=("uniform", "block"),
                   help="with --recompute-granularity full")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="with --recompute-granularity full: layers per recompute unit "
                        "(uniform) or recomputed layers per stage (block)")
    g.add_argument("--recompute-modules", nargs="+", default=None, choices=RECOMPUTE_MODULES,
                   help="with --recompute-granularity selective: the submodules whose "
                        "activations are recomputed (megatron-core's default: core_attn). "
                        "'mlp' keeps the attention output and recomputes the MLP, so long "
                        "sequences do not pay for a second attention forward; 'layernorm' "
                        "keeps the norms' inputs, not their outputs, and 'swiglu' FC1's "
                        "output, not the SwiGLU product (each recomputed in the backward: "
                        "no matmul, ~1%% of the step; 9.5 GiB less at 32K tokens for the "
                        "0.85B model)")
    g.add_argument("--seed", type=int, default=1234,
                   help="initialisation, data order and dropout")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialise weights on the CPU (always on for --device cpu); the "
                        "initial weights then do not depend on TP, which loss-curve "
                        "comparisons across TP sizes need")
    g.add_argument("--skip-nan-steps", action="store_true",
                   help="on a NaN/inf loss or grad norm, skip the optimizer step and go on "
                        "(default: stop with an error naming the iteration)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving with --save) when iteration %% N == 0")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, metavar="MIN",
                   help="stop (after saving with --save) at the end of the first iteration "
                        "that ends MIN minutes or more after start-up began, on the slowest "
                        "rank; a rerun with --load continues from there")
    g.add_argument("--fused-linear-cross-entropy", action="store_true",
                   help="compute the output layer and the loss together over chunks of "
                        "tokens, never holding full-sequence logits (nor their float32 copy)")
    g.add_argument("--linear-cross-entropy-chunk-tokens", type=int, default=None, metavar="N",
                   help="tokens per chunk of --fused-linear-cross-entropy, >= 1 (default "
                        f"{DEFAULT_LOSS_CHUNK_TOKENS}); each chunk holds about N * V/TP * 10 "
                        "bytes of logits")


def _add_lr_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("learning rate", "schedule in iterations (Megatron-LM's)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (required)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate after the decay")
    g.add_argument("--lr-decay-style", default="linear", choices=LR_DECAY_STYLES,
                   help="decay from --lr to --min-lr after the warmup")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="linear warmup from --lr-warmup-init to --lr")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of --lr-decay-iters (instead of iterations)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="learning rate at iteration 0")
    g.add_argument("--lr-wsd-decay-style", default="exponential", choices=WSD_DECAY_STYLES,
                   help="decay phase shape of --lr-decay-style WSD")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="decay phase of --lr-decay-style WSD")


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "checkpointing", "megatron-core distributed checkpoints (torch_dist). A checkpoint is "
                         "written to iter_N.tmp, then renamed; latest_checkpointed_iteration.txt "
                         "only ever names complete ones. SIGTERM saves and exits when --save "
                         "is set")
    g.add_argument("--save", default=None, help="checkpoint directory to write")
    g.add_argument("--load", default=None,
                   help="checkpoint directory to resume from; when it equals --save, a "
                        "missing or empty directory means a fresh start")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between saves")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration instead of the latest")
    g.add_argument("--no-load-optim", action="store_true", help="do not load optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load RNG states")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only; iteration, data position, optimizer and RNG "
                        "start fresh")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="distributed-optimizer state in a TP/PP-reshardable format (gathers "
                        "on save); the default format reshards over DP x CP only")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100,
                   help="iterations between console log lines")
    g.add_argument("--eval-interval", type=int, default=1000, help="iterations between evals")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="global batches per evaluation; 0 disables validation")
    g.add_argument("--tensorboard-dir", default=None, help="TensorBoard scalars")
    g.add_argument("--metrics-file", default=None,
                   help="per-step JSONL metrics (read by tools/compare_loss.py); default "
                        "TENSORBOARD_DIR/metrics.jsonl, else SAVE/metrics.jsonl, else none")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak TFLOP/s per device for MFU; default from the GPU "
                        "name (H100/H200 989, A100/A800 312, L20 119.5, ...); CPU: MFU n/a")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations --profile-step-start to --profile-step-end - 1 "
                        "with torch.profiler on --profile-ranks: a kernel table (.txt) and a "
                        "Chrome trace (.json) per rank in --profile-dir")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="first profiled iteration (1-based, as logged)")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="profiling stops before this iteration")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0],
                   help="global ranks to profile")
    g.add_argument("--profile-dir", default=None,
                   help="where --profile writes; default TENSORBOARD_DIR/profile, else "
                        "./profile")
    g.add_argument("--record-memory-history", action="store_true",
                   help="CUDA only: record every allocation from start-up (torch.cuda.memory) "
                        "and, after --memory-snapshot-iteration, write the snapshot to "
                        "--memory-snapshot-path and where the peak goes to PATH.txt "
                        "(python -m megatron.training.observe.memory_snapshot PATH redoes the summary)")
    g.add_argument("--memory-snapshot-path", default="snapshot.pickle",
                   help="rank N writes PATH with .rankN before the suffix; {seq_length} in "
                        "PATH becomes --seq-length")
    g.add_argument("--memory-snapshot-iteration", type=int, default=2,
                   help="write the memory snapshot after this iteration (1-based)")


def launch_rank() -> int:
    """This process's global rank as the launcher set it (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors (exit status 2) only rank 0 prints: under
    torchrun every rank parses the same command line and fails alike."""

    def error(self, message: str):
        if launch_rank() == 0:
            self.print_usage(sys.stderr)
            self.exit(2, f"{self.prog}: error: {message}\n")
        leave_the_message_to_rank_0()
        self.exit(2)


# A float with an exponent, which argparse (Python < 3.12) takes for a flag when negative.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _join_negative_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> List[str]:
    """``--lr -1e-3`` -> ``--lr=-1e-3``, so that a negative value reaches validation (which
    names the flag) instead of argparse's "expected one argument"."""
    takes_value = {opt for a in parser._actions if a.nargs is None and a.option_strings
                   for opt in a.option_strings}
    out: List[str] = []
    for token in argv:
        if (out and out[-1] in takes_value and _NEGATIVE_NUMBER.match(token)):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain_gpt.py",
        usage="torchrun --nproc-per-node N %(prog)s [flags, grouped below]",
        description="GPT pretraining with Unified Sequence Parallelism (Ulysses x Ring) on "
                    "megatron-core, with Megatron-LM's flag names. Launch scripts: examples/.",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
    )
    _add_model_args(parser)
    _add_parallel_args(parser)
    _add_data_args(parser)
    _add_training_args(parser)
    add_memory_args(parser)
    _add_lr_args(parser)
    _add_checkpoint_args(parser)
    _add_logging_args(parser)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``); no validation (see :func:`validate_args`)."""
    parser = build_parser()
    return parser.parse_args(_join_negative_values(parser, sys.argv[1:] if argv is None
                                                   else list(argv)))


# --------------------------------------------------------------------------- validation
def _require(args, names: List[str]) -> None:
    missing = ["--" + n.replace("_", "-") for n in names if getattr(args, n) is None]
    if missing:
        raise ArgumentsError(f"missing required flag(s): {' '.join(missing)}")


def _check_positive(args, names: List[str], allow_zero: bool = False) -> None:
    for n in names:
        v = getattr(args, n)
        if v is None:
            continue
        if v < 0 or (v == 0 and not allow_zero):
            flag = "--" + n.replace("_", "-")
            raise ArgumentsError(f"{flag} {v} must be {'>= 0' if allow_zero else '> 0'}")


def _model_sizes(args) -> Dict[str, int]:
    """kv_channels, ffn_hidden_size, max_position_embeddings: the flags or their defaults."""
    _require(args, ["num_layers", "hidden_size", "num_attention_heads", "seq_length"])
    _check_positive(args, ["num_layers", "hidden_size", "num_attention_heads", "seq_length",
                           "ffn_hidden_size", "kv_channels", "max_position_embeddings",
                           "rotary_base", "make_vocab_size_divisible_by", "vocab_size"])
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ArgumentsError(
            f"--num-query-groups {args.num_query_groups} has no effect without "
            f"--group-query-attention; add --group-query-attention (or drop "
            f"--num-query-groups for multi-head attention)")
    if args.group_query_attention and args.num_query_groups is None:
        raise ArgumentsError("--group-query-attention needs --num-query-groups, e.g. "
                             f"--num-query-groups {max(1, args.num_attention_heads // 4)}")
    kv_channels = args.kv_channels
    if kv_channels is None:
        if args.hidden_size % args.num_attention_heads:
            raise ArgumentsError(
                f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                f"{args.num_attention_heads}; pass --kv-channels or change one of them")
        kv_channels = args.hidden_size // args.num_attention_heads
    ffn = args.ffn_hidden_size
    if ffn is None:
        ffn = default_ffn_hidden_size(args.hidden_size, args.swiglu)
    positions = args.max_position_embeddings
    if positions is None:
        positions = args.seq_length
    if args.position_embedding_type == "learned_absolute" and positions < args.seq_length:
        raise ArgumentsError(
            f"--max-position-embeddings {positions} < --seq-length "
            f"{args.seq_length} with learned absolute positions; pass "
            f"--max-position-embeddings {args.seq_length}")
    if not 0.0 < args.rotary_percent <= 1.0:
        raise ArgumentsError(f"--rotary-percent {args.rotary_percent} must be in (0, 1]")
    if args.attention_dropout != 0.0:
        raise ArgumentsError(
            f"--attention-dropout {args.attention_dropout}: USP attention has no attention "
            f"dropout (the mask would depend on which ring rank computes a block); pass "
            f"--attention-dropout 0.0")
    if not 0.0 <= args.hidden_dropout < 1.0:
        raise ArgumentsError(f"--hidden-dropout {args.hidden_dropout} must be in [0, 1)")
    window_size, window_attn_skip_freq = window_from_args(args)
    return {"kv_channels": kv_channels, "ffn_hidden_size": ffn,
            "max_position_embeddings": positions, "rope": rope_scaling_from_args(args),
            "window_size": window_size, "window_attn_skip_freq": window_attn_skip_freq,
            "shape": ModelShape(
                num_layers=args.num_layers, hidden_size=args.hidden_size,
                num_attention_heads=args.num_attention_heads,
                num_query_groups=args.num_query_groups if args.group_query_attention else None,
                ffn_hidden_size=ffn, kv_channels=kv_channels, swiglu=args.swiglu,
                untied_embeddings=args.untie_embeddings_and_output_weights,
                normalization=args.normalization,
                position_embedding_type=args.position_embedding_type,
                add_bias_linear=not args.disable_bias_linear,
                window_size=window_size[0] if window_size else None,
                window_attn_skip_freq=window_attn_skip_freq)}


def _validate_overlap_chunks(args, dims: ParallelDims, shape: ModelShape) -> None:
    """``--usp-overlap-chunks`` must split the heads of each Ulysses rank into whole KV heads."""
    chunks = args.usp_overlap_chunks
    if chunks == "auto":
        return
    from megatron.usp.attention import resolve_overlap_chunks  # torch-free --help

    try:
        resolve_overlap_chunks(args.num_attention_heads // dims.tp,
                               dims.kv_heads_per_tp_rank(shape.num_query_groups), dims.ulysses,
                               dims.ring, requested=chunks)
    except ValueError as exc:
        raise ArgumentsError(
            str(exc).replace("overlap_chunks=", "--usp-overlap-chunks ", 1)
            .replace("(or None for auto)", "(or auto)")) from None


def _parallel_fields(args, world_size: int, shape: ModelShape, device: str,
                     degrees: Optional[Tuple[int, int]]) -> Dict[str, Any]:
    """The layout, batch and memory-flag values; ``dims`` None while the degrees are auto.

    ``degrees``: (U, R) chosen by the planner in place of ``--ulysses-degree auto
    --ring-degree auto``.
    """
    ulysses, ring = degrees or (args.ulysses_degree, args.ring_degree)
    auto = [f for f, v in (("--ulysses-degree", ulysses), ("--ring-degree", ring))
            if v == "auto"]
    if len(auto) == 1:
        raise ArgumentsError(
            f"{auto[0]} auto needs the other degree to be auto too: pass --ulysses-degree auto "
            f"--ring-degree auto (the planner chooses both), or give both as integers")
    # Megatron-LM does the same: at TP 1 there is nothing to split.
    sequence_parallel = bool(args.sequence_parallel) and args.tensor_model_parallel_size > 1
    out = {"sequence_parallel": sequence_parallel, "dims": None, "global_batch_size": None,
           "num_microbatches": None, "optimizer_offload_fraction": None,
           "data_parallel_sharding_strategy": None}
    if auto:
        return out  # resolved by cli.auto_layout, then validated
    _check_positive(args, ["micro_batch_size", "global_batch_size"])
    dims = ParallelDims.from_flags(world_size, args.tensor_model_parallel_size, ulysses, ring,
                                   args.pipeline_model_parallel_size,
                                   args.context_parallel_size)
    found = dims.violations(shape, args.seq_length, args.micro_batch_size,
                            args.global_batch_size, sequence_parallel)
    if found:
        # Rules of the model's own flags are argument errors; the rest the layout's.
        own_flags = ("batch", "sequence-parallel", "pp-layers")
        raise (ArgumentsError if found[0].rule in own_flags else USPConfigError)(found[0].message)
    _validate_overlap_chunks(args, dims, shape)
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentsError("--overlap-param-gather needs --use-distributed-optimizer")
    # The global batch (default micro x DP) and the micro-batches per step.
    gbs = args.global_batch_size or args.micro_batch_size * dims.dp
    fraction, strategy = validate_memory_args(args, dims, sequence_parallel, device)
    out.update(dims=dims, global_batch_size=gbs,
               num_microbatches=gbs // (args.micro_batch_size * dims.dp),
               optimizer_offload_fraction=fraction, data_parallel_sharding_strategy=strategy)
    return out


def _validate_exits(args) -> None:
    """The early stops: --exit-interval (iterations) and --exit-duration-in-mins."""
    _check_positive(args, ["exit_interval"])
    minutes = args.exit_duration_in_mins
    if minutes is not None and not minutes > 0:  # also catches NaN
        raise ArgumentsError(f"--exit-duration-in-mins {minutes} must be > 0, e.g. "
                             f"--exit-duration-in-mins 8")


def _lr_schedule(args) -> Dict[str, int]:
    """lr_decay_iters (default --train-iters) and lr_warmup_iters (also from the fraction)."""
    _require(args, ["train_iters", "lr"])
    _check_positive(args, ["train_iters"])
    if not args.lr > 0:  # also catches NaN
        raise ArgumentsError(f"--lr {args.lr} must be > 0 (with --lr 0 nothing would train); "
                             f"e.g. --lr 3e-4")
    _check_positive(args, ["min_lr", "weight_decay", "clip_grad", "lr_warmup_iters",
                           "lr_warmup_init", "adam_eps"], allow_zero=True)
    if args.min_lr > args.lr:
        raise ArgumentsError(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    decay = args.train_iters if args.lr_decay_iters is None else args.lr_decay_iters
    if decay <= 0:
        raise ArgumentsError(f"--lr-decay-iters {decay} must be > 0")
    warmup = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            raise ArgumentsError("--lr-warmup-fraction and --lr-warmup-iters exclude one "
                                 "another; keep one")
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            raise ArgumentsError(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be in "
                                 f"[0, 1]")
        warmup = int(args.lr_warmup_fraction * decay)
    if warmup >= decay:
        raise ArgumentsError(
            f"--lr-warmup-iters {warmup} must be below --lr-decay-iters "
            f"{decay} (default --train-iters): warmup must end before the decay "
            f"does; try --lr-warmup-iters {max(0, decay // 10)}")
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None:
        raise ArgumentsError("--lr-decay-style WSD needs --lr-wsd-decay-iters N")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ArgumentsError(f"--{name.replace('_', '-')} {getattr(args, name)} must be "
                                 f"in [0, 1)")
    _validate_recompute(args)
    return {"lr_decay_iters": decay, "lr_warmup_iters": warmup,
            "loss_chunk_tokens": _loss_chunk_tokens(args)}


def _loss_chunk_tokens(args) -> Optional[int]:
    """``--linear-cross-entropy-chunk-tokens`` belongs to ``--fused-linear-cross-entropy``;
    its default there, None without it."""
    chunk = args.linear_cross_entropy_chunk_tokens
    if not args.fused_linear_cross_entropy:
        if chunk is not None:
            raise ArgumentsError(
                f"--linear-cross-entropy-chunk-tokens {chunk} has no effect without "
                f"--fused-linear-cross-entropy; add --fused-linear-cross-entropy (or drop "
                f"--linear-cross-entropy-chunk-tokens)")
        return None
    if chunk is None:
        return DEFAULT_LOSS_CHUNK_TOKENS
    if chunk < 1:
        raise ArgumentsError(
            f"--linear-cross-entropy-chunk-tokens {chunk} must be >= 1, e.g. "
            f"--linear-cross-entropy-chunk-tokens {DEFAULT_LOSS_CHUNK_TOKENS}")
    return chunk


def _validate_recompute(args) -> None:
    gran, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if args.recompute_modules is not None and gran != "selective":
        raise ArgumentsError("--recompute-modules needs --recompute-granularity selective, "
                             "e.g. --recompute-granularity selective --recompute-modules mlp")
    if args.recompute_modules and "swiglu" in args.recompute_modules and not (
            args.swiglu and args.disable_bias_linear):
        raise ArgumentsError("--recompute-modules swiglu recomputes a bias-free SwiGLU MLP's "
                             "activation; it needs --swiglu and --disable-bias-linear (or drop "
                             "swiglu from --recompute-modules)")
    if args.recompute_modules and "mlp" in args.recompute_modules and "swiglu" in \
            args.recompute_modules:
        raise ArgumentsError("--recompute-modules mlp already recomputes the whole MLP; drop "
                             "swiglu")
    if gran == "full":
        if method is None:
            raise ArgumentsError("--recompute-granularity full needs --recompute-method "
                                 "uniform (or block) and --recompute-num-layers N")
        if n is None or n < 1:
            raise ArgumentsError("--recompute-granularity full needs --recompute-num-layers "
                                 ">= 1, e.g. --recompute-num-layers 1")
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        if method == "block" and n > per_stage:
            raise ArgumentsError(f"--recompute-num-layers {n} exceeds the {per_stage} layers "
                                 f"of a pipeline stage; use at most {per_stage}")
    elif method is not None or n is not None:
        flag = "--recompute-method" if method is not None else "--recompute-num-layers"
        raise ArgumentsError(f"{flag} needs --recompute-granularity full")


def _tokenizer_type(args) -> str:
    """The data flags' checks; returns ``--tokenizer-type`` or its default."""
    if args.data_path is not None and not "".join(args.data_path).strip():
        # `--data-path "$DATA"` with DATA unset, or `--data-path` straight before another
        # flag: argparse accepts both, and the run would train on the default corpus.
        raise ArgumentsError(
            "--data-path was given no prefix (an unset shell variable?); pass --data-path "
            "PREFIX (a .bin/.idx pair from tools/preprocess_data.py), or drop --data-path to "
            "train on the built-in default corpus")
    if args.mock_data and args.data_path:
        raise ArgumentsError("--mock-data and --data-path exclude one another; drop one")
    _check_positive(args, ["num_workers", "batch_agreement_interval"], allow_zero=True)
    tokenizer_type = args.tokenizer_type
    if tokenizer_type is None:
        tokenizer_type = ("NullTokenizer" if (args.mock_data and args.tokenizer_model is None)
                          else "SentencePieceTokenizer")
    if tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ArgumentsError("--tokenizer-type NullTokenizer (the --mock-data default) needs "
                             "--vocab-size, e.g. --vocab-size 32000")
    if not args.data_path and not args.mock_data and args.tokenizer_model is not None:
        raise ArgumentsError(
            "--tokenizer-model without --data-path: the default corpus comes with its own "
            "tokenizer; pass the --data-path made with this tokenizer, or drop "
            "--tokenizer-model")
    # "--data-path needs --tokenizer-model" is checked with the files
    # (megatron.training.cli.input_paths), after a missing prefix, which is the likelier
    # mistake and the one to name first.
    return tokenizer_type


def _validate_split(args) -> None:
    """Validation asked for (``--eval-iters`` > 0) needs data in the validation split."""
    from megatron.training.data.config import parse_split  # torch-free --help

    try:
        weights = parse_split(args.split)
    except DataConfigError as exc:
        raise ArgumentsError(str(exc)) from None
    if args.eval_iters and weights[1] == 0:
        raise ArgumentsError(
            f"--split {args.split} gives the validation split no data, but --eval-iters "
            f"{args.eval_iters} asks for validation; give it a weight (e.g. --split 969,30,1) "
            f"or pass --eval-iters 0 to train without validation")


def _output_fields(args, world_size: int, device: str) -> Dict[str, Optional[str]]:
    """The checkpoint / logging flags' checks; metrics_file and profile_dir or defaults."""
    _check_positive(args, ["save_interval", "log_interval", "eval_interval"])
    _check_positive(args, ["eval_iters", "ckpt_step"], allow_zero=True)
    if args.save_interval is not None and args.save is None:
        raise ArgumentsError("--save-interval needs --save DIR")
    if args.ckpt_step is not None and args.load is None:
        raise ArgumentsError("--ckpt-step needs --load DIR")
    if args.finetune and args.load is None:
        raise ArgumentsError("--finetune needs --load DIR (the weights to start from)")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise ArgumentsError(f"--peak-tflops {args.peak_tflops} must be > 0")
    profile_dir = _profile_dir(args, world_size)
    _validate_memory_history(args, device)
    metrics_file = args.metrics_file
    if metrics_file is None:
        if args.tensorboard_dir:
            metrics_file = os.path.join(args.tensorboard_dir, "metrics.jsonl")
        elif args.save:
            metrics_file = os.path.join(args.save, "metrics.jsonl")
    return {"metrics_file": metrics_file, "profile_dir": profile_dir}


def _validate_memory_history(args, device: str) -> None:
    if not args.record_memory_history:
        return
    if device != "cuda":
        raise ArgumentsError("--record-memory-history records CUDA allocations; it needs a GPU "
                             "(drop the flag on the CPU)")
    if not 1 <= args.memory_snapshot_iteration <= args.train_iters:
        raise ArgumentsError(
            f"--memory-snapshot-iteration {args.memory_snapshot_iteration} must be in "
            f"[1, --train-iters {args.train_iters}], e.g. --memory-snapshot-iteration 2")


def _profile_dir(args, world_size: int) -> Optional[str]:
    """The ``--profile`` flags' checks; ``--profile-dir`` or its default."""
    if not args.profile:
        return args.profile_dir
    start, end = args.profile_step_start, args.profile_step_end
    if start < 1 or end <= start:
        raise ArgumentsError(
            f"--profile-step-start {start} / --profile-step-end {end}: need 1 <= start < end, "
            f"e.g. --profile-step-start {max(1, start)} --profile-step-end {max(1, start) + 2}")
    if start > args.train_iters:
        raise ArgumentsError(f"--profile-step-start {start} is after --train-iters "
                             f"{args.train_iters}; pick a start <= {args.train_iters}")
    bad = [r for r in args.profile_ranks if not 0 <= r < world_size]
    if bad:
        raise ArgumentsError(f"--profile-ranks {' '.join(map(str, bad))}: ranks run from 0 to "
                             f"{world_size - 1}; e.g. --profile-ranks 0")
    if args.profile_dir is None:
        return (os.path.join(args.tensorboard_dir, "profile") if args.tensorboard_dir
                else "profile")
    return args.profile_dir


def _device_fields(args, cuda_available: bool) -> Dict[str, Any]:
    """device, distributed_backend, use_cpu_initialization, fused_kernels_impl: resolved."""
    device = args.device
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    if device == "cuda" and not cuda_available:
        raise ArgumentsError("--device cuda but CUDA is not available; pass --device cpu")
    backend = args.distributed_backend
    if backend is None:
        backend = "nccl" if device == "cuda" else "gloo"
    if args.distributed_timeout_minutes <= 0:     # every collective would time out at once
        raise ArgumentsError(f"--distributed-timeout-minutes {args.distributed_timeout_minutes} "
                             f"must be > 0, e.g. --distributed-timeout-minutes 10")
    if device == "cpu":
        if backend != "gloo":
            raise ArgumentsError("--device cpu needs --distributed-backend gloo")
        if args.bf16:
            raise ArgumentsError("--bf16 needs a GPU; CPU runs are float32 (drop --bf16)")
    try:
        # The implementation --fused-kernels resolves to here (the flag stays as given).
        impl = resolve_fused_kernels(args.fused_kernels, device == "cuda")
    except FusedKernelsUnavailable as exc:
        raise ArgumentsError(str(exc)) from None
    # A missing kernel package is found here, not after the process groups exist.
    problem = backend_problem(args.attention_backend, device)
    if problem:
        raise ArgumentsError(problem)
    return {"device": device, "distributed_backend": backend,
            "use_cpu_initialization": bool(args.use_cpu_initialization) or device == "cpu",
            "fused_kernels_impl": impl,
            "fp8": fp8_options(args, device, _cuda_capability(args, device))}


def _cuda_capability(args, device: str) -> Optional[Tuple[int, int]]:
    """The CUDA device's compute capability when ``--fp8-format`` needs it, else None."""
    if device != "cuda" or args.fp8_format is None or args.fp8_emulate:
        return None
    import torch  # torch-free --help

    return tuple(torch.cuda.get_device_capability())


def _grad_reduce_in_fp32(args) -> bool:
    """Gradients accumulate and reduce in float32 unless ``--bf16 --grad-reduce-in-bf16``
    (True for float32 runs too, whose gradients are float32 anyway)."""
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ArgumentsError("--grad-reduce-in-bf16 needs --bf16 (float32 runs accumulate and "
                             "reduce gradients in float32); drop --grad-reduce-in-bf16")
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        raise ArgumentsError("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 "
                             "exclude one another; keep one (float32 is the default)")
    return not args.grad_reduce_in_bf16


def validate_args(args: argparse.Namespace, world_size: int,
                  cuda_available: Optional[bool] = None,
                  degrees: Optional[Tuple[int, int]] = None) -> RunConfig:
    """Check every flag and return the run's :class:`RunConfig`; identical on every rank, no
    I/O, and ``args`` is left as parsed.

    Raises :class:`ArgumentsError` or :class:`USPConfigError` (both ``ValueError``) naming
    the flag. ``--ulysses-degree auto`` leaves ``dims`` None for
    :func:`megatron.training.cli.auto_layout.resolve_auto_layout`, which calls this again
    with the planner's ``degrees`` (U, R).
    """
    if cuda_available is None:
        import torch  # torch-free --help

        cuda_available = torch.cuda.is_available()
    device = _device_fields(args, cuda_available)
    grad_fp32 = _grad_reduce_in_fp32(args)
    model = _model_sizes(args)
    schedule = _lr_schedule(args)
    _validate_exits(args)
    tokenizer_type = _tokenizer_type(args)
    problem = document_flags_problem(args, device["device"])
    if problem:
        raise ArgumentsError(problem)
    if args.reset_attention_mask and args.recompute_keep_core_attn:
        # Both paths are exact alone; their combination (a kept output replayed through the
        # document ring) has no test yet, so it is refused rather than trusted.
        raise ArgumentsError("--recompute-keep-core-attn with --reset-attention-mask is not "
                             "verified yet; drop --recompute-keep-core-attn (full recompute "
                             "then runs attention again)")
    outputs = _output_fields(args, world_size, device["device"])
    _validate_split(args)
    layout = _parallel_fields(args, world_size, model["shape"], device["device"], degrees)
    return RunConfig(args=args, world_size=world_size, grad_reduce_in_fp32=grad_fp32,
                     tokenizer_type=tokenizer_type, **device, **model, **schedule, **outputs,
                     **layout)


__all__ = ["ArgumentsError", "USPConfigError", "RunConfig", "build_parser", "parse_args",
           "validate_args", "padded_vocab_size", "default_ffn_hidden_size"]
