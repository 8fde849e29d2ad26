#!/usr/bin/env python
"""Print a model preset's ``pretrain_gpt.py`` flags, one per line (the examples use it).

    python tools/model_flags.py cpu-tiny            # --num-layers 4 --hidden-size 128 ...
    python tools/model_flags.py llama3-8b --vocab   # with --vocab-size
    python tools/model_flags.py --list

Presets: megatron/shapes/presets.py. Exit status 2 for an unknown preset.
"""

import argparse
import os
import sys

# megatron.shapes is standard library only: the scripts need no installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.shapes.flags import shape_flags  # noqa: E402
from megatron.shapes.presets import PRESETS  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="model_flags.py", description=__doc__.splitlines()[0])
    p.add_argument("preset", nargs="?", choices=sorted(PRESETS))
    p.add_argument("--vocab", action="store_true", help="add --vocab-size")
    p.add_argument("--list", action="store_true", help="list the presets")
    ns = p.parse_args(argv)
    if ns.list:
        print("\n".join(sorted(PRESETS)))
        return 0
    if ns.preset is None:
        p.error("name a preset (or --list)")
    print("\n".join(shape_flags(PRESETS[ns.preset], vocab=ns.vocab)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
