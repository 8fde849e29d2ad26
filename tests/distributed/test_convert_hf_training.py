"""Training starts from an imported model: ``pretrain_gpt.py --load DIR --finetune`` with the
model's own Hugging Face tokenizer runs 2 iterations, and the first iteration's loss equals
transformers' loss on the same batch (float32, 1e-4 relative: the loss is a mean of 64
per-token float32 cross entropies).

The tiny untied Llama of ``tests/unit/test_convert_hf.py`` gets a word-level tokenizer of its
256-token vocabulary (``</s>`` = 3 is its EOS, the documents' separator); a small corpus of
random words is tokenised with ``tools/preprocess_data.py``. The training runs in a test rank
(``pretrain(args)``) whose batches are recorded on their way to the model.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import torch

import megatron.training.data.batch as batch_module
from megatron.training.cli.arguments import parse_args
from tests.unit.test_convert_hf import ROOT, VOCAB, make_hf_model, run_convert_tool

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
    prep = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "docs.jsonl"),
         "--output-prefix", str(tmp_path / "data"), "--tokenizer-type",
         "HuggingFaceTokenizer", "--tokenizer-model", hf_dir, "--workers", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT))
    assert prep.returncode == 0, prep.stderr[-3000:]
    with open(os.path.join(ckpt, "model_flags.txt")) as f:
        model_flags = f.read().split()
    metrics = str(tmp_path / "metrics.jsonl")
    argv = model_flags + [
        "--load", ckpt, "--finetune", "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", hf_dir, "--data-path", str(tmp_path / "data_text_document"),
        "--split", "100,0,0", "--seq-length", str(SEQ), "--micro-batch-size", str(BATCH),
        "--global-batch-size", str(BATCH), "--train-iters", "2", "--lr", "1e-4",
        "--device", "cpu", "--num-workers", "0", "--log-interval", "1",
        "--metrics-file", metrics, "--eval-iters", "0"]
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
