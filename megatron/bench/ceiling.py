"""The zero-overhead ceiling of a training step: its matmuls and attention alone, timed here.

A training step can be no faster than the time its matrix multiplies and its attention
kernel take on their own. :func:`measure_ceiling` times exactly those, with the model's own
shapes, on this GPU, in this run:

* per layer, the four linear layers (QKV ``[N, H] x [H, (n+2g)d]``, output projection
  ``[N, nd] x [nd, H]``, FC1 ``[N, H] x [H, 2F]`` (SwiGLU), FC2 ``[N, F] x [F, H]``), each as
  its forward GEMM plus the two backward GEMMs (data and weight gradients);
* per layer, the causal attention forward and backward through USP's local kernel
  (:func:`megatron.usp.kernels.get_kernel`, cuDNN on H100/H200) over the whole sequence; a
  layer with the model's sliding window (``--window-size``, ``--window-attn-skip-freq``:
  megatron-core's rule) through the window kernel (:mod:`megatron.usp.window_kernel`: the
  flash op's own window) instead;
* once, the output layer ``[N, H] x [H, V]`` forward and backward.

With documents (``--doc-lengths FILE``, what ``tools/bench_e2e.py --docs`` passes: the
document lengths of each sequence its measured iterations train), the attention is that of
those documents instead: each single-GPU document kernel
(:func:`megatron.bench.document_bench.time_document_kernels`: ``tiles``, ``varlen``,
``per-document``, ``packed``) is timed on each sequence, the fastest one counts, and the
ceiling is the mean over the sequences; its FLOP count is the documents' pairs
(:func:`megatron.shapes.document_pairs`).

``ceiling_s = L * (linears + attention) + output layer`` (attention summed over full and
window layers), and the ceiling MFU is the step's FLOP count
(:func:`megatron.shapes.training_flops` of the layers' pairs, the training loop's too) over
``ceiling_s`` and the peak. Norms, RoPE, the activation, the loss, the optimizer and every
copy count as overhead, so ``share = ceiling_s / measured step time`` is the fraction of
the ideal a stack reaches. Timings are medians of CUDA-event timed repeats on random bf16
data (``N = S`` tokens, batch 1).

Run alone (``python -m megatron.bench.ceiling --model llama-0.85b --seq-lens 32k,64k --out
c.json``) or from ``tools/bench_e2e.py``, which runs it in a process of its own before the
training runs so that none of its memory stays allocated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron.bench.cli import BenchConfigError, parse_seq_lens
from megatron.bench.document_bench import KernelSetup, time_document_kernels
from megatron.bench.flops import FWD_BWD_FACTOR, attention_fwd_bwd_flops
from megatron.bench.models import MODELS
from megatron.bench.timing import median_ms_alone
from megatron.planner.hardware import peak_tflops_for_device
from megatron.shapes import document_pairs, shape_pairs, training_flops
from megatron.shapes.window import (
    SKIP_FREQ_FLAG,
    WINDOW_FLAG,
    effective_window,
    parse_skip_freq,
    parse_window_size,
)
from megatron.usp.kernels import get_kernel
from megatron.usp.window_kernel import window_backward, window_forward

# The single-GPU document kernels a documents ceiling takes the fastest of.
CEILING_DOC_KERNELS = ("tiles", "varlen", "per-document", "packed")


@dataclass
class Ceiling:
    """The ideal step of one length: times in ms, the FLOP count and the ceiling MFU."""

    seq_len: int
    linears_ms_per_layer: float
    attention_ms_per_layer: float
    output_layer_ms: float
    ceiling_ms: float
    flops_per_iteration: float
    ceiling_tflops: float
    peak_tflops: Optional[float]
    ceiling_mfu: Optional[float]
    gemm_tflops: float               # achieved rate of the timed matmuls
    attention_tflops: float          # fwd+bwd, 3.5x-forward convention (useful pairs)
    attention: str = "dense causal"  # "documents": the fastest document kernel; or the window
    window_attention_ms_per_layer: Optional[float] = None     # a window layer's, if any
    dense_attention_ms_per_layer: Optional[float] = None      # documents: for reference
    document_kernels_ms: Optional[Dict[str, float]] = None    # mean per kernel over sequences
    fastest_kernels: Optional[Dict[str, int]] = None          # sequences each kernel won
    sequences: Optional[int] = None
    num_layers: Optional[int] = None  # of the model timed (--num-layers: a slice)
    # documents: each sequence's ceiling (its attention at the fastest kernel), in order
    ceiling_ms_per_sequence: Optional[List[float]] = None


def linear_fwd_bwd_ms(tokens: int, n_in: int, n_out: int, device, dtype, repeats: int) -> float:
    """Forward ``y = x W^T`` plus both backward GEMMs (``dx = dy W``, ``dW = dy^T x``)."""
    x = torch.randn(tokens, n_in, device=device, dtype=dtype)
    w = torch.randn(n_out, n_in, device=device, dtype=dtype)
    dy = torch.randn(tokens, n_out, device=device, dtype=dtype)

    def step():
        torch.matmul(x, w.t())
        torch.matmul(dy, w)
        torch.matmul(dy.t(), x)

    return median_ms_alone(step, warmup=2, iters=repeats)


def attention_fwd_bwd_ms(seq_len: int, heads: int, kv_heads: int, head_dim: int, device,
                         dtype, repeats: int, window: Optional[int] = None) -> float:
    """USP's local kernel, causal, forward then backward, batch 1, ``[b, h, S, d]``; with a
    left ``window``, the window kernel."""
    kernel = get_kernel("auto")
    q = torch.randn(1, heads, seq_len, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, kv_heads, seq_len, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    scale = head_dim ** -0.5

    def step():
        if window is None:
            out, lse = kernel.forward(q, k, v, True, scale)
            kernel.backward(dout, q, k, v, out, lse, True, scale)
        else:
            out, lse = window_forward(q, k, v, True, window, scale)
            window_backward(dout, q, k, v, out, lse, True, window, scale)

    return median_ms_alone(step, warmup=2, iters=repeats)


def document_attention_ms(shape, documents: Sequence[Sequence[int]], device, dtype,
                          repeats: int) -> Dict:
    """Per sequence (its document lengths), the fastest single-GPU document kernel's
    forward+backward ms (``per_sequence_ms``, in the order given); the mean of that over the
    sequences, each kernel's mean and how many sequences each kernel won. Identical sequences
    are timed once."""
    setup = KernelSetup(shape.num_attention_heads, shape.num_query_groups, shape.head_dim,
                        dtype, iters=repeats)
    keys = [tuple(int(n) for n in lengths) for lengths in documents]
    distinct: Dict[tuple, int] = {}
    for key in keys:
        distinct[key] = distinct.get(key, 0) + 1
    best, per_kernel, wins, fastest_ms = 0.0, {}, {}, {}
    for lengths, count in distinct.items():
        seg = np.repeat(np.arange(len(lengths)), lengths)[None]
        times = {r.kernel: r.fwd_bwd_ms for r in time_document_kernels(
            setup, seg, CEILING_DOC_KERNELS, device) if r.status == "ok"}
        if not times:
            raise RuntimeError(f"no document kernel ran on a sequence of {len(lengths)} "
                               f"documents")
        fastest = min(times, key=times.get)
        fastest_ms[lengths] = times[fastest]
        wins[fastest] = wins.get(fastest, 0) + count
        best += count * times[fastest]
        for name, ms in times.items():
            per_kernel[name] = per_kernel.get(name, 0.0) + count * ms / len(documents)
    return {"ms": best / len(documents), "kernels_ms": per_kernel, "wins": wins,
            "per_sequence_ms": [fastest_ms[key] for key in keys]}


def measure_ceiling(shape, seq_len: int, peak_tflops: Optional[float] = None,
                    repeats: int = 5,
                    documents: Optional[Sequence[Sequence[int]]] = None) -> Ceiling:
    """Time the step's matmuls and attention for ``shape`` (a
    :class:`megatron.shapes.ModelShape`, its sliding window included) at ``seq_len``; with
    ``documents`` (each sequence's document lengths, adding up to ``seq_len``) the attention
    is theirs (module docstring)."""
    window = effective_window(shape.window_size, seq_len)
    if window is not None and documents:
        raise BenchConfigError("the documents ceiling times the document kernels without a "
                               "sliding window; run a windowed model with --ceiling off")
    device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    h, n, g, d = shape.hidden_size, shape.num_attention_heads, shape.num_query_groups, \
        shape.head_dim
    f, v = shape.ffn_hidden_size, shape.vocab_size
    linears = [(h, (n + 2 * g) * d), (n * d, h), (h, 2 * f), (f, h)]
    lin_ms = sum(linear_fwd_bwd_ms(seq_len, a, b, device, dtype, repeats) for a, b in linears)
    attn_ms = attention_fwd_bwd_ms(seq_len, n, g, d, device, dtype, repeats)
    out_ms = linear_fwd_bwd_ms(seq_len, h, v, device, dtype, repeats)
    flops = training_flops(shape, seq_len, shape_pairs(shape, [seq_len]))
    attn_flops = attention_fwd_bwd_flops(1, n, seq_len, d, True)
    window_ms, label = None, "dense causal"
    if window is not None:
        window_ms = attention_fwd_bwd_ms(seq_len, n, g, d, device, dtype, repeats, window)
        share = shape.window_share()
        attn_ms = (1 - share) * attn_ms + share * window_ms        # per layer, the mean
        attn_flops = FWD_BWD_FACTOR * 4.0 * n * d * shape_pairs(shape, [seq_len])
        label = (f"dense causal, window {window} on {sum(shape.window_marks())} of "
                 f"{shape.num_layers} layers")
    docs = None
    if documents:
        docs = document_attention_ms(shape, documents, device, dtype, repeats)
        pairs = sum(document_pairs(x) for x in documents) / len(documents)
        flops = training_flops(shape, seq_len, pairs)
        attn_flops = FWD_BWD_FACTOR * 4.0 * n * d * pairs
    dense_attn_ms, attn_ms = attn_ms, (docs["ms"] if docs else attn_ms)

    def ceiling_of(attention_ms: float) -> float:
        return shape.num_layers * (lin_ms + attention_ms) + out_ms

    ceiling_ms = ceiling_of(attn_ms)
    gemm_flops = 6.0 * seq_len * (sum(a * b for a, b in linears) * shape.num_layers + h * v)
    tflops = flops / (ceiling_ms / 1e3) / 1e12
    if peak_tflops is None:
        peak_tflops = peak_tflops_for_device(torch.cuda.get_device_name(device))
    return Ceiling(
        seq_len=seq_len, linears_ms_per_layer=lin_ms, attention_ms_per_layer=attn_ms,
        output_layer_ms=out_ms, ceiling_ms=ceiling_ms, flops_per_iteration=flops,
        ceiling_tflops=tflops, peak_tflops=peak_tflops,
        ceiling_mfu=tflops / peak_tflops if peak_tflops else None,
        gemm_tflops=gemm_flops / ((shape.num_layers * lin_ms + out_ms) / 1e3) / 1e12,
        attention_tflops=attn_flops / (attn_ms / 1e3) / 1e12,
        attention="documents" if docs else label, window_attention_ms_per_layer=window_ms,
        dense_attention_ms_per_layer=dense_attn_ms if docs else None,
        document_kernels_ms=docs["kernels_ms"] if docs else None,
        fastest_kernels=docs["wins"] if docs else None,
        sequences=len(documents) if docs else None, num_layers=shape.num_layers,
        ceiling_ms_per_sequence=([ceiling_of(a) for a in docs["per_sequence_ms"]]
                                 if docs else None))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron.bench.ceiling",
                                description="Zero-overhead step time of a benchmark model.")
    p.add_argument("--model", default="llama-0.85b", choices=list(MODELS))
    p.add_argument("--num-layers", type=int, default=None,
                   help="the first N of the preset's layers (tools/bench_e2e.py --num-layers)")
    p.add_argument("--seq-lens", default="32k,64k,128k")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument(WINDOW_FLAG, default=None, metavar="W",
                   help="the model's sliding window (pretrain_gpt.py's flag): its layers' "
                        "attention through the window kernel")
    p.add_argument(SKIP_FREQ_FLAG, default=None, metavar="N|LIST",
                   help="which layers have the window (pretrain_gpt.py's flag)")
    p.add_argument("--doc-lengths", default=None,
                   help="JSON {seq_len: [[document lengths of a sequence], ...]}: the "
                        "attention of those documents at the fastest document kernel")
    ns = p.parse_args(argv)
    try:
        seq_lens = parse_seq_lens(ns.seq_lens)
    except BenchConfigError as exc:
        p.error(str(exc))
    layers = MODELS[ns.model].shape.num_layers
    if ns.num_layers is not None and not 1 <= ns.num_layers <= layers:
        p.error(f"--num-layers {ns.num_layers}: a slice of {ns.model} has 1 to {layers} layers")
    shape = MODELS[ns.model].sliced(ns.num_layers).shape
    if ns.window_attn_skip_freq is not None and ns.window_size is None:
        p.error(f"{SKIP_FREQ_FLAG} needs {WINDOW_FLAG}, e.g. {WINDOW_FLAG} 4096")
    if ns.window_size is not None:
        try:
            left, _ = parse_window_size(ns.window_size)
            skip = (None if ns.window_attn_skip_freq is None else
                    parse_skip_freq(ns.window_attn_skip_freq, shape.num_layers))
        except ValueError as exc:
            p.error(str(exc))
        shape = dataclasses.replace(shape, window_size=left, window_attn_skip_freq=(
            tuple(skip) if isinstance(skip, list) else skip))
    if not torch.cuda.is_available():
        p.error("the ceiling is measured on a CUDA GPU; none is visible")
    documents = {}
    if ns.doc_lengths:
        with open(ns.doc_lengths) as fh:
            documents = {int(k): v for k, v in json.load(fh).items()}
    results: List[Dict] = [asdict(measure_ceiling(shape, s, ns.peak_tflops, ns.repeats,
                                                  documents.get(s)))
                           for s in seq_lens]
    with open(ns.out, "w") as fh:
        json.dump(results, fh, indent=1)
    for r in results:
        mfu = "n/a" if r["ceiling_mfu"] is None else f"{100 * r['ceiling_mfu']:.1f}%"
        print(f"[ceiling] S={r['seq_len']} ({r['attention']}): {r['ceiling_ms']:.1f} ms, "
              f"{mfu} MFU "
              f"(GEMM {r['gemm_tflops']:.0f}, attention {r['attention_tflops']:.0f} TFLOP/s)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
