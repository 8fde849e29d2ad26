"""Data: tokenizers, indexed datasets, the built-in corpus, packed documents, the micro-batch.

:mod:`.tokenizer` (SentencePiece and Hugging Face tokenizers), :mod:`.preprocess` (JSONL ->
indexed dataset), :mod:`.indexed_files` (reading and checking ``.idx`` / ``.bin``),
:mod:`.corpus` (the built-in default corpus), :mod:`.config` (the data flags and files, checked
first), :mod:`.loader` (datasets -> samples -> micro-batches), :mod:`.documents` (packed
documents in the loader), :mod:`.batch` (one micro-batch through the model) and :mod:`.errors`.
"""
