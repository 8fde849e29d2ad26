#!/usr/bin/env python
"""Run the GPU tests (tests/gpu) in chunks that fit a time budget and write a dated record.

    python tools/run_gpu_tests.py --out gpu_records              # every chunk
    python tools/run_gpu_tests.py --out gpu_records --list       # the plan only
    python tools/run_gpu_tests.py --out gpu_records --chunk 2    # one chunk
    python tools/run_gpu_tests.py --out DIR tests/gpu/test_x.py -- -k bf16

Each chunk is one pytest process stopped after --budget-s seconds (a hang costs a chunk);
durations are estimated from the newest earlier record in --out. The record
(gpu_tests_<date>_<host>.json and .md in --out) holds the date, host, GPU names,
Python / torch / CUDA versions, the commit, the command, and each test's outcome and
duration. Exit status: 0 when no test failed, errored or timed out; 1 otherwise; 2 on bad
input. The parts live in tests/gpu_runner.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import gpu_runner as gr  # noqa: E402

BAD = ("failed", "error", "timeout", "crashed")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run_gpu_tests.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", default=["tests/gpu"],
                   help="test files or folders (default: tests/gpu)")
    p.add_argument("--out", required=True, type=Path,
                   help="folder for the records (and where earlier ones give estimates)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="seconds one chunk may take: the packing target and its timeout")
    p.add_argument("--default-estimate-s", type=float, default=60.0,
                   help="the estimate for a test no earlier record ran")
    p.add_argument("--chunk", type=int, default=None,
                   help="run only chunk K (1-based) of the plan")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.budget_s <= 0:
        print(f"error: --budget-s {args.budget_s} must be positive, e.g. 540", file=sys.stderr)
        return 2
    estimates = gr.load_estimates(args.out)
    chunks = gr.plan_chunks(gr.collect(args.paths, extra), estimates, args.budget_s,
                            args.default_estimate_s)
    if args.chunk is not None and not 1 <= args.chunk <= len(chunks):
        print(f"error: --chunk {args.chunk}: the plan has chunks 1 to {len(chunks)}",
              file=sys.stderr)
        return 2
    for i, ids in enumerate(chunks, 1):
        est = sum(estimates.get(n, args.default_estimate_s) for n in ids)
        print(f"chunk {i}/{len(chunks)}: {len(ids)} tests, about {est:.0f} s")
        if args.list:
            print("".join(f"  {n}\n" for n in ids), end="")
    if args.list:
        return 0
    picked = [args.chunk] if args.chunk is not None else range(1, len(chunks) + 1)
    report_dir = args.out / "reports"
    report_dir.mkdir(parents=True, exist_ok=True)
    results = [gr.run_chunk(i, chunks[i - 1], args.budget_s, report_dir, extra) for i in picked]
    record = gr.build_record(results, gr.environment(), gr.commit(),
                             ["tools/run_gpu_tests.py", *argv], args.budget_s)
    path = gr.write_record(record, args.out)
    print(f"record: {path} ({record['summary']})")
    return 1 if any(record["summary"].get(k) for k in BAD) else 0


if __name__ == "__main__":
    sys.exit(main())
