"""The evaluation's view of a checkpoint: on 4 gloo ranks under U2xR2 and TP2xR2, the logits
of a sequence of any length (padded to the layout, sharded, gathered) equal transformers'
logits of the same imported model (KL <= 1e-9, |dlogit| <= 1e-4), so the per-bucket losses
agree to 1e-5. A tokenizer with more ids than the checkpoint has rows is refused."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_convert_hf import assert_logits_match, make_hf_model, run_convert_tool

LAYOUTS = {"u2r2": ["--ulysses-degree", "2", "--ring-degree", "2"],
           "tp2r2": ["--tensor-model-parallel-size", "2", "--ring-degree", "2"]}
LENGTHS = (37, 64, 200)    # 200: past the model's 128 positions


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_tiny")
    hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
    make_hf_model("llama").save_pretrained(hf_dir)
    run_convert_tool([["import", hf_dir, ckpt]])
    return hf_dir, ckpt


def _check(rank, world_size, hf_dir, ckpt):
    from transformers import AutoModelForCausalLM

    from megatron.convert.checkpoint_io import loaded_checkpoint
    from megatron.evaluation.models import checkpoint_logits, transformers_logits
    from megatron.evaluation.perplexity import evaluate_perplexity
    from megatron.training.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ref = transformers_logits(hf, torch.device("cpu"))
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    windows = [torch.randint(0, vocab, (n + 1,), generator=gen).tolist() for n in LENGTHS]
    for name, flags in LAYOUTS.items():
        with loaded_checkpoint(ckpt, layout_flags=flags) as built:
            ours = checkpoint_logits(built.model, built.groups, vocab)
            for ids in windows:
                got = ours(ids)
                assert got.shape == (len(ids), vocab)
                assert_logits_match(got.double(), ref(ids).double(), f"{name} {len(ids)}")
            mine = evaluate_perplexity(ours, windows[:1], 8)
        want = evaluate_perplexity(ref, windows[:1], 8)
        for a, b in zip(mine, want):
            assert abs(a.nll - b.nll) <= 1e-5, (name, a, b)


@pytest.mark.slow
def test_checkpoint_logits_match_transformers_on_every_layout(dist_run, tiny):
    dist_run(_check, 4, *tiny, timeout=600)


def _refuse_a_larger_tokenizer(rank, world_size, hf_dir, ckpt):
    from megatron.evaluation.config import EvalConfigError, parse
    from megatron.evaluation.run import model_logits
    from megatron.training.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    config = parse(["--load", ckpt, "--tokenizer-model", hf_dir, "--ppl-length", "16"])
    with pytest.raises(EvalConfigError, match=rf"^--tokenizer-model {hf_dir} has 257 tokens, "
                                              rf"more than the 256 rows of --load {ckpt};"):
        with model_logits(config, 257):
            pass
    with model_logits(config, 256) as (_, about):
        assert about["layout"] == "TP1 U1 R1"


def test_a_tokenizer_with_more_ids_than_rows_is_refused(dist_run, tiny):
    dist_run(_refuse_a_larger_tokenizer, 1, *tiny, timeout=300)


def _fewer_ids_than_rows(rank, world_size, hf_dir, ckpt, corpus):
    from megatron.evaluation.config import parse
    from megatron.evaluation.run import evaluate
    from megatron.training.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    common = ["--tokenizer-model", hf_dir, "--ppl-length", "40", "--ppl-documents", "2",
              "--ppl-data", corpus, "--bucket-tokens", "20"]
    ours = evaluate(parse(["--load", ckpt] + common))["perplexity"]["buckets"]
    theirs = evaluate(parse(["--hf-model", hf_dir] + common))["perplexity"]["buckets"]
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        # normalised over all 384 rows on both sides (over the 300 token ids: ~0.25 apart)
        assert abs(a["nll"] - b["nll"]) <= 1e-5, (a, b)


@pytest.mark.slow
def test_a_model_with_more_rows_than_token_ids_scores_as_transformers_does(dist_run, tmp_path):
    from tests.distributed.test_convert_hf_training import (
        save_qwen2_with_fewer_token_ids,
        write_corpus,
    )

    hf_dir, ckpt, corpus = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "d.jsonl")
    write_corpus(corpus)
    save_qwen2_with_fewer_token_ids(hf_dir, corpus)
    run_convert_tool([["import", hf_dir, ckpt]])
    dist_run(_fewer_ids_than_rows, 1, hf_dir, ckpt, corpus, timeout=300)
