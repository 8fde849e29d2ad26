"""GPU check of ``training.allocate_adam_state``: PyTorch's fused AdamW on CUDA with the
state made at build time (its step count on the GPU, float32, as the fused kernel wants)
steps bitwise like the state the kernel makes itself, under the grad scale and found-inf
arguments the training step hands it (``grad_clip.scaled_in_adam``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


@pytest.mark.gpu
def test_allocated_state_in_fused_adamw_on_gpu():
    from megatron.training.loop import allocate_adam_state  # megatron-core on first use

    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, 64, generator=g, device="cuda"))
                  for n in (128, 3, 1000)]
        return params, torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)

    (pe, eager), (pl, lazy) = make(), make()
    assert allocate_adam_state(SimpleNamespace(optimizer=eager)) == 1
    for p in pe:
        step = eager.state[p]["step"]
        assert step.device == p.device and step.dtype == torch.float32
    for i, skip in enumerate((False, True, False)):
        for opt, params in ((eager, pe), (lazy, pl)):
            g = torch.Generator(device="cuda").manual_seed(10 + i)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g, device="cuda")
            opt.grad_scale = torch.tensor(3.0, device="cuda")
            opt.found_inf = torch.tensor(float(skip), device="cuda")
            opt.step()
    for a, b in zip(pe, pl):
        assert torch.equal(a, b)
        for key in lazy.state[b]:
            assert torch.equal(eager.state[a][key], lazy.state[b][key]), key
        assert float(eager.state[a]["step"]) == 2.0
