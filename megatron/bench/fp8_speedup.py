"""Float8 linears against bf16, per sequence length: the summary step of
``benchmarks/fp8.sh``.

``python -m megatron.bench.fp8_speedup --bf16 A.json [...] --fp8 B.json [...] [--out R.json]``
reads ``tools/bench_e2e.py`` outputs of one model, trained in bf16 and with ``--fp8-format``
in ``--extra-args`` (several files per side are pooled: rounds), and prints per length:

* tokens/s of each (mean over the rows) and their ratio, float8 over bf16;
* peak GPU memory of each and their ratio (float8 must not need more);
* whether float8 is at least as fast and no larger, the floor every length must meet. "No
  larger" allows :data:`MEMORY_SLACK_GIB` (16 MiB): a float8 run holds a few fixed buffers
  of its own at every point of the step (the scaled GEMM's workspace, scale tensors), which
  measure ~2 MiB on an H100 whatever the model's size; the line prints the difference.

Only this project's rows count (the peers of the bf16 run are in its own table).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Sequence

BF16, FP8 = "bf16", "fp8"
MEMORY_SLACK_GIB = 16 / 1024


def _is_fp8(row: dict) -> bool:
    command = row.get("command") or ""
    return "--fp8-format" in (command if isinstance(command, str) else " ".join(command))


def project_rows(payload: dict, source: str, side: str) -> List[dict]:
    """This project's rows of ``payload`` that trained. Raises ValueError naming ``source``
    when a row's command does (not) carry ``--fp8-format`` as ``side`` says (a file passed on
    the wrong side)."""
    rows = [r for r in payload.get("results", [])
            if r.get("stack", "megatron-usp") == "megatron-usp" and r.get("status") == "ok"]
    for r in rows:
        if _is_fp8(r) != (side == FP8):
            other = "--bf16" if side == FP8 else "--fp8"
            raise ValueError(f"{source}: a run {'without' if side == FP8 else 'with'} "
                             f"--fp8-format; pass it as {other}")
    return rows


def _mean(values: Sequence[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def compare(bf16: Sequence[dict], fp8: Sequence[dict]) -> List[Dict[str, object]]:
    """One entry per sequence length both sides trained, in increasing order."""
    out = []
    for seq_len in sorted({r["seq_len"] for r in bf16} & {r["seq_len"] for r in fp8}):
        side = {name: [r for r in rows if r["seq_len"] == seq_len]
                for name, rows in ((BF16, bf16), (FP8, fp8))}
        tps = {name: _mean([r["tokens_per_s"] for r in rows]) for name, rows in side.items()}
        mem = {name: _mean([r.get("peak_mem_gib") for r in rows]) for name, rows in side.items()}
        speed = tps[FP8] / tps[BF16]
        memory = mem[FP8] / mem[BF16] if mem[FP8] and mem[BF16] else None
        out.append({"seq_len": seq_len, "bf16_tokens_per_s": tps[BF16],
                    "fp8_tokens_per_s": tps[FP8], "speedup": speed,
                    "bf16_peak_mem_gib": mem[BF16], "fp8_peak_mem_gib": mem[FP8],
                    "memory_ratio": memory, "rounds": min(len(v) for v in side.values()),
                    "floor_holds": speed >= 1.0 and (
                        memory is None or mem[FP8] - mem[BF16] <= MEMORY_SLACK_GIB)})
    if not out:
        raise ValueError("no sequence length trained on both sides")
    return out


def summary_lines(rows: Sequence[Dict[str, object]]) -> List[str]:
    """One line per length."""
    lines = []
    for r in rows:
        memory = ("" if r["memory_ratio"] is None else
                  f", memory {r['fp8_peak_mem_gib']:.1f} / {r['bf16_peak_mem_gib']:.1f} GiB "
                  f"({r['memory_ratio']:.3f}x, "
                  f"{(r['fp8_peak_mem_gib'] - r['bf16_peak_mem_gib']) * 1024:+.0f} MiB)")
        verdict = "holds" if r["floor_holds"] else "missed"
        lines.append(f"S={r['seq_len']}: float8 over bf16 {r['speedup']:.3f}x tokens/s "
                     f"({r['fp8_tokens_per_s']:.0f} / {r['bf16_tokens_per_s']:.0f}){memory}; "
                     f"never slower, never larger: {verdict}")
    return lines


def _load(paths: Sequence[str], side: str) -> List[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += project_rows(json.load(f), path, side)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron.bench.fp8_speedup",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--bf16", nargs="+", required=True,
                        help="tools/bench_e2e.py JSON files of the bf16 runs")
    parser.add_argument("--fp8", nargs="+", required=True,
                        help="the same of the runs with --fp8-format in --extra-args")
    parser.add_argument("--out", default=None, help="JSON file for the result")
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(args_list)
    try:
        rows = compare(_load(args.bf16, BF16), _load(args.fp8, FP8))
    except ValueError as exc:
        parser.error(str(exc))
    print("\n".join(summary_lines(rows)))
    if args.out:
        from megatron.bench.report import write_summary  # torch: only when writing

        write_summary(args.out, "fp8_speedup", {"lengths": rows}, args_list, args.bf16[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
