#!/usr/bin/env python
"""Measure the data loader against what long-context training consumes.

    python tools/bench_dataloader.py --seq-length 131072 --ulysses-degree 2 --out bench.json

Builds the GPT dataset (the default corpus unless --data-path or --mock-data), runs one
rank's iterator (full micro-batches, then its CP shard, as training does) and reports
samples/s and tokens/s after a warm-up batch. It then prints what training consumes:
every rank loads each sample of its DP group (CP ranks shard the same full sample), so a
rank must load ``GPUs x tokens/s/GPU / seq_length / DP`` samples/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

from megatron.training.data.corpus import ensure_default_corpus


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-length", type=int, default=131072)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-samples", type=int, default=64, help="micro-batch samples to time")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers")
    p.add_argument("--ulysses-degree", type=int, default=1)
    p.add_argument("--ring-degree", type=int, default=2)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--eod-mask-loss", action="store_true")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--mock-data", action="store_true")
    src.add_argument("--data-path", nargs="+", default=None)
    p.add_argument("--tokenizer-model", default=None, help="with --data-path (SentencePiece)")
    p.add_argument("--vocab-size", type=int, default=32000, help="with --mock-data")
    p.add_argument("--cache-dir", default=None, help="default-corpus cache folder")
    p.add_argument("--data-cache-path", default=None, help="sample-index cache folder")
    p.add_argument("--gpus", type=int, default=2, help="GPUs of the training run compared with")
    p.add_argument("--tokens-per-gpu-s", type=float, default=25000.0,
                   help="training throughput per GPU at this length (order of magnitude)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def _source(args):
    """(DataConfig data fields, tokenizer, description) for the chosen data source."""
    from megatron.training.data.tokenizer import build_tokenizer  # torch-free --help

    if args.mock_data:
        return None, build_tokenizer("NullTokenizer", None, args.vocab_size), "mock data"
    if args.data_path:
        if not args.tokenizer_model:
            raise SystemExit("error: --data-path needs --tokenizer-model")
        tok = build_tokenizer("SentencePieceTokenizer", args.tokenizer_model)
        return args.data_path, tok, " ".join(args.data_path)
    c = ensure_default_corpus(args.cache_dir)
    tok = build_tokenizer("SentencePieceTokenizer", c.tokenizer_model)
    return [c.data_prefix], tok, f"default corpus ({c.num_tokens} tokens)"


def run(args) -> dict:
    from megatron.training.data.batch import shard_batch_for_cp  # torch-free --help
    from megatron.training.data.config import DataConfig, validate_data_config  # torch-free --help
    from megatron.training.data.loader import (  # torch-free --help
        build_data_iterator,
        build_gpt_datasets,
    )

    if args.data_cache_path is None:  # a fresh index cache, removed afterwards
        with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
            args.data_cache_path = tmp
            try:
                return run(args)
            finally:
                args.data_cache_path = None
    cp = args.ulysses_degree * args.ring_degree
    data_path, tokenizer, source = _source(args)
    cache = args.data_cache_path
    cfg = DataConfig(
        data_path=data_path, split="1,0,0", mock_data=args.mock_data,
        seq_length=args.seq_length, seed=1234, eod_mask_loss=args.eod_mask_loss,
        num_workers=args.num_workers, data_cache_path=cache,
        micro_batch_size=args.micro_batch_size,
    )
    validate_data_config(cfg, tokenizer, cp)
    total = (args.num_samples + 1) * args.micro_batch_size * args.data_parallel_size
    t0 = time.perf_counter()
    train, _, _ = build_gpt_datasets(cfg, tokenizer, [total, None, None])
    build_s = time.perf_counter() - t0

    it = build_data_iterator(train, args.micro_batch_size, 0, args.data_parallel_size, 0,
                             args.num_workers)
    t0 = time.perf_counter()
    shard_batch_for_cp(next(it), cp - 1, cp)  # warm-up: workers start, first pages read
    first_s = time.perf_counter() - t0
    n_batches = max(1, args.num_samples // args.micro_batch_size)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        batch = shard_batch_for_cp(next(it), cp - 1, cp)
    secs = time.perf_counter() - t0
    assert batch["tokens"].shape == (args.micro_batch_size, args.seq_length // cp)
    samples = n_batches * args.micro_batch_size
    sps = samples / secs
    need_total = args.gpus * args.tokens_per_gpu_s / args.seq_length
    need_rank = need_total / args.data_parallel_size
    return {
        "source": source,
        "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size,
        "num_workers": args.num_workers,
        "cp_size": cp,
        "data_parallel_size": args.data_parallel_size,
        "dataset_build_s": round(build_s, 3),
        "first_batch_s": round(first_s, 3),
        "samples_timed": samples,
        "loader_samples_per_s": sps,
        "loader_tokens_per_s": sps * args.seq_length,
        "training_gpus": args.gpus,
        "training_tokens_per_gpu_s": args.tokens_per_gpu_s,
        "training_samples_per_s_total": need_total,
        "training_samples_per_s_per_rank": need_rank,
        "headroom": sps / need_rank,
    }


def report(r: dict) -> str:
    return "\n".join([
        f"data: {r['source']}; seq {r['seq_length']}, micro-batch {r['micro_batch_size']}, "
        f"{r['num_workers']} workers, CP shard 1 of {r['cp_size']}",
        f"dataset build {r['dataset_build_s']:.2f}s, first batch {r['first_batch_s']:.2f}s",
        f"loader: {r['loader_samples_per_s']:.1f} samples/s = "
        f"{r['loader_tokens_per_s']:,.0f} tokens/s per rank ({r['samples_timed']} samples)",
        f"training at {r['seq_length']} tokens on {r['training_gpus']} H200 consumes "
        f"~{r['training_samples_per_s_total']:.2f} samples/s: {r['training_gpus']} GPUs x "
        f"{r['training_tokens_per_gpu_s']:,.0f} tokens/s/GPU / {r['seq_length']:,} tokens/sample"
        f" = {r['training_samples_per_s_total']:.3f} samples/s; with DP="
        f"{r['data_parallel_size']} each rank loads {r['training_samples_per_s_per_rank']:.3f}"
        f" samples/s",
        f"headroom: the loader is {r['headroom']:,.0f}x faster than training needs",
    ])


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    args = parse_args(argv)
    r = run(args)
    print(report(r))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
