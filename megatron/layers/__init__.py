"""Per-token layer kernels and linear fusions around attention: RMSNorm, SwiGLU, RoPE, and the
linear layers that fuse them or accumulate their weight gradients in float32."""
