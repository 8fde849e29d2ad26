"""Scaled RoPE (llama3, YaRN, linear) under U2, R2, TP2, U2xR2 and R4: the imported models of
``tests/unit/test_convert_hf_rope.py`` loaded on 2 (4) gloo ranks still compute what
transformers computes (one process, the whole sequence).

Each CP rank gets its shard of the tokens and of their positions (spread up to 4x the
original context, so the scaled frequencies matter), and of packed documents (positions
restarting, the balanced chunk assignment, this ring rank's document plan); the logits
gathered over TP and CP are compared with transformers' (KL <= 1e-9, max |dlogit| <= 1e-4). U2
and U2xR2 run ``--fused-kernels usp`` (the fused QKV split + RoPE path and YaRN's factor on
cos and sin; its plain PyTorch form on the CPU), R2, TP2 and R4 megatron-core's own RoPE.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_convert_hf_layouts import _run, document_assignment
from tests.unit.test_convert_hf import SEQ, assert_logits_match, documents_batch, hf_logits
from tests.unit.test_convert_hf_rope import SCALED, imported  # noqa: F401  (fixture)

LAYOUTS = {"u2_fused": ["--ulysses-degree", "2", "--fused-kernels", "usp"],
           "r2": ["--ring-degree", "2", "--fused-kernels", "torch"],
           "u2r2_fused": ["--ulysses-degree", "2", "--ring-degree", "2", "--fused-kernels",
                          "usp"],
           "r4": ["--ring-degree", "4", "--fused-kernels", "torch"],
           "tp2": ["--tensor-model-parallel-size", "2", "--fused-kernels", "torch"]}


def _check(name, hf_dir, ckpt, layout):
    from transformers import AutoModelForCausalLM

    from megatron.convert.checkpoint_io import loaded_checkpoint

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab, what = hf.config.vocab_size, f"{name} {layout}"
    tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(11))
    step = 4 * SCALED[name][1] // SEQ
    positions = (torch.arange(SEQ) * step).expand(2, SEQ).contiguous()
    docs, segments, doc_positions = documents_batch(vocab=vocab)
    with loaded_checkpoint(ckpt, layout_flags=LAYOUTS[layout]) as built:
        groups = built.groups
        assignment = document_assignment(groups, docs, doc_positions)
        logits, _ = _run(built.model, groups, tokens, positions)
        doc_logits, _ = _run(built.model, groups, docs, doc_positions, segments=segments,
                             assignment=assignment)
    with torch.no_grad():
        ref = hf(tokens, position_ids=positions).logits.double()
    assert_logits_match(logits, ref, f"{what} positions up to {int(positions.max())}")
    assert_logits_match(doc_logits, hf_logits(hf, docs, segments), f"{what} packed documents")


def _check_layouts(rank, world_size, dirs, layouts):
    from megatron.training.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    for layout in layouts:
        for name, (hf_dir, ckpt) in dirs.items():
            _check(name, hf_dir, ckpt, layout)


def test_scaled_rope_matches_transformers_under_u2_r2_and_tp2(dist_run, imported):  # noqa: F811
    dist_run(_check_layouts, 2, imported, ["u2_fused", "r2", "tp2"], timeout=600)


@pytest.mark.slow
def test_scaled_rope_matches_transformers_under_u2xr2_and_r4(dist_run, imported):  # noqa: F811
    dist_run(_check_layouts, 4, imported, ["u2r2_fused", "r4"], timeout=600)
