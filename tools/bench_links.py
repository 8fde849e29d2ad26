#!/usr/bin/env python
"""Measure the links the planner models and write a calibration file.

    torchrun --nproc-per-node 8 tools/bench_links.py --output links.json
    torchrun --nnodes 2 --nproc-per-node 8 ... tools/bench_links.py --output links.json

Times, over each node's GPUs (the intra-node level) and, with several nodes, over one
GPU per node (the inter-node level):

* all-to-all of S bytes per rank: bus bandwidth ``S*(n-1)/n / t`` (NCCL-tests busbw);
* ring send/recv, every rank sending S bytes to the next and receiving from the
  previous at once: ``S / t`` per direction;
* all-gather of S bytes of output per rank: bus bandwidth ``S*(n-1)/n / t``;
* latency: a 4 KiB all-to-all.

Each time is the median over ``--iters`` runs after ``--warmup``, taking the slowest
rank of the group; across groups the lowest bandwidth is kept (the planner plans for
the slowest node). With CUDA it also times a bf16 GEMM and a device copy (kernel
rates, ``--no-kernels`` to skip). The output follows the calibration schema
``megatron-usp-calibration/1`` (docs/planner.md); merge it with the attention file of
``tools/bench_attention.py`` by passing both to ``tools/plan_parallel.py
--calibration``. Runs on any torch.distributed backend (nccl on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

SCHEMA = "megatron-usp-calibration/1"  # = megatron.planner.CALIBRATION_SCHEMA
MIB = 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_collective(fn: Callable[[], None], group, device: torch.device, iters: int,
                    warmup: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs, the slowest rank of ``group``."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times: List[float] = []
    for _ in range(iters):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _buffer(nbytes: int, n: int, device: torch.device) -> torch.Tensor:
    """A float32 buffer of about ``nbytes`` bytes, its length a multiple of ``n``."""
    numel = max(n, nbytes // 4 // n * n)
    return torch.ones(numel, dtype=torch.float32, device=device)


def bench_all_to_all(group, nbytes: int, device: torch.device, iters: int, warmup: int) -> Tuple[float, float]:
    """``(busbw GB/s, seconds)`` of an all-to-all with ``nbytes`` per rank."""
    n = dist.get_world_size(group)
    src = _buffer(nbytes, n, device)
    dst = torch.empty_like(src)
    t = time_collective(lambda: dist.all_to_all_single(dst, src, group=group), group, device,
                        iters, warmup)
    return src.numel() * 4 * (n - 1) / n / t / 1e9, t


def bench_ring_p2p(group, nbytes: int, device: torch.device, iters: int, warmup: int) -> Tuple[float, float]:
    """``(GB/s per direction, seconds)``: every rank sends ``nbytes`` to the next group
    rank while receiving as much from the previous one (batched, so NCCL does not
    serialise the ring into a deadlock)."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (me + 1) % n)
    prv = dist.get_global_rank(group, (me - 1) % n)
    src = _buffer(nbytes, 1, device)
    dst = torch.empty_like(src)

    def step() -> None:
        ops = [dist.P2POp(dist.isend, src, nxt, group), dist.P2POp(dist.irecv, dst, prv, group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    t = time_collective(step, group, device, iters, warmup)
    return src.numel() * 4 / t / 1e9, t


def bench_all_gather(group, nbytes: int, device: torch.device, iters: int, warmup: int) -> Tuple[float, float]:
    """``(busbw GB/s, seconds)`` of an all-gather producing ``nbytes`` per rank."""
    n = dist.get_world_size(group)
    out = _buffer(nbytes, n, device)
    shard = out[: out.numel() // n].clone()
    parts = list(out.chunk(n))

    # torch >= 2.13 renames all_gather_into_tensor to all_gather_single.
    fused = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def gather() -> None:
        try:
            fused(out, shard, group=group)
        except (RuntimeError, NotImplementedError):  # backends without the fused form
            dist.all_gather(parts, shard, group=group)

    t = time_collective(gather, group, device, iters, warmup)
    return out.numel() * 4 * (n - 1) / n / t / 1e9, t


def measure_links(group, sizes: List[int], device: torch.device, iters: int,
                  warmup: int) -> Dict[str, object]:
    """Figures of one link level, as the calibration file's ``links.<level>`` holds them;
    bandwidths from the largest size, every size kept under ``per_size``."""
    per_size = []
    for nbytes in sizes:
        a2a, _ = bench_all_to_all(group, nbytes, device, iters, warmup)
        p2p, _ = bench_ring_p2p(group, nbytes, device, iters, warmup)
        ag, _ = bench_all_gather(group, nbytes, device, iters, warmup)
        per_size.append({"bytes": nbytes, "all_to_all_gbps": a2a, "p2p_gbps": p2p,
                         "collective_gbps": ag})
    _, lat = bench_all_to_all(group, 4096, device, iters, warmup)
    big = per_size[-1]
    return {
        "all_to_all_gbps": big["all_to_all_gbps"],
        "p2p_gbps": big["p2p_gbps"],
        "collective_gbps": big["collective_gbps"],
        "latency_us": lat * 1e6,
        "group_size": dist.get_world_size(group),
        "per_size": per_size,
    }


def measure_kernels(device: torch.device, n: int = 8192, iters: int = 10) -> Dict[str, float]:
    """bf16 GEMM TFLOP/s (``2*n^3`` FLOPs), device-copy GB/s (read + write) and memory."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    t_mm = _median_time(lambda: a @ b, device, iters)
    src = torch.empty(2**28, dtype=torch.float32, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    t_cp = _median_time(lambda: dst.copy_(src), device, iters)
    out = {"matmul_tflops": 2 * n**3 / t_mm / 1e12, "hbm_gbps": 2 * src.numel() * 4 / t_cp / 1e9}
    if device.type == "cuda":
        out["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return out


def _median_time(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def node_groups() -> Tuple[object, Optional[object], int]:
    """``(intra-node group, inter-node group or None, number of nodes)`` for this rank.

    Nodes are told apart by host name. Every rank creates every group (new_group is
    collective), in the same order.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    hosts: List[str] = [""] * world
    dist.all_gather_object(hosts, socket.gethostname())
    names = sorted(set(hosts), key=hosts.index)
    by_node = [[r for r in range(world) if hosts[r] == h] for h in names]
    intra = None
    for ranks in by_node:
        g = dist.new_group(ranks)
        if rank in ranks:
            intra = g
    inter = None
    if len(by_node) > 1 and len({len(r) for r in by_node}) == 1:
        for i in range(len(by_node[0])):
            ranks = [node[i] for node in by_node]
            g = dist.new_group(ranks)
            if rank in ranks:
                inter = g
    return intra, inter, len(by_node)


def _worst_over_world(level: Dict[str, object], device: torch.device) -> Dict[str, object]:
    """Lowest bandwidths and highest latency over all groups of a level."""
    keys = ("all_to_all_gbps", "p2p_gbps", "collective_gbps")
    bw = torch.tensor([float(level[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(bw, op=dist.ReduceOp.MIN)
    lat = torch.tensor([float(level["latency_us"])], dtype=torch.float64, device=device)
    dist.all_reduce(lat, op=dist.ReduceOp.MAX)
    out = dict(level)
    out.update({k: float(v) for k, v in zip(keys, bw.tolist())})
    out["latency_us"] = float(lat.item())
    return out


def run_benchmark(sizes_mib: List[float], iters: int, warmup: int, kernels: bool,
                  device: Optional[torch.device] = None) -> Optional[Dict[str, object]]:
    """Measure every level this job spans; returns the calibration document on global
    rank 0 (None elsewhere). ``torch.distributed`` must be initialised."""
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
    sizes = [int(s * MIB) for s in sizes_mib]
    intra, inter, nodes = node_groups()
    links: Dict[str, object] = {}
    per_size: Dict[str, object] = {}
    for name, group in (("intra_node", intra), ("inter_node", inter)):
        if group is None or dist.get_world_size(group) < 2:
            continue
        level = _worst_over_world(measure_links(group, sizes, device, iters, warmup), device)
        per_size[name] = level.pop("per_size")
        links[name] = level
    if not links and inter is None and nodes > 1:
        raise RuntimeError("nodes have different GPU counts; cannot form inter-node groups")
    doc: Dict[str, object] = {
        "schema": SCHEMA,
        "source": (f"measured: tools/bench_links.py, backend {dist.get_backend()}, "
                   f"{dist.get_world_size()} ranks on {nodes} node(s), "
                   f"{datetime.date.today().isoformat()}"),
        "links": links,
        "notes": {"per_size": per_size, "iters": iters, "warmup": warmup},
    }
    if device.type == "cuda":
        doc["device_name"] = torch.cuda.get_device_name(device)
        if kernels:
            doc.update(measure_kernels(device))
    return doc if dist.get_rank() == 0 else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="calibration JSON to write (rank 0)")
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[64, 256, 512],
                   help="message sizes per rank, MiB; bandwidth is taken from the last")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-kernels", action="store_true", help="skip the GEMM / copy timings")
    p.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend)
    try:
        doc = run_benchmark(args.sizes_mib, args.iters, args.warmup, not args.no_kernels)
        if doc is not None:
            with open(args.output, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=2)
            print(json.dumps({k: v for k, v in doc.items() if k != "notes"}, indent=2))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
