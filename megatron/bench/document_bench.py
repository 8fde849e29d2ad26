"""Packed-document attention benchmark: ``tools/bench_attention.py --docs fixed:2k,fixed:8k,lognormal``.

Two modes, both on the document mixes of ``--docs`` (one packed sample per mix and length,
documents back to back, the last one cut at the sample end as megatron-core's dataset cuts it):

* **USP** (default; ``torchrun`` with one process per GPU, or gloo on the CPU): for every
  ``--seq-lens`` S, mix and U x R split, :func:`megatron.usp.attention.usp_attention` with the
  document plan of each rank (the chunk assignment of
  :func:`megatron.usp.load_balance.balance_chunks`, or zigzag with ``--chunk-assignment
  zigzag``). Reported per case: forward and forward+backward time, *useful* TFLOP/s per GPU
  (within-document pairs only, below), the per-ring-rank work spread of the chosen assignment and of
  zigzag, and the ring traffic: K/V messages sent and skipped against the zigzag ring, and the
  bytes skipped per attention call (forward + backward).
* **Kernel comparison** (``--doc-kernels dense,tiles,...``; one process, one GPU): the local
  document kernels on the whole packed sequence [1, h, S, d]: ``dense`` (the local kernel over
  the whole S with the plain causal mask: the ceiling, counted with its own dense causal
  FLOPs), ``tiles`` (batched cuDNN calls on strided views), ``tiles-copy`` (the same with
  contiguous copies), ``varlen`` (PyTorch's flash varlen op), ``per-document`` (one kernel call
  per document on contiguous slices: the anchor table's column), ``auto`` (the block kernels'
  choice by measured cost, what ring ranks use, :mod:`megatron.usp.document_choice`),
  ``packed`` (what one GPU runs: the documents read in place on megatron's ``[s, b, h, d]``
  tensors by measured-cost segments, :mod:`megatron.usp.packed_documents`; the record says how
  many documents each kind took) and, when asked for, ``flex`` (``flex_attention`` with a
  compiled BlockMask, reference only). ``auto`` and ``packed`` choose as on a micro-batch's
  first use, when every batched shape still pays its plan build; ``auto-recurring`` and
  ``packed-recurring`` choose as once the sample's shapes have recurred (:func:`recurring`:
  what training does when every micro-batch brings the same shapes, e.g. equal documents),
  the way the other kernels are timed, with their plans built. Every record carries
  ``auto_choice``, what ``auto``
  runs there (``packed``'s: its documents per kind), printed beside each kernel, so the choice
  can be read against the fastest kernel. Each kernel's output is compared with ``tiles``'s
  (relative L2, recorded, never asserted: correctness is tests/gpu's job).
  ``--doc-kernels-split UxR`` times the block kernels on what ring rank 0 of that split
  computes instead: its heads (``heads/U``), its local block and every K/V block it needs, in
  turn, under the USP mode's assignment; ``auto_choice`` lists the choice per block.
  Repeating one sample times every fixed kernel with its cuDNN plans built; ``--doc-stream
  N`` times each kernel on N distinct samples instead, each once, as training meets them
  (:mod:`megatron.bench.document_stream`): the table that says which kernel is fastest in
  training.

* **Balance report** (``--balance-report``; no GPU, no timing): the per-ring-rank work spread
  of zigzag and of the balanced assignment for every mix, length and ``--splits`` U x R (any
  size, not the world's), and the ring K/V messages and bytes the document ring skips (bytes
  also under zigzag and under the work balanced alone), over ``--balance-samples``
  consecutive samples of the packed document stream: :func:`balance_report`.

Useful FLOPs: forward ``4 * b * h * d * P`` with ``P`` the visible (query, key) pairs (a causal
document of ``L`` tokens has ``L(L+1)/2``), forward+backward 3.5x that; the dense ceiling counts
``4*b*h*S^2*d/2`` (``megatron.bench.flops``). Mixes: ``fixed:N`` (documents of N tokens, k =
1024), ``uniform:N`` (lengths uniform in 1..N-1: megatron-core's mock documents for N = 4k),
``lognormal`` (median 2K, sigma 1.2: a long tail of documents longer than the sequence) and
``corpus`` (the embedded corpus's document lengths, when it is built).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megatron.bench import report, timing
from megatron.bench.cli import BenchConfigError, seq_label
from megatron.bench.flops import FWD_BWD_FACTOR, attention_fwd_flops
from megatron.training.data.corpus import ensure_default_corpus
from megatron.training.data.indexed_files import inspect_indexed_dataset
from megatron.usp import flash_varlen
from megatron.usp import load_balance as lb
from megatron.usp.attention import usp_attention
from megatron.usp.document_choice import (
    AutoDocumentKernel,
    block_candidates,
    choose_block_kernel,
)
from megatron.usp.document_kernels import (
    TileDocumentKernel,
    VarlenDocumentKernel,
    build_document_block,
)
from megatron.usp.document_ring import (
    build_document_ring_plan,
    halo_matrix,
    needs_from_halo,
    ring_positions,
)
from megatron.usp.kernels import get_kernel
from megatron.usp.packed_documents import (
    BATCHED,
    VARLEN,
    KernelCosts,
    PackedDocumentAttention,
    build_packed_plan,
    costs_for,
    documents_in_order,
    packed_plan_for,
)
from megatron.usp.ring_attention import ring_accum_dtype
from megatron.usp.token_order import shard_for_cp_rank

Tensor = torch.Tensor
PROGRESS_PREFIX = "[bench_attention --docs]"
DOC_KERNELS = ("dense", "tiles", "tiles-copy", "varlen", "per-document", "auto", "packed",
               "auto-recurring", "packed-recurring", "flex")
LOGNORMAL_MEDIAN, LOGNORMAL_SIGMA = 2048, 1.2


# --------------------------------------------------------------------------- mixes
def parse_doc_mixes(text: str) -> List[str]:
    """``fixed:2k,fixed:8k,lognormal`` -> names (checked)."""
    mixes = [m.strip() for m in text.split(",") if m.strip()]
    for m in mixes:
        if m in ("lognormal", "corpus"):
            continue
        if m.startswith(("fixed:", "uniform:")):
            try:
                if _size(m.split(":", 1)[1]) >= 1:
                    continue
            except ValueError:
                pass
        raise BenchConfigError(f"--docs {m!r}: use fixed:N (e.g. fixed:2k), uniform:N (lengths "
                               f"uniform in 1..N-1, megatron-core's mock documents for N=4k), "
                               f"lognormal or corpus")
    if not mixes:
        raise BenchConfigError("--docs is empty; try --docs fixed:2k,fixed:8k,lognormal")
    return mixes


def _size(text: str) -> int:
    t = text.strip().lower()
    return int(t[:-1]) * 1024 if t.endswith("k") else int(t)


def corpus_lengths() -> Optional[np.ndarray]:
    """Document lengths of the embedded corpus, if it is built on this machine (else None)."""
    try:
        corpus = ensure_default_corpus()
        return np.asarray(inspect_indexed_dataset(corpus.data_prefix, "corpus").sequence_lengths)
    except Exception:  # noqa: BLE001 - no corpus (no sentencepiece, no disk): mix skipped
        return None


def mix_lengths(mix: str, seq_len: int, seed: int) -> Optional[np.ndarray]:
    """Document lengths of a mix, enough to fill ``seq_len`` (None: unavailable here)."""
    if mix.startswith("fixed:"):
        n = _size(mix[6:])
        return np.full(-(-seq_len // n), n)
    if mix.startswith("uniform:"):
        n = _size(mix[8:])
        rng = np.random.default_rng(seed)
        return rng.integers(1, max(2, n), 2 * seq_len // max(1, n) + 16)
    if mix == "lognormal":
        rng = np.random.default_rng(seed)
        return np.maximum(1, rng.lognormal(math.log(LOGNORMAL_MEDIAN), LOGNORMAL_SIGMA,
                                           seq_len // 64 + 16).astype(np.int64))
    lengths = corpus_lengths()
    if lengths is None:
        return None
    return np.roll(lengths, -(seed % lengths.size))


def useful_pairs(segments: np.ndarray, causal: bool = True) -> int:
    """Visible (query, key) pairs of segment ids [b, S]: the useful attention work."""
    return int(lb.token_work(segments, causal).sum())


# --------------------------------------------------------------------------- results
@dataclass
class DocCaseResult:
    """One timed case. Times in ms, rates in useful TFLOP/s per GPU.

    A stream row (``--doc-stream N``, ``stream_samples`` set) times one forward+backward on
    each of N samples: ``fwd_bwd_times_ms`` per sample, ``fwd_bwd_ms`` their median,
    ``stream_mean_ms`` / ``stream_max_ms`` their mean and max, ``documents``,
    ``useful_pairs`` and ``tile_calls`` summed over the stream, the rate the stream's useful
    FLOPs over its total time, ``auto_choice`` the choices tallied over the stream
    (``stream_sample_choices`` per sample), ``stream_position`` the order the kernel ran in
    (1 = first), and ``vs_fastest`` the fastest document kernel's rate over this one's
    (1.0 = fastest; ``stream_rank`` 1). No forward-only times there.
    """

    seq_len: int
    mix: str
    method: str                     # usp | kernel
    label: str
    gpus: int
    ulysses: Optional[int] = None
    ring: Optional[int] = None
    kernel: Optional[str] = None
    status: str = "ok"
    note: Optional[str] = None
    documents: Optional[int] = None
    useful_pairs: Optional[int] = None
    fwd_ms: Optional[float] = None
    fwd_bwd_ms: Optional[float] = None
    fwd_tflops_per_gpu: Optional[float] = None
    fwd_bwd_tflops_per_gpu: Optional[float] = None
    vs_dense: Optional[float] = None
    chunk_assignment: Optional[str] = None
    work_spread: Optional[float] = None
    zigzag_work_spread: Optional[float] = None
    kv_messages: Optional[int] = None
    kv_messages_skipped: Optional[int] = None
    ring_bytes: Optional[int] = None
    ring_bytes_skipped: Optional[int] = None
    auto_choice: Optional[str] = None
    tile_calls: Optional[int] = None
    rel_err_vs_tiles: Optional[float] = None
    peak_mem_gib: Optional[float] = None
    fwd_times_ms: List[float] = field(default_factory=list)
    fwd_bwd_times_ms: List[float] = field(default_factory=list)
    stream_samples: Optional[int] = None
    stream_position: Optional[int] = None
    stream_seeds: List[int] = field(default_factory=list)
    stream_sample_choices: List[str] = field(default_factory=list)
    stream_mean_ms: Optional[float] = None
    stream_max_ms: Optional[float] = None
    stream_rank: Optional[int] = None
    vs_fastest: Optional[float] = None


def _rates(res: DocCaseResult, fwd_flops: float) -> None:
    res.fwd_ms = timing.median_ms(res.fwd_times_ms)
    res.fwd_bwd_ms = timing.median_ms(res.fwd_bwd_times_ms)
    res.fwd_tflops_per_gpu = fwd_flops / (res.fwd_ms / 1e3) / res.gpus / 1e12
    res.fwd_bwd_tflops_per_gpu = (FWD_BWD_FACTOR * fwd_flops / (res.fwd_bwd_ms / 1e3)
                                  / res.gpus / 1e12)


def progress_line(r: DocCaseResult) -> str:
    head = f"{PROGRESS_PREFIX} S={seq_label(r.seq_len)} {r.mix:<10} {r.label:<24}"
    if r.status != "ok":
        return f"{head} {r.status}: {r.note or ''}".rstrip()
    extra = []
    if r.work_spread is not None:
        extra.append(f"spread {100 * r.work_spread:.1f}% (zigzag {100 * r.zigzag_work_spread:.1f}%)")
    if r.kv_messages_skipped is not None:
        extra.append(f"K/V msgs {r.kv_messages} (skipped {r.kv_messages_skipped}, "
                     f"{r.ring_bytes_skipped / 2**20:.1f} MiB)")
    if r.auto_choice:
        extra.append(f"auto -> {r.auto_choice}")
    if r.rel_err_vs_tiles is not None:
        extra.append(f"rel_err {r.rel_err_vs_tiles:.1e}")
    return (f"{head} fwd {r.fwd_ms:8.2f} ms {r.fwd_tflops_per_gpu:6.1f} | fwd+bwd "
            f"{r.fwd_bwd_ms:8.2f} ms {r.fwd_bwd_tflops_per_gpu:6.1f} useful TFLOP/s/GPU"
            + ("" if not extra else " | " + "; ".join(extra)))


def results_markdown(meta: dict, cfg, results: Sequence[DocCaseResult]) -> str:
    title = (f"Packed documents, {cfg.dtype}, {cfg.heads} query / {cfg.kv_heads} KV heads of "
             f"{cfg.head_dim}, causal within documents; useful TFLOP/s per GPU; median of "
             f"{cfg.iters} after {cfg.warmup} warm-up\n\n")
    headers = ["S", "docs", "case", "GPUs", "fwd+bwd ms", "useful TFLOP/s/GPU", "vs dense",
               "spread (zigzag)", "K/V msgs (skipped)", "ring MiB skipped", "note"]
    rows = []
    for r in results:
        if r.status != "ok":
            rows.append([seq_label(r.seq_len), r.mix, r.label, r.gpus, r.status, "", "", "",
                         "", "", r.note or ""])
            continue
        spread = ("" if r.work_spread is None else
                  f"{100 * r.work_spread:.1f}% ({100 * r.zigzag_work_spread:.1f}%)")
        msgs = "" if r.kv_messages is None else f"{r.kv_messages} ({r.kv_messages_skipped})"
        mib = "" if r.ring_bytes_skipped is None else f"{r.ring_bytes_skipped / 2**20:.1f}"
        note = f"auto -> {r.auto_choice}" if r.auto_choice else (r.note or "")
        rows.append([seq_label(r.seq_len), r.mix, r.label, r.gpus, report.fmt(r.fwd_bwd_ms, 2),
                     report.fmt(r.fwd_bwd_tflops_per_gpu), report.fmt(r.vs_dense, pct=True),
                     spread, msgs, mib, note])
    return title + report.metadata_markdown(meta) + "\n" + report.markdown_table(headers, rows)


# --------------------------------------------------------------------------- inputs
def kernel_inputs(cfg, seq_len: int, device, ulysses: int = 1) -> Dict[str, Tensor]:
    """q, k, v, dout [b, h, seq_len, d]: the heads one of ``ulysses`` ranks holds (K/V heads
    replicated up to ``ulysses`` first, as USP does)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed * 1_000_003 + seq_len)
    hq, hk = cfg.heads // ulysses, max(cfg.kv_heads, ulysses) // ulysses
    heads = {"q": hq, "k": hk, "v": hk, "dout": hq}
    return {n: torch.randn(cfg.batch, h, seq_len, cfg.head_dim, generator=gen, device=device,
                           dtype=cfg.torch_dtype) for n, h in heads.items()}


