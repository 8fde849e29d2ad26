"""Preprocessing (JSONL -> .bin/.idx), the tokenizer tool, and the built-in default corpus."""

import importlib.util
import json
import multiprocessing as mp
import os
import shutil

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.training.data import corpus as corpus_mod
from megatron.training.data.preprocess import PreprocessError, TokenizerSpec, preprocess_jsonl
from megatron.training.data.tokenizer import build_tokenizer
from tests.unit.conftest import SMALL_BYTES, SMALL_VOCAB

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _read(path):
    with open(path, "rb") as f:
        return f.read()


GOOD = ["First document. It has two sentences.", "Second: naïve café ☃ and digits 12345."]


def _write_jsonl(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            f.write(b"\n")
    return str(path)


def _messy_jsonl(tmp_path):
    return _write_jsonl(tmp_path / "in.jsonl", [
        json.dumps({"text": GOOD[0], "id": 1}),
        json.dumps({"text": ""}),                      # empty document
        "",                                            # blank line
        "{not json",                                   # line 4: bad JSON
        json.dumps({"body": "wrong key"}),             # line 5: missing key
        json.dumps({"text": None}),                    # line 6: not a string
        b'{"text": "\xff\xfe"}',                       # line 7: not UTF-8
        "[1, 2]",                                      # line 8: not an object
        json.dumps({"text": "   \n  "}),               # blank text: empty document
        json.dumps({"text": GOOD[1]}, ensure_ascii=False),
    ])


def _spec(corpus):
    return TokenizerSpec("SentencePieceTokenizer", corpus.tokenizer_model)


def test_preprocess_writes_documents_with_eod_and_counts_every_skip(tmp_path, small_corpus):
    src = _messy_jsonl(tmp_path)
    warnings = []
    s = preprocess_jsonl([src], str(tmp_path / "out"), _spec(small_corpus),
                         skip_bad_lines=True, warn=warnings.append)
    prefix = str(tmp_path / "out_text_document")
    assert s.output_prefixes == {"text": prefix}
    assert (s.lines, s.blank_lines) == (10, 1)
    assert (s.skipped_bad_json, s.skipped_missing_key, s.skipped_empty) == (3, 2, {"text": 2})
    assert s.documents_written == {"text": 2}
    assert [w.split(":")[1] for w in warnings] == ["4", "5", "6", "7", "8"]
    assert "not UTF-8" in warnings[3] and "expected a JSON object" in warnings[4]
    line = s.summary_line()
    assert "documents written (text: 2)" in line and "3 bad JSON, 2 missing key" in line

    tok = build_tokenizer("SentencePieceTokenizer", small_corpus.tokenizer_model)
    ds = IndexedDataset(prefix)
    assert ds.index.dtype == np.uint16  # vocabulary of 1000 fits
    assert len(ds) == 2 and s.tokens_written["text"] == int(ds.sequence_lengths.sum())
    for i, text in enumerate(GOOD):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod and ids[:-1] == tok.tokenize(text)
        assert tok.detokenize(ids[:-1]) == text


def test_bad_line_fails_with_file_and_line_and_writes_nothing(tmp_path, small_corpus):
    src = _messy_jsonl(tmp_path)
    with pytest.raises(PreprocessError, match=r"in\.jsonl:4: invalid JSON .*--skip-bad-lines"):
        preprocess_jsonl([src], str(tmp_path / "out"), _spec(small_corpus))
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # no partial or temporary files


def test_workers_give_byte_identical_files(tmp_path, small_corpus):
    docs = [json.dumps({"text": f"Document {i}: " + GOOD[i % 2] * (1 + i % 5)}) for i in range(300)]
    src = _write_jsonl(tmp_path / "many.jsonl", docs)
    one = preprocess_jsonl([src], str(tmp_path / "w1"), _spec(small_corpus), workers=1)
    two = preprocess_jsonl([src, src], str(tmp_path / "w2"), _spec(small_corpus), workers=2)
    assert two.documents_written["text"] == 2 * one.documents_written["text"] == 600
    ds1, ds2 = IndexedDataset(one.output_prefixes["text"]), IndexedDataset(two.output_prefixes["text"])
    for i in range(300):
        assert np.array_equal(ds1[i], ds2[i]) and np.array_equal(ds1[i], ds2[300 + i])
    three = preprocess_jsonl([src], str(tmp_path / "w3"), _spec(small_corpus), workers=2)
    for ext in (".bin", ".idx"):
        assert _read(one.output_prefixes["text"] + ext) == _read(three.output_prefixes["text"] + ext)


def test_several_json_keys_and_no_append_eod(tmp_path, small_corpus):
    src = _write_jsonl(tmp_path / "kv.jsonl", [
        json.dumps({"title": "A title", "body": GOOD[0]}),
        json.dumps({"title": "", "body": GOOD[1]}),
    ])
    s = preprocess_jsonl([src], str(tmp_path / "kv"), _spec(small_corpus),
                         json_keys=["title", "body"], append_eod=False)
    assert s.documents_written == {"title": 1, "body": 2}
    assert s.skipped_empty == {"title": 1, "body": 0}
    tok = build_tokenizer("SentencePieceTokenizer", small_corpus.tokenizer_model)
    body = IndexedDataset(s.output_prefixes["body"])
    assert body[1].tolist() == tok.tokenize(GOOD[1])  # no EOD appended


def test_preprocess_with_a_huggingface_tokenizer(tmp_path):
    from tests.unit.test_tokenizer import _save_hf_tokenizer  # megatron-core on first use

    _save_hf_tokenizer(tmp_path / "hf")
    src = _write_jsonl(tmp_path / "hf.jsonl", [json.dumps({"text": t}) for t in GOOD * 3])
    s = preprocess_jsonl([src], str(tmp_path / "hf"),
                         TokenizerSpec("HuggingFaceTokenizer", str(tmp_path / "hf")), workers=2)
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "hf"))
    ds = IndexedDataset(s.output_prefixes["text"])
    assert len(ds) == 6
    for i in range(6):
        assert ds[i].tolist() == tok.tokenize(GOOD[i % 2]) + [tok.eod]


