"""Long-context evaluation of a model: perplexity by position and passkey retrieval.

:mod:`~megatron.evaluation.perplexity` buckets per-token losses by position over long
documents; :mod:`~megatron.evaluation.passkey` builds passkey prompts and scores a model's
greedy answer; :mod:`~megatron.evaluation.models` gives both a model as one function
``token ids -> logits``, either this project's checkpoint on this rank's parallel layout or a
transformers model; :mod:`~megatron.evaluation.config` holds the validated flags and
:mod:`~megatron.evaluation.report` writes the JSON and the markdown tables. The command line
is ``tools/eval_long_context.py``. This package sits above ``megatron.training`` and
``megatron.convert``; nothing below imports it.
"""
