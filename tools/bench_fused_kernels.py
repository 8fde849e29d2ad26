"""RMSNorm, SwiGLU and RoPE kernels of ``--fused-kernels`` side by side on one GPU.

    python tools/bench_fused_kernels.py --model llama-0.85b --tokens 32768,65536 --out k.json

Times each implementation (torch, compile, liger, megatron-core's own) forward + backward on
the model's shapes and reports its error against float64; see
:mod:`megatron.bench.fused_kernels_bench`.
"""

import sys

from megatron.bench.fused_kernels_bench import main

if __name__ == "__main__":
    sys.exit(main())
