"""One evaluation run: tokenizer, data, model, both evaluations, one result dictionary
(the JSON ``tools/eval_long_context.py`` writes; :mod:`~megatron.evaluation.report` turns it
into tables). Every rank of a torchrun job runs it and gets the same result."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import asdict
from typing import Dict, Iterator, List, Tuple

import torch

from megatron.evaluation import passkey, perplexity
from megatron.evaluation.config import EvalConfig, EvalConfigError
from megatron.evaluation.models import (
    LogitsFn,
    checkpoint_logits,
    init_distributed,
    is_rank0,
    load_transformers,
    transformers_logits,
)
from megatron.evaluation.tokenizer import TextTokenizer, load_tokenizer


def check_passkey_lengths(config: EvalConfig, tok: TextTokenizer) -> None:
    shortest = passkey.fixed_tokens(tok.encode)
    short = [n for n in config.passkey_lengths if n < shortest]
    if short:
        raise EvalConfigError(
            f"--passkey-lengths {short[0]}: a passkey prompt needs at least {shortest} tokens "
            f"with this tokenizer; e.g. --passkey-lengths {max(256, shortest)}")


def perplexity_windows(config: EvalConfig, tok: TextTokenizer) -> List[List[int]]:
    """The ``--ppl-documents`` windows of ``--ppl-length + 1`` tokens, or a one-line error
    naming the longest document."""
    path = config.ppl_data
    if path is None:
        from megatron.training.data.corpus import (
            ensure_default_corpus,  # the corpus is built only when asked for
        )

        path = ensure_default_corpus().corpus_jsonl
    docs = [tok.encode(text) for text in perplexity.read_documents(path)]
    windows = perplexity.long_windows(docs, config.ppl_length, config.ppl_documents)
    if not windows:
        longest = max((len(d) for d in docs), default=0)
        raise EvalConfigError(
            f"--ppl-length {config.ppl_length}: no document of {path} has "
            f"{config.ppl_length + 1} tokens (the longest has {longest}); pass --ppl-length "
            f"{max(1, longest - 1)} or less, or a longer --ppl-data")
    return windows


@contextmanager
def model_logits(config: EvalConfig, vocab: int) -> Iterator[Tuple[LogitsFn, Dict]]:
    """The model's logits function and what to record about it (backend, layout, trained
    context)."""
    if config.hf_model:
        device = torch.device(config.device)
        model = load_transformers(config.hf_model, config.gguf_file, device)
        yield transformers_logits(model, device), {
            "backend": "transformers", "source": config.hf_model,
            "max_position_embeddings": model.config.max_position_embeddings}
        return
    from megatron.convert.checkpoint_io import loaded_checkpoint  # megatron-core on first use

    with loaded_checkpoint(config.load, config.ckpt_step, config.layout) as built:
        rows = built.config.padded_vocab_size
        if vocab > rows:   # ids past the embedding: refuse before the first forward
            raise EvalConfigError(
                f"--tokenizer-model {config.tokenizer_model} has {vocab} tokens, more than the "
                f"{rows} rows of --load {config.load}; pass the model's own tokenizer")
        # Logits over the model's own vocabulary where the checkpoint records it (an imported
        # Qwen2 has more rows than token ids; transformers normalises over all of them), never
        # fewer than the tokenizer's ids nor more than the rows.
        cut = min(rows, max(vocab, built.vocab_size or 0))
        dims = built.groups.dims
        yield checkpoint_logits(built.model, built.groups, cut), {
            "backend": "megatron-usp", "source": config.load,
            "layout": f"TP{dims.tp} U{dims.ulysses} R{dims.ring}",
            "max_position_embeddings": built.config.max_position_embeddings,
            "rotary_base": built.config.args.rotary_base}


def _progress(line: str) -> None:
    # A CPU forward at thousands of tokens takes minutes: say what is done as it is done.
    if is_rank0():
        print(line, file=sys.stderr, flush=True)


def _perplexity_result(config: EvalConfig, logits_fn: LogitsFn, windows) -> Dict:
    buckets = perplexity.evaluate_perplexity(logits_fn, windows, config.bucket_tokens)
    return {"length": config.ppl_length, "windows": len(windows),
            "buckets": [dict(asdict(b), ppl=b.ppl) for b in buckets]}


def _passkey_result(config: EvalConfig, logits_fn: LogitsFn, tok: TextTokenizer) -> Dict:
    cells = passkey.evaluate_passkey(logits_fn, tok.encode, tok.decode, config.passkey_lengths,
                                     config.passkey_depths, config.passkey_trials, config.seed,
                                     _progress)
    return {"trials": config.passkey_trials,
            "cells": [dict(asdict(c), accuracy=c.accuracy) for c in cells]}


def evaluate(config: EvalConfig) -> Dict:
    """The result dictionary: ``model``, and ``perplexity`` / ``passkey`` when asked for."""
    init_distributed()
    # A GGUF file carries its tokenizer too, when the tokenizer is read from its directory.
    same_dir = config.tokenizer_model == config.hf_model
    tok = load_tokenizer(config.tokenizer_type, config.tokenizer_model,
                         config.gguf_file if same_dir else None)
    check_passkey_lengths(config, tok)
    windows = perplexity_windows(config, tok) if config.ppl_length else []
    result: Dict = {"label": config.label}
    with model_logits(config, tok.vocab_size) as (logits_fn, about):
        result["model"] = about
        if windows:
            result["perplexity"] = _perplexity_result(config, logits_fn, windows)
        if config.passkey_lengths:
            result["passkey"] = _passkey_result(config, logits_fn, tok)
    return result