def _segments(cfg, mix: str, seq_len: int) -> Optional[np.ndarray]:
    lengths = mix_lengths(mix, seq_len, cfg.seed)
    if lengths is None:
        return None
    return lb.segments_from_lengths(lengths, seq_len, cfg.batch)


def _ring_bytes(plan, kv_bytes: int, dtype: torch.dtype) -> Dict[str, int]:
    """Ring traffic of one attention call (forward + backward, all ranks) against zigzag;
    ``kv_bytes``: one rank's whole K/V block.

    Zigzag: every rank sends R-1 K/V blocks forward and backward and R dK/dV hops (R-1 in the
    accumulator dtype). Document ring: the plan's halo tokens forward and backward, and their
    dK/dV shares back (kv's dtype).
    """
    R = plan.ring_size
    acc_scale = torch.finfo(ring_accum_dtype(dtype, R)).bits // torch.finfo(dtype).bits
    zigzag = R * (2 * (R - 1) + (R - 1) * acc_scale + 1) * kv_bytes if R > 1 else 0
    ours = 3 * plan.ring_kv_tokens() * kv_bytes // (plan.seq_len // R)
    return {"ring_bytes": ours, "ring_bytes_skipped": zigzag - ours,
            "kv_messages": plan.kv_messages(), "kv_messages_skipped": plan.skipped_kv_messages()}


