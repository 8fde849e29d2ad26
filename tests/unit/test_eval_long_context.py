"""The pieces of tools/eval_long_context.py without a model: passkey prompts (exact length,
the key at its depth), greedy scoring in one pass, position buckets and their means, and the
flags refused in one line naming them (exit status 2)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from megatron.evaluation import passkey, perplexity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def encode(text: str):
    """Bytes as tokens: every length is exact and easy to count by hand."""
    return list(text.encode())


def decode(ids) -> str:
    return bytes(ids).decode(errors="replace")


@pytest.mark.parametrize("length", [300, 301, 512, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_prompt_has_the_length_and_the_key_at_its_depth(length, depth):
    prompt = passkey.build_prompt(encode, length, depth, "48213")
    intro, needle = encode(passkey.INTRO), encode(passkey.NEEDLE.format(key="48213"))
    question = encode(passkey.QUESTION)
    fill = length - len(intro) - len(needle) - len(question)
    assert len(prompt.ids) == length
    assert prompt.needle_at == len(intro) + round(depth * fill)
    assert prompt.ids[prompt.needle_at:prompt.needle_at + len(needle)] == needle
    assert prompt.ids[-len(question):] == question
    assert decode(prompt.ids).count("48213") == 2
    assert prompt.answer == encode(" 48213")


def test_depth_zero_and_one_put_the_key_next_to_the_intro_and_the_question():
    first = passkey.build_prompt(encode, 400, 0.0, "11111")
    last = passkey.build_prompt(encode, 400, 1.0, "11111")
    intro, question = encode(passkey.INTRO), encode(passkey.QUESTION)
    assert first.needle_at == len(intro)
    needle = encode(passkey.NEEDLE.format(key="11111"))
    assert last.needle_at + len(needle) == 400 - len(question)


def test_too_short_a_prompt_is_refused_with_its_minimum():
    shortest = passkey.fixed_tokens(encode)
    assert len(passkey.build_prompt(encode, shortest, 0.5, "12345").ids) == shortest
    with pytest.raises(ValueError, match=f"at least {shortest} tokens"):
        passkey.build_prompt(encode, shortest - 1, 0.5, "12345")


def test_keys_are_five_digits_and_fixed_by_the_seed():
    keys = passkey.random_keys(20, seed=3)
    assert keys == passkey.random_keys(20, seed=3) != passkey.random_keys(20, seed=4)
    assert all(len(k) == 5 and k.isdigit() for k in keys)


def _logits_choosing(picks, vocab=300):
    logits = torch.zeros(len(picks), vocab)
    logits[torch.arange(len(picks)), torch.tensor(picks)] = 1.0
    return logits


def test_greedy_answer_stops_after_the_first_wrong_token():
    prompt = passkey.PasskeyPrompt(ids=[7, 8, 9], answer=[1, 2, 3], needle_at=0, key="")
    # row 2 follows the prompt; rows 3, 4 follow answer tokens 1 and 2
    right = _logits_choosing([0, 0, 1, 2, 3, 0])
    assert passkey.greedy_answer(right, prompt) == [1, 2, 3]
    wrong = _logits_choosing([0, 0, 1, 5, 3, 0])
    assert passkey.greedy_answer(wrong, prompt) == [1, 5]


def _reader(correct: bool):
    """A model that reads the key out of the needle (or gets its last digit wrong)."""
    def logits_fn(ids):
        text = decode(ids)
        key = text.split("The pass key is ")[1][:5]
        answer = encode(" " + key if correct else " " + key[:4] + "x")
        prompt_len = len(ids) - len(answer)
        picks = [0] * (prompt_len - 1) + answer + [0]
        return _logits_choosing(picks)
    return logits_fn


@pytest.mark.parametrize("correct, accuracy", [(True, 1.0), (False, 0.0)])
def test_passkey_accuracy_per_length_and_depth(correct, accuracy):
    cells = passkey.evaluate_passkey(_reader(correct), encode, decode, [300, 400],
                                     [0.0, 0.5, 1.0], trials=2, seed=0)
    assert [(c.length, c.depth) for c in cells] == [(n, d) for n in (300, 400)
                                                    for d in (0.0, 0.5, 1.0)]
    assert all(c.accuracy == accuracy and len(c.answers) == 2 for c in cells)
    if correct:
        assert cells[0].answers == [" " + k for k in passkey.random_keys(2, 0)]


@pytest.mark.parametrize("length, width, want", [
    (10, 4, [(0, 4), (4, 8), (8, 10)]), (8, 4, [(0, 4), (4, 8)]), (3, 5, [(0, 3)]),
    (4, 1, [(0, 1), (1, 2), (2, 3), (3, 4)])])
def test_buckets_cover_every_position_once(length, width, want):
    assert perplexity.position_buckets(length, width) == want


def test_bucket_means_average_every_window_over_the_bucket():
    nll = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 4.0, 5.0, 6.0, 7.0]],
                       dtype=torch.float64)
    buckets = perplexity.bucket_means(nll, perplexity.position_buckets(5, 2))
    assert [(b.start, b.end, b.tokens) for b in buckets] == [(0, 2, 4), (2, 4, 4), (4, 5, 2)]
    assert [b.nll for b in buckets] == [2.5, 4.5, 6.0]
    assert buckets[0].ppl == pytest.approx(torch.tensor(2.5).exp().item())


def test_token_nll_is_the_cross_entropy_of_the_next_token():
    gen = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(6, 11, generator=gen), [3, 1, 4, 1, 5, 9, 2]
    want = torch.nn.functional.cross_entropy(logits.double(), torch.tensor(ids[1:]),
                                             reduction="none")
    torch.testing.assert_close(perplexity.token_nll(logits, ids), want)


def test_windows_are_the_first_tokens_of_long_enough_documents():
    docs = [[1] * 5, list(range(10)), [2] * 4, list(range(20, 30)), list(range(40, 50))]
    assert perplexity.long_windows(docs, 4, 2) == [[1] * 5, [0, 1, 2, 3, 4]]
    assert perplexity.long_windows(docs, 10, 3) == []


def test_documents_from_jsonl_and_text(tmp_path):
    jsonl, txt = tmp_path / "d.jsonl", tmp_path / "d.txt"
    jsonl.write_text(json.dumps({"text": "a b"}) + "\n\n" + json.dumps({"text": "c"}) + "\n")
    txt.write_text("one\n\nbook")
    assert perplexity.read_documents(str(jsonl)) == ["a b", "c"]
    assert perplexity.read_documents(str(txt)) == ["one\n\nbook"]


def test_report_marks_what_lies_past_the_trained_context():
    from megatron.evaluation.report import markdown

    result = {"label": "m", "model": {"backend": "megatron-usp", "layout": "TP1 U2 R2",
                                      "max_position_embeddings": 256},
              "perplexity": {"length": 512, "windows": 1, "buckets": [
                  {"start": 0, "end": 256, "tokens": 256, "nll": 2.0, "ppl": 7.389},
                  {"start": 256, "end": 512, "tokens": 256, "nll": 3.0, "ppl": 20.09}]},
              "passkey": {"trials": 2, "cells": [
                  {"length": n, "depth": d, "accuracy": a}
                  for n, d, a in [(256, 0.0, 1.0), (256, 1.0, 0.5), (512, 0.0, 0.0),
                                  (512, 1.0, 0.5)]]}}
    text = markdown(result)
    assert "### m (megatron-usp, TP1 U2 R2)" in text
    assert "| 0-255 | 256 | 2.0000 | 7.39 |" in text and "| 256-511* | 256 |" in text
    assert "| length | 0 | 1 | mean |" in text
    assert "| 256 | 1.00 | 0.50 | 0.75 |" in text and "| 512* | 0.00 | 0.50 | 0.25 |" in text


# --------------------------------------------------------------------------- flags
def _tool():
    spec = importlib.util.spec_from_file_location(
        "eval_long_context", os.path.join(ROOT, "tools", "eval_long_context.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    ([], "give exactly one of --load"),
    (["--hf-model", "{d}", "--load", "{d}"], "give exactly one of --load"),
    (["--hf-model", "/nonexistent"], "--hf-model /nonexistent: no such directory"),
    (["--load", "{d}"], "--load needs --tokenizer-model"),
    (["--load", "{d}", "--gguf-file", "x.gguf", "--tokenizer-model", "{d}"],
     "--gguf-file needs --hf-model"),
    (["--hf-model", "{d}", "--ring-degree", "2"], "apply to --load only"),
    (["--load", "{d}", "--tokenizer-model", "{d}", "--device", "cuda"], "--device cuda"),
    (["--hf-model", "{d}"], "nothing to evaluate"),
    (["--hf-model", "{d}", "--ppl-length", "-1"], "--ppl-length -1 must be >= 0"),
    (["--hf-model", "{d}", "--ppl-length", "64", "--bucket-tokens", "65"],
     "--bucket-tokens 65 must be in 1..--ppl-length"),
    (["--hf-model", "{d}", "--passkey-lengths", "256,x"], "--passkey-lengths '256,x' is not"),
    (["--hf-model", "{d}", "--passkey-lengths", "0"], "lengths must be > 0"),
    (["--hf-model", "{d}", "--passkey-lengths", "256", "--passkey-depths", "0,1.5"],
     "--passkey-depths 0,1.5: depths must be in [0, 1]"),
    (["--hf-model", "{d}", "--passkey-lengths", "256", "--passkey-trials", "0"],
     "--passkey-trials 0 must be >= 1"),
    (["--hf-model", "{d}", "--ppl-length", "8", "--ppl-data", "/nonexistent.jsonl"],
     "--ppl-data /nonexistent.jsonl: no such file"),
    (["--hf-model", "{d}", "--ppl-length", "8", "--out-json", "/nonexistent/r.json"],
     "--out-json /nonexistent/r.json: no folder"),
])
def test_bad_flags_are_refused_in_one_line_with_status_2(argv, message, tmp_path, capsys):
    assert _tool().main([a.replace("{d}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eval_long_context.py: error: ") and "\n" not in err
    assert message in err, err


def test_defaults_fill_the_config(tmp_path):
    from megatron.evaluation.config import parse

    cfg = parse(["--load", str(tmp_path), "--tokenizer-model", str(tmp_path), "--ppl-length",
                 "100", "--ulysses-degree", "2", "--ring-degree", "2"])
    assert cfg.bucket_tokens == 12 and cfg.passkey_lengths == ()
    assert cfg.passkey_depths == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert cfg.layout == ("--tensor-model-parallel-size", "1", "--ulysses-degree", "2",
                          "--ring-degree", "2")
    assert cfg.label == tmp_path.name
