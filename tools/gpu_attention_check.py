"""USP attention numerics on GPUs: bf16 USP vs one-GPU fp32, within 2x the kernel's own error.

For every case (layout U x R over the launched ranks, sequence length S, query / KV heads):

1. every rank draws the same full-sequence q, k, v, dout (fp32, rounded to the test dtype so
   that all paths see identical inputs);
2. reference: whole-sequence attention on one GPU in fp32 (PyTorch SDPA, memory-efficient
   backend, autograd), its output also checked on a slice of query rows against float64;
3. kernel error: the local kernel USP uses (``megatron.usp.kernels``) on the whole sequence on
   one GPU in the test dtype, against the reference;
4. USP error: ``megatron.usp.attention.usp_attention`` forward+backward on this rank's tokens
   (order of ``megatron.usp.token_order``), against the reference's slice; statistics summed over
   ranks;
5. pass when, for out, dq, dk and dv, the USP relative L2 error is at most
   ``--max-ratio`` (2) times the kernel's own relative L2 error. Max-abs errors are reported.

It also times USP forward+backward and the single-GPU kernel (TFLOP/s per GPU, causal work
counted at half, backward = 2.5x forward) and, on CUDA, measures the memory one USP
forward+backward needs above the resident inputs (``usp_peak_mem_gib``). With several
``--overlap-chunks`` values (head chunks pipelined against the all-to-alls, see
``megatron.usp.attention``; ``auto`` is the default rule) every case is checked and timed
once per value, against one reference.

Usage (2 GPUs; layouts U2xR1 and U1xR2)::

    torchrun --nproc-per-node 2 tools/gpu_attention_check.py --out gpu_attention.json

Compare the overlap settings (unpipelined, auto, 4 chunks)::

    torchrun --nproc-per-node 2 tools/gpu_attention_check.py --overlap-chunks 1 auto 4 \\
        --seq-lens 32768 131072 --heads 32/32 --out overlap.json

CPU smoke run (gloo, bf16, small S)::

    torchrun --nproc-per-node 2 tools/gpu_attention_check.py --device cpu --seq-lens 256 \\
        --out /tmp/cpu.json

Imports only torch and the megatron.usp modules that do not need megatron-core.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.bench.cli import BenchConfigError, parse_overlap_chunks, parse_splits
from megatron.bench.flops import attention_fwd_bwd_flops
from megatron.usp import token_order
from megatron.usp.attention import resolve_overlap_chunks, usp_attention
from megatron.usp.kernels import get_kernel
from megatron.usp.parallel_dims import ParallelDims, group_containing

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FIELDS = ("out", "dq", "dk", "dv")


@dataclass
class CheckConfig:
    """What to check; ``layouts`` default to every U x R = world split."""

    seq_lens: Sequence[int] = (8192, 32768, 65536)
    heads: Sequence[Tuple[int, int]] = ((32, 32), (32, 8))   # (query heads, KV heads)
    head_dim: int = 128
    batch: int = 1
    dtype: str = "bf16"
    causal: bool = True
    backend: str = "auto"
    layouts: Optional[Sequence[Tuple[int, int]]] = None
    overlap_chunks: Sequence[Optional[int]] = (None,)     # None: auto
    max_ratio: float = 2.0
    timing_iters: int = 3
    seed: int = 1234


@dataclass
class CaseResult:
    ulysses: int
    ring: int
    seq_len: int
    heads: int
    kv_heads: int
    overlap_chunks: Optional[int] = None     # as requested; None: auto
    resolved_chunks: int = 1                 # what USP attention ran with
    errors: Dict[str, Dict[str, float]] = field(default_factory=dict)
    reference_out_err_vs_fp64: float = 0.0
    usp_ms: float = 0.0
    usp_tflops_per_gpu: float = 0.0
    usp_peak_mem_gib: float = 0.0            # CUDA: peak above the resident inputs, max rank
    kernel_ms: float = 0.0
    kernel_tflops: float = 0.0
    passed: bool = False


# --------------------------------------------------------------------------- groups
def layouts_for(world: int) -> List[Tuple[int, int]]:
    """Every (U, R) with U * R = world."""
    return [(u, world // u) for u in range(1, world + 1) if world % u == 0]


def make_groups(ulysses: int, ring: int, backend: Optional[str] = None):
    """(Ulysses group, Ring group) of this rank for TP = DP = 1; ``None`` for size 1.

    Collective: every rank must call it with the same arguments (it creates every group).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(world, ulysses=ulysses, ring=ring)
    mine = {}
    for axis, size in (("ulysses", ulysses), ("ring", ring)):
        groups = dims.rank_groups((axis,))
        handles = [dist.new_group(g, backend=backend) for g in groups]
        if size > 1:
            mine[axis] = handles[groups.index(group_containing(groups, rank))]
    return mine.get("ulysses"), mine.get("ring")


