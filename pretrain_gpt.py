"""Pretrain a GPT model with Unified Sequence Parallelism (Ulysses x Ring) on megatron-core.

    torchrun --nproc-per-node 4 pretrain_gpt.py --ulysses-degree 2 --ring-degree 2 ...

Flags: ``python pretrain_gpt.py --help`` (Megatron-LM's names, grouped). Launch scripts in
``examples/``. The work happens in :func:`megatron.training.loop.pretrain`.

Exit status: 0 when training ends (or stops on SIGTERM after saving), 2 for bad input
(flags, layout, data, ``--save``, ``--load``), with one ``error:`` line from rank 0 instead
of a traceback from every rank, 1 for a NaN/inf loss or grad norm and for a failed save
(one line naming the directory and the last complete checkpoint). ``torchrun`` itself
exits 1 whenever a worker fails; ``tools/launch.py`` (what ``examples/`` use) is torchrun
with the first failed worker's exit status passed through. See docs/reliability.md.
"""

import logging
import os
import sys

from megatron.errors import UsageError
from megatron.training.cli.arguments import launch_rank, parse_args, validate_args
from megatron.training.cli.output_paths import check_output_paths


def main(argv=None) -> int:
    # Only the argument module before parsing: `--help` and usage errors need neither torch
    # nor megatron-core (whose import takes seconds).

    args = parse_args(argv)
    failed = preflight(args)
    if failed is not None:
        return failed
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from megatron.training.observe.console import (
        install_console_filters,  # per call: tests replace it
    )
    from megatron.training.process_guard import start_guard  # per call: tests replace it

    install_console_filters(launch_rank())
    start_guard()
    from megatron.training.loop import RUN_ERRORS, pretrain  # torch-free --help

    try:
        pretrain(args)
    except RUN_ERRORS as exc:
        return report_error(exc)
    return 0


def preflight(args):
    """The flag and output-directory checks, before megatron-core is imported (seconds of
    imports and its warnings); exit status 2 after one line from rank 0, else None.
    ``pretrain`` repeats them (``validate_args`` only reads ``args``)."""
    try:
        check_output_paths(validate_args(args, int(os.environ.get("WORLD_SIZE", "1"))))
    except UsageError as exc:
        if launch_rank() == 0:
            print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return None


def report_error(exc: BaseException) -> int:
    """Print ``exc`` in one line (rank 0, or the rank where it arose) and return its exit
    status (:func:`megatron.training.loop.exit_status`)."""
    from megatron.training.loop import exit_status, reported_here  # torch-free --help

    if reported_here(exc, launch_rank()):
        print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)
    return exit_status(exc)


if __name__ == "__main__":
    sys.exit(main())
