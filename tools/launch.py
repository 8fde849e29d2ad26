#!/usr/bin/env python
"""torchrun with the first failed worker's exit status passed through (2 for bad input)
and a free-port check; see megatron/training/launch.py.

    python tools/launch.py --nproc-per-node 4 pretrain_gpt.py [flags]
"""

import sys

from megatron.training.launch import main

if __name__ == "__main__":
    sys.exit(main())
