#!/usr/bin/env python
"""Rank TP x Ulysses x Ring x DP x PP layouts (with ZeRO stage and recompute) for a model,
a sequence length and a cluster; or compare predictions with measured step times.

    python tools/plan_parallel.py --model llama3-8b --seq-length 131072 --gpus 64 \\
        --gpus-per-node 8 --hardware h200 [--calibration calib.json] [--top 10] [--json]
    python tools/plan_parallel.py --model llama-0.85b --seq-length 131072 --gpus 8 --docs lognormal
    python tools/plan_parallel.py --validate measured.json

Exit status: 0 with a plan (or all validated runs within tolerance), 1 when validated
runs fall outside the tolerance, 2 on bad input or when no layout is feasible (the
message names the binding limit and the smallest change that fits).
See docs/planner.md for the cost model, the rules and the file schemas.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any, Dict, List, Optional

from megatron.planner import (
    HARDWARE_PRESETS,
    PlannerError,
    Workload,
    apply_calibration,
    get_hardware,
    load_calibration,
    load_model,
    plan_layouts,
    with_overrides,
)
from megatron.planner.cost_model import DEFAULT_ASSUMPTIONS, Assumptions
from megatron.planner.explain import format_table
from megatron.planner.plan import plan_from, result_to_json
from megatron.planner.validate import DEFAULT_TOLERANCE, validate_measurements
from megatron.shapes import PRESETS


def _degree(value: str) -> Optional[int]:
    """A degree flag: an integer, or 'auto' (let the planner choose)."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"preset ({', '.join(sorted(PRESETS))}) or JSON/YAML file")
    p.add_argument("--seq-length", type=int)
    p.add_argument("--gpus", type=int, help="world size")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--hardware", default=None,
                   help=f"preset: {', '.join(sorted(HARDWARE_PRESETS))} (default h200; "
                        f"with --validate, the file's)")
    p.add_argument("--calibration", action="append", default=[], metavar="FILE",
                   help="calibration JSON from tools/bench_links.py / tools/bench_attention.py; "
                        "repeat to merge partial files (later wins)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB", help="memory per GPU, GiB")
    p.add_argument("--intra-node-bw", type=float, metavar="GBPS",
                   help="per-GPU bandwidth inside a node, GB/s (all link kinds)")
    p.add_argument("--inter-node-bw", type=float, metavar="GBPS",
                   help="per-GPU bandwidth between nodes, GB/s (all link kinds)")
    p.add_argument("--docs", metavar="MIX",
                   help="packed documents (--reset-attention-mask --reset-position-ids): the "
                        "document mix the plan is costed on, as bench_e2e --docs: fixed:N, "
                        "uniform:N, lognormal or corpus")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--tensor-model-parallel-size", type=_degree, default=None, metavar="N|auto")
    p.add_argument("--ulysses-degree", type=_degree, default=None, metavar="N|auto")
    p.add_argument("--ring-degree", type=_degree, default=None, metavar="N|auto")
    p.add_argument("--context-parallel-size", type=_degree, default=None, metavar="N|auto")
    p.add_argument("--data-parallel-size", type=_degree, default=None, metavar="N|auto")
    p.add_argument("--pipeline-model-parallel-size", type=_degree, default=None, metavar="N|auto")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3])
    p.add_argument("--recompute", choices=["none", "selective", "full"])
    p.add_argument("--linear-cross-entropy-chunk-tokens", type=int,
                   default=DEFAULT_ASSUMPTIONS.loss_chunk_tokens, metavar="N",
                   help="plan the fused output layer and loss (--fused-linear-cross-entropy) "
                        "over chunks of N tokens (default %(default)s; the plan's flags "
                        "include it)")
    p.add_argument("--plain-cross-entropy", action="store_true",
                   help="plan megatron-core's unfused loss instead (full-sequence logits and "
                        "their float32 softmax)")
    p.add_argument("--top", type=int, default=10, help="rows in the table (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--validate", metavar="MEASURED_JSON",
                   help="compare predictions with measured step times (docs/planner.md)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="--validate: allowed |predicted/measured - 1| (default 0.25)")
    p.add_argument("--list-presets", action="store_true")
    return p


DEFAULT_HARDWARE = "h200"


def hardware_from_args(args: argparse.Namespace, default: Optional[str] = DEFAULT_HARDWARE):
    """The preset, calibrated and overridden as the flags say; None when nothing was
    asked and there is no default (``--validate`` then uses the file's hardware)."""
    name = args.hardware or default
    changed = args.calibration or args.gpu_memory or args.intra_node_bw or args.inter_node_bw
    if name is None and not changed:
        return None
    hw = get_hardware(name or DEFAULT_HARDWARE)
    if args.calibration:
        hw = apply_calibration(hw, load_calibration(args.calibration))
    return with_overrides(hw, args.gpu_memory, args.intra_node_bw, args.inter_node_bw)


def assumptions_from_args(args: argparse.Namespace) -> Assumptions:
    """The loss the plan assumes (the other assumptions are megatron-core's defaults)."""
    chunk = None if args.plain_cross_entropy else args.linear_cross_entropy_chunk_tokens
    return replace(DEFAULT_ASSUMPTIONS, loss_chunk_tokens=chunk)


def fixed_from_args(args: argparse.Namespace) -> Dict[str, Any]:
    keys = ("tensor_model_parallel_size", "ulysses_degree", "ring_degree",
            "context_parallel_size", "data_parallel_size", "pipeline_model_parallel_size",
            "zero_stage", "recompute")
    return {k: getattr(args, k) for k in keys if getattr(args, k) is not None}


def _list_presets() -> str:
    lines = ["models:"]
    for name, m in sorted(PRESETS.items()):
        lines.append(f"  {name:<12} {m.total_params() / 1e9:6.2f}B  L={m.num_layers} "
                     f"h={m.hidden_size} heads={m.num_attention_heads}/{m.num_query_groups} "
                     f"ffn={m.ffn_hidden_size} V={m.vocab_size}"
                     + (f" W={m.window_size}" if m.window_size is not None else ""))
    lines.append("hardware:")
    for name in sorted(HARDWARE_PRESETS):
        lines += ["  " + line for line in get_hardware(name).describe()]
    return "\n".join(lines)


def _error(exc: PlannerError, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"error": str(exc), "binding_limit": exc.binding_limit,
                          "suggestions": exc.suggestions}, indent=2))
    else:
        print(f"error: {exc}", file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_presets:
        print(_list_presets())
        return 0
    try:
        if args.validate:
            report = validate_measurements(args.validate, hardware_from_args(args, None),
                                           args.tolerance)
            print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
            return 0 if report.ok else 1
        missing = [f for f, v in (("--model", args.model), ("--seq-length", args.seq_length),
                                  ("--gpus", args.gpus)) if v is None]
        if missing:
            parser.error(f"missing {', '.join(missing)} (or use --validate FILE / --list-presets)")
        workload = Workload(load_model(args.model), args.seq_length, args.gpus,
                            args.gpus_per_node, args.micro_batch_size, args.global_batch_size,
                            args.docs)
        result = plan_layouts(workload, hardware_from_args(args), fixed_from_args(args),
                              top=args.top, assumptions=assumptions_from_args(args))
    except PlannerError as exc:
        return _error(exc, args.json)
    if args.json:
        print(json.dumps(result_to_json(result), indent=2))
        return 0
    print(format_table(result))
    # Only layouts pretrain_gpt.py here can run are ranked (megatron/planner/capabilities.py).
    print(f"\nrun #1 (add the data, LR and output flags):\n  {plan_from(result, result.best).command()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