# --------------------------------------------------------------------------- USP mode
def usp_case(sweep, cfg, seq_len: int, mix: str, split, groups) -> DocCaseResult:
    u, r = split
    res = DocCaseResult(seq_len, mix, "usp", f"USP U{u}xR{r} {cfg.document_kernel}",
                        sweep.world, ulysses=u, ring=r, kernel=cfg.document_kernel)
    seg = _segments(cfg, mix, seq_len)
    if seg is None:
        res.status, res.note = "skipped", "the embedded corpus is not built here"
        return res
    choice = lb.balance_chunks(seg, u, r)
    assignment = None if (choice.is_zigzag or cfg.chunk_assignment == "zigzag") else \
        choice.assignment
    res.chunk_assignment = "zigzag" if assignment is None else f"balanced m={assignment.group_chunks}"
    res.work_spread = choice.zigzag_spread if assignment is None else choice.spread
    res.zigzag_work_spread = choice.zigzag_spread
    res.documents = int(sum(row.max() + 1 for row in seg))
    res.useful_pairs = useful_pairs(seg)
    rank = sweep.rank
    plan = build_document_ring_plan(seg, rank // u, r, assignment, True, sweep.device)
    x = kernel_inputs(cfg, seq_len, sweep.device)
    loc = {n: shard_for_cp_rank(t, 2, rank, sweep.world, assignment).permute(2, 0, 1, 3)
           .contiguous() for n, t in x.items()}
    del x
    kv_bytes = (2 * cfg.batch * max(cfg.kv_heads, u) // u * (seq_len // r) * cfg.head_dim
                * torch.finfo(cfg.torch_dtype).bits // 8)
    for key, value in _ring_bytes(plan, kv_bytes, cfg.torch_dtype).items():
        setattr(res, key, value)
    q, k, v = (loc[n].requires_grad_() for n in ("q", "k", "v"))
    ulysses_group, ring_group = groups

    def fwd():
        return usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group,
                             causal=True, backend=cfg.backend, documents=plan,
                             document_kernel=cfg.document_kernel)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), (q, k, v), loc["dout"])

    timing.reset_peak_memory(sweep.device)
    res.fwd_times_ms = timing.time_iterations(fwd, warmup=cfg.warmup, iters=cfg.iters,
                                              device=sweep.device)
    res.fwd_bwd_times_ms = timing.time_iterations(fwd_bwd, warmup=cfg.warmup, iters=cfg.iters,
                                                  device=sweep.device)
    res.peak_mem_gib = sweep._max_over_ranks(timing.peak_memory_gib(sweep.device))
    _rates(res, 4.0 * cfg.heads * cfg.head_dim * res.useful_pairs)
    return res


