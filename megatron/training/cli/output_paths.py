"""The directories a run writes to, checked at start-up (before any process group exists).

``--save``, the folder of ``--metrics-file`` and ``--tensorboard-dir`` must be directories
this process can create files in. Without the check a read-only ``--save`` failed before
step 1 with an ``OSError`` on one rank and "Connection closed by peer" tracebacks on the
others, and with ``--metrics-file`` elsewhere the run trained until its first save and
then died, losing that work.

Every rank checks (each rank writes its own checkpoint shards), by creating and removing
a small file: permission bits alone do not tell (root ignores them; a read-only mount
does not show in them).
"""

from __future__ import annotations

import os
import tempfile
from typing import List, Optional, Tuple

from megatron.training.cli.config import RunConfig
from megatron.training.cli.errors import ArgumentsError


def directory_problem(path: str) -> Optional[str]:
    """Why no file can be written in directory ``path`` (created when missing), or None."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} exists and is not a directory"
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-", delete=True):
            pass
    except OSError as exc:
        return f"{path} is not writable ({exc.strerror or exc})"
    return None


def output_directories(config: RunConfig) -> List[Tuple[str, str]]:
    """(flag, directory) for each place the run will write to."""
    out = []
    if config.args.save:
        out.append(("--save", config.args.save))
    if config.metrics_file:
        out.append(("--metrics-file", os.path.dirname(os.path.abspath(config.metrics_file))))
    if config.args.tensorboard_dir:
        out.append(("--tensorboard-dir", config.args.tensorboard_dir))
    return out


def check_output_paths(config: RunConfig) -> None:
    """Raise :class:`ArgumentsError` naming the flag when a run's output directory cannot
    be written; ``--metrics-file`` must also not be a directory."""
    metrics_file = config.metrics_file
    if metrics_file and os.path.isdir(metrics_file):
        raise ArgumentsError(f"--metrics-file {metrics_file} is a directory; pass a file "
                             f"name, e.g. --metrics-file "
                             f"{os.path.join(metrics_file, 'metrics.jsonl')}")
    for flag, directory in output_directories(config):
        problem = directory_problem(directory)
        if problem:
            implied = "" if flag != "--metrics-file" else f" (the folder of {metrics_file})"
            raise ArgumentsError(f"{flag}: {problem}{implied}; pass a directory you can write "
                                 f"to")
