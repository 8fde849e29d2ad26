"""Activation memory for long sequences: recompute offload to host, kept attention under full
recompute, the sequence-tiled MLP.

:mod:`.activation_offload` (``--recompute-cpu-offload``), :mod:`.kept_attention`
(``--recompute-keep-core-attn``) and :mod:`.tiled_mlp` (``--mlp-tile-tokens``).
"""
