"""Start-up validation: every bad layout fails with a message naming the flag and a fix."""

import pytest

from megatron.usp.config import USPConfigError, USPParallelConfig


def cfg(**kw):
    return USPParallelConfig(**kw)


def test_valid_layouts_pass_and_dp_is_derived():
    c = cfg(tensor_model_parallel_size=2, ulysses_degree=2, ring_degree=2)
    c.validate(world_size=16, num_attention_heads=32, num_query_groups=8, seq_length=4096)
    assert c.data_parallel_size(16) == 2
    assert c.cp_size == 4


def test_world_not_divisible():
    with pytest.raises(USPConfigError) as e:
        cfg(ulysses_degree=2, ring_degree=3).validate(world_size=8)
    msg = str(e.value)
    assert "world size 8" in msg and "--ring-degree" in msg and "[1, 2, 4]" in msg


@pytest.mark.parametrize("flag,kw", [
    ("--ulysses-degree", dict(ulysses_degree=0)),
    ("--ring-degree", dict(ring_degree=-1)),
    ("--tensor-model-parallel-size", dict(tensor_model_parallel_size=0)),
])
def test_degrees_must_be_positive(flag, kw):
    with pytest.raises(USPConfigError, match=flag):
        cfg(**kw).validate(world_size=4)


def test_heads_not_divisible_by_ulysses_lists_valid_values():
    with pytest.raises(USPConfigError) as e:
        cfg(ulysses_degree=4, tensor_model_parallel_size=2).validate(
            world_size=8, num_attention_heads=12)
    msg = str(e.value)
    assert "--ulysses-degree 4" in msg and "6" in msg and "[1, 2, 3, 6]" in msg


def test_heads_not_divisible_by_tp():
    with pytest.raises(USPConfigError, match="--tensor-model-parallel-size"):
        cfg(tensor_model_parallel_size=4).validate(world_size=4, num_attention_heads=6)


def test_kv_heads_fewer_than_ulysses_allowed_when_they_divide():
    # Llama-3-8B: 32 heads, 8 KV groups, TP 2 -> 4 KV heads per TP rank, U 8 replicates.
    cfg(tensor_model_parallel_size=2, ulysses_degree=8).validate(
        world_size=16, num_attention_heads=32, num_query_groups=8)
    # MQA
    cfg(ulysses_degree=4).validate(world_size=4, num_attention_heads=8, num_query_groups=1)


def test_kv_heads_and_ulysses_must_divide_each_other():
    with pytest.raises(USPConfigError) as e:
        cfg(ulysses_degree=4).validate(world_size=4, num_attention_heads=24, num_query_groups=6)
    assert "--ulysses-degree" in str(e.value) and "KV heads" in str(e.value)


def test_seq_length_divisible_by_2UR():
    with pytest.raises(USPConfigError) as e:
        cfg(ulysses_degree=2, ring_degree=2).validate(world_size=4, seq_length=100)
    msg = str(e.value)
    assert "--seq-length=100" in msg and "8" in msg and "96 or 104" in msg
    cfg(ulysses_degree=2, ring_degree=2).validate(world_size=4, seq_length=104)


def test_conflicting_context_parallel_size():
    with pytest.raises(USPConfigError) as e:
        cfg(ulysses_degree=2, ring_degree=2, context_parallel_size=2).validate(world_size=4)
    msg = str(e.value)
    assert "--context-parallel-size=2" in msg and "--context-parallel-size 4" in msg
    cfg(ulysses_degree=2, ring_degree=2, context_parallel_size=4).validate(world_size=4)


def test_num_query_groups_must_divide_heads():
    with pytest.raises(USPConfigError, match="--num-query-groups"):
        cfg().validate(world_size=1, num_attention_heads=8, num_query_groups=3)
