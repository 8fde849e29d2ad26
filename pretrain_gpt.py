"""Pretrain a GPT model with Unified Sequence Parallelism (Ulysses x Ring) on megatron-core.

    torchrun --nproc-per-node 4 pretrain_gpt.py --ulysses-degree 2 --ring-degree 2 ...

Flags: ``python pretrain_gpt.py --help`` (Megatron-LM's names, grouped). Launch scripts in
``examples/``. The work happens in :func:`megatron.training.training.pretrain`.

Exit status: 0 when training ends (or stops on SIGTERM after saving), 2 for bad input
(flags, layout, data, --load), with one ``error:`` line from rank 0 instead of a traceback
from every rank, 1 for a NaN/inf loss.
"""

import logging
import os
import sys


def main(argv=None) -> int:
    from megatron.training.arguments import parse_args
    from megatron.training.training import INPUT_ERRORS, NonFiniteLossError, pretrain

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        pretrain(args)
    except INPUT_ERRORS as exc:
        _report(exc)
        return 2
    except NonFiniteLossError as exc:
        _report(exc)
        return 1
    return 0


def _report(exc: BaseException) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