# --------------------------------------------------------------------------- tensors
def full_inputs(cfg: CheckConfig, seq_len: int, heads: int, kv_heads: int, device):
    """Identical full-sequence q, k, v, dout [S, b, h, d] on every rank (test-dtype values)."""
    gen = torch.Generator(device=device).manual_seed(cfg.seed + seq_len + kv_heads)
    dtype = DTYPES[cfg.dtype]

    def draw(h):
        x = torch.randn(seq_len, cfg.batch, h, cfg.head_dim, generator=gen, device=device)
        return x.to(dtype)

    return draw(heads), draw(kv_heads), draw(kv_heads), draw(heads)


def reference(q, k, v, dout, causal: bool):
    """fp32 whole-sequence attention and gradients, [S, b, h, d] in and out."""
    g = q.shape[2] // k.shape[2]
    leaves = [t.float().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v)]
    qf, kf, vf = leaves
    ke, ve = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    backend = SDPBackend.EFFICIENT_ATTENTION if q.is_cuda else SDPBackend.MATH
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(qf, ke, ve, is_causal=causal)
    out.backward(dout.float().permute(1, 2, 0, 3))
    back = lambda t: t.permute(2, 0, 1, 3).contiguous()  # noqa: E731  [b,h,S,d] -> [S,b,h,d]
    return {"out": back(out.detach()), "dq": back(qf.grad), "dk": back(kf.grad),
            "dv": back(vf.grad)}


def reference_self_check(q, k, v, ref_out, causal: bool, rows: int = 256) -> float:
    """Relative L2 error of the fp32 reference output on the last ``rows`` queries vs fp64."""
    seq, g = q.shape[0], q.shape[2] // k.shape[2]
    qs = q[seq - rows:].double().permute(1, 2, 0, 3)
    kd = k.double().permute(1, 2, 0, 3).repeat_interleave(g, 1)
    vd = v.double().permute(1, 2, 0, 3).repeat_interleave(g, 1)
    scores = qs @ kd.transpose(-1, -2) / math.sqrt(q.shape[3])
    if causal:
        qpos = torch.arange(seq - rows, seq, device=q.device).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(seq, device=q.device) > qpos, float("-inf"))
    exact = (torch.softmax(scores, -1) @ vd).permute(2, 0, 1, 3)
    got = ref_out[seq - rows:].double()
    return ((got - exact).norm() / exact.norm()).item()


def kernel_whole_sequence(kernel, q, k, v, dout, causal: bool):
    """The local kernel on the whole sequence on one device, [S, b, h, d] in and out."""
    scale = 1.0 / math.sqrt(q.shape[3])
    qh, kh, vh, doh = (t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v, dout))
    out, lse = kernel.forward(qh, kh, vh, causal, scale)
    dq, dk, dv = kernel.backward(doh, qh, kh, vh, out, lse, causal, scale)
    back = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731
    return {"out": back(out), "dq": back(dq), "dk": back(dk), "dv": back(dv)}


