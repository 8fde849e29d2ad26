"""Attention benchmark: USP (Ulysses x Ring splits) vs the single-GPU kernel and native CP.

Launch one process per GPU::

    torchrun --nproc-per-node 2 tools/bench_attention.py --seq-lens 32k,64k,128k,256k \\
        --heads 32 --kv-heads 32 --head-dim 128 --dtype bf16 --splits 2x1,1x2 \\
        --iters 5 --warmup 2 --out benchmarks/out/attention.json --markdown benchmarks/out/attention.md

Every flag, the FLOP convention and the measurement method are documented in
:mod:`megatron.bench.attention_bench` and ``docs/performance.md``.
"""

import sys

from megatron.bench.attention_bench import main

if __name__ == "__main__":
    sys.exit(main())