# --------------------------------------------------------------------------- kernel mode
def _per_document(kernel, block):
    """One kernel call per document on contiguous slices (the anchor table's column)."""

    def bounds():
        seg = block.q_seg[0]
        starts = np.flatnonzero(np.concatenate([[True], seg[1:] != seg[:-1]]))
        return list(zip(starts.tolist(), np.concatenate([starts[1:], [seg.size]]).tolist()))

    spans = bounds()

    def fwd(q, k, v, scale):
        outs, lses = [], []
        for a, b in spans:
            o, lse = kernel.forward(q[:, :, a:b].contiguous(), k[:, :, a:b].contiguous(),
                                    v[:, :, a:b].contiguous(), True, scale)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)

    def bwd(dout, q, k, v, out, lse, scale):
        grads = [kernel.backward(*(t[:, :, a:b].contiguous() for t in (dout, q, k, v, out)),
                                 lse[:, :, a:b].contiguous(), True, scale) for a, b in spans]
        return tuple(torch.cat([g[i] for g in grads], dim=2) for i in range(3))

    return fwd, bwd


def recurring(costs: KernelCosts, choose: Callable[[], object]):
    """What ``choose()`` returns once the shapes it records in ``costs`` have been seen
    ``costs.reuse_before_build`` times, as when every micro-batch brings the same shapes; the
    table's sightings are left as they were, so later choices see no difference."""
    saved = costs.sightings()
    try:
        for _ in range(costs.reuse_before_build):
            choose()
        return choose()
    finally:
        costs.restore_sightings(saved)


def _packed(kernel, block, x, scale, recur: bool = False, layers: int = 1):
    """fwd, fwd_bwd and the documents per kind of the in-place path on [s, b, h, d] copies of x
    (the fwd returns head-major out, to compare with the other kernels); ``recur``: its plan
    as once the sample's shapes have recurred (:func:`recurring`); ``layers``: the calls its
    plan serves (``--doc-layers``)."""
    q, k, v, dout = (x[n].permute(2, 0, 1, 3).contiguous() for n in ("q", "k", "v", "dout"))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if recur:
        costs = costs_for(kernel, q, k, block.causal, layers=layers)
        plan = recurring(costs, lambda: build_packed_plan(
            documents_in_order(block), block.causal, costs, q.device, block.window))
    else:
        plan = packed_plan_for(block, kernel, q, k, layers=layers)

    def fwd():
        return PackedDocumentAttention.apply(q, k, v, plan, kernel, scale).permute(1, 2, 0, 3)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), (q, k, v), dout.permute(1, 2, 0, 3))
    return fwd, fwd_bwd, plan.counts()


