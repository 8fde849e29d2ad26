"""The packed-document flags of ``pretrain_gpt.py`` and their start-up check, without torch
(``--help`` and the argument checks import no torch); the batching is
:mod:`megatron.training.data.documents`."""

from __future__ import annotations

from typing import Optional

from megatron.usp.backend_names import DOCUMENT_KERNEL_NAMES, document_kernel_name_problem

CHUNK_ASSIGNMENTS = ("auto", "zigzag")


def add_document_args(group) -> None:
    """The document flags of ``pretrain_gpt.py`` (the data group)."""
    group.add_argument("--document-attention-kernel", default="auto",
                       choices=DOCUMENT_KERNEL_NAMES,
                       help="with --reset-attention-mask: local document-masked kernel (tiles: "
                            "batched calls of --attention-backend per tile shape; varlen: "
                            "PyTorch's flash varlen, CUDA bf16; math: exact dense mask, tiny "
                            "shapes; auto: measured choice, docs/performance.md)")
    # --document-layout is the flag's former name, kept so existing scripts still run.
    group.add_argument("--chunk-assignment", "--document-layout", dest="chunk_assignment",
                       default="auto", choices=CHUNK_ASSIGNMENTS,
                       help="with --reset-attention-mask: auto balances the ring ranks' causal "
                            "work by assigning sequence chunks per micro-batch (zigzag when "
                            "not better); zigzag keeps the zigzag token order on every "
                            "micro-batch. --document-layout is an alias")


def document_flags_problem(args, device: str) -> Optional[str]:
    """Why the document flags cannot combine on ``device`` (``cuda`` or ``cpu``), naming the
    flag and a valid value, or None."""
    masked = args.reset_attention_mask
    if args.document_attention_kernel != "auto" and not masked:
        return (f"--document-attention-kernel {args.document_attention_kernel} has no effect "
                f"without --reset-attention-mask; add --reset-attention-mask or drop the flag")
    if args.chunk_assignment != "auto" and not masked:
        return (f"--chunk-assignment {args.chunk_assignment} has no effect without "
                f"--reset-attention-mask; add --reset-attention-mask or drop the flag")
    if masked:
        return document_kernel_name_problem(args.document_attention_kernel, device,
                                            bool(args.bf16))
    return None
