"""The imported SmolLM2-135M-Instruct under R4, TP3 and U3 on gloo ranks, with and without
packed documents, against transformers on the held-out text of
``tests/unit/test_convert_smollm2.py`` (its checks and tolerances: on the text KL <= 1e-9
and max |dlogit| <= 1e-4; on packed documents KL <= 1e-9 and ours and transformers' float32
logits each within 2e-4 of the float64 reference; per-token loss to 1e-5 of the cross
entropy of the gathered logits).

SmolLM2-135M has 9 query heads and 3 KV heads: TP2 and Ulysses 2 do not divide them (the
layout check refuses both), so TP3 and U3 stand in for TP2 and U2xR2; R4 splits the
sequence only. The references are computed once in the test process; each rank loads the
checkpoint under its layout (megatron-core reshards it), is fed its shard of the tokens (the
balanced chunk assignment of ``DocumentBatching`` for documents) and the logits are
gathered over TP and CP.
"""

from __future__ import annotations

import pytest
import torch

from megatron.convert.checkpoint_io import loaded_checkpoint
from megatron.training.cpu_shims import apply_cpu_shims
from megatron.training.data.documents import DocumentBatching
from tests.distributed.test_convert_hf_layouts import _run
from tests.unit.test_convert_hf import assert_logits_match
from tests.unit.test_convert_smollm2 import (
    SEQ,
    assert_loss_matches,
    assert_near_exact,
    references,
)

pytestmark = pytest.mark.slow
LAYOUTS = {"r4": (4, ["--ring-degree", "4"]),
           "tp3": (3, ["--tensor-model-parallel-size", "3"]),
           "u3": (3, ["--ulysses-degree", "3"])}


def _check(refs, ckpt, layout):
    tokens, labels, docs = refs["tokens"], refs["labels"], refs["docs"]
    positions = torch.arange(SEQ).unsqueeze(0)
    eos = int(docs[0, -1])
    # --seq-length: the text's, not the import's 8192, which 2 x U3 does not divide
    flags = LAYOUTS[layout][1] + ["--seq-length", str(SEQ)]
    with loaded_checkpoint(ckpt, layout_flags=flags) as built:
        groups = built.groups
        batching = DocumentBatching(eod=eos, ulysses=groups.ulysses_size, ring=groups.ring_size)
        assignment = batching([{"tokens": docs[0], "labels": docs[0],
                                "loss_mask": torch.ones(SEQ),
                                "position_ids": refs["doc_positions"][0]}])["chunk_assignment"]
        logits, loss = _run(built.model, groups, tokens, positions, labels)
        doc_logits, _ = _run(built.model, groups, docs, refs["doc_positions"],
                             segments=refs["segments"], assignment=assignment)
    what = f"SmolLM2 {layout}"
    assert_logits_match(logits, refs["hf"], f"{what} held-out text")
    assert_loss_matches(loss, logits, refs["hf"], labels, what)
    assert_near_exact(doc_logits, refs["doc_hf"], refs["doc_exact"], f"{what} packed documents")


def _check_layouts(rank, world_size, refs, ckpt, layouts):
    apply_cpu_shims()
    for layout in layouts:
        _check(refs, ckpt, layout)


def test_smollm2_matches_transformers_under_r4_tp3_and_u3(dist_run, smollm2):
    hf_dir, ckpt = smollm2
    refs = references(hf_dir)
    dist_run(_check_layouts, 4, refs, ckpt, ["r4"], timeout=900)
    dist_run(_check_layouts, 3, refs, ckpt, ["tp3", "u3"], timeout=900)
