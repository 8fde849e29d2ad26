"""What the benchmark prints and writes: one console line per row, ratio and pooled
ratio, and the markdown report."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from megatron.bench import report
from megatron.bench.cli import seq_label
from megatron.bench.e2e.config import (
    DENSE_COUNT,
    PROGRESS_PREFIX,
    USEFUL_COUNT,
    E2EConfig,
    E2EResult,
)
from megatron.bench.e2e.pairing import peer_ratios, pooled_ratios


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
                 f"({report.fmt(r.ceiling_mfu, pct=True)} MFU{_gemm_note(r)})")
    if r.docs is not None:
        line += f"; FLOPs {r.flops_count}, {report.fmt(r.documents_per_iteration, 0)} docs/iter"
        if r.steady_iterations is not None:
            line += (f"; {r.steady_iterations} of {r.iterations_measured} iterations built no "
                     f"new attention plans"
                     + (f": {r.iter_ms_steady:.1f} ms/iter" if r.iter_ms_steady else "")
                     + (f" ({100 * r.ceiling_share_steady:.1f}% of their ceiling)"
                        if r.ceiling_share_steady is not None else ""))
        if r.attention_path:
            line += f", attention {r.attention_path}"
    return line


def _gemm_note(r: E2EResult) -> str:
    """Which GEMM time the ceiling counted: the profiled iteration's, where it was lower."""
    if r.ceiling_gemm_ms is None:
        return ""
    if r.step_gemm_ms is None:
        return f"; GEMMs {r.ceiling_gemm_ms:.1f} ms timed alone, no profiled iteration"
    which = "the step's" if r.step_gemm_ms < r.ceiling_gemm_ms else "timed alone"
    return (f"; GEMMs {r.step_gemm_ms:.1f} ms in the profiled step, {r.ceiling_gemm_ms:.1f} ms "
            f"timed alone: counts {which}")


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
                   "step on one H200): a lower bound on speed.")


def report_flops_count(cfg: E2EConfig, results: Sequence[E2EResult]) -> str:
    """The count this project's rows follow: the training loop's label where they counted a
    sliding window (``"dense causal, window W on k of L layers"``), else dense causal or,
    with ``--docs``, useful (documents)."""
    windowed = next((r.flops_count for r in results
                     if r.stack == "megatron-usp" and "window" in r.flops_count), None)
    if windowed is not None:
        return windowed
    return DENSE_COUNT if cfg.docs is None else USEFUL_COUNT


def flops_count_line(cfg: E2EConfig, results: Sequence[E2EResult] = ()) -> str:
    """Which attention pairs the report's FLOPs count."""
    count = report_flops_count(cfg, results)
    if "window" in count:
        return (f"FLOPs: {count}: the training loop's count, the pairs inside the window on "
                f"the windowed layers (megatron.shapes.training_flops).")
    if cfg.docs is None:
        return ("FLOPs: dense causal (S^2/2 attention pairs per sequence, "
                "megatron.shapes.training_flops).")
    return (f"FLOPs: useful (documents): packed documents of --docs {cfg.docs}, the attention "
            f"pairs counted are the sum of n^2/2 over the documents of the sequences each "
            f"measured iteration trained (megatron.shapes.training_flops), so MFU is of useful "
            f"work.")


def results_markdown(meta: dict, cfg: E2EConfig, results: List[E2EResult],
                     longest: Optional[Dict[str, Optional[int]]] = None) -> str:
    s = cfg.shape
    title = (f"End to end, {cfg.model} ({s.num_layers} layers, hidden {s.hidden_size}, "
             f"{s.num_attention_heads} heads, {s.num_query_groups} KV groups, FFN "
             f"{s.ffn_hidden_size}, vocab {s.vocab_size}), {cfg.nproc_per_node} processes, "
             f"mean of iterations {cfg.warmup + 1}..{cfg.iters}; MFU against "
             f"{_peaks(results)} TFLOP/s\n\n")
    title += flops_count_line(cfg, results) + "\n\n"
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
    if cfg.docs is not None:
        headers += ["docs/iter", "FLOPs", "attention"]
        for row, r in zip(rows, results):
            row += [report.fmt(r.documents_per_iteration, 0), r.flops_count,
                    r.attention_path or ("USP documents" if r.stack == "megatron-usp" else "")]
    rounds = cfg.rounds > 1
    if rounds:
        _insert_round_column(headers, rows, [r.round for r in results])
    text = title + report.metadata_markdown(meta) + "\n" + report.markdown_table(headers, rows)
    gemms = [r for r in results if r.ceiling_gemm_ms is not None]
    if gemms:
        text += ("\nThe ceiling's GEMMs, timed alone / in the profiled iteration after the "
                 "measured ones (the share counts the lower): " + "; ".join(
                     f"{seq_label(r.seq_len)} {r.ceiling_gemm_ms:.1f} / "
                     f"{report.fmt(r.step_gemm_ms)} ms" for r in gemms) + "\n")
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
