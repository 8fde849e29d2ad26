"""GPU checks of the training loop's host transfers (megatron/training/loop.py and the loss
report of megatron/training/data/batch.py).

* ``_copy_to_host`` queues the step's loss / norm / pairs copy before the optimizer step and
  reads it after: the read must wait for the copy only, not for kernels queued after it (large
  matrix products stand in for the optimizer), and give the values as they were when copied.
* The loss report's attention pairs reach the device without a copy from pageable memory (PyTorch
  synchronises the stream for one): summing the reports after the backward is queued must not
  wait for the backward (``torch.cuda.set_sync_debug_mode("error")`` raises on a sync).
* The next micro-batch, prepared while the step's work is still queued (``prepare_batch``:
  the cut, the copies to the device, the document plan), does not wait for that work either.
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron.training.data.batch import BatchContext, loss_func, prepare_batch
from megatron.training.loop import _copy_to_host

LATER_MATMULS = 24                   # 8192^3 float32 products, ~0.4 s or more on one GPU


@pytest.mark.gpu
def test_the_step_values_are_read_without_waiting_for_later_work():
    values = [torch.tensor(v, device="cuda") for v in (2.5, 7.0, 4096.0)]
    a = torch.randn(8192, 8192, device="cuda")
    c = torch.empty_like(a)
    # First uses may wait for the device: the cuBLAS handle and workspace, a pinned block, and
    # the first launch of a kernel (on an H100 the first fill_, then the first neg_, waited
    # 0.5 s for the queued products: CUDA's lazy module loading, by all signs). Make them here.
    torch.mm(a, a, out=c)
    _copy_to_host(*values)()
    for v in values:
        v.neg_()
        v.neg_()
    torch.cuda.synchronize()
    t = [time.perf_counter()]
    read = _copy_to_host(*values)
    t.append(time.perf_counter())
    for _ in range(LATER_MATMULS):               # the optimizer step queued after the copy
        torch.mm(a, a, out=c)
    t.append(time.perf_counter())
    for v in values:
        v.neg_()                                 # later work changes the device values
    later = torch.cuda.Event()
    later.record()
    t.append(time.perf_counter())
    queued = not later.query()
    got = read()
    t.append(time.perf_counter())
    pending = not later.query()
    later.synchronize()
    assert got == [2.5, 7.0, 4096.0], got
    took = ", ".join(f"{what} {b - a:.3f} s" for what, a, b in
                     zip(("the copy", "the products", "the negations", "the read"), t, t[1:]))
    assert queued, f"the later work was already done when it had been queued ({took})"
    assert pending, f"the later work was done when the read returned ({took})"


@pytest.mark.gpu
def test_the_loss_report_reaches_the_device_without_a_synchronising_copy():
    losses = torch.rand(2, 64, device="cuda")
    mask = torch.ones(2, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, _, report = loss_func(mask, losses, attention_pairs=4096.0)
        pairs = report["attention pairs"].to(device="cuda", dtype=torch.float32)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert pairs.is_cuda and pairs.item() == 4096.0


@pytest.mark.gpu
def test_the_next_micro_batch_is_prepared_without_waiting_for_the_step():
    lengths = [1000, 3000, 17, 4000, 2500] * 6 + [2768]           # 32K tokens, 31 documents
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    tokens = torch.randint(0, 32000, seg.shape)
    full = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(seg.shape),
            "position_ids": pos, "segment_ids": seg, "attention_mask": None}
    ctx = BatchContext(cp_rank=0, cp_size=1, device=torch.device("cuda"), first_stage=True,
                       last_stage=True, documents=True)
    prepare_batch(full, ctx)                     # first uses: pinned blocks, code paths
    a = torch.randn(8192, 8192, device="cuda")
    c = torch.empty_like(a)
    torch.mm(a, a, out=c)
    torch.cuda.synchronize()
    for _ in range(LATER_MATMULS):               # the step's backward and optimizer
        torch.mm(a, a, out=c)
    queued = torch.cuda.Event()
    queued.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = prepare_batch(full, ctx)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    pending = not queued.query()
    torch.cuda.synchronize()
    assert pending, "the step's queued work was done when the micro-batch was prepared"
    for key in ("tokens", "labels", "position_ids", "segment_ids"):
        assert torch.equal(out[key].cpu(), full[key]), key
    assert out["packed_seq_params"].plan.seq_len == seg.shape[1]
