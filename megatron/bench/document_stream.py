"""Document kernels on a stream of distinct micro-batches: ``--doc-kernels ... --doc-stream N``.

The kernel comparison of :mod:`megatron.bench.document_bench` times each kernel on one packed
sample, repeated. cuDNN builds an execution plan for every new call shape on its first use
and caches it, so there the fixed kernels run with every plan built, while ``auto`` and
``packed`` price the builds of shapes they have not seen recur. Training brings a new packed
sample every micro-batch; on mixes of random lengths the shapes mostly do not recur, and
``tiles`` pays plan builds too. The stream mode times what training sees:

* For each (length, mix) and each kernel of ``--doc-kernels``: one forward+backward on each
  of N distinct samples of the mix, each timed once, none repeated. The mix's lengths are
  drawn with a seed per sample (:func:`stream_seeds`: distinct over the samples, the kernels
  and the lengths; ``fixed:N`` brings the same shapes every sample, as its training data
  does). Each kernel gets its own samples, so none runs a sample whose exact shapes another
  kernel has just built.
* First ``--warmup`` throwaway samples per kernel, seeded apart from the stream, so that
  loading the libraries and measuring the cost table are not counted.
* The choosing kernels (``auto``, then ``packed``) run before the fixed kernels (in the
  order given), so they never profit from plans another kernel built: cuDNN's plan cache
  cannot be emptied within a process. Each choosing kernel starts its stream from a cost
  table with no sightings, as a training process does, and keeps the table across its
  samples (sightings accumulate: a shape that recurs moves to the batched call as in
  training); the sightings are put back afterwards, so the next kernel starts afresh too.
  ``packed`` may still find a shape ``auto`` built, where both call cuDNN on it.
* A sample's per-micro-batch work (its block, ``auto``'s choice, ``packed``'s plan) is done
  before its timed calls, as training does it once per micro-batch for every layer. Each
  sample runs ``--doc-layers`` L forward+backward calls in one timing, as a model of L
  layers does: the first builds the plans of the sample's new shapes, the others reuse
  them, and ``auto`` and ``packed`` price a build at ``1/L`` per call as well
  (:meth:`~megatron.usp.packed_documents.KernelCosts.for_layers`). Times are per call (the
  sample's time over L).

Reported per kernel (:class:`~megatron.bench.document_bench.DocCaseResult`, stream fields):
mean, median and max ms per micro-batch; useful TFLOP/s of the stream (its useful FLOPs over
its total time; each kernel has its own samples, so kernels compare by rate); ``auto``'s
and ``packed``'s choices tallied over the stream; ``vs_fastest``, the fastest document
kernel's rate over this one's (1.00 = fastest; ``dense``, the ceiling, is not a document
kernel), and the rank. ``--doc-kernels-split UxR`` times what ring rank 0 computes of each
sample. ``auto-recurring`` and ``packed-recurring`` (a choice as if the sample's shapes had
recurred, which the stream measures instead) and ``flex`` (one compiled mask per sample)
are refused.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from megatron.bench import report, timing
from megatron.bench.cli import BenchConfigError, seq_label
from megatron.bench.document_bench import (
    DOC_KERNELS,
    PROGRESS_PREFIX,
    WHOLE_SEQUENCE_ONLY,
    DocCaseResult,
    DocSweep,
    guarded,
    kernel_calls,
    kernel_inputs,
    mix_lengths,
    ring_rank_blocks,
    useful_pairs,
)
from megatron.bench.flops import FWD_BWD_FACTOR
from megatron.usp import flash_varlen
from megatron.usp import load_balance as lb
from megatron.usp.document_choice import BLOCK_KERNELS
from megatron.usp.document_kernels import build_document_block
from megatron.usp.kernels import get_kernel
from megatron.usp.packed_documents import BATCHED, VARLEN, KernelCosts, costs_for_shape

CHOOSING_KERNELS = ("auto", "packed")
STREAM_REFUSED = ("auto-recurring", "packed-recurring", "flex")
# Seeds of different samples are this prime apart: distinct for any sequence length below
# it, and as a corpus offset (seed mod the corpus's documents) distinct for as many samples
# as the corpus has documents.
SEED_STRIDE = 2_147_483_647


# --------------------------------------------------------------------------- the samples
def stream_order(kernels: Sequence[str]) -> List[str]:
    """The choosing kernels first (``auto`` before ``packed``), then the others as given."""
    return ([k for k in CHOOSING_KERNELS if k in kernels]
            + [k for k in kernels if k not in CHOOSING_KERNELS])


def stream_seeds(seed: int, kernel: str, seq_len: int, warmup: int, samples: int
                 ) -> Tuple[List[int], List[int]]:
    """(throwaway seeds, stream seeds) of ``kernel``'s stream at ``seq_len``: all distinct,
    for every kernel and length, and none equal to ``seed`` (the repeated sample's)."""
    first = DOC_KERNELS.index(kernel) * (warmup + samples)
    seeds = [seed + seq_len + SEED_STRIDE * (first + j + 1) for j in range(warmup + samples)]
    return seeds[:warmup], seeds[warmup:]


def stream_label(name: str, ulysses: int, ring: int, samples: int) -> str:
    """``tiles, stream of 16``; ``tiles U2xR2 rank 0, stream of 16`` with a split."""
    where = "" if ulysses * ring == 1 else f" U{ulysses}xR{ring} rank 0"
    return f"{name}{where}, stream of {samples}"


def sample_segments(cfg, mix: str, seq_len: int, seed: int) -> np.ndarray:
    """Segment ids [b, S] of the stream sample drawn with ``seed``."""
    return lb.segments_from_lengths(mix_lengths(mix, seq_len, seed), seq_len, cfg.batch)


@dataclass
class _Sample:
    """One sample's timed call and what it counts."""

    fwd_bwd: Callable[[], object]
    fwd_flops: float
    documents: int
    pairs: int
    tile_calls: int
    choice: object


def _prepare(cfg, mix: str, seq_len: int, seed: int, name: str, x, device) -> _Sample:
    """Everything of one sample before its timed call: blocks, choice, plan."""
    seg = sample_segments(cfg, mix, seq_len, seed)
    pos = np.arange(seq_len)[None].repeat(cfg.batch, 0)
    block = build_document_block(pos, seg, pos, seg, True, device)
    u, r = cfg.doc_kernels_split
    blocks = [block] if u * r == 1 else ring_rank_blocks(cfg, seg, u, r, device)
    pairs = useful_pairs(seg) if u * r == 1 else sum(b.pairs for b in blocks)
    _, fwd_bwd, flops, choice = kernel_calls(cfg, name, x, block, blocks, pairs)
    return _Sample(fwd_bwd, flops, int(sum(row.max() + 1 for row in seg)), pairs,
                   sum(len(b.groups) for b in blocks), choice)


# --------------------------------------------------------------------------- tallies
def tally_choices(choices: Sequence) -> str:
    """Choices over a stream: ``auto``'s kernel per block (one list per sample) as
    ``tiles 5 / varlen 27 blocks``; ``packed``'s documents per kind (one dict per sample) as
    ``batched 812 / varlen 4031 documents``."""
    if choices and isinstance(choices[0], dict):
        return (f"batched {sum(c[BATCHED] for c in choices)} / "
                f"varlen {sum(c[VARLEN] for c in choices)} documents")
    counts = Counter(name for per_sample in choices for name in per_sample)
    order = sorted(counts, key=lambda n: (BLOCK_KERNELS.index(n) if n in BLOCK_KERNELS
                                          else len(BLOCK_KERNELS), n))
    return " / ".join(f"{n} {counts[n]}" for n in order) + " blocks"


def rank_stream_rows(rows: Sequence[DocCaseResult]) -> None:
    """Set ``vs_fastest`` (the fastest document kernel's rate over each row's: 1.0 for the
    fastest, 1.05 for 5 % slower) and ``stream_rank`` (1 = fastest; equal rates share a
    rank) on the ok rows of one (length, mix); ``dense`` is not ranked."""
    ranked = [r for r in rows if r.status == "ok" and r.kernel != "dense"
              and r.fwd_bwd_tflops_per_gpu]
    if not ranked:
        return
    best = max(r.fwd_bwd_tflops_per_gpu for r in ranked)
    for r in ranked:
        r.vs_fastest = best / r.fwd_bwd_tflops_per_gpu
        r.stream_rank = 1 + sum(o.fwd_bwd_tflops_per_gpu > r.fwd_bwd_tflops_per_gpu
                                for o in ranked)


# --------------------------------------------------------------------------- one kernel
def _choosing_costs(cfg, name: str, x, device) -> Optional[KernelCosts]:
    """The process's cost table ``name`` chooses with (None: a fixed kernel)."""
    if name not in CHOOSING_KERNELS:
        return None
    q, k = x["q"], x["k"]
    return costs_for_shape(get_kernel(cfg.backend), device, q.dtype, q.shape[1], k.shape[1],
                           q.shape[-1], True)


def stream_case(sweep, cfg, seq_len: int, mix: str, name: str, x, position: int
                ) -> DocCaseResult:
    """Kernel ``name`` on its stream of ``cfg.doc_stream`` samples (module docstring); ``x``:
    q, k, v, dout [b, h, s, d] shared by every sample (only the documents differ)."""
    u, r = cfg.doc_kernels_split
    warm, seeds = stream_seeds(cfg.seed, name, seq_len, cfg.warmup, cfg.doc_stream)
    res = _stream_row(cfg, seq_len, mix, name, position)
    res.stream_seeds = seeds
    if u * r > 1 and name in WHOLE_SEQUENCE_ONLY:
        res.status, res.note = "skipped", "whole sequence only (--doc-kernels-split 1x1)"
        return res
    costs = _choosing_costs(cfg, name, x, sweep.device)
    saved = None if costs is None else costs.sightings()
    try:
        for seed in warm:
            _prepare(cfg, mix, seq_len, seed, name, x, sweep.device).fwd_bwd()
        if costs is not None:
            costs.restore_sightings({})          # a training process's first micro-batch
        _time_stream(sweep, cfg, seq_len, mix, name, x, seeds, res)
        if costs is not None:
            res.note = (f"plan build priced {1e3 * costs.build_s:.2f} ms, "
                        f"/{cfg.doc_layers} per call")
    finally:
        if costs is not None:
            costs.restore_sightings(saved)
    return res


def _stream_row(cfg, seq_len: int, mix: str, name: str, position: int) -> DocCaseResult:
    u, r = cfg.doc_kernels_split
    return DocCaseResult(seq_len, mix, "kernel", stream_label(name, u, r, cfg.doc_stream), 1,
                         ulysses=u, ring=r, kernel=name, stream_samples=cfg.doc_stream,
                         stream_position=position)


def _time_stream(sweep, cfg, seq_len, mix, name, x, seeds, res: DocCaseResult) -> None:
    """Each sample prepared, then its forward+backward timed once; the row's figures."""
    timing.reset_peak_memory(sweep.device)
    fwd_flops, choices = 0.0, []
    res.documents = res.useful_pairs = res.tile_calls = 0
    layers = cfg.doc_layers
    for seed in seeds:
        sample = _prepare(cfg, mix, seq_len, seed, name, x, sweep.device)

        def model(call=sample.fwd_bwd):          # the sample through every layer
            for _ in range(layers):
                call()
        res.fwd_bwd_times_ms += [t / layers for t in timing.time_iterations(
            model, warmup=0, iters=1, device=sweep.device, distributed=False)]
        fwd_flops += sample.fwd_flops
        res.documents += sample.documents
        res.useful_pairs += sample.pairs
        res.tile_calls += sample.tile_calls
        if sample.choice is not None:
            choices.append(sample.choice)
    res.peak_mem_gib = timing.peak_memory_gib(sweep.device)
    times = res.fwd_bwd_times_ms
    res.fwd_bwd_ms = statistics.median(times)
    res.stream_mean_ms = statistics.fmean(times)
    res.stream_max_ms = max(times)
    res.fwd_bwd_tflops_per_gpu = FWD_BWD_FACTOR * fwd_flops / (sum(times) / 1e3) / 1e12
    if choices:
        res.auto_choice = tally_choices(choices)
        res.stream_sample_choices = [_sample_choice(c) for c in choices]


def _sample_choice(choice) -> str:
    if isinstance(choice, dict):
        return f"batched {choice[BATCHED]} / varlen {choice[VARLEN]}"
    return ",".join(choice)


# --------------------------------------------------------------------------- the sweep
def run_stream_sweep(cfg, base_sweep, write) -> List[DocCaseResult]:
    """Every (S, mix) stream of ``cfg.doc_kernels`` (one process); ``write(results)`` after
    each kernel, so an interrupted sweep keeps what it measured."""
    sweep = DocSweep(base_sweep)
    results: List[DocCaseResult] = []
    for seq_len in cfg.seq_lens:
        dense_rate = None
        for mix in cfg.docs:
            results += _stream_cases(sweep, cfg, seq_len, mix, dense_rate,
                                     lambda done, so_far=list(results): write(so_far + done))
            dense_rate = next((r.fwd_bwd_tflops_per_gpu for r in results
                               if r.seq_len == seq_len and r.kernel == "dense"
                               and r.status == "ok"), dense_rate)
    return results


def _stream_cases(sweep, cfg, seq_len: int, mix: str, dense_rate, write
                  ) -> List[DocCaseResult]:
    if mix_lengths(mix, seq_len, cfg.seed) is None:
        return [DocCaseResult(seq_len, mix, "kernel", "all", 1, status="skipped",
                              note="the embedded corpus is not built here")]
    u, r = cfg.doc_kernels_split
    x = kernel_inputs(cfg, seq_len // r, sweep.device, u)
    out: List[DocCaseResult] = []
    for position, name in enumerate(stream_order(cfg.doc_kernels), 1):
        if name == "dense" and dense_rate is not None:
            continue                       # the ceiling does not depend on the mix
        fallback = _stream_row(cfg, seq_len, mix, name, position)
        if name == "varlen" and not flash_varlen.available():
            fallback.status, fallback.note = "skipped", "no flash varlen op here"
            res = fallback
        else:
            res = guarded(lambda n=name, p=position: stream_case(sweep, cfg, seq_len, mix, n,
                                                                  x, p), fallback)
        out.append(res)
        sweep.log(lambda row=res: stream_progress_line(row))
        timing.free_memory(sweep.device)
        write(out)
    rank_stream_rows(out)
    dense_rate = next((o.fwd_bwd_tflops_per_gpu for o in out
                       if o.kernel == "dense" and o.status == "ok"), dense_rate)
    for o in out:
        if o.status == "ok" and dense_rate and o.kernel != "dense":
            o.vs_dense = o.fwd_bwd_tflops_per_gpu / dense_rate
    sweep.log(lambda: ranking_line(out))
    write(out)
    return out


# --------------------------------------------------------------------------- output
def stream_progress_line(r: DocCaseResult) -> str:
    head = f"{PROGRESS_PREFIX} S={seq_label(r.seq_len)} {r.mix:<10} {r.label:<32}"
    if r.status != "ok":
        return f"{head} {r.status}: {r.note or ''}".rstrip()
    line = (f"{head} fwd+bwd mean {r.stream_mean_ms:8.2f} ms (median {r.fwd_bwd_ms:.2f}, max "
            f"{r.stream_max_ms:.2f}) {r.fwd_bwd_tflops_per_gpu:6.1f} useful TFLOP/s/GPU")
    return line + (f" | chose {r.auto_choice}" if r.auto_choice else "")


def ranking_line(rows: Sequence[DocCaseResult]) -> str:
    """``... S=32K lognormal vs fastest: tiles 1.00, auto 1.04, varlen 1.71``."""
    ranked = sorted((r for r in rows if r.vs_fastest is not None), key=lambda r: r.vs_fastest)
    if not ranked:
        return f"{PROGRESS_PREFIX} no kernel of the stream ran"
    return (f"{PROGRESS_PREFIX} S={seq_label(ranked[0].seq_len)} {ranked[0].mix} vs fastest: "
            + ", ".join(f"{r.kernel} {r.vs_fastest:.2f}" for r in ranked))


def stream_markdown(meta: dict, cfg, results: Sequence[DocCaseResult]) -> str:
    plural = "" if cfg.warmup == 1 else "s"
    title = (f"Packed documents on a stream of {cfg.doc_stream} distinct micro-batches per "
             f"kernel, {cfg.dtype}, {cfg.heads} query / {cfg.kv_heads} KV heads of "
             f"{cfg.head_dim}, causal within documents: {cfg.doc_layers} forward+backward "
             f"call(s) per sample, one per model layer (the first builds new plans), timed "
             f"once, in ms per call, after {cfg.warmup} throwaway sample{plural}; the choosing kernels "
             f"(auto, packed) ran first. Useful TFLOP/s per GPU over the stream; vs fastest: "
             f"the fastest document kernel's rate over the row's (1.00 = fastest)\n\n")
    headers = ["S", "docs", "case", "mean ms", "median ms", "max ms", "useful TFLOP/s/GPU",
               "vs fastest (rank)", "vs dense", "choices over the stream", "note"]
    rows = []
    for r in results:
        if r.status != "ok":
            rows.append([seq_label(r.seq_len), r.mix, r.label, r.status, "", "", "", "", "",
                         "", r.note or ""])
            continue
        fastest = "" if r.vs_fastest is None else f"{r.vs_fastest:.2f} ({r.stream_rank})"
        rows.append([seq_label(r.seq_len), r.mix, r.label, report.fmt(r.stream_mean_ms, 2),
                     report.fmt(r.fwd_bwd_ms, 2), report.fmt(r.stream_max_ms, 2),
                     report.fmt(r.fwd_bwd_tflops_per_gpu), fastest,
                     report.fmt(r.vs_dense, pct=True), r.auto_choice or "", r.note or ""])
    return title + report.metadata_markdown(meta) + "\n" + report.markdown_table(headers, rows)


def stream_record(cfg) -> dict:
    """What the payload says about the stream (beside each row's fields)."""
    return {"samples": cfg.doc_stream, "throwaway_samples": cfg.warmup,
            "layers": cfg.doc_layers,
            "kernel_order": stream_order(cfg.doc_kernels),
            "order_note": "the choosing kernels (auto, packed) run before the fixed kernels, "
                          "so they never profit from plans another kernel built; each "
                          "choosing kernel's stream starts from a cost table with no "
                          "sightings and keeps it across its samples",
            "seed_note": "each kernel's own samples, a seed per sample (stream_seeds)"}


def check_stream_config(cfg) -> None:
    """``--doc-stream`` checks (before any case runs); 0 is off."""
    n = cfg.doc_stream
    if n == 0:
        return
    if n < 2:
        raise BenchConfigError(f"--doc-stream {n}: a stream is at least 2 distinct samples "
                               f"per kernel (0: off); try --doc-stream 16")
    if not cfg.docs or not cfg.doc_kernels:
        raise BenchConfigError(f"--doc-stream {n} times the --doc-kernels on the --docs mixes; "
                               f"add e.g. --docs lognormal --doc-kernels tiles,auto,packed")
    refused = [k for k in cfg.doc_kernels if k in STREAM_REFUSED]
    if refused:
        raise BenchConfigError(
            f"--doc-stream {n} with --doc-kernels {','.join(refused)}: the recurring choices "
            f"are what the stream measures, flex compiles a mask per sample; drop them, e.g. "
            f"--doc-kernels tiles,varlen,per-document,auto,packed")
