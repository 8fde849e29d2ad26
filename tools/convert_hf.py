#!/usr/bin/env python
"""Hugging Face checkpoints in and out of this project's checkpoint format.

    python tools/convert_hf.py import HF_DIR CKPT_DIR      # prints the model flags
    torchrun ... pretrain_gpt.py $(cat CKPT_DIR/model_flags.txt) --load CKPT_DIR --finetune \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model HF_DIR ...
    python tools/convert_hf.py export CKPT_DIR OUT_DIR [--hf-config HF_DIR]

Import reads ``config.json`` and ``*.safetensors`` (Llama 2/3/3.1/3.2, Qwen2/2.5, Qwen3,
Mistral, SmolLM2) and writes a weights-only checkpoint that ``--load CKPT_DIR --finetune``
loads under any TP / PP / U x R, plus ``CKPT_DIR/model_flags.txt``. Export writes
``model.safetensors`` and ``config.json`` that transformers loads (from any checkpoint of a
supported shape; the model type, unpadded vocabulary and token ids come from
``--hf-config``, else from the import's copy in CKPT_DIR, else are inferred). The work is in
:mod:`megatron.convert`. Runs on one CPU process. Exit status 2 for a model or checkpoint it
cannot convert, with one ``error:`` line naming the config field or flag.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import List, Optional

DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert_hf.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory -> checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("ckpt_dir")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                     help="vocabulary padding of the checkpoint; default: the largest power "
                          "of two up to 128 that pads nothing up to TP 8")
    exp = sub.add_parser("export", help="checkpoint -> Hugging Face directory")
    exp.add_argument("ckpt_dir")
    exp.add_argument("out_dir")
    exp.add_argument("--ckpt-step", type=int, default=None,
                     help="iteration to export; default the latest")
    exp.add_argument("--hf-config", default=None,
                     help="the source model's config.json (or its directory)")
    exp.add_argument("--dtype", default="float32", choices=DTYPES,
                     help="dtype of the written tensors")
    return parser


def run(argv: Optional[List[str]] = None) -> int:
    import torch  # torch-free --help

    from megatron.convert import checkpoint_io  # torch-free --help

    args = build_parser().parse_args(argv)
    if args.command == "import":
        flags = checkpoint_io.import_hf(args.hf_dir, args.ckpt_dir,
                                        args.make_vocab_size_divisible_by)
        print(shlex.join(flags))
        return 0
    model = checkpoint_io.export_hf(args.ckpt_dir, args.out_dir, args.ckpt_step,
                                    args.hf_config, getattr(torch, args.dtype))
    print(f"wrote {args.out_dir} ({model.model_type}, {model.num_layers} layers)")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return run(argv)
    except ValueError as exc:
        print(f"convert_hf.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
