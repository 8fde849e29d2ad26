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


@pytest.fixture
def fake_flash(monkeypatch):
    """PyTorch's flash varlen op replaced by tests/fake_flash.py's float64 stand-in, usable on
    any tensor: every caller's flash path runs on the CPU."""
    from megatron.usp import flash_varlen  # fixture-only: the module whose lookup is replaced
    from tests import fake_flash as fake

    monkeypatch.setattr(flash_varlen, "ops", lambda: (fake.forward, fake.backward))
    monkeypatch.setattr(flash_varlen, "usable", lambda q: True)
    return flash_varlen