def test_preprocess_cli(tmp_path, small_corpus, capsys):
    tool = _tool("preprocess_data")
    src = _messy_jsonl(tmp_path)
    args = ["--input", src, "--output-prefix", str(tmp_path / "cli"),
            "--tokenizer-model", small_corpus.tokenizer_model, "--log-interval", "1"]
    assert tool.main(args) == 1
    err = capsys.readouterr().err
    assert f"{src}:4: invalid JSON" in err and "nothing was written" in err
    assert tool.main(args + ["--skip-bad-lines", "--workers", "2"]) == 0
    out, err = capsys.readouterr()
    assert "docs/s" in err and f"{src}:5: no key 'text'" in err
    last = out.strip().splitlines()[-1]
    assert last.startswith("documents written (text: 2); skipped: 3 bad JSON, 2 missing key, "
                           "empty (text: 2); tokens written (text: ")
    assert f"--data-path {tmp_path / 'cli_text_document'}" in out


# --------------------------------------------------------------------------- default corpus
def test_default_corpus_is_real_prose_and_cached(small_corpus):
    c = small_corpus
    assert c.text_bytes <= SMALL_BYTES and c.num_documents > 10 and c.num_tokens > 10_000
    with open(c.corpus_jsonl, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    assert len(docs) == c.num_documents
    words = " ".join(docs).split()
    common = {"the", "of", "a", "is", "and", "to"}
    assert sum(w.lower() in common for w in words) / len(words) > 0.1  # English prose
    stamp = os.path.join(c.root, "STAMP.json")
    mtime = os.stat(stamp).st_mtime_ns
    again = corpus_mod.ensure_default_corpus(os.path.dirname(os.path.dirname(c.root)),
                                             SMALL_BYTES, SMALL_VOCAB)
    assert again == c and os.stat(stamp).st_mtime_ns == mtime  # not rebuilt


def test_default_corpus_rebuild_is_byte_identical_and_repairs_damage(tmp_path, small_corpus):
    c2 = corpus_mod.ensure_default_corpus(str(tmp_path), SMALL_BYTES, SMALL_VOCAB)
    assert c2.root != small_corpus.root
    for name in corpus_mod._ARTIFACTS:
        assert _read(os.path.join(c2.root, name)) == _read(os.path.join(small_corpus.root, name))
    with open(c2.data_prefix + ".bin", "r+b") as f:  # damage the cached copy
        f.write(b"\x00\x00\x00\x00")
    c3 = corpus_mod.ensure_default_corpus(str(tmp_path), SMALL_BYTES, SMALL_VOCAB)
    assert _read(c3.data_prefix + ".bin") == _read(small_corpus.data_prefix + ".bin")


def _race(cache, queue, barrier):
    barrier.wait()
    c = corpus_mod.ensure_default_corpus(cache, SMALL_BYTES, SMALL_VOCAB)
    queue.put(c.root)


def test_concurrent_first_use_builds_once(tmp_path, monkeypatch):
    builds = tmp_path / "builds.log"
    real_build = corpus_mod.build_corpus_files

    def counting_build(*args):
        with open(builds, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real_build(*args)

    monkeypatch.setattr(corpus_mod, "build_corpus_files", counting_build)
    ctx = mp.get_context("fork")
    q, barrier = ctx.Queue(), ctx.Barrier(3)
    cache = str(tmp_path / "cache")
    procs = [ctx.Process(target=_race, args=(cache, q, barrier)) for _ in range(3)]
    for p in procs:
        p.start()
    roots = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len(set(roots)) == 1
    base = os.path.dirname(roots[0])
    leftovers = [n for n in os.listdir(base) if n.startswith(".build-")]
    assert leftovers == []
    assert corpus_mod._read_stamp(roots[0]) is not None
    assert len(builds.read_text().split()) == 1  # the others waited on the lock


def test_tools_reproduce_the_default_corpus(tmp_path, small_corpus, capsys):
    """train_tokenizer + preprocess_data on corpus.jsonl give the cached files, byte for byte."""
    prefix = str(tmp_path / "tok")
    assert _tool("train_tokenizer").main([
        "--input", small_corpus.corpus_jsonl, "--output-prefix", prefix,
        "--vocab-size", str(SMALL_VOCAB), "--num-threads", str(corpus_mod.SP_NUM_THREADS),
    ]) == 0
    assert _read(prefix + ".model") == _read(small_corpus.tokenizer_model)
    assert _tool("preprocess_data").main([
        "--input", small_corpus.corpus_jsonl, "--output-prefix", str(tmp_path / "corpus"),
        "--tokenizer-model", prefix + ".model", "--workers", "2",
    ]) == 0
    for ext in (".bin", ".idx"):
        assert _read(str(tmp_path / "corpus_text_document") + ext) == _read(
            small_corpus.data_prefix + ext)
    out = capsys.readouterr().out
    assert f"documents written (text: {small_corpus.num_documents})" in out


def test_train_tokenizer_cli_reports_bad_lines(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "t.jsonl", [json.dumps({"text": GOOD[i % 2]}) for i in range(50)]
                       + ["{oops"])
    tool = _tool("train_tokenizer")
    args = ["--input", src, "--output-prefix", str(tmp_path / "m"), "--vocab-size", "350"]
    assert tool.main(args) == 1
    assert f"{src}:51: invalid JSON" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "m.model")
    assert tool.main(args + ["--skip-bad-lines"]) == 0
    out = capsys.readouterr().out
    assert "on 50 documents" in out and "1 bad lines" in out
    assert build_tokenizer("SentencePieceTokenizer", str(tmp_path / "m.model")).vocab_size == 350


def test_module_document_extracts_docstrings_and_comments_without_doctests():
    path = os.path.join(corpus_mod.stdlib_dir(), "textwrap.py")
    doc = corpus_mod.module_document(path)
    assert doc.startswith("Text wrapping and filling.")
    assert ">>>" not in doc and "def " not in doc
    assert len(doc) > 2000
    # the module extraction path of the corpus, past the pydoc topics
    docs = list(corpus_mod.iter_corpus_documents(max_bytes=700_000))
    assert sum(len(d.encode()) for d in docs) <= 700_000 and len(docs) > 80


def test_build_default_corpus_tool(small_corpus, capsys):
    cache = os.path.dirname(os.path.dirname(small_corpus.root))
    assert _tool("build_default_corpus").main([
        "--cache-dir", cache, "--max-bytes", str(SMALL_BYTES), "--vocab-size", str(SMALL_VOCAB),
        "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["data_prefix"] == small_corpus.data_prefix
    assert got["tokenizer_model"] == small_corpus.tokenizer_model


def test_missing_input_and_empty_keys_are_errors(tmp_path, small_corpus):
    with pytest.raises(PreprocessError, match="--input .*nope.jsonl: no such file"):
        preprocess_jsonl([str(tmp_path / "nope.jsonl")], str(tmp_path / "o"), _spec(small_corpus))
    with pytest.raises(PreprocessError, match="--json-keys is empty"):
        preprocess_jsonl([], str(tmp_path / "o"), _spec(small_corpus), json_keys=[])
    shutil.rmtree(tmp_path)
