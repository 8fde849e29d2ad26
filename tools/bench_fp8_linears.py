"""Float8 training of each linear layer (QKV, proj, FC1, FC2) against bf16 on one GPU.

    python tools/bench_fp8_linears.py --model llama-0.85b,llama3-8b --tokens 8k,32k \\
        --recipes tensorwise --impls bf16,usp,torchao,torchao-eager --profile \\
        --out fp8_linears.json --markdown fp8_linears.md

Times each linear forward + backward in bf16, through this project's float8 GEMMs (``usp``)
and through torchao's float8 linear (compiled and eager), with the top CUDA kernels of each
under ``--profile``; see :mod:`megatron.bench.fp8_linears_bench`.
"""

import sys

from megatron.bench.fp8_linears_bench import main

if __name__ == "__main__":
    sys.exit(main())
