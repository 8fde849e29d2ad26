"""``tools/bench_e2e.py``: its flags, their checks, and the run from flags to files."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from megatron.bench import report
from megatron.bench.cli import BenchConfigError, parse_seq_len, parse_seq_lens, parse_splits
from megatron.bench.e2e.ceilings import ceiling_enabled, run_ceiling
from megatron.bench.e2e.config import (
    DENSE_COUNT,
    PROGRESS_PREFIX,
    RECOMPUTE_CHOICES,
    REPO_ROOT,
    USEFUL_COUNT,
    E2EConfig,
    E2EResult,
    RunSpec,
    global_batch_size,
)
from megatron.bench.e2e.documents import check_extra_args, parse_docs, prepare_documents
from megatron.bench.e2e.output import (
    COLD_FIRST_STEP,
    pooled_line,
    progress_line,
    ratio_line,
    report_flops_count,
    results_markdown,
)
from megatron.bench.e2e.pairing import peer_ratios, pooled_ratios
from megatron.bench.e2e.peers import parse_peers
from megatron.bench.e2e.sweep import find_max_seq, throughput_sweep
from megatron.bench.models import MODELS
from megatron.shapes.flops import FORMULA
from megatron.usp.kernels import BACKEND_NAMES


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
    p.add_argument("--extra-args", action="append", default=[],
                   help="more pretrain_gpt.py flags as one string, e.g. "
                        "--extra-args='--num-workers 0'; given more than once, the flags of "
                        "every one are passed, in order")
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
    p.add_argument("--docs", default=None,
                   help="train on packed documents (--reset-attention-mask "
                        "--reset-position-ids --eod-mask-loss) of one mix: mock "
                        "(megatron-core's --mock-data documents), uniform:4k, fixed:N, "
                        "lognormal or corpus (written under --log-dir); TFLOP/s and MFU then "
                        "count the trained documents' attention pairs")
    return p


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
        pretrain_script=ns.pretrain_script,
        extra_args=[a for text in ns.extra_args for a in shlex.split(text)],
        seed=ns.seed, out=ns.out, markdown=ns.markdown, peers=parse_peers(ns.peers),
        ceiling=ns.ceiling, rounds=ns.rounds, docs=parse_docs(ns.docs))


def validate_config(cfg: E2EConfig) -> None:
    """Flag checks before anything is launched."""
    if not Path(cfg.pretrain_script).exists():
        raise BenchConfigError(f"--pretrain-script {cfg.pretrain_script} does not exist; "
                               f"point it at the repository's pretrain_gpt.py")
    layers = MODELS[cfg.model].shape.num_layers
    if cfg.num_layers is not None and not 1 <= cfg.num_layers <= layers:
        raise BenchConfigError(f"--num-layers {cfg.num_layers}: a slice of {cfg.model} has 1 to "
                               f"{layers} layers")
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
    check_extra_args(cfg.docs, cfg.extra_args)
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
               "config": dict(asdict(cfg), shape=cfg.bench_model.record(),
                              splits=[f"{u}x{r}" for u, r in cfg.splits]),
               "flops_formula": FORMULA,
               "flops_count": DENSE_COUNT if cfg.docs is None else USEFUL_COUNT,
               "results": []}
    if cfg.docs is not None:
        payload["documents"] = prepare_documents(cfg.docs, cfg.log_dir, eod_id(cfg),
                                                 documents_tokens(cfg), cfg.seed)
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


def eod_id(cfg: E2EConfig) -> int:
    """The end-of-document id of the runs: the NullTokenizer's, one past the ``--vocab-size``
    that :func:`megatron.bench.models.model_flags` passes (the model's last vocabulary row)."""
    return cfg.shape.vocab_size - 1


def documents_tokens(cfg: E2EConfig) -> int:
    """Tokens the written documents must hold so that no run goes round them twice (its
    iterations and a profiled one after them: :func:`megatron.bench.e2e.ceilings.profiles_step`)."""
    longest = cfg.max_seq if cfg.find_max_seq else max(cfg.seq_lens)
    spec = RunSpec(longest, 1, 1, "none", cfg.iters, profile_step=True)
    batch = max(global_batch_size(cfg, RunSpec(longest, u, r, "none", cfg.iters))
                for u, r in cfg.splits)
    return spec.train_iters * batch * longest + longest + 1


def _device(cfg: E2EConfig):
    return torch.device("cuda", 0) if cfg.use_cuda() else torch.device("cpu")


def _write(cfg: E2EConfig, payload: dict, meta: dict, results: List[E2EResult],
           longest: Optional[Dict[str, Optional[int]]]) -> None:
    payload["flops_count"] = report_flops_count(cfg, results)
    if cfg.out:
        report.write_json(cfg.out, payload)
    if cfg.markdown:
        report.write_text(cfg.markdown, results_markdown(meta, cfg, results, longest))
