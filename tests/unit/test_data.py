"""Data validation, GPT datasets, the micro-batch iterator and CP sharding (one process)."""

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron.training.data.batch import shard_batch_for_cp
from megatron.training.data.config import (
    DataConfig,
    DataConfigError,
    parse_data_path,
    parse_split,
    validate_data_config,
)
from megatron.training.data.indexed_files import inspect_indexed_dataset, scan_token_ids
from megatron.training.data.loader import (
    PretrainingSampler,
    build_data_iterator,
    build_gpt_datasets,
    collate_samples,
    worker_start_method,
)
from megatron.training.data.preprocess import TokenizerSpec, preprocess_jsonl
from megatron.training.data.tokenizer import build_tokenizer
from megatron.usp.token_order import positions_for_cp_rank, unshard_from_cp_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok(small_corpus):
    return build_tokenizer("SentencePieceTokenizer", small_corpus.tokenizer_model)


def _cfg(prefix, tmp_path, **kw):
    base = dict(data_path=[prefix], split="90,5,5", seq_length=64, seed=7,
                data_cache_path=str(tmp_path / "index-cache"), num_workers=0)
    base.update(kw)
    return DataConfig(**base)


def _copy(prefix, tmp_path, name="copy"):
    dst = str(tmp_path / name)
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, dst + ext)
    return dst


# =========================================================================== validation
def test_valid_corpus_passes_with_facts(small_corpus, tok, tmp_path):
    report = validate_data_config(_cfg(small_corpus.data_prefix, tmp_path), tok, cp_size=4)
    (info,) = report.datasets
    assert report.warnings == []
    assert info.num_documents == small_corpus.num_documents
    assert info.num_tokens == small_corpus.num_tokens
    assert info.tokens_scanned == info.num_tokens  # small: scanned whole
    assert 0 < info.max_token_id < tok.vocab_size
    assert info.eod_endings == info.eod_checked > 0


def test_missing_files_are_named(small_corpus, tok, tmp_path):
    prefix = _copy(small_corpus.data_prefix, tmp_path)
    os.remove(prefix + ".bin")
    with pytest.raises(DataConfigError, match=rf"missing {prefix}\.bin;"):
        validate_data_config(_cfg(prefix, tmp_path), tok, 1)
    with pytest.raises(DataConfigError, match=r"without '\.bin', i\.e\. --data-path .*copy$"):
        validate_data_config(_cfg(prefix + ".bin", tmp_path), tok, 1)
    # the output prefix given instead of the dataset prefix
    good = _copy(small_corpus.data_prefix, tmp_path, "mydata_text_document")
    with pytest.raises(DataConfigError, match=rf"did you mean --data-path {good} "):
        validate_data_config(_cfg(str(tmp_path / "mydata"), tmp_path), tok, 1)


