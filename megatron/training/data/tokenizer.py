"""Tokenizers for GPT pretraining, and SentencePiece training.

:func:`build_tokenizer` returns one of three tokenizers, all implementing the interface that
megatron-core's ``GPTDataset`` / ``BlendedMegatronDatasetBuilder`` read from
``config.tokenizer`` (``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``) plus
``tokenize`` / ``detokenize`` for the tools:

* ``SentencePieceTokenizer``: a SentencePiece ``.model`` file (``--tokenizer-model``);
  the document separator ``eod`` is the model's EOS piece.
* ``HuggingFaceTokenizer``: a local directory written by ``save_pretrained`` (or a
  ``tokenizer.json``), loaded with ``transformers.AutoTokenizer`` without network access;
  ``eod`` is its ``eos_token_id``. ``transformers`` is imported only when asked for.
* ``NullTokenizer``: no text at all, for ``--mock-data``: ids ``0 .. V-1`` and
  ``eod = V``, so ``vocab_size = V + 1`` (Megatron-LM's convention for ``--vocab-size V``).

:func:`train_sentencepiece` trains a BPE SentencePiece model in memory. Training reads the
sentences in the order given and records only the arguments passed here, so the same
sentences give a byte-identical ``.model`` on every run.

Token ids are Python ``int`` lists. ``pad`` is ``-1`` when the tokenizer has no padding
token, which is also megatron-core's "no pad token" value.
"""

from __future__ import annotations

import io
import os
from collections import OrderedDict
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

import sentencepiece
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron.errors import UsageError

TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")

# Special-piece ids of the models train_sentencepiece() writes. Pad is distinct from EOD so
# megatron-core can mask padded labels without masking document ends.
SP_UNK_ID, SP_BOS_ID, SP_EOS_ID, SP_PAD_ID = 0, 1, 2, 3


class TokenizerError(UsageError, ValueError):
    """A tokenizer cannot be built from the given flags; the message names the flag."""


class _TextTokenizer(MegatronTokenizerBase):
    """Shared shape of the tokenizers here: what megatron-core datasets need, and no more."""

    def __init__(self, path: Optional[str], library: str) -> None:
        super().__init__(path, {"library": library})

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no chat template (pretraining only)")

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        """Identifies the tokenizer in megatron-core's dataset-index cache key."""
        return OrderedDict(
            [("class", f"{type(self).__module__}.{type(self).__qualname__}"),
             ("tokenizer_path", self.path)]
        )

    @property
    def eos(self) -> int:
        return self.eod


class SentencePieceTokenizer(_TextTokenizer):
    """A SentencePiece model. ``eod`` is the EOS piece, ``pad`` the PAD piece (or -1)."""

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path, "sentencepiece")
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(model_path)
        except (OSError, RuntimeError) as exc:
            raise TokenizerError(
                f"--tokenizer-model {model_path}: not a SentencePiece model ({exc}); pass the "
                f".model file written by tools/train_tokenizer.py or spm_train"
            ) from None
        if self._sp.eos_id() < 0:
            raise TokenizerError(
                f"--tokenizer-model {model_path}: the SentencePiece model has no EOS piece, "
                f"which GPT pretraining uses to separate documents; retrain it with an eos_id "
                f"(tools/train_tokenizer.py does)"
            )
        self._vocab: Optional[Dict[str, int]] = None

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def vocab(self) -> Dict[str, int]:
        if self._vocab is None:
            self._vocab = {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}
        return self._vocab

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class HuggingFaceTokenizer(_TextTokenizer):
    """A ``transformers`` tokenizer loaded from a local path; ``eod`` is its EOS token.

    ``tokenize`` adds no special tokens (no BOS): documents are separated by the EOD that
    preprocessing appends. ``vocab_size`` is ``len(tokenizer)``, added tokens included.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path, "huggingface")
        if not os.path.exists(path):
            raise TokenizerError(
                f"--tokenizer-model {path}: no such file or directory. The Hugging Face "
                f"tokenizer is loaded from a local directory (written by "
                f"tokenizer.save_pretrained(DIR)); this code never downloads one"
            )
        auto_tokenizer = _import_auto_tokenizer()
        try:
            self._tok = auto_tokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise TokenizerError(
                f"--tokenizer-model {path}: transformers could not load a tokenizer from it "
                f"({exc}); pass a directory written by save_pretrained()"
            ) from None
        if self._tok.eos_token_id is None:
            raise TokenizerError(
                f"--tokenizer-model {path}: the tokenizer has no eos_token, which GPT "
                f"pretraining uses to separate documents; set one and save it again"
            )

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._tok.get_vocab()

    @property
    def eod(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def bos(self) -> int:
        bos = self._tok.bos_token_id
        return -1 if bos is None else int(bos)

    @property
    def pad(self) -> int:
        pad = self._tok.pad_token_id
        return -1 if pad is None else int(pad)

    def tokenize(self, text: str) -> List[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def _import_auto_tokenizer():
    try:
        from transformers import AutoTokenizer  # optional: transformers
    except ImportError as exc:
        raise TokenizerError(
            f"--tokenizer-type HuggingFaceTokenizer needs the 'transformers' package ({exc}); "
            f"install it with: pip install 'megatron-usp[hf]' (or pip install transformers)"
        ) from None
    return AutoTokenizer


class NullTokenizer(_TextTokenizer):
    """Token ids without text, for ``--mock-data``: ids ``0..V-1`` plus ``eod = V``.

    ``tokenize`` reads space-separated integers, ``detokenize`` writes them back.
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__(None, "null")
        self._v = int(vocab_size)

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        ids = super().unique_identifiers
        ids["vocab_size"] = self._v
        return ids

    @property
    def vocab_size(self) -> int:
        return self._v + 1

    @property
    def vocab(self) -> Dict[str, int]:
        raise NotImplementedError("NullTokenizer has no vocabulary of strings")

    @property
    def eod(self) -> int:
        return self._v

    @property
    def bos(self) -> int:
        return -1

    @property
    def pad(self) -> int:
        return -1

    def tokenize(self, text: str) -> List[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: Optional[str],
    vocab_size: Optional[int] = None,
) -> _TextTokenizer:
    """Build the tokenizer named by ``--tokenizer-type``.

    Args:
        tokenizer_type: one of :data:`TOKENIZER_TYPES`.
        tokenizer_model: ``--tokenizer-model``: the SentencePiece ``.model`` file or the
            Hugging Face tokenizer directory; unused by ``NullTokenizer``.
        vocab_size: ``--vocab-size``: required by ``NullTokenizer`` only (ids ``0..V-1``).

    Raises:
        TokenizerError: naming the flag that is missing or wrong.
    """
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or int(vocab_size) < 1:
            raise TokenizerError(
                f"--tokenizer-type NullTokenizer needs --vocab-size >= 1 (got {vocab_size}); "
                f"e.g. --vocab-size 32000"
            )
        return NullTokenizer(int(vocab_size))
    if tokenizer_type not in TOKENIZER_TYPES:
        raise TokenizerError(
            f"--tokenizer-type {tokenizer_type!r} is not supported; use one of "
            f"{', '.join(TOKENIZER_TYPES)}"
        )
    if not tokenizer_model:
        raise TokenizerError(
            f"--tokenizer-type {tokenizer_type} needs --tokenizer-model (the "
            f"{'.model file' if tokenizer_type == 'SentencePieceTokenizer' else 'tokenizer directory'})"
        )
    if tokenizer_type == "SentencePieceTokenizer":
        if not os.path.isfile(tokenizer_model):
            raise TokenizerError(
                f"--tokenizer-model {tokenizer_model}: no such file; train one with "
                f"tools/train_tokenizer.py or leave --data-path unset to use the default corpus"
            )
        return SentencePieceTokenizer(tokenizer_model)
    return HuggingFaceTokenizer(tokenizer_model)


