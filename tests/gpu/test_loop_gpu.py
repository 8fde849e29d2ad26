"""GPU checks of the training loop's host transfers (megatron/training/loop.py and the loss
report of megatron/training/data/batch.py).

* ``_copy_to_host`` queues the step's loss / norm / pairs copy before the optimizer step and
  reads it after: the read must wait for the copy only, not for kernels queued after it (a
  spinning kernel stands in for the optimizer), and give the values as they were when copied.
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

SPIN_CYCLES = 500_000_000            # ~0.25 s at a 2 GHz SM clock


@pytest.mark.gpu
def test_the_step_values_are_read_without_waiting_for_later_work():
    values = [torch.tensor(v, device="cuda") for v in (2.5, 7.0, 4096.0)]
    torch.cuda.synchronize()
    read = _copy_to_host(*values)
    for _ in range(4):
        torch.cuda._sleep(SPIN_CYCLES)           # the optimizer step queued after the copy
    for v in values:
        v.fill_(-1.0)                            # later work changes the device values
    t0 = time.perf_counter()
    got = read()
    waited = time.perf_counter() - t0
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert got == [2.5, 7.0, 4096.0], got
    assert busy and waited < 0.1, f"the read waited {waited:.3f} s (stream busy after: {busy})"


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
