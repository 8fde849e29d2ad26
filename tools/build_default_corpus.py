#!/usr/bin/env python
"""Build (or find) the built-in default corpus and print the flags that use it.

    python tools/build_default_corpus.py [--cache-dir DIR]

The corpus is English prose from the installed Python standard library (pydoc topics,
docstrings, comment paragraphs), a SentencePiece tokenizer trained on it, and its indexed
dataset: see megatron/training/data/corpus.py. Training builds it by itself when no
--data-path is given; this command builds it ahead of time or shows where it is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings

from megatron.training.data import corpus


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", default=None,
                   help=f"parent folder of the cache (default {corpus.default_cache_dir()})")
    p.add_argument("--max-bytes", type=int, default=corpus.DEFAULT_MAX_BYTES,
                   help="cap on the corpus text in bytes")
    p.add_argument("--vocab-size", type=int, default=corpus.DEFAULT_VOCAB_SIZE)
    p.add_argument("--rebuild", action="store_true", help="delete the cached copy first")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

    args = parse_args(argv)
    if args.rebuild:
        root = os.path.join(args.cache_dir or corpus.default_cache_dir(), "default-corpus",
                            corpus.corpus_key(args.max_bytes, args.vocab_size))
        shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    c = corpus.ensure_default_corpus(args.cache_dir, args.max_bytes, args.vocab_size)
    secs = time.perf_counter() - t0
    if args.json:
        print(json.dumps({**c.__dict__, "seconds": round(secs, 3)}, indent=1))
        return 0
    print(
        f"default corpus in {c.root} ({secs:.1f}s): {c.num_documents} documents, "
        f"{c.text_bytes / 1e6:.2f} MB of text, {c.num_tokens} tokens, vocabulary {c.vocab_size}\n"
        f"use: --data-path {c.data_prefix} --tokenizer-type SentencePieceTokenizer "
        f"--tokenizer-model {c.tokenizer_model}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
