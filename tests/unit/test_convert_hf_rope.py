"""Hugging Face models with scaled RoPE (llama3, YaRN, linear) import, compute what transformers
computes, and export back.

Tiny random Llamas (helpers of ``tests/unit/test_convert_hf.py``) imported with
``tools/convert_hf.py``, loaded into the one-rank float32 model and compared with
transformers: logits to KL <= 1e-9 and max |dlogit| <= 1e-4, at positions 0..47, at positions
spread up to 4x the original context (where the scaling changes the frequencies most), and on
packed documents (positions restarting); greedy decoding, the export's weights and its
decoding as in the other families. The llama3 model has theta 500000, so its head dimension
of 8 has frequencies in each of llama3's three bands.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.unit.test_convert_hf import (
    COMMON,
    SEQ,
    VOCAB,
    _check_family,
    _ours,
    assert_logits_match,
    run_convert_tool,
)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 8.0, "beta_slow": 1.0}
# name -> (LlamaConfig fields, the original context positions reach 4x of)
SCALED = {
    "llama3": (dict(rope_theta=500000.0, rope_scaling=LLAMA3), 8192),
    "yarn": (dict(rope_scaling=YARN), 32),
    "linear": (dict(rope_scaling={"rope_type": "linear", "factor": 4.0}), 32),
}


def make_scaled_model(name: str, seed: int = 0):
    import transformers

    fields, _ = SCALED[name]
    config = transformers.LlamaConfig(**{**COMMON, "tie_word_embeddings": False, **fields})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if "norm" in pname
                        else 0.08 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_hf_rope")
    dirs, jobs = {}, []
    for name in SCALED:
        hf_dir, ckpt = str(root / name / "hf"), str(root / name / "ckpt")
        make_scaled_model(name).save_pretrained(hf_dir)
        jobs.append(["import", hf_dir, ckpt])
        dirs[name] = (hf_dir, ckpt)
    run_convert_tool(jobs)
    return dirs


def _check_far_positions(name: str, hf_dir: str, ckpt: str) -> None:
    from transformers import AutoModelForCausalLM

    from megatron.convert.checkpoint_io import loaded_checkpoint

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    original = SCALED[name][1]
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(11))
    positions = (torch.arange(SEQ) * (4 * original // SEQ)).unsqueeze(0)   # up to 4x
    with torch.no_grad():
        ref = hf(tokens, position_ids=positions).logits.double()
    with loaded_checkpoint(ckpt) as built:
        assert_logits_match(_ours(built.model, tokens, positions), ref,
                            f"{name} logits at positions up to {int(positions.max())}")


def _check_all(rank, world_size, imported, out_root):
    from megatron.training.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    for name, (hf_dir, ckpt) in imported.items():
        _check_far_positions(name, hf_dir, ckpt)
        _check_family(name, hf_dir, ckpt, os.path.join(out_root, name))


def test_scaled_rope_models_match_transformers(dist_run, imported, tmp_path):
    dist_run(_check_all, 1, imported, str(tmp_path), timeout=600)


def test_import_writes_the_scaling_flags_and_export_writes_the_scaling_back(imported,
                                                                            tmp_path):
    import json

    from megatron.convert.checkpoint_io import FLAGS_FILE

    with open(os.path.join(imported["llama3"][1], FLAGS_FILE)) as f:
        flags = f.read().split()
    assert flags[flags.index("--rope-scaling-factor") + 1] == "8"
    assert "--use-rope-scaling" in flags
    with open(os.path.join(imported["yarn"][1], FLAGS_FILE)) as f:
        flags = f.read().split()
    assert flags[flags.index("--position-embedding-type") + 1] == "yarn"
    assert flags[flags.index("--yarn-original-max-position-embeddings") + 1] == "32"
    out = tmp_path / "yarn_export"
    run_convert_tool([["export", imported["yarn"][1], str(out)]])
    params = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert {k: params[k] for k in YARN} == YARN
