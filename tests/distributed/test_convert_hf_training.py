"""Training starts from an imported model: ``pretrain_gpt.py --load DIR --finetune`` with the
model's own Hugging Face tokenizer runs 2 iterations, and the first iteration's loss equals
transformers' loss on the same batch (float32, 1e-4 relative: the loss is a mean of 64
per-token float32 cross entropies).

The tiny untied Llama of ``tests/unit/test_convert_hf.py`` gets a word-level tokenizer of its
256-token vocabulary (``</s>`` = 3 is its EOS, the documents' separator); a small corpus of
random words is tokenised with ``tools/preprocess_data.py``. The training runs in a test rank
(``pretrain(args)``) whose batches are recorded on their way to the model.

A model with more embedding rows than its tokenizer has ids (Qwen2: 151936 rows, 151665
tokens) keeps its rows: a tiny Qwen2 of 384 rows with a byte-level BPE tokenizer of 300 ids
trains a step under TP2 (torchrun), exports, and transformers loads the 384 rows and computes the logits
the trained checkpoint computes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

import megatron.training.data.batch as batch_module
from megatron.training.cli.arguments import parse_args
from megatron.training.cpu_shims import apply_cpu_shims
from tests.helpers import free_port
from tests.unit.test_convert_hf import (
    COMMON,
    ROOT,
    VOCAB,
    _ours,
    assert_logits_match,
    make_hf_model,
    run_convert_tool,
)

SPECIALS = ["<unk>", "<s>", "<pad>", "</s>"]   # ids 0..3; </s> is the models' eos_token_id
SEQ, BATCH, REL_TOL = 32, 2, 1e-4


def save_word_tokenizer(out_dir: str) -> None:
    """A word-level tokenizer of SPECIALS + ``w4 .. w255`` (one id per model row)."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # optional: tokenizers
    from transformers import PreTrainedTokenizerFast  # optional: transformers

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                  pad_token="<pad>", eos_token="</s>")
    assert len(tok) == VOCAB
    tok.save_pretrained(out_dir)


def write_corpus(path: str, docs: int = 64) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(docs):
            words = [f"w{rng.randrange(len(SPECIALS), VOCAB)}" for _ in range(rng.randint(5, 60))]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")


def finetune_argv(model_flags, ckpt: str, tokenizer_dir: str, data_prefix: str, iters: int,
                  lr: str) -> list:
    """pretrain_gpt.py flags that continue the imported ``ckpt`` on CPU (``--finetune``) on
    the preprocessed ``data_prefix``, with the model's own tokenizer."""
    return model_flags + [
        "--load", ckpt, "--finetune", "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", tokenizer_dir, "--data-path", data_prefix, "--split", "100,0,0",
        "--seq-length", str(SEQ), "--micro-batch-size", str(BATCH),
        "--global-batch-size", str(BATCH), "--train-iters", str(iters), "--lr", lr,
        "--device", "cpu", "--num-workers", "0", "--eval-iters", "0"]


def preprocess(jsonl: str, prefix: str, tokenizer_dir: str) -> None:
    prep = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", jsonl, "--output-prefix",
         prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
         tokenizer_dir, "--workers", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT))
    assert prep.returncode == 0, prep.stderr[-3000:]


def _train(rank, world_size, argv, out_path):
    from megatron.training.loop import pretrain  # megatron-core on first use

    real, seen = batch_module.get_batch, []

    def recording(data_iterator, ctx):
        out = real(data_iterator, ctx)
        seen.append({k: out[k].clone() for k in ("tokens", "labels", "loss_mask",
                                                 "position_ids")})
        return out

    batch_module.get_batch = recording
    result = pretrain(parse_args(argv))
    assert result.iteration == 2, result.iteration
    torch.save(seen, out_path)


