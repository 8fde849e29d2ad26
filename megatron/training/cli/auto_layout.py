"""``--ulysses-degree auto --ring-degree auto``: the layout planner chooses the degrees.

The bridge from the command line to :mod:`megatron.planner`: the planner is given the model
and the run as configured (TP, PP, ``--context-parallel-size``, recompute, sequence
parallelism, gradient dtype and the fused loss stay the user's), and its choice is validated
like degrees given on the command line. With ``--reset-attention-mask`` it plans the run's
packed documents (:func:`run_documents`); without, dense sequences.
"""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Sequence, Tuple

from megatron.planner import DEFAULT_ASSUMPTIONS, Documents
from megatron.planner.hardware import preset_for_device
from megatron.planner.models import check_model
from megatron.training.cli.arguments import validate_args
from megatron.training.cli.config import RunConfig
from megatron.training.cli.errors import ArgumentsError


def _planner_inputs(config: RunConfig, vocab_size: int):
    """(model, fixed degrees, assumptions) of the run as configured, for the planner."""
    args = config.args
    model = check_model(dataclasses.replace(config.shape, vocab_size=vocab_size))
    fixed = {"tensor_model_parallel_size": args.tensor_model_parallel_size,
             "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
             "zero_stage": 1 if args.use_distributed_optimizer else 0,
             "recompute": args.recompute_granularity or "none"}
    if args.context_parallel_size is not None:
        fixed["context_parallel_size"] = args.context_parallel_size
    # The memory model must describe the run as configured: Megatron sequence parallelism is
    # the user's flag, not the planner's to switch on; so are the gradient buffer's dtype
    # (float32 unless --grad-reduce-in-bf16) and the loss (the fused output layer and loss
    # over its chunks, or megatron-core's).
    grad_bytes = 4 if config.grad_reduce_in_fp32 else 2
    assumptions = dataclasses.replace(
        DEFAULT_ASSUMPTIONS, tp_sequence_parallel=config.sequence_parallel,
        main_grad_bytes=grad_bytes, grad_reduce_bytes=grad_bytes,
        loss_chunk_tokens=config.loss_chunk_tokens)
    return model, fixed, assumptions


def _mock_documents(tokenizer, seq_length: int, micro_batch_size: int) -> Documents:
    """megatron-core's mock documents: the mix they are drawn from, or (where the tokenizer's
    EOD id falls inside a mock document) the mix's lengths cut there."""
    from megatron.planner.documents import packed_lengths, plan_samples  # the mix (torch)
    from megatron.training.data.document_lengths import (
        cut_at_inner_eods,
        inner_eod_cuts,
        mock_mix,
    )

    mix, longest = mock_mix()
    docs = Documents(mix=mix, label=f"megatron-core's mock documents ({mix})")
    vocab, eod = int(tokenizer.vocab_size), int(tokenizer.eod)
    if not inner_eod_cuts(longest - 1, vocab, eod):
        return docs
    whole = packed_lengths(docs, seq_length, plan_samples(micro_batch_size))
    return Documents(lengths=tuple(cut_at_inner_eods(whole, vocab, eod)),
                     label=f"megatron-core's mock documents ({mix}) cut at the EOD id {eod} "
                           f"inside them (vocabulary {vocab})")


def run_documents(config: RunConfig, data_path: Optional[Sequence[str]] = None,
                  tokenizer=None) -> Optional[Documents]:
    """The packed documents the run trains on, for the planner; None without
    ``--reset-attention-mask`` (dense sequences).

    ``--mock-data``: megatron-core's mock documents as ``tokenizer`` ids them (default: the
    ``NullTokenizer`` of ``--vocab-size``). Otherwise the document lengths of ``data_path``'s
    (default ``--data-path``'s) train split, enough to fill the plan's packed samples of
    ``--seq-length``, read from the ``.idx`` files
    (:func:`~megatron.training.data.document_lengths.training_document_lengths`, seeded by
    ``--seed``: every rank plans the same documents).
    """
    args = config.args
    if not args.reset_attention_mask:
        return None
    if args.mock_data:
        if tokenizer is None:
            from megatron.training.data.tokenizer import NullTokenizer  # --mock-data's default

            tokenizer = NullTokenizer(args.vocab_size)
        return _mock_documents(tokenizer, args.seq_length, args.micro_batch_size)
    from megatron.planner.documents import plan_tokens  # numpy with the lengths
    from megatron.training.data.document_lengths import training_document_lengths

    data_path = data_path or args.data_path
    if not data_path:
        raise ArgumentsError("--ulysses-degree auto --reset-attention-mask: no --data-path to "
                             "read the documents' lengths from; pass --data-path PREFIX or "
                             "--mock-data")
    tokens = plan_tokens(args.seq_length, args.micro_batch_size)
    lengths = training_document_lengths(data_path, args.split, args.seed, tokens)
    return Documents(lengths=tuple(int(n) for n in lengths),
                     label="the training data's lengths")


def resolve_auto_layout(config: RunConfig, vocab_size: int, device_name: Optional[str],
                        data_path: Optional[Sequence[str]] = None,
                        tokenizer=None) -> Tuple[RunConfig, List[str]]:
    """The run with the planner's degrees in place of ``auto``, and the plan's reasons (to log
    on rank 0).

    Degrees the user gave explicitly (TP, PP, ``--context-parallel-size``) are kept fixed;
    with ``--reset-attention-mask`` the plan is costed on the run's packed documents
    (:func:`run_documents` of ``data_path``, the resolved data path, and ``tokenizer``).
    Deterministic, so every rank chooses the same layout without communicating. Raises
    :class:`ArgumentsError` naming the flags when no preset or no layout fits.
    """
    from megatron.planner import (  # per call: tests replace choose_layout
        PlannerError,
        choose_layout,
    )

    args, world_size = config.args, config.world_size
    hardware = args.hardware or preset_for_device(device_name)
    if hardware is None:
        raise ArgumentsError(
            f"--ulysses-degree auto: no planner preset matches the device {device_name!r}; "
            f"pass --hardware (one of the presets of tools/plan_parallel.py), or give "
            f"--ulysses-degree and --ring-degree as integers")
    gpus_per_node = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    try:
        model, fixed, assumptions = _planner_inputs(config, vocab_size)
        plan = choose_layout(model, args.seq_length, world_size, gpus_per_node, hardware,
                             micro_batch_size=args.micro_batch_size,
                             global_batch_size=args.global_batch_size, fixed=fixed,
                             assumptions=assumptions,
                             documents=run_documents(config, data_path, tokenizer))
    except PlannerError as exc:
        raise ArgumentsError(f"--ulysses-degree auto --ring-degree auto: {exc}") from None
    planned = validate_args(args, world_size, cuda_available=config.device == "cuda",
                            degrees=(plan.ulysses_degree, plan.ring_degree))
    notes = []
    if args.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        notes.append(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} without "
                     f"--sequence-parallel: planned with each TP rank holding the full "
                     f"activations of its tokens; add --sequence-parallel to shard them")
    return planned, [f"planner chose TP{plan.tensor_model_parallel_size} U{plan.ulysses_degree} "
                     f"R{plan.ring_degree} DP{plan.data_parallel_size} "
                     f"PP{plan.pipeline_model_parallel_size}"] + notes + list(plan.reasons)


__all__ = ["resolve_auto_layout", "run_documents"]
