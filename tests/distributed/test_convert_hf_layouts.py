"""An imported Hugging Face model loads under TP2, U2xR2 and R4 and still computes what
transformers computes, with and without packed documents.

The checkpoints of ``tests/unit/test_convert_hf.py`` (written at TP = 1 by
``tools/convert_hf.py import``) are loaded on 4 gloo ranks under each layout (megatron-core
reshards them), each CP rank is fed its shard of the tokens (for packed documents, the
balanced chunk assignment of ``DocumentBatching`` and this ring rank's document plan), and the
vocab-parallel logits gathered over TP and CP are compared with transformers' in float32
(KL <= 1e-9, max |dlogit| <= 1e-4; per document for packed documents), the per-token
losses to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.convert.checkpoint_io import loaded_checkpoint
from megatron.training.cpu_shims import apply_cpu_shims
from megatron.training.data.documents import DocumentBatching
from megatron.usp.token_order import shard_for_cp_rank, unshard_from_cp_ranks
from tests.unit.test_convert_hf import (  # noqa: F401  (imported: the module fixture)
    LOSS_TOL,
    SEQ,
    assert_logits_match,
    document_params,
    documents_batch,
    hf_logits,
    imported,
)

LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"],
           "u2r2": ["--ulysses-degree", "2", "--ring-degree", "2"],
           "r4": ["--ring-degree", "4"]}
FAMILIES = ("llama", "llama_tied", "qwen2", "qwen3", "mistral")


def _gather(x: torch.Tensor, group) -> list:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _full(local: torch.Tensor, groups, assignment, vocab_parallel: bool) -> torch.Tensor:
    """[b, s_local(, V/TP)] on each rank -> [b, s(, V)]."""

    if vocab_parallel:
        local = torch.cat(_gather(local, groups.tp), dim=-1)
    return unshard_from_cp_ranks(_gather(local, groups.cp), 1, assignment)


def _run(model, groups, tokens, positions, labels=None, segments=None, assignment=None):
    """Full-sequence logits (and losses) of the model fed this CP rank's tokens."""

    cp, cp_rank = groups.dims.cp, groups.cp_rank

    def shard(x):
        return shard_for_cp_rank(x, 1, cp_rank, cp, assignment)

    packed = None if segments is None else document_params(
        segments, groups.ring_rank, groups.ring_size, assignment)
    with torch.no_grad():
        logits = model(shard(tokens), shard(positions), None, packed_seq_params=packed)
        out = _full(logits, groups, assignment, vocab_parallel=True)
        if labels is None:
            return out, None
        loss = model(shard(tokens), shard(positions), None, labels=shard(labels))
        return out, _full(loss, groups, assignment, vocab_parallel=False)


def document_assignment(groups, docs, doc_positions):
    """The chunk assignment the data loader gives the first packed sample under ``groups``."""
    batching = DocumentBatching(eod=3, ulysses=groups.ulysses_size, ring=groups.ring_size)
    return batching([{"tokens": docs[0], "labels": docs[0], "loss_mask": torch.ones(SEQ),
                      "position_ids": doc_positions[0]}])["chunk_assignment"]


def _check(name, hf_dir, ckpt, layout):
    from transformers import AutoModelForCausalLM  # optional: transformers

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab, what = hf.config.vocab_size, f"{name} {layout}"
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab, (2, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (2, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(2, SEQ).contiguous()
    docs, segments, doc_positions = documents_batch(vocab=vocab)
    with loaded_checkpoint(ckpt, layout_flags=LAYOUTS[layout]) as built:
        groups = built.groups
        assignment = document_assignment(groups, docs, doc_positions)
        logits, loss = _run(built.model, groups, tokens, positions, labels)
        doc_logits, _ = _run(built.model, groups, docs, doc_positions, segments=segments,
                             assignment=assignment)
    ref = hf_logits(hf, tokens)
    assert_logits_match(logits, ref, what)
    want = torch.nn.functional.cross_entropy(ref.flatten(0, 1), labels.flatten(),
                                             reduction="none").view(2, SEQ)
    torch.testing.assert_close(loss.double(), want, atol=LOSS_TOL, rtol=0,
                               msg=f"{what} per-token loss")
    assert_logits_match(doc_logits, hf_logits(hf, docs, segments), f"{what} packed documents")


def _check_layouts(rank, world_size, dirs):
    apply_cpu_shims()
    for layout in LAYOUTS:
        for name in FAMILIES:
            _check(name, *dirs[name], layout)


@pytest.mark.slow
def test_imported_models_match_transformers_on_every_layout(dist_run, imported):  # noqa: F811
    dist_run(_check_layouts, 4, imported, timeout=900)
