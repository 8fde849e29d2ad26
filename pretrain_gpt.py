"""Pretrain a GPT model with Unified Sequence Parallelism (Ulysses x Ring) on megatron-core.

    torchrun --nproc-per-node 4 pretrain_gpt.py --ulysses-degree 2 --ring-degree 2 ...

Flags: ``python pretrain_gpt.py --help`` (Megatron-LM's names, grouped). Launch scripts in
``examples/``. The work happens in :func:`megatron.training.loop.pretrain`.

Exit status: 0 when training ends (or stops on SIGTERM after saving), 2 for bad input
(flags, layout, data, ``--save``, ``--load``), with one ``error:`` line from rank 0 instead
of a traceback from every rank, 1 for a NaN/inf loss or grad norm and for a failed save
(one line naming the directory and the last complete checkpoint), 3 when another rank died
or went silent (one line from each rank that noticed), 130 for a Ctrl-C (SIGINT) without
``--save`` or before training began (with ``--save`` it saves like SIGTERM and exits 0). ``torchrun`` itself
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
        result = pretrain(args)
    except RUN_ERRORS as exc:
        return report_error(exc)
    except KeyboardInterrupt:
        return report_interrupt(args)
    if result.stop_signal and not args.save:
        return 128 + result.stop_signal   # stopped unsaved, as its line said
    return 0


def report_interrupt(args) -> int:
    """A SIGINT before the training loop could take it: one line from rank 0 saying that
    nothing was saved; exit status 130 (128 + SIGINT)."""
    from megatron.training.cli.arguments import launch_rank

    if launch_rank() == 0:
        advice = "" if args.save else " (with --save, SIGINT and SIGTERM save first)"
        print(f"pretrain_gpt.py: interrupted (SIGINT) before training reached a save: no "
              f"checkpoint was written{advice}", file=sys.stderr, flush=True)
    return 130


def preflight(args):
    """The flag, input-file and output-directory checks, before megatron-core is imported (seconds of
    imports and its warnings); exit status 2 after one line from rank 0, else None.
    ``pretrain`` repeats them (``validate_args`` only reads ``args``)."""

    from megatron.training.cli.input_paths import check_input_paths

    try:
        config = validate_args(args, int(os.environ.get("WORLD_SIZE", "1")))
        check_input_paths(config)
        check_output_paths(config)
    except UsageError as exc:
        from megatron.training.cli.arguments import launch_rank
        from megatron.training.exit_paths import leave_the_message_to_rank_0

        if launch_rank() == 0:
            print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)
        leave_the_message_to_rank_0()
        return 2
    return None


def report_error(exc: BaseException) -> int:
    """Print ``exc`` in one line (rank 0, or the rank where it arose) and return its exit
    status (:func:`megatron.training.loop.exit_status`)."""
    from megatron.training.cli.arguments import launch_rank
    from megatron.training.exit_paths import leave_the_message_to_rank_0
    from megatron.training.loop import exit_status, reported_here

    if reported_here(exc, launch_rank()):
        print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)
    else:
        leave_the_message_to_rank_0()
    return exit_status(exc)


if __name__ == "__main__":
    sys.exit(main())
