"""Sequence-tiled MLP (``--mlp-tile-tokens N``): the MLP over tiles of N local tokens.

The MLP is the widest per-token activation of a layer: for the input ``[s, b, h]`` it holds
``[s, b, 2F/TP]`` after FC1 (SwiGLU's gate and up) and ``[s, b, F/TP]`` after the activation,
and as much again as gradients in the backward: ``s*b*(3F/TP)*2`` values, 12 bytes per token
and FFN unit in bf16, 33 GiB at 512K tokens with F = 5632 (the layer input is 2 GiB). Because the MLP acts on each
token alone, :class:`TiledMLP` runs megatron-core's ``MLP.forward`` (whatever it does: fused or
plain SwiGLU, biases, TP linears) on tiles of ``N`` tokens along ``s`` and concatenates the
outputs; with autograd on, each tile runs under a non-reentrant ``torch.utils.checkpoint``, so
only the tile's input is kept and its ``[N, b, 2F/TP]`` intermediates exist for one tile at a
time, in the forward and again in the backward. The sums are those of the untiled MLP token by
token (the same GEMM per token row), so results agree to the GEMMs' rounding (1e-12 in the
float64 tests); the cost is one more MLP forward per step (the tile's recompute).

With Megatron sequence parallelism the MLP's input is the rank's ``[s/TP, b, h]``: each tile's
FC1 all-gathers the tile over TP (``[TP*N, b, h]``, rank-major) and FC2 reduce-scatters it back
to the same tokens, so tiles compose with SP (TP collectives per tile instead of per layer; the
same bytes in total). ``N`` counts the MLP's local tokens (``seq / CP``, divided by TP with SP);
it must divide them (checked at start-up).

Under full recompute the forward's MLP runs without autograd: tiles then only bound the
forward's peak, and the recompute (with autograd) checkpoints each tile.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.utils.checkpoint as torch_checkpoint
from megatron.core.transformer.mlp import MLP

Tensor = torch.Tensor


class TiledMLPMixin:
    """Turns an ``MLP`` subclass into its tiled form; combine as ``(TiledMLPMixin, SomeMLP)``."""

    def __init__(self, *args, tile_tokens: Optional[int] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if tile_tokens is not None and tile_tokens < 1:
            raise ValueError(f"--mlp-tile-tokens {tile_tokens} must be >= 1")
        self.tile_tokens = tile_tokens

    def forward(self, hidden_states: Tensor, per_token_scale=None, **kwargs):
        """[s, b, h] -> ([s, b, h], bias or None), tile by tile along s."""
        n, s = self.tile_tokens, hidden_states.shape[0]
        if n is None or s <= n:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        if per_token_scale is not None:
            raise NotImplementedError("--mlp-tile-tokens: per_token_scale (MoE experts) is not "
                                      "tiled; drop --mlp-tile-tokens for expert MLPs")
        if s % n:
            raise ValueError(f"--mlp-tile-tokens {n} does not divide the MLP's {s} local tokens")
        run = super().forward
        outs, bias = [], None
        for tile in hidden_states.split(n, dim=0):
            if torch.is_grad_enabled():
                # No random numbers are drawn inside the MLP (dropout sits in
                # bias-dropout-add), so the RNG state need not be restored for the recompute.
                out, bias = torch_checkpoint.checkpoint(run, tile, use_reentrant=False,
                                                        preserve_rng_state=False, **kwargs)
            else:
                out, bias = run(tile, **kwargs)
            outs.append(out)
        # The bias (skip_bias_add) is the FC2 bias parameter, the same for every tile.
        return torch.cat(outs, dim=0), bias


class TiledMLP(TiledMLPMixin, MLP):
    """megatron-core's ``MLP`` over tiles of ``tile_tokens`` tokens (module docstring)."""


def tiled_mlp_class(base: type) -> type:
    """The tiled form of ``base`` (``MLP`` or a subclass of it)."""
    if base is MLP:
        return TiledMLP
    if not (isinstance(base, type) and issubclass(base, MLP)):
        raise TypeError(f"--mlp-tile-tokens tiles megatron-core's MLP; the layer spec's mlp is "
                        f"{base!r}")
    return type(f"Tiled{base.__name__}", (TiledMLPMixin, base), {})


__all__ = ["TiledMLP", "TiledMLPMixin", "tiled_mlp_class"]
