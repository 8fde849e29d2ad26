"""The pinned host buffers of ``--recompute-cpu-offload`` are reserved after the optimizer.

megatron-core's optimizer set-up makes transient host copies (with ``--optimizer-cpu-offload``
its HybridDeviceOptimizer is built twice); the buffers of the layer inputs are pinned after
it, so the two do not stack (Llama-3-8B at 256K on one H200 was killed at the host's 125 GiB
in that phase). One gloo rank trains one step of a 2-layer model whose layer inputs (2048
tokens x 128 float32 = 1 MiB each) are big enough to offload; the order of the set-up calls
and the bytes reserved are recorded.
"""

import json

from megatron.training.cli.arguments import parse_args
from tests.harness import run_on_ranks
from tests.helpers import tiny_gpt_flags

ARGS = tiny_gpt_flags(
    hidden_size=128, group_query_attention=None, num_query_groups=None, seq_length=2048,
    max_position_embeddings=2048, mock_data=True, vocab_size=255, global_batch_size=1,
    micro_batch_size=1, train_iters=1, lr="1e-3", eval_iters=0, num_workers=0, device="cpu",
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
    recompute_cpu_offload="layer_input")


def _run(rank, world_size, out_path):
    from megatron.training import loop as training  # megatron-core on first use
    from megatron.training.model.build import unwrap  # megatron-core on first use

    order, chunks = [], []
    build, reserve = training.build_optimizer, training.reserve_offload_buffers

    def recording_build(args, model):
        order.append("optimizer")
        chunks.extend(model)
        return build(args, model)

    def recording_reserve(args, model):
        reserved = reserve(args, model)
        order.append(["reserve", reserved])
        return reserved

    training.build_optimizer, training.reserve_offload_buffers = recording_build, recording_reserve
    try:
        result = training.pretrain(parse_args(ARGS))
    finally:
        training.build_optimizer, training.reserve_offload_buffers = build, reserve
    stats = vars(unwrap(chunks[0]).activation_offloader.stats)
    with open(out_path, "w") as f:
        json.dump({"order": order, "iteration": result.iteration, "stats": stats}, f)


def test_offload_buffers_are_pinned_after_the_optimizer(tmp_path):
    out = tmp_path / "order.json"
    run_on_ranks(_run, 1, str(out), timeout=300)
    got = json.loads(out.read_text())
    layer_input = 2048 * 1 * 128 * 4                 # [s, b, h] float32
    assert got["order"] == ["optimizer", ["reserve", 2 * layer_input]], got
    assert got["iteration"] == 1
    # the step used the reserved buffers: both layer inputs went to them and came back
    assert got["stats"]["offloaded"] == got["stats"]["taken"] == 2, got["stats"]