def _flex(block, x, scale):
    seg = block.tensor("q_seg")[0]

    def mask_mod(b, h, q_idx, kv_idx):
        return (seg[q_idx] == seg[kv_idx]) & (kv_idx <= q_idx)

    s = seg.numel()
    mask = create_block_mask(mask_mod, 1, 1, s, s, device=x["q"].device, _compile=True)
    compiled = torch.compile(flex_attention)
    gqa = x["k"].shape[1] != x["q"].shape[1]

    def run(q, k, v):
        return compiled(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)

    return run


WHOLE_SEQUENCE_ONLY = ("per-document", "packed", "packed-recurring", "flex")


def _block_calls(kern, block):
    """(forward, backward) of a document kernel on one block, in :func:`_per_document`'s form.
    A ring rank's remote block reads only the halo its plan ships (``block.sk`` keys), so the
    call gets the first ``block.sk`` K/V tokens of the rank's block as that halo."""
    def fwd(q, k, v, scale):
        return kern.forward(q, k[:, :, :block.sk], v[:, :, :block.sk], block, scale)

    def bwd(dout, q, k, v, out, lse, scale):
        return kern.backward(dout, q, k[:, :, :block.sk], v[:, :, :block.sk], out, lse, block,
                             scale)
    return fwd, bwd


def auto_choice(auto: AutoDocumentKernel, q: Tensor, k: Tensor, blocks: Sequence) -> str:
    """What ``auto`` runs on each block, e.g. ``tiles`` or ``tiles,varlen`` (one per block)."""
    return ",".join(auto.choose(q, k, blk).name for blk in blocks)


def kernel_case(sweep, cfg, seq_len: int, mix: str, name: str, x, seg, block,
                reference: Optional[Tensor], ring_blocks: Optional[Sequence] = None
                ) -> DocCaseResult:
    """One kernel on the whole sequence's ``block``, or with ``ring_blocks`` (a ring rank's
    blocks, ``x`` its tokens and heads) on each of those in turn."""
    res = DocCaseResult(seq_len, mix, "kernel", name, 1, kernel=name)
    res.documents = int(seg[0].max() + 1)
    blocks = list(ring_blocks) if ring_blocks is not None else [block]
    res.useful_pairs = (useful_pairs(seg) if ring_blocks is None
                        else sum(b.pairs for b in blocks))
    res.tile_calls = sum(len(b.groups) for b in blocks)
    if ring_blocks is not None and name in WHOLE_SEQUENCE_ONLY:
        res.status, res.note = "skipped", "whole sequence only (--doc-kernels-split 1x1)"
        return res
    fwd, fwd_bwd, flops, choice = kernel_calls(cfg, name, x, block, blocks, res.useful_pairs)
    if choice is not None:
        res.auto_choice = choice_text(choice)
    timing.reset_peak_memory(sweep.device)
    res.fwd_times_ms = timing.time_iterations(fwd, warmup=cfg.warmup, iters=cfg.iters,
                                              device=sweep.device, distributed=False)
    res.fwd_bwd_times_ms = timing.time_iterations(fwd_bwd, warmup=cfg.warmup, iters=cfg.iters,
                                                  device=sweep.device, distributed=False)
    res.peak_mem_gib = timing.peak_memory_gib(sweep.device)
    _rates(res, flops)
    if reference is not None and name != "dense":
        with torch.no_grad():
            out = fwd()
        out = out[0] if isinstance(out, tuple) else out
        res.rel_err_vs_tiles = float((out.float() - reference.float()).norm()
                                     / reference.float().norm())
    return res


def kernel_calls(cfg, name: str, x, block, blocks: Sequence, pairs: int):
    """``(fwd, fwd_bwd, forward FLOPs, choice)`` of kernel ``name`` on ``blocks`` (the whole
    sequence's ``block``, or a ring rank's blocks in turn) with ``x``'s q, k, v, dout
    [b, h, s, d]; ``pairs``: the useful pairs of ``blocks``. The kernel's per-micro-batch
    work (``auto``'s choice, ``packed``'s plan) is done here, before anything is timed;
    ``choice`` is ``auto``'s kernel per block (a list) or ``packed``'s documents per kind (a
    dict), else None."""
    local = get_kernel(cfg.backend)
    layers = getattr(cfg, "doc_layers", 1)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    q, k, v, dout = x["q"], x["k"], x["v"], x["dout"]
    heads = q.shape[1]
    flops = 4.0 * heads * cfg.head_dim * pairs
    choice = None
    if name == "dense":
        def fwd():
            return local.forward(q, k, v, True, scale)

        def fwd_bwd():
            out, lse = fwd()
            return local.backward(dout, q, k, v, out, lse, True, scale)
        return fwd, fwd_bwd, attention_fwd_flops(q.shape[0], heads, q.shape[2], cfg.head_dim,
                                                 True), None
    if name == "flex":
        run = _flex(block, x, scale)
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def fwd():
            return run(qg, kg, vg)

        def fwd_bwd():
            return torch.autograd.grad(fwd(), (qg, kg, vg), dout)
        return fwd, fwd_bwd, flops, None
    if name in ("packed", "packed-recurring"):
        fwd, fwd_bwd, choice = _packed(local, block, x, scale, recur=name == "packed-recurring",
                                       layers=layers)
        return fwd, fwd_bwd, flops, choice
    if name == "per-document":
        steps = [_per_document(local, block)]
    elif name == "auto-recurring":
        auto = AutoDocumentKernel(local, layers=layers)
        costs = auto.costs(q, k, block.causal)
        candidates = block_candidates(q.device.type, q.dtype, flash_varlen.available())
        choice = [recurring(costs, lambda blk=blk: choose_block_kernel(blk, costs, candidates))
                  for blk in blocks]
        steps = [_block_calls(auto.kernels[c], blk) for c, blk in zip(choice, blocks)]
    else:
        kern = {"tiles": lambda: TileDocumentKernel(local),
                "tiles-copy": lambda: TileDocumentKernel(local, views=False),
                "varlen": VarlenDocumentKernel, "auto": lambda: AutoDocumentKernel(local, layers=layers)}[
            name]()
        if name == "auto":
            choice = [kern.choose(q, k, blk).name for blk in blocks]
        steps = [_block_calls(kern, blk) for blk in blocks]

    def fwd():                                 # a ring rank's blocks in turn
        outs = [f(q, k, v, scale) for f, _ in steps]
        return outs[0]

    def fwd_bwd():
        grads = []
        for f, b in steps:
            out, lse = f(q, k, v, scale)
            grads.append(b(dout, q, k, v, out, lse, scale))
        return grads[0]
    return fwd, fwd_bwd, flops, choice


