"""Data: tokenizers, indexed datasets, the built-in corpus, packed documents, the micro-batch."""
