"""Fixtures shared by the unit tests."""

import pytest

from megatron.training.data import corpus as corpus_mod

SMALL_BYTES = 200_000  # pydoc topics only: builds in about a second
SMALL_VOCAB = 1000


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """A small built-in corpus and its tokenizer, built once per test session."""
    cache = tmp_path_factory.getbasetemp() / "default-corpus-cache"
    return corpus_mod.ensure_default_corpus(str(cache), SMALL_BYTES, SMALL_VOCAB)
