"""megatron.training.grad_clip against megatron-core's own get_grad_norm_fp32 and
clip_grad_by_total_norm_fp32 (run on the CPU inside the CPU shims' context), for one and for
chained sub-optimizers, with and without clipping; grads on mixed dtypes."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.training import grad_clip


@pytest.fixture(scope="module", autouse=True)
def gloo_world_of_one():
    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29617")
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Sub:
    """The four methods and the config megatron-core's optimizers give the step."""

    def __init__(self, params, clip):
        self.params = params
        self.config = SimpleNamespace(clip_grad=clip,
                                      use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)

    def get_parameters(self):
        return self.params

    def get_main_grads_for_grad_norm(self):
        return [p.grad for p in self.params[:-1]]   # the last one: a "shared" parameter

    def get_grad_stats_parallel_group(self):
        return dist.group.WORLD


def _params(seed, n=4, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.nn.Parameter(torch.randn(5 + i, 3, generator=gen))
        p.grad = scale * torch.randn(p.shape, generator=gen)
        out.append(p)
    return out


def _reference_norm(subs):
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    from megatron.usp.cpu_shims import cuda_requests_on_cpu

    with cuda_requests_on_cpu():
        norms = [get_grad_norm_fp32(s.get_main_grads_for_grad_norm(),
                                    grad_stats_parallel_group=s.get_grad_stats_parallel_group())
                 for s in subs]
    return sum(n ** 2 for n in norms) ** 0.5                      # ChainedOptimizer's rule


@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("clip", [0.0, 1.0, 1e6])
def test_norm_and_clip_equal_megatron_cores(chained, clip):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from megatron.usp.cpu_shims import cuda_requests_on_cpu

    subs = [_Sub(_params(0), clip)] + ([_Sub(_params(1, n=3), clip)] if chained else [])
    optimizer = SimpleNamespace(chained_optimizers=subs) if chained else subs[0]
    want = _reference_norm(subs)
    norm = grad_clip.grad_norm(optimizer, torch.device("cpu"))
    assert norm.shape == () and norm.dtype == torch.float32
    assert abs(norm.item() - want) <= 1e-6 * want
    expected = []
    for sub in subs:
        ps = [torch.nn.Parameter(p.detach().clone()) for p in sub.params]
        for p, q in zip(ps, sub.params):
            p.grad = q.grad.clone()
        if clip > 0:
            with cuda_requests_on_cpu():
                clip_grad_by_total_norm_fp32(ps, clip, norm.item())
        expected.append([p.grad for p in ps])
    grad_clip.clip_grads(optimizer, norm.item())
    for sub, want_grads in zip(subs, expected):
        for p, g in zip(sub.params, want_grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=0)
    if 0 < clip < norm.item():                                    # clipped to the bound
        assert abs(grad_clip.grad_norm(optimizer, torch.device("cpu")).item() - clip) < 1e-4


def test_mixed_dtypes_and_no_grads():
    g32 = torch.tensor([3.0, 0.0, 0.0, 0.0])
    g16 = torch.tensor([4.0, 0.0, 0.0], dtype=torch.bfloat16)
    squares = grad_clip.sum_of_squares([g32, g16], torch.device("cpu"))
    assert squares.dtype == torch.float32 and squares.item() == 25.0
    assert grad_clip.sum_of_squares([], torch.device("cpu")).item() == 0.0
    empty = _Sub([], 1.0)
    empty.get_main_grads_for_grad_norm = lambda: []
    assert grad_clip.grad_norm(empty, torch.device("cpu")).item() == 0.0