def test_truncated_or_mismatched_files_are_refused(small_corpus, tok, tmp_path):
    prefix = _copy(small_corpus.data_prefix, tmp_path)
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(DataConfigError, match=r"copy\.bin: .* the \.bin is truncated"):
        validate_data_config(_cfg(prefix, tmp_path), tok, 1)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0" * 20)
    with pytest.raises(DataConfigError, match="longer than its index says"):
        validate_data_config(_cfg(prefix, tmp_path), tok, 1)

    prefix = _copy(small_corpus.data_prefix, tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".idx") - 8)
    with pytest.raises(DataConfigError, match=r"copy\.idx: .* truncated or corrupt"):
        validate_data_config(_cfg(prefix, tmp_path), tok, 1)

    prefix = _copy(small_corpus.data_prefix, tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"NOTANIDX!")
    with pytest.raises(DataConfigError, match="bad magic"):
        validate_data_config(_cfg(prefix, tmp_path), tok, 1)

    prefix = _copy(small_corpus.data_prefix, tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(9)
        f.write(struct.pack("<Q", 2))
    with pytest.raises(DataConfigError, match="index version 2"):
        validate_data_config(_cfg(prefix, tmp_path), tok, 1)


def test_tokenizer_vocabulary_mismatch_is_refused(small_corpus, tmp_path):
    small = build_tokenizer("NullTokenizer", None, vocab_size=100)
    with pytest.raises(DataConfigError, match=r"holds token id \d+, but the tokenizer .* has 101 "
                                              r"ids: the dataset was made with another tokenizer"):
        validate_data_config(_cfg(small_corpus.data_prefix, tmp_path), small, 1)


def test_large_datasets_are_scanned_in_windows_that_reach_both_ends(tmp_path):
    docs = [[1] * 50 for _ in range(10)]
    docs[-1][-1] = 900  # the very last token
    info = scan_token_ids(inspect_indexed_dataset(_write_raw(str(tmp_path / "w"), docs)),
                          window=8, windows=4)
    assert info.tokens_scanned == 32 and info.max_token_id == 900
    whole = scan_token_ids(inspect_indexed_dataset(str(tmp_path / "w")), window=8, windows=100)
    assert whole.tokens_scanned == 500


def _write_raw(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(np.asarray(d, dtype=dtype), [len(d)])
    b.finalize(prefix + ".idx")
    return prefix


def test_empty_documents(tok, tmp_path):
    allempty = _write_raw(str(tmp_path / "empty"), [[], [], []])
    with pytest.raises(DataConfigError, match=r"empty\.bin: the dataset has no tokens \(3 "):
        validate_data_config(_cfg(allempty, tmp_path), tok, 1)
    eod = tok.eod
    some = _write_raw(str(tmp_path / "some"), [[5, 6, eod], [], [7, eod]])
    report = validate_data_config(_cfg(some, tmp_path), tok, 1)
    assert report.warnings == [f"{some}.bin: 1 of 3 documents are empty (they contribute no tokens)"]
    noeod = _write_raw(str(tmp_path / "noeod"), [[5, 6], [7, 8, 9]])
    report = validate_data_config(_cfg(noeod, tmp_path), tok, 1)
    assert "ends with the tokenizer's EOD id" in report.warnings[0]


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(seq_length=1001), r"--seq-length=1001 must be divisible by .* = 8.*try --seq-length "
                                r"1000 or 1008"),
        (dict(seq_length=0), "--seq-length 0 must be a positive integer"),
        (dict(mock_data=True), "--mock-data and --data-path exclude one another"),
        (dict(data_path=None), "no data: pass --data-path"),
        (dict(split="90,x"), "--split '90,x'"),
        (dict(split="0,1,1"), "the train weight must be > 0"),
        (dict(split="1,2,3,4"), "up to three"),
        (dict(data_path=["0.5", "a", "b"]), "either prefixes only, or 'weight prefix' pairs"),
        (dict(data_path=["-1", "a"]), "weights must be positive"),
        (dict(micro_batch_size=2, global_batch_size=5), "--global-batch-size 5 must be a multiple"),
        (dict(num_workers=-1), "--num-workers -1"),
    ],
)
def test_bad_flags_are_named(small_corpus, tok, tmp_path, change, match):
    cfg = _cfg(small_corpus.data_prefix, tmp_path, **change)
    with pytest.raises(DataConfigError, match=match):
        validate_data_config(cfg, tok, cp_size=4)


