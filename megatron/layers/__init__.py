"""Per-token layer kernels and linear fusions around attention: RMSNorm, SwiGLU, RoPE, and the
linear layers that fuse them or accumulate their weight gradients in float32.

:mod:`.fused_kernels` (the ``--fused-kernels`` switch for RMSNorm, SwiGLU and RoPE),
:mod:`.lean_kernels` (Triton RMSNorm and SwiGLU writing into given outputs), :mod:`.qkv_rope`
(QKV split and RoPE in one pass), :mod:`.norms` (the layer spec's norms), :mod:`.fused_linears`
(linear layers that drop and refill their input's elementwise op), :mod:`.linear_wgrad`
(weight gradients straight into ``main_grad``) and :mod:`.self_attention` (``SelfAttention``
with RoPE from :mod:`.fused_kernels`).
"""