def choice_text(choice) -> str:
    """``auto``'s kernel per block, ``tiles,varlen``, or ``packed``'s documents per kind,
    ``batched 3 / varlen 12 documents``."""
    if isinstance(choice, dict):
        return f"batched {choice[BATCHED]} / varlen {choice[VARLEN]} documents"
    return ",".join(choice)


# --------------------------------------------------------------------------- the sweep
class DocSweep:
    """What the cases share: config, device, rank (the attention bench's _Sweep helpers)."""

    def __init__(self, base_sweep) -> None:
        self.base = base_sweep
        self.device = base_sweep.device
        self.rank = base_sweep.rank
        self.world = base_sweep.world

    def _max_over_ranks(self, value):
        return self.base._max_over_ranks(value)

    def log(self, text: Callable[[], str]) -> None:
        self.base.log(text)


def guarded(res_factory: Callable[[], DocCaseResult], fallback: DocCaseResult) -> DocCaseResult:
    try:
        return res_factory()
    except Exception as exc:  # noqa: BLE001 - an OOM or a kernel refusing a shape is a result
        fallback.status = "oom" if timing.is_out_of_memory(exc) else "error"
        fallback.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return fallback


def run_document_sweep(cfg, base_sweep, splits, meta: dict, payload: dict, write) -> List:
    """Every (S, mix) case of the configured mode; rank 0 calls ``write(results)`` after each
    case, so an interrupted sweep keeps what it measured."""
    sweep = DocSweep(base_sweep)
    results: List[DocCaseResult] = []
    kernels = cfg.doc_kernels
    for seq_len in cfg.seq_lens:
        dense_rate = None
        for mix in cfg.docs:
            if kernels:
                if sweep.rank == 0:
                    results += _kernel_cases(sweep, cfg, seq_len, mix, kernels, dense_rate,
                                             lambda done, so_far=list(results):
                                             write(so_far + done))
                    dense_rate = next((r.fwd_bwd_tflops_per_gpu for r in results
                                       if r.seq_len == seq_len and r.kernel == "dense"
                                       and r.status == "ok"), dense_rate)
                timing.barrier(None, sweep.device)
                continue
            for split in splits:
                fallback = DocCaseResult(seq_len, mix, "usp", f"USP U{split[0]}xR{split[1]}",
                                         sweep.world, ulysses=split[0], ring=split[1])
                res = guarded(lambda s=seq_len, m=mix, sp=split: usp_case(
                    sweep, cfg, s, m, sp, base_sweep.groups_for(sp)), fallback)
                results.append(res)
                sweep.log(lambda r=res: progress_line(r))
                timing.free_memory(sweep.device)
                if sweep.rank == 0:
                    write(results)
    return results


def ring_rank_blocks(cfg, seg: np.ndarray, ulysses: int, ring: int, device) -> List:
    """The blocks ring rank 0 of a ``ulysses`` x ``ring`` split computes for segment ids
    ``seg`` [b, S], under the assignment USP mode uses (balanced, or zigzag)."""
    choice = lb.balance_chunks(seg, ulysses, ring)
    zigzag = choice.is_zigzag or getattr(cfg, "chunk_assignment", "auto") == "zigzag"
    plan = build_document_ring_plan(seg, 0, ring, None if zigzag else choice.assignment, True,
                                    device)
    return [b for b in plan.blocks if b is not None]


