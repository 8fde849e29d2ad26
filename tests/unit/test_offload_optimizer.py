"""The staged HybridDeviceOptimizer's pure parts (its GPU test: tests/gpu/test_offload_optimizer_gpu.py)."""

import pytest

from megatron.training.optim.offload_optimizer import staging_plan


def staging_bytes(numels):
    """Bytes of pinned float32 staging that ``staging_plan`` asks for."""
    slots, per_slot = staging_plan(numels)
    return 4 * slots * per_slot


def test_two_slots_of_the_largest_sub_optimizer():
    assert staging_plan([10, 300, 20]) == (2, 300)
    assert staging_bytes([10, 300, 20]) == 2 * 300 * 4


def test_one_sub_optimizer_needs_one_slot_and_none_needs_none():
    # without --overlap-cpu-optimizer-d2h-h2d megatron-core builds one CPU sub-optimizer
    assert staging_plan([12345]) == (1, 12345)
    assert staging_plan([]) == (0, 0) and staging_bytes([]) == 0


def test_llama3_8b_embedding_fits_two_power_of_two_slots():
    # the largest shard of Llama-3-8B (the 128256 x 4096 embedding) in float32: two slots
    # stay inside one 4 GiB pinned block (PyTorch rounds pinned blocks to powers of two)
    assert staging_bytes([128256 * 4096, 4096 * 14336]) <= 2**32


def test_empty_sub_optimizer_is_refused():
    with pytest.raises(ValueError, match="positive numel"):
        staging_plan([4, 0])


def test_megatron_core_builds_on_the_gpu_where_its_copies_fit():
    from megatron.training.optim.offload_optimizer import (
        build_fraction,  # megatron-core on first use
    )

    gib = 2**30
    llama3_8b = 8_030_261_248
    # one H200 after building the model: ~100 GiB free -> 64 GB of float32 copies fit there
    assert build_fraction(llama3_8b, 100 * gib) == 0.0
    # an 80 GB GPU: ~45 GiB free beside 30 GiB of bf16 weights and gradients -> on the host
    assert build_fraction(llama3_8b, 45 * gib) == 1.0
    assert build_fraction(0, 0) == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        build_fraction(-1, gib)
