"""The optimizer step: gradient norm and clipping, the CPU-offloaded optimizer."""
