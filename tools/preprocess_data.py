#!/usr/bin/env python
"""Tokenize JSONL documents into megatron-core indexed datasets (.bin/.idx).

    python tools/preprocess_data.py --input docs.jsonl --output-prefix data/my \\
        --json-keys text --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model my-tokenizer.model --workers 4

writes ``data/my_text_document.bin/.idx`` (one dataset per JSON key, Megatron-LM naming);
train on it with ``--data-path data/my_text_document``. Each line is a JSON object whose
``--json-keys`` values are documents; the end-of-document id is appended to each
(``--no-append-eod`` to leave it out). A malformed line stops the run with its file and
line number, or is skipped and counted with ``--skip-bad-lines``; empty documents are
skipped and counted. The last line printed says how many documents and tokens were
written and how many lines were skipped, and why.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from megatron.errors import UsageError
from megatron.training.data.preprocess import TokenizerSpec, preprocess_jsonl


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input / output")
    g.add_argument("--input", nargs="+", required=True, help="JSONL files, one document a line")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to tokenize, one dataset each (default: text)")
    g.add_argument("--output-prefix", required=True,
                   help="writes OUTPUT_PREFIX_{key}_document.bin/.idx")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="SentencePieceTokenizer",
                   choices=["SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model file, or Hugging Face tokenizer directory")
    g.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer only")
    g.add_argument("--append-eod", dest="append_eod", action="store_true", default=True,
                   help="append the end-of-document id to each document (default)")
    g.add_argument("--no-append-eod", dest="append_eod", action="store_false")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--log-interval", type=int, default=10000,
                   help="update the progress bar every N documents")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed lines (each reported, all counted) instead of failing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    args = parse_args(argv)

    spec = TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    if args.workers < 1:
        print(f"error: --workers {args.workers} must be >= 1", file=sys.stderr)
        return 2
    try:
        summary = preprocess_jsonl(
            args.input, args.output_prefix, spec, json_keys=args.json_keys,
            append_eod=args.append_eod, workers=args.workers, skip_bad_lines=args.skip_bad_lines,
            log_interval=args.log_interval, progress=sys.stderr,
            warn=lambda msg: print(msg, file=sys.stderr),
        )
    except UsageError as exc:
        print(f"error: {exc}\nnothing was written.", file=sys.stderr)
        return 1
    for key, prefix in summary.output_prefixes.items():
        print(f"wrote {prefix}.bin/.idx: {summary.documents_written[key]} documents, "
              f"{summary.tokens_written[key]} tokens; use --data-path {prefix}")
    print(summary.summary_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
