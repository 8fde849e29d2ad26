"""The flags of ``tools/eval_long_context.py`` and their one validated form, :class:`EvalConfig`.

Every check here runs before a model or tokenizer is loaded; the two that need the tokenizer
(the shortest passkey prompt, a long enough document) are in :mod:`~megatron.evaluation.run`.
Each error is one line naming the flag and a valid value (exit status 2).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from megatron.errors import UsageError

LAYOUT_FLAGS = ("tensor_model_parallel_size", "ulysses_degree", "ring_degree")
TOKENIZER_TYPES = ("HuggingFaceTokenizer", "SentencePieceTokenizer")
DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"


class EvalConfigError(UsageError, ValueError):
    """A flag of the evaluation is wrong; the message names it and a valid value."""


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate (``load`` xor ``hf_model``) and how.

    ``layout``: ``pretrain_gpt.py`` flags of this rank's parallel layout (``--load`` only).
    ``ppl_length`` 0 or ``passkey_lengths`` empty skips that evaluation.
    """

    load: Optional[str]
    ckpt_step: Optional[int]
    hf_model: Optional[str]
    gguf_file: Optional[str]
    tokenizer_type: str
    tokenizer_model: str
    layout: Tuple[str, ...]
    device: str
    ppl_length: int
    ppl_documents: int
    ppl_data: Optional[str]
    bucket_tokens: int
    passkey_lengths: Tuple[int, ...]
    passkey_depths: Tuple[float, ...]
    passkey_trials: int
    seed: int
    label: str
    out_json: Optional[str]
    out_md: Optional[str]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eval_long_context.py",
                                description="Long-context evaluation: perplexity by position "
                                            "and passkey retrieval.")
    m = p.add_argument_group("model")
    m.add_argument("--load", help="this project's checkpoint directory")
    m.add_argument("--ckpt-step", type=int, help="iteration of --load; default the latest")
    m.add_argument("--hf-model", help="a transformers model directory, for comparison")
    m.add_argument("--gguf-file", help="a GGUF file inside --hf-model to load instead")
    m.add_argument("--tokenizer-type", default="HuggingFaceTokenizer", choices=TOKENIZER_TYPES)
    m.add_argument("--tokenizer-model", help="tokenizer directory or .model file; default "
                                             "--hf-model")
    m.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where --hf-model runs (--load runs on CPU processes)")
    for flag in LAYOUT_FLAGS:
        m.add_argument("--" + flag.replace("_", "-"), type=int, default=1,
                       help="parallel layout of --load's model (torchrun: their product of "
                            "processes)")
    e = p.add_argument_group("evaluation")
    e.add_argument("--ppl-length", type=int, default=0, help="tokens per window; 0 skips")
    e.add_argument("--ppl-documents", type=int, default=4, help="windows, one per document")
    e.add_argument("--ppl-data", help="a .jsonl ({\"text\": ...} per line) or a text file (one "
                                      "document); default the built-in corpus")
    e.add_argument("--bucket-tokens", type=int, help="bucket width; default --ppl-length / 8")
    e.add_argument("--passkey-lengths", default="", help="prompt lengths in tokens, e.g. "
                                                         "256,512; empty skips")
    e.add_argument("--passkey-depths", default=DEFAULT_DEPTHS,
                   help="needle depths in [0, 1] (0: start, 1: end)")
    e.add_argument("--passkey-trials", type=int, default=3, help="keys per (length, depth)")
    e.add_argument("--seed", type=int, default=1234)
    o = p.add_argument_group("output")
    o.add_argument("--label", help="name of the model in the report; default its directory")
    o.add_argument("--out-json", help="result file; the markdown tables go to stdout anyway")
    o.add_argument("--out-md", help="the markdown tables as a file")
    return p



def _numbers(flag: str, text: str, kind, example: str) -> List:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise EvalConfigError(f"{flag} {text!r} is not a comma-separated list; e.g. "
                              f"{flag} {example}") from None


