"""GPU checks of the training loop's host transfers (megatron/training/loop.py and the loss
report of megatron/training/data/batch.py).

* ``_copy_to_host`` queues the step's loss / norm / pairs copy before the optimizer step and
  reads it after: the read must wait for the copy only, not for kernels queued after it (large
  matrix products stand in for the optimizer), and give the values as they were when copied.
* The loss report's attention pairs reach the device without a copy from pageable memory (PyTorch
  synchronises the stream for one): summing the reports after the backward is queued must not
  wait for the backward (``torch.cuda.set_sync_debug_mode("error")`` raises on a sync).
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron.training.data.batch import loss_func
from megatron.training.loop import _copy_to_host

LATER_MATMULS = 24                   # 8192^3 float32 products, ~0.4 s or more on one GPU


@pytest.mark.gpu
def test_the_step_values_are_read_without_waiting_for_later_work():
    values = [torch.tensor(v, device="cuda") for v in (2.5, 7.0, 4096.0)]
    a = torch.randn(8192, 8192, device="cuda")
    c = torch.empty_like(a)
    torch.cuda.synchronize()
    read = _copy_to_host(*values)
    for _ in range(LATER_MATMULS):               # the optimizer step queued after the copy
        torch.mm(a, a, out=c)
    for v in values:
        v.fill_(-1.0)                            # later work changes the device values
    later = torch.cuda.Event()
    later.record()
    t0 = time.perf_counter()
    got = read()
    waited = time.perf_counter() - t0
    pending = not later.query()
    later.synchronize()
    assert got == [2.5, 7.0, 4096.0], got
    assert pending, f"the later work was done when the read returned ({waited:.3f} s)"


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
