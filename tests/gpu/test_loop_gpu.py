"""GPU check of the training loop's host reads (megatron/training/loop.py).

``_copy_to_host`` queues the step's loss / norm / pairs copy before the optimizer step and
reads it after: the read must wait for the copy only, not for kernels queued after it (a
sleeping kernel stands in for the optimizer), and give the values as they were when copied.
"""

from __future__ import annotations

import pytest
import torch

from megatron.training.loop import _copy_to_host

BUSY_CYCLES = 2_000_000_000          # ~1 s on a 2 GHz GPU clock


@pytest.mark.gpu
def test_the_step_values_are_read_without_waiting_for_later_work():
    values = [torch.tensor(v, device="cuda") for v in (2.5, 7.0, 4096.0)]
    torch.cuda.synchronize()
    read = _copy_to_host(*values)
    torch.cuda._sleep(BUSY_CYCLES)               # the optimizer step queued after the copy
    for v in values:
        v.fill_(-1.0)                            # later work changes the device values
    got = read()
    assert not torch.cuda.current_stream().query(), "the read waited for the later work"
    assert got == [2.5, 7.0, 4096.0]
    torch.cuda.synchronize()
