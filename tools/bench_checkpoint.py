#!/usr/bin/env python
"""Save-time (and load-time) cost of checkpoint checksums, one process (one GPU or the CPU):

    python tools/bench_checkpoint.py --model llama-0.85b --saves 2 --out checkpoint_cost.json

See megatron/bench/checkpoint_cost.py for what is timed and the JSON.
"""

import sys

from megatron.bench.checkpoint_cost import main

if __name__ == "__main__":
    sys.exit(main())