def _kernel_cases(sweep, cfg, seq_len, mix, kernels, dense_rate, write
                  ) -> List[DocCaseResult]:
    out: List[DocCaseResult] = []
    seg = _segments(cfg, mix, seq_len)
    if seg is None:
        return [DocCaseResult(seq_len, mix, "kernel", "all", 1, status="skipped",
                              note="the embedded corpus is not built here")]
    pos = np.arange(seq_len)[None].repeat(cfg.batch, 0)
    block = build_document_block(pos, seg, pos, seg, True, sweep.device)
    u, r = getattr(cfg, "doc_kernels_split", (1, 1))
    ring_blocks = None if u * r == 1 else ring_rank_blocks(cfg, seg, u, r, sweep.device)
    x = kernel_inputs(cfg, seq_len // r, sweep.device, u)
    try:
        auto = AutoDocumentKernel(get_kernel(cfg.backend), layers=getattr(cfg, "doc_layers", 1))
        chosen = auto_choice(auto, x["q"], x["k"], ring_blocks or [block])
    except Exception as exc:  # noqa: BLE001 - a table that cannot be timed here is a result
        chosen = f"none ({type(exc).__name__})"
    reference = None
    for name in kernels:
        if name == "dense" and dense_rate is not None:
            continue                       # the ceiling does not depend on the mix
        if name == "varlen" and not flash_varlen.available():
            out.append(DocCaseResult(seq_len, mix, "kernel", name, 1, kernel=name,
                                     status="skipped", note="no flash varlen op here"))
            continue
        fallback = DocCaseResult(seq_len, mix, "kernel", name, 1, kernel=name)
        res = guarded(lambda n=name, ref=reference: kernel_case(
            sweep, cfg, seq_len, mix, n, x, seg, block, ref, ring_blocks), fallback)
        res.ulysses, res.ring = u, r
        if ring_blocks is not None:
            res.label = f"{name} U{u}xR{r} rank 0"
        if res.auto_choice is None:
            res.auto_choice = chosen          # printed beside every kernel
        if name == "tiles" and res.status == "ok" and ring_blocks is None:
            with torch.no_grad():
                reference, _ = TileDocumentKernel(get_kernel(cfg.backend)).forward(
                    x["q"], x["k"], x["v"], block, 1.0 / math.sqrt(cfg.head_dim))
        if name == "dense" and res.status == "ok":
            dense_rate = res.fwd_bwd_tflops_per_gpu
        out.append(res)
        sweep.log(lambda r=res: progress_line(r))
        timing.free_memory(sweep.device)
        write(out)                          # an interrupted run keeps what it measured
    for r in out:
        if r.status == "ok" and dense_rate and r.kernel != "dense":
            r.vs_dense = r.fwd_bwd_tflops_per_gpu / dense_rate
    return out


@dataclass(frozen=True)
class KernelSetup:
    """The attention shape and timing of :func:`time_document_kernels` (the fields
    :func:`kernel_case` reads from ``tools/bench_attention.py``'s config)."""

    heads: int
    kv_heads: int
    head_dim: int
    torch_dtype: torch.dtype = torch.bfloat16
    backend: str = "auto"
    warmup: int = 2
    iters: int = 5
    seed: int = 1234
    batch: int = 1


@dataclass(frozen=True)
class _OneDevice:
    device: torch.device


def time_document_kernels(setup: KernelSetup, seg: np.ndarray, kernels: Sequence[str],
                          device) -> List[DocCaseResult]:
    """Forward+backward of each single-GPU document kernel (:func:`kernel_case`) on one packed
    sequence: ``seg`` segment ids [1, S]. A kernel that is unavailable here, refuses the shape
    or runs out of memory is a result with that status."""
    seq_len = seg.shape[1]
    pos = np.arange(seq_len)[None]
    block = build_document_block(pos, seg, pos, seg, True, device)
    x = kernel_inputs(setup, seq_len, device)
    out = []
    for name in kernels:
        fallback = DocCaseResult(seq_len, "", "kernel", name, 1, kernel=name)
        if name == "varlen" and not flash_varlen.available():
            fallback.status, fallback.note = "skipped", "no flash varlen op here"
            out.append(fallback)
            continue
        out.append(guarded(lambda n=name: kernel_case(_OneDevice(device), setup, seq_len, "",
                                                       n, x, seg, block, None), fallback))
        timing.free_memory(device)
    return out


def as_dicts(results: Sequence[DocCaseResult]) -> List[dict]:
    return [asdict(r) for r in results]


def check_document_config(cfg, world: int) -> None:
    """Flag checks of the document mode (before any case runs)."""
    layers = getattr(cfg, "doc_layers", 1)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise BenchConfigError(f"--doc-layers {layers!r}: the layers that reuse a micro-batch's "
                               f"kernel choice, at least 1; try --doc-layers 16 (the 0.85B "
                               f"model's)")
    if cfg.doc_kernels:
        unknown = [k for k in cfg.doc_kernels if k not in DOC_KERNELS]
        if unknown:
            raise BenchConfigError(f"--doc-kernels {','.join(unknown)}: choose from "
                                   f"{list(DOC_KERNELS)}")
        if world != 1:
            raise BenchConfigError("--doc-kernels compares single-GPU kernels: run one "
                                   "process (python tools/bench_attention.py ...)")
        u, r = getattr(cfg, "doc_kernels_split", (1, 1))
        bad = [s for s in cfg.seq_lens if s % (2 * u * r)]
        if cfg.heads % u or bad:
            raise BenchConfigError(
                f"--doc-kernels-split {u}x{r}: U must divide --heads ({cfg.heads}) and 2*U*R "
                f"every --seq-lens (not {bad}); try --doc-kernels-split 1x2")
    elif getattr(cfg, "doc_kernels_split", (1, 1)) != (1, 1):
        raise BenchConfigError("--doc-kernels-split needs --doc-kernels, e.g. --doc-kernels "
                               "tiles,varlen,auto --doc-kernels-split 2x2")
    if not cfg.causal:
        raise BenchConfigError("--docs measures causal attention within documents; drop "
                               "--no-causal")
    if dist.is_initialized() and cfg.batch < 1:
        raise BenchConfigError("--batch-size must be >= 1")


# --------------------------------------------------------------------------- balance report
def balance_report(mixes: Sequence[str], seq_lens: Sequence[int], splits, samples: int,
                   seed: int = 1234) -> List[dict]:
    """Work spread of zigzag and of :func:`~megatron.usp.load_balance.balance_chunks` per
    (mix, S, U x R), and the share of the zigzag ring's K/V messages and bytes the document
    ring skips under the balanced assignment (bytes also under zigzag and under
    :func:`~megatron.usp.load_balance.work_balance`, the work balanced alone), over
    ``samples`` consecutive samples of the mix's document stream (a document cut at a
    sample end continues in the next one). Pure computation."""
    rows = []
    for mix in mixes:
        for seq_len in seq_lens:
            lengths = mix_lengths(mix, seq_len * samples, seed)
            if lengths is None:
                rows.append(dict(mix=mix, seq_len=seq_len, status="skipped",
                                 note="the embedded corpus is not built here"))
                continue
            seg = lb.segments_from_lengths(lengths, seq_len, samples)
            for u, r in splits:
                zig, bal, ms, skipped, bytes_skipped = [], [], [], [], []
                zig_bytes, work_bytes = [], []
                for row in seg:
                    choice = lb.balance_chunks(row, u, r)
                    zig.append(choice.zigzag_spread)
                    bal.append(choice.spread)
                    ms.append(0 if choice.is_zigzag else choice.assignment.group_chunks)
                    assignment = None if choice.is_zigzag else choice.assignment
                    msgs, moved = _ring_skipped(row, r, assignment)
                    skipped.append(msgs)
                    bytes_skipped.append(moved)
                    zig_bytes.append(moved if assignment is None else
                                     _ring_skipped(row, r, None)[1])
                    alone = lb.work_balance(lb.token_work(row), u, r)
                    work_bytes.append(_ring_skipped(
                        row, r, None if alone.is_zigzag else alone.assignment)[1])
                rows.append(dict(mix=mix, seq_len=seq_len, ulysses=u, ring=r, samples=samples,
                                 documents=int(sum(row.max() + 1 for row in seg)),
                                 zigzag_spread_max=max(zig), zigzag_spread_mean=float(
                                     np.mean(zig)), spread_max=max(bal),
                                 spread_mean=float(np.mean(bal)),
                                 zigzag_kept=sum(m == 0 for m in ms),
                                 group_chunks=sorted(set(m for m in ms if m)),
                                 kv_messages_skipped_mean=float(np.mean(skipped)),
                                 kv_bytes_skipped_mean=float(np.mean(bytes_skipped)),
                                 zigzag_kv_bytes_skipped_mean=float(np.mean(zig_bytes)),
                                 work_only_kv_bytes_skipped_mean=float(np.mean(work_bytes))))
    return rows


def _ring_skipped(row: np.ndarray, ring: int, assignment) -> Tuple[float, float]:
    """Fractions of the zigzag ring's K/V messages and bytes the document ring skips for one
    sample's segment ids under ``assignment`` (None: zigzag), counted from the halo plan."""
    if ring == 1:
        return 1.0, 1.0
    seq_len = row.size
    halo = halo_matrix(row[None], ring_positions(seq_len, ring, assignment), None)
    needs = needs_from_halo(halo)
    pairs = [(a, b) for a in range(ring) for b in range(ring) if a != b and needs[a][b]]
    tokens = sum(seq_len // ring if halo[a][b] is None else halo[a][b].size for a, b in pairs)
    return 1 - len(pairs) / (ring * (ring - 1)), 1 - tokens / ((ring - 1) * seq_len)


def balance_markdown(rows: Sequence[dict]) -> str:
    headers = ["docs", "S", "U x R", "samples", "documents", "zigzag spread max / mean",
               "balanced spread max / mean", "zigzag kept", "m used", "ring K/V msgs skipped",
               "ring K/V bytes skipped", "zigzag's K/V bytes skipped",
               "work-only's K/V bytes skipped"]
    table = []
    for r in rows:
        if r.get("status") == "skipped":
            table.append([r["mix"], seq_label(r["seq_len"]), "", "", "", r["note"], "", "", "",
                          "", "", "", ""])
            continue
        table.append([r["mix"], seq_label(r["seq_len"]), f"{r['ulysses']}x{r['ring']}",
                      r["samples"], r["documents"],
                      f"{100 * r['zigzag_spread_max']:.1f}% / {100 * r['zigzag_spread_mean']:.1f}%",
                      f"{100 * r['spread_max']:.2f}% / {100 * r['spread_mean']:.2f}%",
                      r["zigzag_kept"], ",".join(map(str, r["group_chunks"])) or "-",
                      f"{100 * r['kv_messages_skipped_mean']:.0f}%",
                      f"{100 * r['kv_bytes_skipped_mean']:.0f}%",
                      f"{100 * r['zigzag_kv_bytes_skipped_mean']:.0f}%",
                      f"{100 * r['work_only_kv_bytes_skipped_mean']:.0f}%"])
    return report.markdown_table(headers, table)
