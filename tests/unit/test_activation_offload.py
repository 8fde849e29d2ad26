"""ActivationOffloader (megatron/memory/activation_offload.py) on the CPU: order, window, prefetch.

The CPU path is the GPU path with synchronous copies, so what is checked here holds for both:
items come back equal to what was kept; the newest ``prefetch`` items of a forward never
leave the device; taking items in backward order brings each next one back before it is asked
for (no on-demand reload); out of order still returns the right tensors (reloaded on demand);
an item cannot be taken twice; host buffers are reused from step to step; only tensors that are
recorded layer inputs, saved in no-grad mode (a checkpoint's ``save_for_backward``), are
caught by the saved-tensor hooks.
"""

import pytest
import torch

from megatron.memory.activation_offload import ActivationOffloader, HostBufferPool, OffloadConfig


def _offloader(prefetch=2):
    cfg = OffloadConfig(layer_input=True, prefetch=prefetch)
    return ActivationOffloader(torch.device("cpu"), cfg, min_offload_bytes=0)


def _forward(off, tensors):
    off.forward_started()
    items = [off.keep(t, to_host=True) for t in tensors]
    off.forward_finished()
    return items


def test_items_come_back_in_backward_order_with_prefetch():
    off = _offloader(prefetch=2)
    tensors = [torch.full((4, 3), float(i)) for i in range(6)]
    items = _forward(off, tensors)
    resident = [it.device_tensor is not None for it in items]
    assert resident == [False, False, False, False, True, True]
    for it, t in zip(reversed(items), reversed(tensors)):
        assert torch.equal(off.take(it), t)
    assert off.stats.reloaded_on_demand == 0 and off.stats.prefetched == 4
    assert off.stats.offloaded == off.stats.taken == 6


def test_out_of_order_take_reloads_on_demand_and_refuses_a_second_take():
    off = _offloader(prefetch=1)
    tensors = [torch.randn(5) for _ in range(3)]
    items = _forward(off, tensors)
    assert torch.equal(off.take(items[0]), tensors[0])
    assert off.stats.reloaded_on_demand == 1
    assert torch.equal(off.take(items[2]), tensors[2])
    assert torch.equal(off.take(items[1]), tensors[1])
    with pytest.raises(RuntimeError, match="read twice"):
        off.take(items[1])


def test_keep_outside_a_decoder_forward_is_refused():
    with pytest.raises(RuntimeError, match="outside a training forward"):
        _offloader().keep(torch.zeros(2), to_host=True)


def test_host_buffers_are_reused_across_steps():
    off = _offloader()
    off.reserve((8, 8), torch.float32, 4)         # what build_gpt_model does at start-up
    assert off.pool.allocated_bytes == 4 * 8 * 8 * 4
    for _ in range(3):
        for it in reversed(_forward(off, [torch.randn(8, 8) for _ in range(4)])):
            off.take(it)
    assert off.pool.allocated_bytes == 4 * 8 * 8 * 4
    pool = HostBufferPool(pin=False)
    buf = pool.get(10, torch.float32)
    pool.put(buf, None)
    assert pool.get(10, torch.float32) is buf


class _Save(torch.autograd.Function):
    """Saves its inputs like a checkpoint does (packed in no-grad mode)."""

    @staticmethod
    def forward(ctx, x, table):
        ctx.save_for_backward(x, table)
        return x * table

    @staticmethod
    def backward(ctx, grad):
        x, table = ctx.saved_tensors
        return grad * table, None


def test_saved_tensor_hooks_catch_recorded_layer_inputs_only():
    off = _offloader()
    x = torch.randn(6, requires_grad=True)
    h = x * 2                         # a layer input: on the autograd path
    table = torch.randn(6)            # like the RoPE table a checkpoint also saves
    off.forward_started()
    off.note_layer_input(h)
    with off.saved_tensors_hooks():
        y = _Save.apply(h, table)
        z = (y * y).sum()             # saved in grad mode: not an item
    off.forward_finished()
    assert off.stats.kept == 1
    z.backward()
    assert off.stats.taken == 1
    torch.testing.assert_close(x.grad, 2 * 2 * (h * table) * table)