def usp_local(q, k, v, dout, groups, causal: bool, backend: str,
              overlap_chunks: Optional[int] = None):
    """USP forward+backward on this rank's [s, b, h, d] tokens."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = usp_attention(*leaves, ulysses_group=groups[0], ring_group=groups[1], causal=causal,
                        backend=backend, overlap_chunks=overlap_chunks)
    out.backward(dout)
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad,
            "dv": leaves[2].grad}


def error_sums(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """[sum (got-want)^2, sum want^2, max |got-want|] in float64."""
    diff = got.double() - want.double()
    return torch.stack([diff.square().sum(), want.double().square().sum(), diff.abs().max()])


def summarise(sums: torch.Tensor) -> Dict[str, float]:
    return {"rel_l2": math.sqrt(sums[0].item() / max(sums[1].item(), 1e-300)),
            "max_abs": sums[2].item()}


def all_reduce_sums(sums: torch.Tensor) -> torch.Tensor:
    """Sum the first two entries and max the third over every rank (default group)."""
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    total = sums[:2].to(on)
    peak = sums[2:].to(on)
    dist.all_reduce(total)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return torch.cat([total, peak]).cpu()


# --------------------------------------------------------------------------- timing
def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, iters: int, device, distributed: bool) -> float:
    fn()
    _sync(device)
    if distributed:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    if distributed:
        dist.barrier()
    return (time.perf_counter() - start) / iters * 1e3


def peak_memory_gib(fn, device) -> float:
    """CUDA memory one call of ``fn`` needs above what is allocated before it (GiB), the
    maximum over ranks; 0 on the CPU."""
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.tensor([(torch.cuda.max_memory_allocated(device) - base) / 2**30],
                        dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def fwd_bwd_flops(cfg: CheckConfig, seq_len: int, heads: int) -> float:
    """4*b*h*S^2*d forward (halved causal), times 3.5 for forward + backward."""
    return attention_fwd_bwd_flops(cfg.batch, heads, seq_len, cfg.head_dim, cfg.causal)


# --------------------------------------------------------------------------- one case
def run_case(cfg: CheckConfig, layout_ur, seq_len, heads, kv_heads, groups,
             device) -> List[CaseResult]:
    """Check and time one (layout, S, heads) case, once per ``cfg.overlap_chunks`` value."""
    ulysses, ring = layout_ur
    world, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, dout = full_inputs(cfg, seq_len, heads, kv_heads, device)
    ref = reference(q, k, v, dout, cfg.causal)
    ref_err = reference_self_check(q, k, v, ref["out"], cfg.causal)

    kernel = get_kernel(cfg.backend)
    whole = kernel_whole_sequence(kernel, q, k, v, dout, cfg.causal)
    kernel_err = {f: summarise(error_sums(whole[f], ref[f])) for f in FIELDS}
    del whole

    shard = lambda t: token_order.shard_for_cp_rank(t, 0, rank, world).contiguous()  # noqa: E731
    local = [shard(t) for t in (q, k, v, dout)]
    results = []
    for chunks in cfg.overlap_chunks:
        try:
            resolved = resolve_overlap_chunks(heads, kv_heads, ulysses, ring, chunks)
        except ValueError as exc:   # e.g. 4 chunks of an MQA case: skip, keep the run going
            if rank == 0:
                print(f"U{ulysses}xR{ring} S={seq_len} h={heads}/{kv_heads}: skipped: {exc}")
            continue
        res = CaseResult(ulysses, ring, seq_len, heads, kv_heads, overlap_chunks=chunks,
                         resolved_chunks=resolved, reference_out_err_vs_fp64=ref_err)
        mine = usp_local(*local, groups, cfg.causal, cfg.backend, chunks)
        res.passed = True
        for f in FIELDS:
            usp_err = summarise(all_reduce_sums(error_sums(mine[f], shard(ref[f]))))
            ratio = usp_err["rel_l2"] / max(kernel_err[f]["rel_l2"], 1e-30)
            res.errors[f] = {"usp_rel_l2": usp_err["rel_l2"],
                             "kernel_rel_l2": kernel_err[f]["rel_l2"], "ratio": ratio,
                             "usp_max_abs": usp_err["max_abs"],
                             "kernel_max_abs": kernel_err[f]["max_abs"]}
            res.passed &= ratio <= cfg.max_ratio
        del mine
        results.append(res)
    del ref

    if cfg.timing_iters > 0:
        flops = fwd_bwd_flops(cfg, seq_len, heads)
        kernel_ms = time_ms(lambda: kernel_whole_sequence(kernel, q, k, v, dout, cfg.causal),
                            cfg.timing_iters, device, distributed=False)
        for res in results:
            run = functools.partial(usp_local, *local, groups, cfg.causal, cfg.backend,
                                    res.overlap_chunks)
            res.usp_peak_mem_gib = peak_memory_gib(run, device)
            res.usp_ms = time_ms(run, cfg.timing_iters, device, distributed=True)
            res.usp_tflops_per_gpu = flops / (res.usp_ms / 1e3) / world / 1e12
            res.kernel_ms = kernel_ms
            res.kernel_tflops = flops / (kernel_ms / 1e3) / 1e12
    return results


def run_checks(cfg: CheckConfig, device, group_backend: Optional[str] = None) -> List[CaseResult]:
    """Every case of ``cfg`` on the initialised default process group; results on all ranks."""
    world = dist.get_world_size()
    results = []
    for layout_ur in cfg.layouts or layouts_for(world):
        if layout_ur[0] * layout_ur[1] != world:
            raise ValueError(f"layout U={layout_ur[0]} x R={layout_ur[1]} needs {world} ranks")
        groups = make_groups(*layout_ur, backend=group_backend)
        for seq_len in cfg.seq_lens:
            for heads, kv_heads in cfg.heads:
                results += run_case(cfg, layout_ur, seq_len, heads, kv_heads, groups, device)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return results


# --------------------------------------------------------------------------- command line
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="path of the JSON summary (written by rank 0)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 65536])
    p.add_argument("--heads", type=str, nargs="+", default=["32/32", "32/8"],
                   help="query/KV head pairs, e.g. 32/8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--layouts", type=str, nargs="*", default=None,
                   help="U x R splits such as 2x1 1x2 (default: every split of the world)")
    p.add_argument("--overlap-chunks", type=str, nargs="+", default=["auto"],
                   help="head chunks pipelined against the all-to-alls: 'auto' or a count; "
                   "several values are compared case by case (e.g. 1 auto 4)")
    p.add_argument("--max-ratio", type=float, default=2.0)
    p.add_argument("--timing-iters", type=int, default=3)
    args = p.parse_args(argv)
    for pair in args.heads:
        parts = pair.split("/")
        if len(parts) != 2 or not all(x.isdigit() for x in parts) or int(parts[0]) % int(parts[1]):
            p.error(f"--heads {pair!r}: expected Q/KV with KV dividing Q, e.g. 32/8")
    try:   # the benchmark tools' parsers; their errors name the flag and a valid value
        args.overlap_chunks = parse_overlap_chunks(",".join(args.overlap_chunks))
        args.layouts = parse_splits(",".join(args.layouts), "--layouts") if args.layouts else None
    except BenchConfigError as exc:
        p.error(str(exc))
    return args


def config_from_args(args: argparse.Namespace) -> CheckConfig:
    return CheckConfig(
        seq_lens=tuple(args.seq_lens),
        heads=tuple(tuple(int(x) for x in pair.split("/")) for pair in args.heads),
        head_dim=args.head_dim,
        batch=args.batch,
        dtype=args.dtype,
        causal=not args.no_causal,
        backend=args.attention_backend,
        layouts=tuple(args.layouts) if args.layouts else None,
        overlap_chunks=tuple(args.overlap_chunks),
        max_ratio=args.max_ratio,
        timing_iters=args.timing_iters,
    )


def summary(cfg: CheckConfig, results: List[CaseResult], device) -> dict:
    info = {"torch": torch.__version__, "device": str(device), "world_size": dist.get_world_size()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cudnn"] = torch.backends.cudnn.version()

    info["kernel"] = repr(get_kernel(cfg.backend))
    return {"config": asdict(cfg), "environment": info, "passed": all(r.passed for r in results),
            "cases": [asdict(r) for r in results]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args)
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        results = run_checks(cfg, device)
        report = summary(cfg, results, device)
        if dist.get_rank() == 0:
            with open(args.out, "w") as fh:
                json.dump(report, fh, indent=2)
            for r in results:
                worst = max(r.errors[f]["ratio"] for f in FIELDS)
                print(f"U{r.ulysses}xR{r.ring} S={r.seq_len} h={r.heads}/{r.kv_heads} "
                      f"G={r.resolved_chunks}{' (auto)' if r.overlap_chunks is None else ''}: "
                      f"worst USP/kernel error ratio {worst:.2f} "
                      f"{'PASS' if r.passed else 'FAIL'}; USP {r.usp_tflops_per_gpu:.0f} "
                      f"TFLOP/s/GPU ({r.usp_peak_mem_gib:.2f} GiB peak), kernel "
                      f"{r.kernel_tflops:.0f} TFLOP/s")
        return 0 if report["passed"] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
