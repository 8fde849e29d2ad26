"""The staged HybridDeviceOptimizer against megatron-core's, on one GPU.

Same bf16 parameters, same gradients, a few steps: the parameters, float32 masters and Adam
moments must be bitwise megatron-core's HybridDeviceOptimizer's (the same fused AdamW on each
device), for a fraction on the CPU of 0.5 and 1.0, with and without the D2H / H2D overlap
(megatron-core's own runs without it: with it, 0.16.1 converts the GPU-side gradients on its
D2H stream and steps them on the default stream without waiting, a race); and
the staged one must keep no per-parameter gradient buffers and no float32 GPU gradients after
its step, and hold its Adam state before the first step.
"""

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import (  # noqa: E402
    HybridDeviceOptimizer,
)

from megatron.training.optim.offload_optimizer import StagedHybridDeviceOptimizer  # noqa: E402
from tests.unit.test_offload_optimizer import staging_bytes  # noqa: E402

SHAPES = [(384, 256), (1000,), (256, 512), (64, 64), (3, 7, 11)]


def _params(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g).to(torch.bfloat16))
            for s in SHAPES]


def _build(cls, params, fraction, overlap):
    # the arguments megatron-core 0.16.1 gives its HDO for Adam (optimizer/__init__.py)
    return cls([{"params": params, "wd_mult": 1.0}], offload_fraction=fraction,
               cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW,
               overlap_cpu_optimizer_d2h_h2d=overlap, pin_cpu_grads=True, pin_cpu_params=True,
               param_update_in_fp32=True, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
               eps=1e-8, bias_correction=True, fused=True)


def _state(opt):
    out = {}
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        st = opt.state[p]
        out[i] = {k: v.detach().cpu().clone() for k, v in st.items() if torch.is_tensor(v)}
    return out


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("overlap", [True, False])
def test_staged_matches_megatron_core(fraction, overlap):
    ref_params, new_params = _params(0), _params(0)
    ref = _build(HybridDeviceOptimizer, ref_params, fraction, overlap=False)
    new = _build(StagedHybridDeviceOptimizer, new_params, fraction, overlap)
    n_cpu = [sum(len(g["params"]) for o in opt.cpu_optimizers for g in o.param_groups)
             for opt in (ref, new)]
    assert n_cpu[0] == n_cpu[1] > 0
    # with the overlap one CPU sub-optimizer per parameter (megatron-core's build), else one
    assert len(new.cpu_optimizers) == (n_cpu[1] if overlap else 1)
    assert (new.gpu_optimizer is None) == (ref.gpu_optimizer is None) == (fraction == 1.0)
    assert len(new.state) == len(new_params)                 # Adam state before the first step
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(3):
        for a, b in zip(ref_params, new_params):
            grad = torch.randn(a.shape, device="cuda", generator=g).to(torch.bfloat16)
            a.grad, b.grad = grad.clone(), grad.clone()
        ref.step()
        new.step()
        torch.cuda.synchronize()
        for a, b in zip(ref_params, new_params):
            assert torch.equal(a, b)
    ref_state, new_state = _state(ref), _state(new)
    for i in ref_state:
        assert ref_state[i].keys() == new_state[i].keys()
        for k in ref_state[i]:
            assert torch.equal(ref_state[i][k], new_state[i][k]), (i, k)
    # nothing kept between steps besides the state: no per-parameter pinned gradients, no
    # float32 GPU gradients; the staging is the plan's size
    assert len(new.cpu_copy_map_grad) == 0 and len(ref.cpu_copy_map_grad) > 0
    assert all(m.grad is None for m in new.param_to_fp32_param.values())
    numels = [sum(p.numel() for grp in o.param_groups for p in grp["params"])
              for o in new.cpu_optimizers]
    assert sum(s.numel() * 4 for s in new.staging) == staging_bytes(numels)
    assert all(s.is_pinned() for s in new.staging)


def _step_both(a_opt, a_params, b_opt, b_params, seed, steps=2):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        for a, b in zip(a_params, b_params):
            grad = torch.randn(a.shape, device="cuda", generator=g).to(torch.bfloat16)
            a.grad, b.grad = grad.clone(), grad.clone()
        a_opt.step()
        b_opt.step()
    torch.cuda.synchronize()


@pytest.mark.parametrize("overlap", [True, False])
def test_staged_state_dict_round_trip_keeps_each_state_on_its_device(overlap):
    """Half on the CPU: a state dict loaded into a fresh optimizer puts the GPU moments on the
    GPU (megatron-core's loader moved them to the CPU without TE / Apex) and steps on exactly
    as the optimizer it came from."""
    params = _params(0)
    opt = _build(StagedHybridDeviceOptimizer, params, 0.5, overlap)
    _step_both(opt, params, opt, params, seed=2, steps=1)   # (the same optimizer twice)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = _build(StagedHybridDeviceOptimizer, fresh_params, 0.5, overlap)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))   # (as through a checkpoint)
    for sub in fresh.sub_optimizers:
        for group in sub.param_groups:
            for p in group["params"]:
                for key, value in sub.state[p].items():
                    if torch.is_tensor(value) and key != "step":
                        assert value.device == p.device, (key, value.device, p.device)
    _step_both(opt, params, fresh, fresh_params, seed=3)
    for a, b in zip(params, fresh_params):
        assert torch.equal(a, b)
