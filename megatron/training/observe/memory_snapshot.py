"""``--record-memory-history``: where a training step's peak GPU memory goes.

:class:`MemoryHistory` turns on PyTorch's allocation recording
(``torch.cuda.memory._record_memory_history``, Python stacks) at start-up, before the model
is built, so parameters, gradient buffers, optimizer state and every activation are in the
trace. After iteration ``--memory-snapshot-iteration`` it writes the snapshot
(``--memory-snapshot-path``, with ``.rankN`` before the suffix; open it at
https://pytorch.org/memory_viz) and ``PATH.txt``, the summary of :func:`summarize`.

:func:`summarize` replays the trace (alloc / free events in order) to find the moment the
allocated bytes peak, and groups the blocks alive then by where they were allocated: the
innermost stack frame in this project or megatron-core (``site``), with a coarse
``category`` (parameters and gradients, optimizer state, attention, MLP, norms, RoPE, loss,
communication, other activations) read from the frames. Run it again on a snapshot with
``python -m megatron.training.observe.memory_snapshot PATH [--top N]``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

MAX_ENTRIES = 2_000_000

# (substring of a frame's file or function name, category); the first match, innermost frame
# first, wins.
CATEGORIES: Tuple[Tuple[str, str], ...] = (
    ("optimizer", "optimizer state"),
    ("param_and_grad_buffer", "parameters and gradient buffers"),
    ("distributed_data_parallel", "parameters and gradient buffers"),
    ("fused_loss", "output layer and loss"),
    ("cross_entropy", "output layer and loss"),
    ("language_module", "output layer and loss"),
    ("usp/attention", "attention"),
    ("usp/kernels", "attention"),
    ("usp/ring", "attention"),
    ("usp/ulysses", "attention"),
    ("rope", "RoPE"),
    ("rotary", "RoPE"),
    ("fused_kernels", "norms / SwiGLU / RoPE kernels"),
    ("norms", "norms"),
    ("mlp", "MLP"),
    ("attention.py", "attention block (QKV, projection)"),
    ("embedding", "embedding"),
    ("transformer_layer", "layer (residual, dropout)"),
    ("random.py", "activation recompute"),
    ("checkpoint", "activation recompute"),
    ("megatron/core/tensor_parallel", "linear layers"),
    ("model.py", "model build"),
)


def snapshot_path_for_rank(path: str, rank: int) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.pickle'}"


class MemoryHistory:
    """Record allocations from construction (``enabled`` and a CUDA ``device``); write the
    snapshot to ``path`` (``{seq_length}`` replaced, this rank's suffix added) after
    ``iteration``."""

    def __init__(self, enabled: bool, iteration: int, path: str, seq_length: int, rank: int,
                 device: torch.device) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.iteration = iteration
        self.path = snapshot_path_for_rank(path.replace("{seq_length}", str(seq_length)), rank)
        self.written: Optional[str] = None
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")

    def after(self, iteration: int) -> bool:
        """``iteration`` has run; True when this wrote the snapshot and its summary."""
        if not self.enabled or iteration != self.iteration or self.written:
            return False
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "wb") as fh:
            pickle.dump(snapshot, fh)
        with open(self.path + ".txt", "w") as fh:
            fh.write(format_summary(summarize(snapshot)))
        self.written = self.path
        return True

    def close(self) -> None:
        if self.enabled and not self.written:
            torch.cuda.memory._record_memory_history(enabled=None)


def _frames_text(frames: Sequence[dict]) -> List[str]:
    return [f"{f.get('filename', '')}:{f.get('name', '')}" for f in frames]


def site_of(frames: Sequence[dict]) -> str:
    """The innermost frame in this project or megatron-core (``file:line function``)."""
    for f in frames:
        name = f.get("filename", "")
        if "megatron/" in name or "pretrain_gpt" in name:
            short = name[name.index("megatron/"):] if "megatron/" in name else name
            return f"{short}:{f.get('line', '?')} {f.get('name', '')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '')}"
    return "(no stack)"


def category_of(frames: Sequence[dict]) -> str:
    for text in _frames_text(frames):
        for key, cat in CATEGORIES:
            if key in text:
                return cat
    return "other"


def _events(snapshot: dict) -> Iterable[dict]:
    for trace in snapshot.get("device_traces", []):
        yield from trace


def summarize(snapshot: dict) -> dict:
    """Peak allocated bytes and the blocks alive at that moment, grouped two ways.

    Returns ``{"peak_bytes", "peak_index", "events", "by_category": [(name, bytes)],
    "by_site": [(site, category, bytes, blocks)], "untracked_bytes"}`` where
    ``untracked_bytes`` are blocks alive at the snapshot whose allocation is not in the trace
    (allocated before recording started, or dropped from a full trace buffer).
    """
    live: Dict[int, Tuple[int, Sequence[dict]]] = {}
    total = peak = peak_index = 0
    peak_live: Dict[int, Tuple[int, Sequence[dict]]] = {}
    frees = {"free_completed"} if any(e.get("action") == "free_completed"
                                      for e in _events(snapshot)) else {"free_requested"}
    for i, ev in enumerate(_events(snapshot)):
        action, addr, size = ev.get("action"), ev.get("addr"), int(ev.get("size", 0))
        if action == "alloc":
            live[addr] = (size, ev.get("frames", []))
            total += size
            if total > peak:
                peak, peak_index, peak_live = total, i, dict(live)
        elif action in frees and addr in live:
            total -= live.pop(addr)[0]
    untracked = sum(size for addr, size in _active_blocks(snapshot) if addr not in live)
    by_cat: Dict[str, int] = defaultdict(int)
    by_site: Dict[Tuple[str, str], List[int]] = defaultdict(lambda: [0, 0])
    for size, frames in peak_live.values():
        cat = category_of(frames)
        by_cat[cat] += size
        entry = by_site[(site_of(frames), cat)]
        entry[0] += size
        entry[1] += 1
    return {
        "peak_bytes": peak, "peak_index": peak_index,
        "events": sum(1 for _ in _events(snapshot)),
        "by_category": sorted(by_cat.items(), key=lambda kv: -kv[1]),
        "by_site": sorted(((s, c, b, n) for (s, c), (b, n) in by_site.items()),
                          key=lambda row: -row[2]),
        "untracked_bytes": untracked,
    }


def _active_blocks(snapshot: dict) -> Iterable[Tuple[int, int]]:
    """(address, size) of every allocated block at the snapshot; a segment lists its blocks
    in address order from its start."""
    for seg in snapshot.get("segments", []):
        addr = seg["address"]
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                yield addr, block["size"]
            addr += block["size"]


def format_summary(summary: dict, top: int = 25) -> str:
    gib = 2 ** 30
    lines = [f"peak of traced allocations: {summary['peak_bytes'] / gib:.2f} GiB "
             f"(event {summary['peak_index']} of {summary['events']}); blocks alive at the "
             f"snapshot but not in the trace: {summary['untracked_bytes'] / gib:.2f} GiB",
             "", "by category (GiB at the peak):"]
    lines += [f"  {b / gib:8.2f}  {name}" for name, b in summary["by_category"]]
    lines += ["", f"top {top} allocation sites (GiB, blocks):"]
    lines += [f"  {b / gib:8.2f}  {n:6d}  [{c}] {s}" for s, c, b, n in summary["by_site"][:top]]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron.training.observe.memory_snapshot",
                                description="Where the peak of a CUDA memory snapshot goes.")
    p.add_argument("snapshot", help="a pickle written by --record-memory-history")
    p.add_argument("--top", type=int, default=25)
    ns = p.parse_args(argv)
    with open(ns.snapshot, "rb") as fh:
        snapshot = pickle.load(fh)
    print(format_summary(summarize(snapshot), ns.top), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
