"""Model flags that pretrained architectures need beyond the Llama-style defaults.

Megatron-LM's names and meanings: ``--add-qkv-bias`` (biases on the query, key and value
projections only, as Qwen2 has, also with ``--disable-bias-linear``) and ``--qk-layernorm``
(a norm of ``--normalization`` over each query and key head before RoPE, as Qwen3 has).
``tools/convert_hf.py import`` prints the full set of model flags a checkpoint needs.
No torch here (``--help`` imports none).
"""

from __future__ import annotations


def add_pretrained_args(group) -> None:
    """The architecture flags of pretrained models (the model group)."""
    group.add_argument("--add-qkv-bias", action="store_true",
                       help="biases on the query, key and value projections, also with "
                            "--disable-bias-linear (Qwen2)")
    group.add_argument("--qk-layernorm", action="store_true",
                       help="normalise each query and key head before RoPE (Qwen3)")