def test_unwritable_cache_path_is_named(small_corpus, tok, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = _cfg(small_corpus.data_prefix, tmp_path, data_cache_path=str(blocker / "sub"))
    with pytest.raises(DataConfigError, match="--data-cache-path"):
        validate_data_config(cfg, tok, 1)


def test_parsers():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["0.3 a 0.7 b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path(["1", "a", "3", "b"]) == (["a", "b"], [1.0, 3.0])
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert parse_split("98/2/0") == pytest.approx([0.98, 0.02, 0.0])


# =========================================================================== datasets
def test_gpt_dataset_samples(small_corpus, tok, tmp_path):
    cfg = _cfg(small_corpus.data_prefix, tmp_path, seq_length=64)
    train, valid, test = build_gpt_datasets(cfg, tok, [40, 8, 8])
    assert len(train) >= 40 and len(valid) >= 8 and len(test) >= 8
    s = train[3]
    assert set(s) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert s["tokens"].shape == (64,) and s["tokens"].dtype == torch.int64
    assert torch.equal(s["labels"][:-1], s["tokens"][1:])
    assert torch.equal(s["position_ids"], torch.arange(64))
    assert torch.equal(s["loss_mask"], torch.ones(64))
    assert int(s["tokens"].max()) < tok.vocab_size
    # a sample is text: it detokenizes to words of the corpus
    assert len(tok.detokenize(s["tokens"].tolist()).split()) > 5
    # same seed, same samples; another seed, another order
    again, _, _ = build_gpt_datasets(cfg, tok, [40, 8, 8])
    assert torch.equal(again[3]["tokens"], s["tokens"])
    other, _, _ = build_gpt_datasets(_cfg(small_corpus.data_prefix, tmp_path, seed=8), tok,
                                     [40, 8, 8])
    assert not all(torch.equal(other[i]["tokens"], train[i]["tokens"]) for i in range(5))


def test_eod_mask_loss(small_corpus, tok, tmp_path):
    cfg = _cfg(small_corpus.data_prefix, tmp_path, seq_length=512, eod_mask_loss=True)
    train, _, _ = build_gpt_datasets(cfg, tok, [10, None, None])
    found = 0
    for i in range(len(train)):
        s = train[i]
        is_eod = s["tokens"] == tok.eod
        assert torch.equal(s["loss_mask"] == 0, is_eod)
        found += int(is_eod.sum())
    assert found > 0


def test_split_without_documents_is_refused(small_corpus, tok, tmp_path):
    # ~30 documents: a 0.1% test share gets none, which would make megatron-core loop forever
    cfg = _cfg(small_corpus.data_prefix, tmp_path, split="969,30,1")
    with pytest.raises(DataConfigError, match=r"--split 969,30,1: the test split .* hold no tokens"):
        build_gpt_datasets(cfg, tok, [10, 2, 2])
    train, valid, test = build_gpt_datasets(cfg, tok, [10, 2, None])  # test not sampled: fine
    assert train is not None


def test_blend_follows_weights(small_corpus, tok, tmp_path):
    other = tmp_path / "other.jsonl"
    with open(other, "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"Another source, document {i}. " * 20}) + "\n")
    s = preprocess_jsonl([str(other)], str(tmp_path / "other"),
                         TokenizerSpec("SentencePieceTokenizer", small_corpus.tokenizer_model))
    cfg = _cfg(None, tmp_path, data_path=["0.25", small_corpus.data_prefix, "0.75",
                                          s.output_prefixes["text"]])
    validate_data_config(cfg, tok, 1)
    train, _, _ = build_gpt_datasets(cfg, tok, [400, 8, 8])
    assert type(train).__name__ == "BlendedDataset" and len(train) == 400
    batch = collate_samples([train[i] for i in range(400)])
    share = float((batch["dataset_id"] == 1).float().mean())
    assert abs(share - 0.75) < 0.02


def test_mock_data(tmp_path):
    null = build_tokenizer("NullTokenizer", None, vocab_size=500)
    cfg = DataConfig(mock_data=True, seq_length=128, seed=1)
    validate_data_config(cfg, null, cp_size=2)
    train, valid, test = build_gpt_datasets(cfg, null, [20, 4, 4])
    s = train[0]
    assert s["tokens"].shape == (128,) and int(s["tokens"].max()) <= null.eod


# =========================================================================== iteration
def test_sampler_slices_global_batches_and_resumes():
    micro, dp, total = 2, 3, 50
    per_rank = [list(PretrainingSampler(total, 0, micro, d, dp)) for d in range(dp)]
    assert all(len(r) == total // (micro * dp) for r in per_rank)
    for step in range(len(per_rank[0])):
        glob = [i for d in range(dp) for i in per_rank[d][step]]
        assert glob == list(range(step * micro * dp, (step + 1) * micro * dp))
    resumed = list(PretrainingSampler(total, 2 * micro * dp, micro, 1, dp))
    assert resumed == per_rank[1][2:]
    with pytest.raises(DataConfigError, match="past the dataset's 50 samples"):
        PretrainingSampler(total, 50, micro, 0, dp)
    with pytest.raises(ValueError):
        PretrainingSampler(total, 0, micro, 3, dp)


@pytest.mark.slow
def test_iterator_batches_are_deterministic_and_resumable(small_corpus, tok, tmp_path):
    cfg = _cfg(small_corpus.data_prefix, tmp_path, seq_length=32)
    train, _, _ = build_gpt_datasets(cfg, tok, [64, None, None])
    micro, dp, rank = 2, 2, 1
    it = build_data_iterator(train, micro, rank, dp, consumed_samples=0, num_workers=0)
    batches = [next(it) for _ in range(5)]
    b = batches[0]
    assert b["attention_mask"] is None
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert b[key].shape == (micro, 32)
    for step, batch in enumerate(batches):  # Megatron's slicing of the global batch
        idx = [step * micro * dp + rank * micro + j for j in range(micro)]
        assert torch.equal(batch["tokens"], torch.stack([train[i]["tokens"] for i in idx]))
    workers = build_data_iterator(train, micro, rank, dp, consumed_samples=0, num_workers=2)
    for want in batches:
        assert torch.equal(next(workers)["tokens"], want["tokens"])
    # workers started by a fork server (--optimizer-cpu-offload: nothing shared with the
    # trainer's memory) give the same batches
    assert worker_start_method(True) == "forkserver" and worker_start_method(False) is None
    served = build_data_iterator(train, micro, rank, dp, consumed_samples=0, num_workers=2,
                                 worker_start_method=worker_start_method(True))
    for want in batches:
        assert torch.equal(next(served)["tokens"], want["tokens"])
    resumed = build_data_iterator(train, micro, rank, dp, consumed_samples=3 * micro * dp,
                                  num_workers=0)
    assert torch.equal(next(resumed)["tokens"], batches[3]["tokens"])
    assert build_data_iterator(None, micro, rank, dp) is None


def test_shard_batch_for_cp():
    s, cp = 48, 4
    tokens = torch.arange(2 * s).view(2, s)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, s),
             "position_ids": torch.arange(s).repeat(2, 1), "attention_mask": None,
             "dataset_id": torch.tensor([0, 1])}
    shards = [shard_batch_for_cp(batch, c, cp) for c in range(cp)]
    for c, sh in enumerate(shards):
        assert sh["tokens"].shape == (2, s // cp)
        assert sh["position_ids"][0].tolist() == positions_for_cp_rank(s, c, cp)
        assert torch.equal(sh["tokens"], tokens[:, positions_for_cp_rank(s, c, cp)])
        assert sh["attention_mask"] is None and torch.equal(sh["dataset_id"], batch["dataset_id"])
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(unshard_from_cp_ranks([sh[key] for sh in shards], 1), batch[key])
    assert shard_batch_for_cp(batch, 0, 1)["tokens"] is tokens
    with pytest.raises(DataConfigError, match="--seq-length"):
        shard_batch_for_cp({"tokens": torch.zeros(1, 12)}, 0, 4)
    with pytest.raises(ValueError, match="attention_mask None"):
        shard_batch_for_cp({"tokens": tokens, "attention_mask": torch.ones(1)}, 0, 2)


@pytest.mark.slow
def test_bench_dataloader_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "bench_dataloader.py"), "--mock-data",
         "--seq-length", "2048", "--num-samples", "8", "--num-workers", "0",
         "--ulysses-degree", "2", "--ring-degree", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["cp_size"] == 4 and r["samples_timed"] == 8
    assert r["loader_samples_per_s"] > 0
    assert r["training_samples_per_s_total"] == pytest.approx(2 * 25000 / 2048)
    assert r["headroom"] == pytest.approx(r["loader_samples_per_s"] / r["training_samples_per_s_per_rank"])
    assert "training at 2048 tokens on 2 H200 consumes" in proc.stdout
    assert "2 GPUs x 25,000 tokens/s/GPU / 2,048 tokens/sample" in proc.stdout
