"""Activation memory for long sequences: recompute offload to host, kept attention under full
recompute, the sequence-tiled MLP."""