def _check_model(args) -> None:
    if (args.load is None) == (args.hf_model is None):
        raise EvalConfigError("give exactly one of --load CKPT_DIR and --hf-model HF_DIR")
    source = args.load or args.hf_model
    if not os.path.isdir(source):
        flag = "--load" if args.load else "--hf-model"
        raise EvalConfigError(f"{flag} {source}: no such directory; pass a checkpoint or "
                              f"model directory")
    if args.gguf_file and not args.hf_model:
        raise EvalConfigError("--gguf-file needs --hf-model DIR (the directory that holds "
                              "the file)")
    if args.load and not args.tokenizer_model:
        raise EvalConfigError("--load needs --tokenizer-model (e.g. the imported model's "
                              "directory)")
    if args.hf_model and any(getattr(args, f) != 1 for f in LAYOUT_FLAGS):
        raise EvalConfigError("--tensor-model-parallel-size, --ulysses-degree and "
                              "--ring-degree apply to --load only; drop them with --hf-model")
    if args.load and args.device != "cpu":
        raise EvalConfigError("--device cuda applies to --hf-model; --load runs on CPU "
                              "processes (--device cpu)")
    for flag in LAYOUT_FLAGS:
        if getattr(args, flag) < 1:
            value = getattr(args, flag)
            raise EvalConfigError(f"--{flag.replace('_', '-')} {value} must be >= 1")


def _check_perplexity(args) -> int:
    """The bucket width."""
    if args.ppl_length < 0:
        raise EvalConfigError(f"--ppl-length {args.ppl_length} must be >= 0 (0 skips "
                              f"perplexity)")
    if args.ppl_documents < 1:
        raise EvalConfigError(f"--ppl-documents {args.ppl_documents} must be >= 1")
    if args.ppl_data and not os.path.isfile(args.ppl_data):
        raise EvalConfigError(f"--ppl-data {args.ppl_data}: no such file; pass a .jsonl or "
                              f"text file")
    width = args.bucket_tokens or max(1, args.ppl_length // 8)
    if args.ppl_length and not 1 <= width <= args.ppl_length:
        raise EvalConfigError(f"--bucket-tokens {width} must be in 1..--ppl-length "
                              f"({args.ppl_length}); e.g. {max(1, args.ppl_length // 8)}")
    return width


def _check_passkey(args) -> Tuple[List[int], List[float]]:
    lengths = _numbers("--passkey-lengths", args.passkey_lengths, int, "256,512")
    depths = _numbers("--passkey-depths", args.passkey_depths, float, DEFAULT_DEPTHS)
    if any(n < 1 for n in lengths):
        raise EvalConfigError(f"--passkey-lengths {args.passkey_lengths}: lengths must be "
                              f"> 0; e.g. 256,512")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise EvalConfigError(f"--passkey-depths {args.passkey_depths}: depths must be in "
                              f"[0, 1]; e.g. {DEFAULT_DEPTHS}")
    if args.passkey_trials < 1:
        raise EvalConfigError(f"--passkey-trials {args.passkey_trials} must be >= 1")
    return lengths, depths


def _check_outputs(args) -> None:
    for flag in ("out_json", "out_md"):
        path = getattr(args, flag)
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise EvalConfigError(f"--{flag.replace('_', '-')} {path}: no folder {folder}; "
                                  f"create it or pass a path in an existing one")


def _layout(args) -> Tuple[str, ...]:
    return tuple(x for f in LAYOUT_FLAGS for x in ("--" + f.replace("_", "-"),
                                                   str(getattr(args, f))))


def validate(args: argparse.Namespace) -> EvalConfig:
    """The :class:`EvalConfig` of parsed flags, or :class:`EvalConfigError`."""
    _check_model(args)
    width = _check_perplexity(args)
    lengths, depths = _check_passkey(args)
    if not args.ppl_length and not lengths:
        raise EvalConfigError("nothing to evaluate: pass --ppl-length N and/or --passkey-lengths "
                    "256,512")
    _check_outputs(args)
    source = args.load or args.hf_model
    return EvalConfig(
        load=args.load, ckpt_step=args.ckpt_step, hf_model=args.hf_model,
        gguf_file=args.gguf_file, tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model or args.hf_model, layout=_layout(args),
        device=args.device, ppl_length=args.ppl_length, ppl_documents=args.ppl_documents,
        ppl_data=args.ppl_data, bucket_tokens=width, passkey_lengths=tuple(lengths),
        passkey_depths=tuple(depths), passkey_trials=args.passkey_trials, seed=args.seed,
        label=args.label or os.path.basename(os.path.normpath(source)),
        out_json=args.out_json, out_md=args.out_md)


def parse(argv: Optional[Sequence[str]] = None) -> EvalConfig:
    return validate(build_parser().parse_args(argv))
