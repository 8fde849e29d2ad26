#!/usr/bin/env python
"""Train a SentencePiece tokenizer on JSONL documents.

    python tools/train_tokenizer.py --input docs.jsonl --json-keys text \\
        --output-prefix my-tokenizer --vocab-size 32000

writes ``my-tokenizer.model`` for ``--tokenizer-type SentencePieceTokenizer
--tokenizer-model my-tokenizer.model``. Each non-blank line of each document is one
training sentence. Special pieces: <unk>=0, <s>=1, </s>=2 (the end-of-document id),
<pad>=3; characters never seen in training fall back to UTF-8 bytes. The same input and
flags give a byte-identical file.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

from megatron.errors import UsageError
from megatron.training.data.preprocess import iter_jsonl_texts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="JSONL files, one document a line")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys whose string values are documents (default: text)")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.model")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--no-byte-fallback", action="store_true",
                   help="map unseen characters to <unk> instead of UTF-8 byte pieces")
    p.add_argument("--num-threads", type=int, default=2,
                   help="training threads (recorded in the model file)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed JSONL lines (reported) instead of failing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    args = parse_args(argv)
    from megatron.training.data.tokenizer import (  # torch-free --help
        train_sentencepiece,
        training_sentences,
    )

    counts: dict = {}
    t0 = time.perf_counter()
    warn = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    try:
        # Read everything first so a bad line fails here, not inside SentencePiece (which
        # keeps all sentences in memory anyway).
        texts = iter_jsonl_texts(args.input, args.json_keys, args.skip_bad_lines, warn, counts)
        sentences = [s for text in texts for s in training_sentences(text)]
        model = train_sentencepiece(
            sentences, args.vocab_size, model_type=args.model_type,
            character_coverage=args.character_coverage,
            byte_fallback=not args.no_byte_fallback, num_threads=args.num_threads,
        )
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out = args.output_prefix + ".model"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "wb") as f:
        f.write(model)
    os.replace(out + ".tmp", out)
    print(
        f"trained a {args.model_type} SentencePiece model of {args.vocab_size} pieces on "
        f"{counts['documents']} documents in {time.perf_counter() - t0:.1f}s "
        f"(skipped: {counts['bad_lines']} bad lines, {counts['empty']} empty documents; "
        f"{counts['blank_lines']} blank lines)\n"
        f"wrote {out}\n"
        f"use: --tokenizer-type SentencePieceTokenizer --tokenizer-model {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