def model_vocab_size(tokenizer_type: str, tokenizer_model: Optional[str], tokenizer_size: int,
                     vocab_size: Optional[int]) -> int:
    """The model's vocabulary before padding: ``--vocab-size`` when a tokenizer model is given
    with it (a pretrained model's embedding rows, which may outnumber its tokenizer's ids:
    Qwen2 has 151936 rows for 151665 tokens), else the tokenizer's ``tokenizer_size``.
    ``NullTokenizer`` makes its ids from ``--vocab-size``, so its size is the model's.

    Raises:
        TokenizerError: the tokenizer has more ids than the model has rows.
    """
    if tokenizer_type == "NullTokenizer" or vocab_size is None:
        return tokenizer_size
    if tokenizer_size > vocab_size:
        raise TokenizerError(
            f"--tokenizer-model {tokenizer_model} has {tokenizer_size} tokens, more than the "
            f"model's vocabulary of {vocab_size} (--vocab-size); pass the model's own "
            f"tokenizer, or --vocab-size {tokenizer_size} or more for a new model")
    return int(vocab_size)


# --------------------------------------------------------------------------- training
def training_sentences(text: str) -> Iterator[str]:
    """The SentencePiece training sentences of one document: its non-blank lines."""
    for line in text.split("\n"):
        line = line.strip()
        if line:
            yield line


def train_sentencepiece(
    sentences: Iterable[str],
    vocab_size: int,
    model_type: str = "bpe",
    character_coverage: float = 0.9995,
    byte_fallback: bool = True,
    num_threads: int = 2,
    max_sentence_length: int = 1 << 16,
) -> bytes:
    """Train a SentencePiece model on ``sentences`` and return the serialized ``.model``.

    Special pieces: ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2 (the EOD), ``<pad>`` = 3.
    ``byte_fallback`` spells characters unseen in training as UTF-8 bytes instead of
    ``<unk>``. All sentences are used (no sampling), in order, so the result is
    deterministic; ``num_threads`` is recorded in the model, so keep it fixed to get
    byte-identical files.

    Raises:
        TokenizerError: when SentencePiece refuses (e.g. ``vocab_size`` too large for the
            text), naming ``--vocab-size``.
    """
    if model_type not in ("bpe", "unigram", "char", "word"):
        raise TokenizerError(f"--model-type {model_type!r}: use bpe or unigram")
    out = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=out,
            vocab_size=int(vocab_size),
            model_type=model_type,
            character_coverage=character_coverage,
            byte_fallback=byte_fallback,
            split_digits=True,
            unk_id=SP_UNK_ID,
            bos_id=SP_BOS_ID,
            eos_id=SP_EOS_ID,
            pad_id=SP_PAD_ID,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=max_sentence_length,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as exc:
        msg = str(exc)
        hint = ""
        if "smaller than required" in msg:
            hint = (f"; --vocab-size {vocab_size} cannot hold the text's characters"
                    f"{' plus the 256 byte-fallback pieces' if byte_fallback else ''}: "
                    f"raise --vocab-size")
        elif "Vocabulary size" in msg or "vocab_size" in msg:
            hint = "; the text is too small for this vocabulary: lower --vocab-size"
        raise TokenizerError(f"SentencePiece training failed: {msg}{hint}") from None
    return out.getvalue()
