"""The CPU shims: applied only without CUDA, each named, each doing what upstream does."""

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron.training import cpu_shims
from megatron.usp.token_order import positions_for_cp_rank


class _FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_shims_are_named_and_idempotent():
    first = cpu_shims.apply_cpu_shims()
    assert first == cpu_shims.apply_cpu_shims()
    if torch.cuda.is_available():
        assert first == []
        return
    for name in ["rotary_pos_embedding.RotaryEmbedding.get_emb",
                 "rope_utils.get_pos_emb_on_this_cp_rank",
                 "utils.GlobalMemoryBuffer.get_tensor",
                 "tensor_parallel.random.CudaRNGStatesTracker.add",
                 "tensor_parallel.random.model_parallel_cuda_manual_seed",
                 "tensor_parallel.mappings._gather_along_first_dim",
                 "tensor_parallel.mappings._reduce_scatter_along_first_dim",
                 "optimizer.get_megatron_optimizer"]:
        assert name in first
    # Each shim names its upstream function in the module docstring.
    for name in first:
        assert name.split(".")[-1] in cpu_shims.__doc__


@pytest.mark.slow
def test_not_applied_when_cuda_is_available():
    code = textwrap.dedent("""
        import torch
        torch.cuda.is_available = lambda: True
        from megatron.training.cpu_shims import apply_cpu_shims
        from megatron.core.models.common.embeddings import rope_utils
        before = rope_utils.get_pos_emb_on_this_cp_rank
        assert apply_cpu_shims() == []
        assert rope_utils.get_pos_emb_on_this_cp_rank is before
        print("unpatched")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "unpatched" in out.stdout


def test_rope_cp_slice_matches_token_order():
    s, cp = 32, 4
    emb = torch.arange(s, dtype=torch.float64).view(s, 1, 1, 1)
    for c in range(cp):
        got = cpu_shims._get_pos_emb_on_this_cp_rank(emb, 0, _FakeGroup(c, cp))
        assert got.view(-1).long().tolist() == positions_for_cp_rank(s, c, cp)


def test_rope_table_equals_upstream_formula():
    cpu_shims.apply_cpu_shims()
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding,  # megatron-core on first use
    )

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    emb = rope.get_emb(16)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    freqs = torch.outer(torch.arange(16, dtype=torch.float32), inv)
    assert torch.allclose(emb.view(16, 8), torch.cat([freqs, freqs], dim=-1))


def test_rng_tracker_forks_cpu_generator():
    cpu_shims.apply_cpu_shims()
    from megatron.core.tensor_parallel.random import (
        CudaRNGStatesTracker,  # megatron-core on first use
    )

    tracker = CudaRNGStatesTracker()
    tracker.add("a", 1)
    tracker.add("b", 2)
    torch.manual_seed(0)
    outside = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("a"):
        a1 = torch.rand(3)
    with tracker.fork("b"):
        b1 = torch.rand(3)
    with tracker.fork("a"):
        a2 = torch.rand(3)
    assert torch.equal(torch.rand(3), outside)  # default stream untouched by the forks
    torch.manual_seed(1)
    assert torch.equal(a1, torch.rand(3))  # state "a" is seed 1 ...
    assert not torch.equal(a1, a2)  # ... and it advances
    assert not torch.equal(a1, b1)


def test_global_memory_buffer_on_cpu():
    cpu_shims.apply_cpu_shims()
    from megatron.core.utils import GlobalMemoryBuffer  # megatron-core on first use

    buf = GlobalMemoryBuffer()
    t = buf.get_tensor((2, 3), torch.float32, "x")
    assert t.device.type == "cpu" and t.shape == (2, 3)
    t2 = buf.get_tensor((3,), torch.float32, "x")
    assert t2.data_ptr() == t.data_ptr()
