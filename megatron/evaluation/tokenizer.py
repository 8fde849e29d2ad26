"""The evaluation's tokenizer: ``encode(text) -> ids`` without special tokens (as
``tools/preprocess_data.py`` tokenises training documents), ``decode(ids) -> text``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional


@dataclass(frozen=True)
class TextTokenizer:
    encode: Callable[[str], List[int]]
    decode: Callable[[List[int]], str]
    vocab_size: int


def load_tokenizer(kind: str, path: str, gguf_file: Optional[str] = None) -> TextTokenizer:
    """``kind``: ``HuggingFaceTokenizer`` (a directory; ``gguf_file`` a GGUF in it) or
    ``SentencePieceTokenizer`` (a ``.model`` file), the names of ``--tokenizer-type``."""
    if kind == "HuggingFaceTokenizer" and gguf_file:
        from transformers import AutoTokenizer  # optional: transformers

        tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
        return TextTokenizer(lambda text: tok(text, add_special_tokens=False).input_ids,
                             tok.decode, len(tok))
    from megatron.training.data.tokenizer import build_tokenizer  # torch-free module

    tok = build_tokenizer(kind, path)
    return TextTokenizer(tok.tokenize, tok.detokenize, tok.vocab_size)
