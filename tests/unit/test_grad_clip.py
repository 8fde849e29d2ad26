"""megatron.training.optim.grad_clip against megatron-core's own get_grad_norm_fp32 and
clip_grad_by_total_norm_fp32 (run on the CPU inside the CPU shims' context), for one and for
chained sub-optimizers, with and without clipping; grads on mixed dtypes."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.training.cpu_shims import cuda_requests_on_cpu
from megatron.training.optim import grad_clip


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
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32  # megatron-core on first use

    with cuda_requests_on_cpu():
        norms = [get_grad_norm_fp32(s.get_main_grads_for_grad_norm(),
                                    grad_stats_parallel_group=s.get_grad_stats_parallel_group())
                 for s in subs]
    return sum(n ** 2 for n in norms) ** 0.5                      # ChainedOptimizer's rule


@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("clip", [0.0, 1.0, 1e6])
def test_norm_and_clip_equal_megatron_cores(chained, clip):
    from megatron.core.optimizer.clip_grads import (
        clip_grad_by_total_norm_fp32,  # megatron-core on first use
    )

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


def _adam(params, fused):
    # eps near the grads' size: Adam is otherwise blind to a constant factor on the grads,
    # and the test to a wrong division.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=0.3, fused=fused,
                             foreach=False if fused else None)


@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("clip", [0.0, 1.0, 1e6])
def test_step_scaled_in_fused_adam_equals_divide_clip_then_adam(chained, clip):
    """The division by the token count and the clip inside the fused kernel give what
    megatron-core's order gives: grads divided (``scale_gradients``), clipped by the norm of
    the divided grads, then the default (foreach) AdamW."""
    num_tokens = 37.0
    seeds = [0, 1] if chained else [0]
    ours = [_Sub(_params(s, scale=40.0), clip) for s in seeds]
    ref = [_Sub(_params(s, scale=40.0), clip) for s in seeds]
    for sub in ours:
        sub.optimizer = _adam(sub.params, fused=True)
    for sub in ref:
        sub.optimizer = _adam(sub.params, fused=False)
    pick = (lambda subs: SimpleNamespace(chained_optimizers=subs)) if chained else \
        (lambda subs: subs[0])
    ours_opt, ref_opt = pick(ours), pick(ref)
    assert grad_clip.fused_adams(ours_opt) == [s.optimizer for s in ours]
    assert grad_clip.fused_adams(ref_opt) is None                   # foreach: not fused
    start = [[p.detach().clone() for p in sub.params] for sub in ours]
    cpu = torch.device("cpu")
    for step in range(3):
        for a, b in zip(ours, ref):                                  # fresh equal grads
            fresh = _params(7 + step, n=len(a.params), scale=(step + 1.0) * 40.0)
            for p, q, f in zip(a.params, b.params, fresh):
                p.grad, q.grad = f.grad.clone(), f.grad.clone()
        # reference: megatron-core's order
        for sub in ref:
            for p in sub.params:
                p.grad.mul_(1.0 / num_tokens)
        want_norm = grad_clip.grad_norm(ref_opt, cpu)
        grad_clip.clip_grads(ref_opt, want_norm.item())
        for sub in ref:
            sub.optimizer.step()
        # ours: the raw sums, divided in the kernel
        n = torch.tensor(num_tokens)
        norm = grad_clip.grad_norm(ours_opt, cpu) / n
        assert abs(norm.item() - want_norm.item()) <= 1e-6 * want_norm.item()
        with grad_clip.scaled_in_adam(ours_opt, grad_clip.fused_adams(ours_opt), n, norm,
                                      torch.isfinite(norm)):
            for sub in ours:
                sub.optimizer.step()
        assert not any(hasattr(s.optimizer, "grad_scale") for s in ours)
    for a, b, first in zip(ours, ref, start):
        for p, q, p0 in zip(a.params, b.params, first):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-6, atol=1e-7)
            assert (p.detach() - p0).abs().max() > 1e-3              # not a trivial update


def test_non_finite_step_changes_nothing_in_the_fused_kernel():
    sub = _Sub(_params(0), 1.0)
    sub.optimizer = _adam(sub.params, fused=True)
    sub.optimizer.step()                                             # a normal first step
    before = [p.detach().clone() for p in sub.params]
    state = {k: v.clone() for k, v in sub.optimizer.state[sub.params[0]].items()}
    sub.params[1].grad[0, 0] = float("nan")
    n = torch.tensor(8.0)
    norm = grad_clip.grad_norm(sub, torch.device("cpu")) / n
    assert not torch.isfinite(norm)
    with pytest.raises(RuntimeError, match="inside"):
        with grad_clip.scaled_in_adam(sub, [sub.optimizer], n, norm, torch.isfinite(norm)):
            assert sub.optimizer.found_inf.item() == 1.0
            assert torch.isfinite(sub.optimizer.grad_scale)
            sub.optimizer.step()
            raise RuntimeError("inside")
    assert not hasattr(sub.optimizer, "grad_scale") and not hasattr(sub.optimizer, "found_inf")
    for p, b in zip(sub.params, before):
        assert torch.equal(p.detach(), b)
    for k, v in sub.optimizer.state[sub.params[0]].items():
        assert torch.equal(v, state[k]), k


def test_fused_adams_only_where_the_kernel_takes_the_scaling():
    def sub_with(opt, **extra):
        sub = _Sub(_params(0), 1.0)
        sub.optimizer = opt(sub.params)
        for k, v in extra.items():
            setattr(sub, k, v)
        return sub

    fused = sub_with(lambda ps: _adam(ps, True))
    assert grad_clip.fused_adams(fused) == [fused.optimizer]
    assert grad_clip.fused_adams(sub_with(lambda ps: _adam(ps, False))) is None
    assert grad_clip.fused_adams(sub_with(lambda ps: torch.optim.SGD(ps, lr=0.1))) is None
    assert grad_clip.fused_adams(sub_with(lambda ps: _adam(ps, True), grad_scaler=object())) \
        is None
    aware = sub_with(lambda ps: _adam(ps, True))
    aware.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    assert grad_clip.fused_adams(aware) is None
    other = sub_with(lambda ps: _adam(ps, True))
    other.optimizer = SimpleNamespace(param_groups=[])              # e.g. the offload's HDO
    assert grad_clip.fused_adams(SimpleNamespace(chained_optimizers=[fused, other])) is None


def test_use_fused_adam_switches_cpu_and_cuda_adams_only():
    from megatron.training.loop import use_fused_adam  # megatron-core on first use

    def wrapped(opt):
        return SimpleNamespace(optimizer=opt)

    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert use_fused_adam(wrapped(adam)) == 1
    assert all(g["fused"] and not g["foreach"] for g in adam.param_groups)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    chained = SimpleNamespace(chained_optimizers=[wrapped(sgd), wrapped(
        torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))]))])
    assert use_fused_adam(chained) == 1
    assert "fused" not in sgd.param_groups[0] or not sgd.param_groups[0]["fused"]


def test_fused_step_copies_the_host_values_before_it_queues_the_step(monkeypatch):
    """With the fused Adam step, the loss, the norm and the attention pairs are copied to the
    host in one transfer queued before the step and read after the step is queued (on a GPU
    the read waits for the copy only: tests/gpu/test_training_kernels_gpu.py), so the host
    neither leaves the GPU idle before the step nor waits for it; the values returned are
    the reduced ones."""
    from megatron.training import loop

    events = []

    class _Optimizer:
        def prepare_grads(self):
            events.append("prepare")
            return False

        def step_with_ready_grads(self):
            events.append("step")
            return True

    copy = loop._copy_to_host

    def spy(*values):
        events.append("copy")
        read = copy(*values)
        return lambda: events.append("read") or read()

    monkeypatch.setattr(grad_clip, "fused_adams", lambda optimizer: ["adam"])
    monkeypatch.setattr(grad_clip, "grad_norm", lambda optimizer, device: torch.tensor(6.0))
    monkeypatch.setattr(grad_clip, "scaled_in_adam", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(loop, "_copy_to_host", spy)
    total = torch.tensor([12.0, 3.0, 4096.0])
    got = loop.guarded_optimizer_step(_Optimizer(), [], total, torch.device("cpu"))
    assert events == ["prepare", "copy", "step", "read"]
    assert got == (True, 4.0, 2.0, 4096.0)
