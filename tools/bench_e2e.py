"""End-to-end training throughput of pretrain_gpt.py, and the longest trainable sequence.

Throughput of the Llama-style 0.85B model on 2 GPUs, U=2 and R=2 (launches torchrun itself)::

    python tools/bench_e2e.py --seq-lens 32k,64k,128k --splits 2x1,1x2 --nproc-per-node 2 \\
        --iters 10 --warmup 3 --out benchmarks/out/e2e.json --markdown benchmarks/out/e2e.md

The longest sequence that trains (full recompute, doubling from 128K)::

    python tools/bench_e2e.py --find-max-seq --start-seq 128k --splits 1x2 --iters 2 \\
        --warmup 1 --out benchmarks/out/max_seq.json --markdown benchmarks/out/max_seq.md

Packed documents of 2K tokens (useful FLOPs, a document ceiling, the Liger peer on the same
sequences)::

    python tools/bench_e2e.py --docs fixed:2k --seq-lens 32k --splits 1x1 --nproc-per-node 1 \
        --peers hf-liger --ceiling on --out e2e_docs.json --markdown e2e_docs.md

FLOPs are counted as Megatron-LM counts them with causal attention at half; the formula, the
flags and the method are in :mod:`megatron.bench.e2e` and ``docs/performance.md``.
"""

import sys

from megatron.bench.e2e.cli import main

if __name__ == "__main__":
    sys.exit(main())
