"""Summarise a Chrome trace written by ``--profile`` / ``--profile-dir`` (torch.profiler).

What a per-phase profile needs, read from the device events of one rank's trace:

* per stream: kernel count and busy time (the compute stream and NCCL's stream apart);
* the compute stream (the busiest one): total idle gaps longer than ``min_gap_us`` and the
  largest ones with their neighbours and position (exposed communication and CPU-bound
  launches show up here);
* device time by category: cuDNN attention forward / backward, NCCL, GEMMs, reorder copies
  (PyTorch's strided-copy kernel), other kernels;
* device time by caller, for the kernels outside GEMMs, attention and NCCL: each kernel is
  matched to its launch on the host (the ``correlation`` id the profiler gives both) and
  named after the innermost host event around that launch that is not a bare ``aten::`` op
  (an autograd function's forward or backward, the optimizer's step, a ``record_function``
  range), so element-wise passes are told apart by the code that runs them.

``python -m megatron.bench.trace_summary TRACE.json [...]`` prints it; :func:`summarize`
returns it as a dict (used by tests and by the docs' tables).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Dict, List, Optional, Sequence

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def category(name: str) -> str:
    """Coarse class of a device kernel by its name."""
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if "bprop" in low or "attention_backward" in low or "flash_bwd" in low:
        return "attention backward"
    if "fprop" in low or "attention_forward" in low or "flash_fwd" in low:
        return "attention forward"
    if "gemm" in low or "nvjet" in low or "cutlass" in low or "sm90_xmma" in low:
        return "gemm"
    if name.startswith("void at::native::elementwise_kernel") or "memcpy" in low:
        return "copy / strided elementwise"
    return "other"


HOST_CATS = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
_ENGINE = "autograd::engine::evaluate_function: "
UNATTRIBUTED = ("gemm", "attention forward", "attention backward", "nccl")


def _caller(names: Sequence[str]) -> str:
    """The label of a launch whose enclosing host events are ``names`` (outermost first):
    the innermost that is not an ``aten::`` op or a runtime call, else the outermost
    ``aten::`` op."""
    for name in reversed(names):
        if not name.startswith(("aten::", "cu")):     # cuda*/cu* runtime and driver calls
            return name[len(_ENGINE):] if name.startswith(_ENGINE) else name
    ops = [n for n in names if n.startswith("aten::")]
    return ops[0] if ops else "(no host event)"


def launch_callers(trace: dict) -> Dict[int, str]:
    """correlation id -> the caller label (:func:`_caller`) of the host launch carrying it."""
    host = [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in HOST_CATS]
    host.sort(key=lambda e: (str(e.get("pid")), str(e.get("tid")), e["ts"], -e["dur"]))
    callers: Dict[int, str] = {}
    stack: List[dict] = []
    for e in host:
        while stack and ((stack[-1].get("pid"), stack[-1].get("tid")) != (e.get("pid"), e.get("tid"))
                         or stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]):
            stack.pop()
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and corr is not None:
            callers[corr] = _caller([s["name"] for s in stack])
        stack.append(e)
    return callers


def by_caller(trace: dict, events: Sequence[dict]) -> Dict[str, Dict]:
    """Device time (ms) and kernel count per caller of the ``events`` outside
    :data:`UNATTRIBUTED`'s categories, largest first; ``by_kernel`` splits each caller's
    time by kernel name (the first 90 characters), largest first."""
    callers = launch_callers(trace)
    time: Counter = Counter()
    count: Counter = Counter()
    kernels: Dict[str, Counter] = {}
    kernel_count: Dict[str, Counter] = {}
    for e in events:
        if category(e["name"]) in UNATTRIBUTED:
            continue
        name = callers.get((e.get("args") or {}).get("correlation"), "(no host event)")
        time[name] += e["dur"]
        count[name] += 1
        kernels.setdefault(name, Counter())[e["name"][:90]] += e["dur"]
        kernel_count.setdefault(name, Counter())[e["name"][:90]] += 1
    return {name: {"ms": us / 1e3, "kernels": count[name],
                   "by_kernel": {k: {"ms": kus / 1e3, "kernels": kernel_count[name][k]}
                                 for k, kus in kernels[name].most_common()}}
            for name, us in time.most_common()}


def summarize(trace: dict, min_gap_us: float = 50.0, top: int = 8) -> Dict:
    """Per-stream busy time, compute-stream gaps and time by category (module docstring)."""
    events = [e for e in trace.get("traceEvents", [])
              if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    if not events:
        return {"span_ms": 0.0, "streams": {}, "gaps_ms": 0.0, "largest_gaps": [],
                "by_category_ms": {}, "by_caller": {}}
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    streams: Dict[str, List[dict]] = {}
    for e in events:
        streams.setdefault(str(e.get("tid")), []).append(e)
    busy = {tid: sum(e["dur"] for e in es) for tid, es in streams.items()}
    compute_tid = max(busy, key=busy.get)
    compute = sorted(streams[compute_tid], key=lambda e: e["ts"])
    gaps = []
    for a, b in zip(compute, compute[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap > min_gap_us:
            gaps.append({"gap_us": gap, "at_ms": (a["ts"] + a["dur"] - t0) / 1e3,
                         "after": a["name"][:60], "before": b["name"][:60]})
    gaps.sort(key=lambda g: -g["gap_us"])
    by_cat: Counter = Counter()
    for e in events:
        by_cat[category(e["name"])] += e["dur"]
    return {
        "span_ms": (t1 - t0) / 1e3,
        "compute_stream": compute_tid,
        "streams": {tid: {"kernels": len(streams[tid]), "busy_ms": busy[tid] / 1e3}
                    for tid in streams},
        "gaps_ms": sum(g["gap_us"] for g in gaps) / 1e3,
        "largest_gaps": gaps[:top],
        "by_category_ms": {k: v / 1e3 for k, v in by_cat.most_common()},
        "by_caller": by_caller(trace, events),
    }


def render(name: str, s: Dict, callers: int = 25, kernels: int = 0) -> str:
    """The summary as text; ``kernels`` > 0 lists that many kernels under each caller."""
    lines = [f"{name}: device span {s['span_ms']:.2f} ms"]
    for tid, st in s["streams"].items():
        mark = " (compute)" if tid == s.get("compute_stream") else ""
        lines.append(f"  stream {tid}{mark}: {st['kernels']} kernels, busy {st['busy_ms']:.2f} ms")
    lines.append(f"  compute-stream idle gaps: {s['gaps_ms']:.2f} ms")
    for g in s["largest_gaps"]:
        lines.append(f"    {g['gap_us']:.0f} us at {g['at_ms']:.2f} ms: {g['after']} -> "
                     f"{g['before']}")
    lines.append("  device time by category:")
    for k, v in s["by_category_ms"].items():
        lines.append(f"    {k:<28} {v:9.2f} ms")
    if s.get("by_caller"):
        lines.append("  device time by caller (kernels outside GEMMs, attention and NCCL):")
        for name, c in list(s["by_caller"].items())[:callers]:
            lines.append(f"    {name[:56]:<56} {c['ms']:9.2f} ms  {c['kernels']:5d} kernels")
            for kname, k in list(c.get("by_kernel", {}).items())[:kernels]:
                lines.append(f"        {kname[:52]:<52} {k['ms']:9.2f} ms  {k['kernels']:5d}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="trace_summary",
                                description="Summarise torch.profiler Chrome traces.")
    p.add_argument("traces", nargs="+")
    p.add_argument("--min-gap-us", type=float, default=50.0)
    p.add_argument("--gaps", type=int, default=8, help="largest compute-stream gaps listed")
    p.add_argument("--kernels", type=int, default=0,
                   help="kernels listed under each caller, largest first (default none)")
    ns = p.parse_args(argv)
    for path in ns.traces:
        with open(path) as fh:
            print(render(path, summarize(json.load(fh), ns.min_gap_us, top=ns.gaps),
                         kernels=ns.kernels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
