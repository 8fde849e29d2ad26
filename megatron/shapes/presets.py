"""The one table of named model shapes: :data:`PRESETS`.

Public model cards (the Hugging Face ``config.json`` of each model), the Llama-style
models this project benchmarks and its examples train, and two tiny CPU models. GPT-1.2B
is the GPT shape DeepSpeed-Ulysses and Megatron use for their 1.2B runs (24 x 2048, GELU
MLP of 4h, tied embeddings). Mistral-7B-v0.1 windows every layer: its ``sliding_window`` of
4096 counts the query itself, so ``window_size`` (the keys before it) is 4095
(docs/sliding_window.md).

``tools/plan_parallel.py --model``, ``tools/bench_e2e.py --model`` (the Llama-style ones
it can train) and ``tools/model_flags.py`` (the examples' model flags) read this table.
"""

from __future__ import annotations

from typing import Dict

from megatron.shapes.model import ModelShape


def _llama(name, layers, hidden, heads, groups, ffn, vocab, **kw) -> ModelShape:
    return ModelShape(name=name, num_layers=layers, hidden_size=hidden,
                      num_attention_heads=heads, num_query_groups=groups,
                      ffn_hidden_size=ffn, vocab_size=vocab, **kw)


def _gpt(name, layers, hidden, heads, vocab) -> ModelShape:
    return ModelShape(name=name, num_layers=layers, hidden_size=hidden,
                      num_attention_heads=heads, vocab_size=vocab, swiglu=False,
                      untied_embeddings=False, normalization="LayerNorm",
                      position_embedding_type="learned_absolute", add_bias_linear=True)


PRESETS: Dict[str, ModelShape] = {
    m.name: m
    for m in (
        # The benchmark model: 16 layers, hidden 2048, 16 heads of dim 128, 4 KV groups.
        _llama("llama-0.85b", 16, 2048, 16, 4, 5632, 32000),
        # pretrain_tp_usp.sh's model: Llama-2-7B's width at 24 layers, 8 KV groups.
        _llama("llama-4.5b", 24, 4096, 32, 8, 11008, 32000),
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
        _llama("mistral-7b-v0.1", 32, 4096, 32, 8, 14336, 32000, window_size=4095),
        _gpt("gpt-1.2b", 24, 2048, 16, 50304),
        _gpt("gpt-7b", 32, 4096, 32, 50304),
        # A few-second CPU smoke model of the benchmark's structure.
        _llama("tiny", 2, 64, 4, 2, 128, 512),
        # pretrain_cpu.sh's model; the vocabulary is the built-in corpus's tokenizer's.
        _llama("cpu-tiny", 4, 128, 8, 4, 352, 8000),
    )
}


def get_preset(name: str) -> ModelShape:
    """The preset called ``name`` (case-insensitive); KeyError naming the choices."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise KeyError(f"model preset {name!r} is not one of {sorted(PRESETS)}")
    return PRESETS[key]
