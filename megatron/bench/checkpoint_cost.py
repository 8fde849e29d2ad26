"""What checkpoint checksums cost at save and at load: ``tools/bench_checkpoint.py``.

One process (one GPU, or the CPU) builds a benchmark model (:data:`megatron.bench.models.MODELS`,
default the Llama-style 0.85B), trains one step so the distributed optimizer holds its Adam
state, then saves the same state ``--saves`` times with checksums and as often without,
alternately (after one warm-up save, which starts the writer's Manager and caches the
shard distribution), timing each whole
:func:`~megatron.training.checkpoint.save_load.save_checkpoint` (write, fsync, publish). It also
times the load-time verification of one checkpoint. The JSON::

    {"model": "llama-0.85b", "device": "...", "checkpoint_bytes": ...,
     "save_s": {"with_checksums": [...], "without_checksums": [...]},
     "median_s": {...}, "overhead": 0.03, "checksum_s": 0.4, "verify_s": 1.2,
     "verify_gbps": ...}

``overhead`` = median with / median without - 1 (the issue's budget: <= 0.05 at 0.85B).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from functools import partial
from typing import Dict, List, Optional

from megatron.bench.models import MODELS, model_flags
from megatron.training.checkpoint.faults import directory_bytes
from megatron.training.cli.arguments import parse_args


def _pretrain_args(model: str, seq_length: int, save_dir: str, device: str) -> List[str]:
    flags = model_flags(MODELS[model]) + [
        "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--eval-iters", "0",
        "--mock-data", "--num-workers", "0", "--use-distributed-optimizer",
        "--save", save_dir, "--device", device]
    if device == "cuda":
        flags.append("--bf16")
    return flags


def measure(model: str = "llama-0.85b", seq_length: int = 4096, saves: int = 2,
            save_dir: str = "/tmp/checkpoint_cost", device: str = "auto") -> Dict:
    """Run the measurement of the module docstring in this process; returns the JSON dict."""
    import torch  # torch-free --help
    import torch.distributed as dist  # torch-free --help

    from megatron.training.checkpoint.save_load import (
        TrainState,
        save_checkpoint,
        verify_checksums_on_all_ranks,
    )  # torch-free --help
    from megatron.training.data import batch as batch_mod  # torch-free --help
    from megatron.training.initialize import initialize, shutdown  # torch-free --help
    from megatron.training.loop import (
        _wire_grad_sync,
        batch_context,
        build_data_iterators,
        build_optimizer,
        build_scheduler,
        train_step,
    )  # torch-free --help
    from megatron.training.model.build import build_model  # torch-free --help

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    shutil.rmtree(save_dir, ignore_errors=True)
    args = parse_args(_pretrain_args(model, seq_length, save_dir, device))
    rt = initialize(args)
    config = rt.config
    try:
        model_chunks = build_model(config, rt.groups)
        _wire_grad_sync(model_chunks)
        optimizer = build_optimizer(config, model_chunks)
        scheduler = build_scheduler(config, optimizer)
        state = TrainState()
        train_iter, _ = build_data_iterators(config, rt, state)
        step_fn = partial(batch_mod.forward_step, batch_context(rt, config))
        train_step(config, rt, step_fn, train_iter, model_chunks, optimizer, 1)
        state.iteration = 1

        path = os.path.join(save_dir, "iter_0000001")

        def save(with_checksums: bool) -> float:
            if rt.device.type == "cuda":
                torch.cuda.synchronize()
            if dist.get_rank() == 0:  # the previous save's files go outside the timing
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            t0 = time.perf_counter()
            save_checkpoint(config, state, model_chunks, optimizer, scheduler, rt.groups,
                            rt.device, with_checksums=with_checksums)
            return time.perf_counter() - t0

        save(False)  # warm-up: starts the writer's Manager, caches the shard distribution
        times: Dict[str, List[float]] = {"with_checksums": [], "without_checksums": []}
        for _ in range(saves):  # the last save has checksums: it is the one verified
            for key, flag in (("without_checksums", False), ("with_checksums", True)):
                times[key].append(save(flag))
        size = directory_bytes(path)
        t0 = time.perf_counter()
        verify_checksums_on_all_ranks(save_dir, 1, path)
        verify_s = time.perf_counter() - t0
    finally:
        shutdown(rt)
        shutil.rmtree(save_dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": model, "seq_length": seq_length, "device": rt.device_name or device,
            "checkpoint_bytes": size, "save_s": times, "median_s": med,
            "overhead": med["with_checksums"] / med["without_checksums"] - 1,
            "checksum_s": med["with_checksums"] - med["without_checksums"],
            "verify_s": verify_s, "verify_gbps": size / verify_s / 1e9}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-0.85b", choices=sorted(MODELS))
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--saves", type=int, default=2, help="saves of each kind (default 2)")
    p.add_argument("--save-dir", default="/tmp/checkpoint_cost")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--out", default=None, help="write the JSON here too")
    a = p.parse_args(argv)
    result = measure(a.model, a.seq_length, a.saves, a.save_dir, a.device)
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0
