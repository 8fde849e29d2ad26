"""``--gradient-accumulation-fusion`` under tensor parallelism (TP = 2, gloo, float64): the
MLP built with this project's linear layers (weight gradients added into ``main_grad`` by
:mod:`megatron.layers.linear_wgrad`) against megatron-core's MLP with its own linear layers, with
and without Megatron sequence parallelism (the input all-gathered forward and backward, the
input gradient reduce-scattered) and with FC2 applying the SwiGLU itself
(:class:`~megatron.layers.fused_linears.SwiGLURowParallelLinear` with the ``usp`` kernels, plain
PyTorch math on the CPU). Each weight gets ``main_grad`` and ``grad_added_to_main_grad`` as
megatron-core's DDP gives them; two micro-batches accumulate. Output, input gradient and each
weight's gradient (this rank's shard) agree to 1e-12.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.training.cpu_shims import apply_cpu_shims
from megatron.usp.parallel_dims import ParallelDims
from tests.helpers import swiglu_mlp_config

TOL = dict(atol=1e-12, rtol=1e-12)
SEQ, BATCH, HIDDEN, FFN = 8, 2, 16, 24


def _mlp(sequence_parallel: bool, ours: bool, swiglu_inside: bool):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,  # megatron-core on first use
    )
    from megatron.core.parallel_state import (
        get_tensor_model_parallel_group,  # megatron-core on first use
    )
    from megatron.core.tensor_parallel import (
        model_parallel_cuda_manual_seed,  # megatron-core on first use
    )
    from megatron.core.transformer.mlp import MLP  # megatron-core on first use
    from megatron.core.transformer.spec_utils import ModuleSpec  # megatron-core on first use

    from megatron.layers.fused_linears import (  # megatron-core on first use
        PassThroughActivation,
        SwiGLURowParallelLinear,
    )
    from megatron.training.model.layer_specs import with_wgrad_fusion  # megatron-core on first use

    config = swiglu_mlp_config(HIDDEN, FFN, tensor_model_parallel_size=2,
                               sequence_parallel=sequence_parallel,
                               use_te_activation_func=swiglu_inside)
    sub = get_gpt_layer_local_spec().submodules.mlp.submodules
    if swiglu_inside:
        sub = dataclasses.replace(sub, activation_func=PassThroughActivation, linear_fc2=ModuleSpec(
            module=SwiGLURowParallelLinear, params={"swiglu_impl": "usp"}))
    if ours:
        sub = dataclasses.replace(sub, linear_fc1=with_wgrad_fusion(sub.linear_fc1),
                                  linear_fc2=with_wgrad_fusion(sub.linear_fc2))
    model_parallel_cuda_manual_seed(1234)
    mlp = MLP(config, sub, ffn_hidden_size=FFN, tp_group=get_tensor_model_parallel_group())
    for p in mlp.parameters():           # what megatron-core's DDP gives each parameter
        p.main_grad = torch.zeros_like(p)
        p.grad_added_to_main_grad = False
    return mlp


def _grads(mlp, x, probe):
    """Two micro-batches; (outputs, input grads, each weight's accumulated gradient)."""
    outs, dxs = [], []
    for _ in range(2):
        xi = x.clone().requires_grad_(True)
        out, _ = mlp(xi)
        (out * probe).sum().backward()
        outs.append(out.detach())
        dxs.append(xi.grad)
        for p in mlp.parameters():       # DDP's hook: add unless the layer did
            if p.grad is not None and not p.grad_added_to_main_grad:
                p.main_grad.add_(p.grad)
            p.grad = None
    return outs, dxs, [p.main_grad for p in mlp.parameters()]


def _run(rank, world_size):
    from megatron.core.parallel_state import (
        get_tensor_model_parallel_rank,  # megatron-core on first use
    )

    from megatron.usp.parallel_state import initialize_usp_parallel  # megatron-core on first use

    apply_cpu_shims()
    initialize_usp_parallel(ParallelDims(2, tp=2))
    tp_rank = get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64, generator=gen)
    probe = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64, generator=gen)
    for sp in (False, True):
        xs, ps = x, probe
        if sp:   # this rank's sequence shard
            rows = SEQ // 2
            xs, ps = (t[tp_rank * rows:(tp_rank + 1) * rows] for t in (x, probe))
        for swiglu_inside in (False, True):
            want = _grads(_mlp(sp, ours=False, swiglu_inside=False), xs, ps)
            ours = _mlp(sp, ours=True, swiglu_inside=swiglu_inside)
            got = _grads(ours, xs, ps)
            what = f"sp={sp} swiglu_inside={swiglu_inside}"
            for g_list, w_list, name in zip(got, want, ("output", "input grad", "weight grad")):
                for g, w in zip(g_list, w_list):
                    torch.testing.assert_close(g, w, **TOL, msg=f"{name} {what}")
            assert all(p.grad_added_to_main_grad for p in ours.parameters()), what


def test_fused_wgrad_linears_match_megatron_core_under_tp(dist_run):
    dist_run(_run, 2, timeout=180)
