"""Tokenizers: SentencePiece training and loading, Hugging Face, Null, and their errors."""

import sys

import pytest

from megatron.training.data import tokenizer as tk

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Return a new list containing all items from the iterable in ascending order.",
    "A function definition defines a user-defined function object.",
    "Lists are mutable sequences, typically used to store collections of items.",
    "If the key is not found, raise a KeyError exception with a helpful message.",
] * 40


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp") / "t.model"
    path.write_bytes(tk.train_sentencepiece(TEXT, vocab_size=300))
    return str(path)


def test_sentencepiece_training_is_deterministic(sp_model):
    again = tk.train_sentencepiece(TEXT, vocab_size=300)
    with open(sp_model, "rb") as f:
        assert f.read() == again
    other = tk.train_sentencepiece(TEXT[:-1], vocab_size=300)
    assert other != again  # the bytes depend on the text


def test_sentencepiece_tokenizer_contract(sp_model):
    t = tk.build_tokenizer("SentencePieceTokenizer", sp_model)
    assert t.vocab_size == 300
    assert (t.eod, t.pad, t.bos) == (tk.SP_EOS_ID, tk.SP_PAD_ID, tk.SP_BOS_ID)
    assert t.eod != t.pad  # megatron-core must not mask document ends as padding
    ids = t.tokenize("Return a new list of items.")
    assert ids and all(isinstance(i, int) and 0 <= i < t.vocab_size for i in ids)
    assert t.eod not in ids
    assert t.detokenize(ids) == "Return a new list of items."
    # byte fallback: characters never seen in training survive a round trip
    assert t.detokenize(t.tokenize("naïve café ☃")) == "naïve café ☃"
    assert t.unique_identifiers["tokenizer_path"] == sp_model
    assert t.vocab[t._sp.id_to_piece(5)] == 5


def test_training_sentences_are_nonblank_lines():
    assert list(tk.training_sentences("a b\n\n  c  \n")) == ["a b", "c"]


def test_sentencepiece_training_errors_say_which_way_to_move_the_vocab():
    with pytest.raises(tk.TokenizerError, match="lower --vocab-size"):
        tk.train_sentencepiece(["tiny text"] * 3, vocab_size=5000)
    with pytest.raises(tk.TokenizerError, match="256 byte-fallback pieces: raise --vocab-size"):
        tk.train_sentencepiece(TEXT, vocab_size=100)


def test_null_tokenizer_follows_megatron_convention():
    t = tk.build_tokenizer("NullTokenizer", None, vocab_size=100)
    assert t.vocab_size == 101 and t.eod == 100 and t.pad == -1
    assert t.tokenize("1 2 3") == [1, 2, 3]
    assert t.detokenize([4, 5]) == "4 5"
    assert t.unique_identifiers["vocab_size"] == 100


@pytest.mark.parametrize(
    "args,match",
    [
        (("NullTokenizer", None, None), "--vocab-size"),
        (("GPT2BPETokenizer", "x", None), "--tokenizer-type 'GPT2BPETokenizer' is not supported"),
        (("SentencePieceTokenizer", None, None), "needs --tokenizer-model"),
        (("SentencePieceTokenizer", "/nonexistent/t.model", None), "no such file"),
        (("HuggingFaceTokenizer", "/nonexistent/dir", None), "local directory"),
    ],
)
def test_build_tokenizer_errors_name_the_flag(args, match):
    with pytest.raises(tk.TokenizerError, match=match):
        tk.build_tokenizer(*args)


def test_sentencepiece_rejects_a_file_that_is_not_a_model(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(tk.TokenizerError, match="not a SentencePiece model"):
        tk.build_tokenizer("SentencePieceTokenizer", str(bad))


def test_huggingface_tokenizer_without_transformers_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    with pytest.raises(tk.TokenizerError, match="pip install"):
        tk.build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


def _save_hf_tokenizer(path, with_eos=True):
    """A real fast tokenizer trained locally with the `tokenizers` library."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    special = ["<unk>", "<pad>", "</s>"] if with_eos else ["<unk>", "<pad>"]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=special)
    bpe.train_from_iterator(TEXT, trainer)
    kwargs = {"eos_token": "</s>"} if with_eos else {}
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", pad_token="<pad>", **kwargs
    )
    fast.save_pretrained(str(path))
    return fast


def test_huggingface_tokenizer_from_local_directory(tmp_path):
    fast = _save_hf_tokenizer(tmp_path)
    t = tk.build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert t.vocab_size == len(fast)
    assert t.eod == fast.convert_tokens_to_ids("</s>")
    assert t.pad == fast.convert_tokens_to_ids("<pad>")
    ids = t.tokenize("Return a new list.")
    assert ids and t.eod not in ids
    assert t.detokenize(ids) == "Return a new list."


def test_huggingface_tokenizer_without_eos_is_refused(tmp_path):
    _save_hf_tokenizer(tmp_path, with_eos=False)
    with pytest.raises(tk.TokenizerError, match="no eos_token"):
        tk.build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


def test_transformers_is_imported_lazily():
    assert not any(name.startswith("transformers") or name == "AutoTokenizer" for name in dir(tk))


def test_the_model_vocabulary_may_outnumber_the_tokenizer_but_not_the_reverse():
    # an imported checkpoint's rows (--vocab-size) govern; the tokenizer may have fewer ids
    assert tk.model_vocab_size("HuggingFaceTokenizer", "qwen2", 300, 384) == 384
    assert tk.model_vocab_size("HuggingFaceTokenizer", "qwen2", 300, None) == 300
    # NullTokenizer's ids come from --vocab-size (plus EOD): its own size is the model's
    assert tk.model_vocab_size("NullTokenizer", None, 385, 384) == 385
    with pytest.raises(tk.TokenizerError, match=r"^--tokenizer-model big has 400 tokens, more "
                                                r"than the model's vocabulary of 384 "
                                                r"\(--vocab-size\)[^\n]*$"):
        tk.model_vocab_size("HuggingFaceTokenizer", "big", 400, 384)
