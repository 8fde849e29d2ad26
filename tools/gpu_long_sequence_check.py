"""The long-sequence training paths on GPUs: losses of short runs, for tests/gpu.

Runs ``pretrain(args)`` for each case below on a small Llama-style model (2 layers, hidden
512, 8 query / 2 KV heads of 64, SwiGLU 1024, RoPE, mock data, 4096 tokens, 2 micro-batches
per rank and step, bf16, ZeRO-1, full recompute, 6 steps), in one process (NCCL, world 1), or
under ``torchrun`` on several GPUs (data parallel), and writes (rank 0)
``{case: {"losses": [...], "error": null | traceback, "extra": {...}}}`` as JSON. The cases:

* ``full``: the baseline (megatron-core's full recompute);
* ``keep_offload_tiled``: + ``--recompute-keep-core-attn --recompute-cpu-offload layer_input
  core_attn --mlp-tile-tokens 1024`` (pinned host buffers, side streams, 4 MLP tiles);
* ``optimizer_offload``: + ``--optimizer-cpu-offload --use-precision-aware-optimizer
  --overlap-cpu-optimizer-d2h-h2d`` (megatron-core's HybridDeviceOptimizer, all state on the
  CPU), saving a checkpoint at step 3; ``optimizer_offload_resumed``: the same run resumed from
  that checkpoint to step 6; ``optimizer_half_offload`` / ``..._resumed``: the same with half
  of the parameters' state on the GPU (``--optimizer-offload-fraction 0.5``: a CPU and a GPU
  sub-optimizer);
* ``fsdp``: ``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params``
  (refused at start-up on one GPU: nothing to shard, and megatron-core 0.16.1 double-counts
  the gradients over one rank; see docs/long_sequences.md).

``extra`` records each step's learning rate and grad norm, where the optimizer state lives
(``optimizer_state_devices``) and, for the offload case, the offloader's counters. The
assertions are in ``tests/gpu/test_long_sequence_gpu.py``::

    python tools/gpu_long_sequence_check.py --out /tmp/long_seq_gpu.json [--cases full fsdp]
    torchrun --nproc-per-node 2 tools/gpu_long_sequence_check.py --out J --cases full fsdp \
        --ckpt-dir /shared/tmp/dir
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

from megatron.training.cli.arguments import parse_args
from megatron.training.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

STEPS = 6
BASE = [
    "--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "1024",
    "--seq-length", "4096", "--max-position-embeddings", "4096", "--swiglu",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--mock-data", "--vocab-size", "2047",
    "--fused-linear-cross-entropy", "--micro-batch-size", "1",
    "--train-iters", str(STEPS), "--lr", "1e-3", "--lr-warmup-iters", "1", "--seed", "1234",
    "--eval-iters", "0", "--num-workers", "0", "--log-interval", "1", "--bf16",
    "--use-distributed-optimizer", "--recompute-granularity", "full",
    "--recompute-method", "uniform", "--recompute-num-layers", "1",
]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
OPT_OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer",
               "--overlap-cpu-optimizer-d2h-h2d"]
OPT_HALF = OPT_OFFLOAD + ["--optimizer-offload-fraction", "0.5"]


def cases(ckpt_dir: str):
    half_dir = os.path.join(ckpt_dir, "half")
    return {
        "full": [],
        "keep_offload_tiled": ["--recompute-keep-core-attn", "--recompute-cpu-offload",
                               "layer_input", "core_attn", "--mlp-tile-tokens", "1024"],
        "optimizer_offload": OPT_OFFLOAD + ["--save", ckpt_dir, "--save-interval", "3",
                                            "--exit-interval", "3"],
        "optimizer_offload_resumed": OPT_OFFLOAD + ["--load", ckpt_dir, "--save", ckpt_dir],
        "optimizer_half_offload": OPT_HALF + ["--save", half_dir, "--save-interval", "3",
                                              "--exit-interval", "3"],
        "optimizer_half_offload_resumed": OPT_HALF + ["--load", half_dir, "--save", half_dir],
        "fsdp": FSDP,
    }



def _state_devices(optimizer) -> list:
    """Devices of the optimizer's state tensors (sorted, unique)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    found = set()
    for state in getattr(inner, "state", {}).values():
        for v in state.values():
            if hasattr(v, "device"):
                found.add(v.device.type)
    return sorted(found)


def _records(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_case(name: str, flags, extra: dict, world: int = 1) -> list:
    from megatron.training import loop as training  # torch-free --help

    seen = {}
    build = training.build_optimizer

    def recording_build(args, model):     # a wrapper in this tool only, to look inside
        opt = build(args, model)
        seen["optimizer"], seen["model"] = opt, model
        return opt

    training.build_optimizer = recording_build
    metrics = os.path.join(tempfile.mkdtemp(prefix="long_seq_metrics_"), f"{name}.jsonl")
    try:
        # two micro-batches per rank and step at any world size
        result = training.pretrain(parse_args(BASE + ["--global-batch-size", str(2 * world)]
                                              + list(flags) + ["--metrics-file", metrics]))
    finally:
        training.build_optimizer = build
    # Per step, the learning rate and grad norm the run logged: the cases share one schedule,
    # so their lr must agree; the grad norms say where a case's losses leave the baseline's.
    steps = [r for r in _records(metrics) if r.get("kind") == "train"]
    extra["lr"] = [r.get("lr") for r in steps]
    extra["grad_norm"] = [r.get("grad_norm") for r in steps]
    if "optimizer" in seen:
        extra["optimizer_state_devices"] = _state_devices(seen["optimizer"])
        from megatron.training.model.build import unwrap  # torch-free --help

        off = getattr(unwrap(seen["model"][0]), "activation_offloader", None)
        if off is not None:
            extra["offload_stats"] = vars(off.stats)
            bufs = [buf for free in off.pool._free.values() for buf, _ in free]
            extra["host_buffers"] = len(bufs)
            extra["host_pinned"] = bool(bufs) and all(buf.is_pinned() for buf in bufs)
    return [result.losses[i] for i in sorted(result.losses)]


def main(argv=None) -> int:
    import torch  # torch-free --help
    import torch.distributed as dist  # torch-free --help

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="*", default=None)
    p.add_argument("--ckpt-dir", default=None,
                   help="checkpoint directory of the optimizer_offload cases (every rank's "
                        "same path under torchrun; default: a fresh temporary one)")
    ns = p.parse_args(argv)
    chosen = cases(ns.ckpt_dir or tempfile.mkdtemp(prefix="long_seq_ckpt_"))
    unknown = sorted(set(ns.cases or ()) - set(chosen))
    if unknown:
        p.error(f"--cases: unknown {unknown}; choose from {sorted(chosen)}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and ns.ckpt_dir is None:
        p.error("--ckpt-dir: under torchrun every rank needs the same checkpoint directory")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        dist.init_process_group("nccl")          # torchrun's environment
    else:                                        # a port of its own: no inherited MASTER_PORT
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    out = {}
    for name, flags in chosen.items():
        if ns.cases and name not in ns.cases:
            continue
        extra, losses, error = {}, None, None
        try:
            losses = run_case(name, flags, extra, world)
        except Exception:  # noqa: BLE001 - each case reports its own failure
            error = traceback.format_exc()
        out[name] = {"losses": losses, "error": error, "extra": extra}
        if dist.get_rank() == 0:
            print(f"[gpu_long_sequence_check] {name}: {'error' if error else losses}",
                  flush=True)
            with open(ns.out, "w") as f:
                json.dump(out, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