def test_finetune_starts_from_the_imported_model(dist_run, tmp_path):
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    hf = make_hf_model("llama")
    hf.save_pretrained(hf_dir)
    save_word_tokenizer(hf_dir)
    run_convert_tool([["import", hf_dir, ckpt]])
    write_corpus(str(tmp_path / "docs.jsonl"))
    preprocess(str(tmp_path / "docs.jsonl"), str(tmp_path / "data"), hf_dir)
    with open(os.path.join(ckpt, "model_flags.txt")) as f:
        model_flags = f.read().split()
    metrics = str(tmp_path / "metrics.jsonl")
    argv = finetune_argv(model_flags, ckpt, hf_dir, str(tmp_path / "data_text_document"),
                         iters=2, lr="1e-4") + ["--log-interval", "1", "--metrics-file", metrics]
    dist_run(_train, 1, argv, str(tmp_path / "batches.pt"), timeout=600)
    first = torch.load(str(tmp_path / "batches.pt"))[0]
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    loss = next(r["lm_loss"] for r in records if r.get("kind") == "train"
                and r["iteration"] == 1)
    with torch.no_grad():
        logits = hf(first["tokens"], position_ids=first["position_ids"]).logits.double()
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                  first["labels"].flatten(), reduction="none")
    mask = first["loss_mask"].flatten().double()
    want = (per_token * mask).sum().item() / mask.sum().item()
    assert abs(loss - want) <= REL_TOL * want, (loss, want)


# --------------------------------------------------------------------------- fewer token ids
ROWS, TOKEN_IDS = 384, 300


def save_qwen2_with_fewer_token_ids(hf_dir: str, corpus: str) -> None:
    """A tiny random Qwen2 of ROWS embedding rows and a byte-level BPE tokenizer of TOKEN_IDS
    ids trained on ``corpus`` (transformers reads a qwen2 directory's tokenizer as
    ``Qwen2Tokenizer``, which needs byte-level BPE)."""
    import transformers  # optional: transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # optional

    with open(corpus) as f:
        texts = [json.loads(line)["text"] for line in f]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=TOKEN_IDS, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                               pad_token="<|endoftext|>")
    assert len(tok) == TOKEN_IDS
    config = transformers.Qwen2Config(**{**COMMON, "vocab_size": ROWS, "use_sliding_window": False,
                                         "eos_token_id": tok.eos_token_id,
                                         "tie_word_embeddings": False})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if "norm" in name
                        else 0.08 * torch.randn_like(param))
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)


def _compare_export(rank, world_size, ckpt, hf_dir):
    from transformers import AutoModelForCausalLM  # optional: transformers

    from megatron.convert.checkpoint_io import loaded_checkpoint  # megatron-core on first use

    apply_cpu_shims()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert hf.model.embed_tokens.weight.shape[0] == ROWS == hf.lm_head.weight.shape[0]
    tokens = torch.randint(0, ROWS, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(tokens).logits.double()
    with loaded_checkpoint(ckpt) as built:
        assert_logits_match(_ours(built.model, tokens), want, "trained Qwen2, exported")


@pytest.mark.slow
def test_a_tokenizer_with_fewer_ids_than_rows_trains_and_exports(dist_run, tmp_path):
    hf_dir, ckpt, out = (str(tmp_path / d) for d in ("hf", "ckpt", "out"))
    write_corpus(str(tmp_path / "docs.jsonl"))
    save_qwen2_with_fewer_token_ids(hf_dir, str(tmp_path / "docs.jsonl"))
    run_convert_tool([["import", hf_dir, ckpt]])
    with open(os.path.join(ckpt, "model_flags.txt")) as f:
        model_flags = f.read().split()
    assert model_flags[model_flags.index("--vocab-size") + 1] == str(ROWS)
    preprocess(str(tmp_path / "docs.jsonl"), str(tmp_path / "data"), hf_dir)
    argv = finetune_argv(model_flags, ckpt, hf_dir, str(tmp_path / "data_text_document"),
                         iters=1, lr="1e-3") + ["--tensor-model-parallel-size", "2",
                                                "--save", out]
    # torchrun, not test ranks: the checkpoint writer starts processes, which a daemonic
    # test rank may not
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "pretrain_gpt.py"] + argv
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert run.returncode == 0, run.stderr[-4000:]
    run_convert_tool([["export", out, str(tmp_path / "out_hf")]])
    dist_run(_compare_export, 1, out, str(tmp_path / "out_hf"), timeout=300)
    from safetensors.torch import load_file  # optional: safetensors

    before = load_file(os.path.join(hf_dir, "model.safetensors"))
    after = load_file(str(tmp_path / "out_hf" / "model.safetensors"))
    assert after.keys() == before.keys()
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"]), "no step taken"
