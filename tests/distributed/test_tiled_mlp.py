"""The tiled MLP (``--mlp-tile-tokens``) computes megatron-core's MLP, forward and backward.

float64 on one gloo rank, SwiGLU MLP of the long-sequence models' shape (hidden 64, FFN 96):
outputs, input gradients and weight gradients of :class:`TiledMLP` over tiles of 8 of 32
tokens equal ``MLP``'s to 1e-12; without autograd (the forward of full recompute) the tiles
run without checkpoints and give the same output; a tile size that does not divide the tokens
is refused; ``tiled_mlp_class`` tiles a subclass of ``MLP`` and refuses anything else. (With
TP 2 and sequence parallelism the tiled MLP is exercised by test_long_sequence_training.py.)
"""

from __future__ import annotations

import pytest
import torch

from megatron.training.cpu_shims import apply_cpu_shims
from megatron.usp.parallel_dims import ParallelDims
from tests.helpers import swiglu_mlp_config

TOL = dict(atol=1e-12, rtol=1e-12)


def _mlp(cls, **params):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,  # megatron-core on first use
    )
    from megatron.core.parallel_state import (
        get_tensor_model_parallel_group,  # megatron-core on first use
    )
    from megatron.core.tensor_parallel import (
        model_parallel_cuda_manual_seed,  # megatron-core on first use
    )

    config = swiglu_mlp_config(64, 96)
    submodules = get_gpt_layer_local_spec().submodules.mlp.submodules
    model_parallel_cuda_manual_seed(1234)
    return cls(config, submodules, ffn_hidden_size=96,
               tp_group=get_tensor_model_parallel_group(), **params).double()


def _run(rank, world_size):
    from megatron.core.transformer.mlp import MLP  # megatron-core on first use

    from megatron.memory.tiled_mlp import (  # megatron-core on first use
        TiledMLP,
        TiledMLPMixin,
        tiled_mlp_class,
    )
    from megatron.usp.parallel_state import initialize_usp_parallel  # megatron-core on first use

    apply_cpu_shims()
    initialize_usp_parallel(ParallelDims(1))
    plain, tiled = _mlp(MLP), _mlp(TiledMLP, tile_tokens=8)
    tiled.load_state_dict(plain.state_dict())
    x = torch.randn(32, 2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    probe = torch.randn(32, 2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for mlp in (plain, tiled):
        xi = x.clone().requires_grad_()
        out, bias = mlp(xi)
        assert bias is None
        (out * probe).sum().backward()
        outs.append(out.detach())
        grads.append([xi.grad] + [p.grad for p in mlp.parameters()])
    torch.testing.assert_close(outs[1], outs[0], **TOL)
    for g_tiled, g_plain in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_tiled, g_plain, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(tiled(x)[0], plain(x)[0], **TOL)
    with pytest.raises(ValueError, match="does not divide"):
        _mlp(TiledMLP, tile_tokens=12)(x)

    class MyMLP(MLP):
        pass

    cls = tiled_mlp_class(MyMLP)
    assert issubclass(cls, MyMLP) and issubclass(cls, TiledMLPMixin)
    assert tiled_mlp_class(MLP) is TiledMLP
    with pytest.raises(TypeError, match="tiles megatron-core's MLP"):
        tiled_mlp_class(torch.nn.Linear)


def test_tiled_mlp_matches_mlp(dist_run):
    dist_run(_run, 1, timeout=120)
