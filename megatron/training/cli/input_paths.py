"""The files a run reads, checked at start-up (before any process group exists).

Each ``--data-path`` prefix must have its ``PREFIX.bin`` and ``PREFIX.idx``, and a
``--data-path`` needs the ``--tokenizer-model`` it was made with. Missing files are named
before the missing tokenizer flag: a typo in the prefix is the likelier mistake, and asking
for a tokenizer first sends the user to the wrong flag. The contents of the files are
checked later, once the tokenizer exists (:func:`~megatron.training.data.config.validate_data_config`).
"""

from __future__ import annotations

from megatron.training.cli.config import RunConfig
from megatron.training.cli.errors import ArgumentsError
from megatron.training.data.config import parse_data_path
from megatron.training.data.indexed_files import check_prefix_files


def check_input_paths(config: RunConfig) -> None:
    """Raise a :class:`~megatron.errors.UsageError` naming the flag and the missing file(s)."""
    args = config.args
    if not args.data_path:
        return
    prefixes, _ = parse_data_path(args.data_path)
    for prefix in prefixes:
        check_prefix_files(prefix, "--data-path")
    if config.tokenizer_type != "NullTokenizer" and args.tokenizer_model is None:
        raise ArgumentsError(f"--data-path needs --tokenizer-model (the {config.tokenizer_type} "
                             f"the data was preprocessed with)")


__all__ = ["check_input_paths"]
