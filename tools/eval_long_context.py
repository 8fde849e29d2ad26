#!/usr/bin/env python
"""Long-context evaluation: perplexity by position bucket and passkey retrieval accuracy.

    python tools/eval_long_context.py --hf-model HF_DIR --ppl-length 2048 \\
        --passkey-lengths 256,1024 --out-json hf.json
    python tools/eval_long_context.py --load CKPT_DIR --tokenizer-model HF_DIR ...
    torchrun --nproc-per-node 4 tools/eval_long_context.py --load CKPT_DIR \\
        --tokenizer-model HF_DIR --ulysses-degree 2 --ring-degree 2 ...

``--load``: this project's checkpoint on CPU processes (gloo), under any TP x U x R that
multiplies to the processes started; ``--hf-model``: a transformers model directory (or a GGUF
file in it, ``--gguf-file``) for comparison. Writes the result as JSON (``--out-json``) and
prints markdown tables (``--out-md`` also writes them). The work is in
:mod:`megatron.evaluation`. Exit status 2 for a bad flag, with one line naming it.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import List, Optional


def run(argv: Optional[List[str]] = None) -> int:
    from megatron.evaluation import config, report  # torch-free --help
    from megatron.evaluation.models import is_rank0  # torch-free --help
    from megatron.evaluation.run import evaluate  # torch-free --help

    cfg = config.parse(argv)
    result = evaluate(cfg)
    if not is_rank0():
        return 0
    text = report.markdown(result)
    print(text)
    if cfg.out_json:
        with open(cfg.out_json, "w") as f:
            json.dump(result, f, indent=1)
    if cfg.out_md:
        with open(cfg.out_md, "w") as f:
            f.write(text)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    # megatron-core warns at import that TransformerEngine and Apex are absent; unused here.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    warnings.filterwarnings("ignore", message="Apex is not installed.*")
    from megatron.errors import UsageError  # torch-free --help
    from megatron.evaluation.models import is_rank0  # torch-free --help

    try:
        return run(argv)
    except UsageError as exc:
        if is_rank0():
            print(f"eval_long_context.py: error: {exc}", file=sys.stderr)
        return exc.exit_status


if __name__ == "__main__":
    sys.exit(main())
