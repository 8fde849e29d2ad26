"""Start-up checks of the long-sequence flags (megatron/training/cli/memory_args.py).

Every combination that cannot work is refused by validate_args with an error that names the
flag and a way out; valid combinations pass and fill in defaults (the offload fraction, the
FSDP sharding strategy). Megatron-LM's names parse to Megatron-LM's dests.
"""

import importlib.util

import pytest
import torch

from megatron.training.cli.arguments import ArgumentsError, parse_args, validate_args
from tests.helpers import tiny_gpt_flags

BASE = tiny_gpt_flags(llama=False, num_attention_heads=8, seq_length=256, train_iters=10,
                      lr="1e-3", mock_data=True, vocab_size=1000)
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]
OFFLOAD = ["--use-distributed-optimizer", "--use-precision-aware-optimizer",
           "--optimizer-cpu-offload"]


def _valid(extra, world=2, cuda=False):
    return validate_args(parse_args(BASE + extra), world, cuda_available=cuda)


def test_megatron_lm_names_parse_to_their_dests():
    args = parse_args(BASE + OFFLOAD + ["--optimizer-offload-fraction", "0.5",
                                        "--overlap-cpu-optimizer-d2h-h2d", "--use-megatron-fsdp",
                                        "--data-parallel-sharding-strategy", "optim_grads"])
    assert args.optimizer_cpu_offload and args.use_precision_aware_optimizer
    assert args.optimizer_offload_fraction == 0.5 and args.overlap_cpu_optimizer_d2h_h2d
    assert args.use_megatron_fsdp and args.data_parallel_sharding_strategy == "optim_grads"


def test_valid_long_sequence_combinations_pass():
    config = _valid(FULL + ["--recompute-keep-core-attn", "--recompute-cpu-offload",
                            "layer_input", "core_attn", "--mlp-tile-tokens", "32",
                            "--ulysses-degree", "2"])
    assert config.args.recompute_cpu_offload == ["layer_input", "core_attn"]
    assert config.offload.layer_input and config.offload.core_attn
    assert config.offload.keep_core_attn
    config = _valid(FULL + OFFLOAD, world=1, cuda=True)
    assert config.optimizer_offload_fraction == 1.0      # Megatron-LM's default
    config = _valid(["--use-distributed-optimizer", "--use-megatron-fsdp"], world=2, cuda=True)
    assert config.data_parallel_sharding_strategy == "optim_grads_params"
    _valid(["--use-distributed-optimizer", "--use-megatron-fsdp", "--ulysses-degree", "2"],
           world=2, cuda=True)      # shards over DP x CP: CP alone is enough
    # tile = the MLP's local tokens: 256 / U2 / TP2 with sequence parallelism
    _valid(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--ulysses-degree",
            "2", "--mlp-tile-tokens", "64"], world=4)


@pytest.mark.parametrize("extra, world, cuda, match", [
    (["--recompute-keep-core-attn"], 2, False, "needs|recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-keep-core-attn"], 2, False,
     "--recompute-granularity full"),
    (["--recompute-cpu-offload", "layer_input"], 2, False, "add --recompute-granularity full"),
    (FULL + ["--recompute-cpu-offload", "core_attn"], 2, False,
     "add --recompute-keep-core-attn"),
    (["--mlp-tile-tokens", "0"], 2, False, "must be >= 1"),
    (["--ulysses-degree", "2", "--mlp-tile-tokens", "48"], 2, False,
     r"does not divide the MLP's 128 local tokens .*--mlp-tile-tokens 32"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--mlp-tile-tokens", "256"],
     2, False, r"128 local tokens .*--sequence-parallel"),
    (OFFLOAD, 1, False, "CUDA-only.*drop --optimizer-cpu-offload"),
    (["--optimizer-cpu-offload"], 1, True,
     "needs --use-distributed-optimizer and --use-precision-aware-optimizer"),
    (OFFLOAD + ["--optimizer", "sgd"], 1, True, "offloads Adam only"),
    (OFFLOAD + ["--optimizer-offload-fraction", "1.5"], 1, True, r"must be in \[0, 1\]"),
    (["--optimizer-offload-fraction", "0.5"], 1, True, "without --optimizer-cpu-offload"),
    (["--overlap-cpu-optimizer-d2h-h2d"], 1, True, "without --optimizer-cpu-offload"),
    (["--use-precision-aware-optimizer", "--use-distributed-optimizer"], 1, True,
     "TransformerEngine's FusedAdam"),
    (["--data-parallel-sharding-strategy", "optim"], 1, True, "without --use-megatron-fsdp"),
    (["--use-megatron-fsdp", "--use-distributed-optimizer"], 1, False, "needs --device cuda"),
    (["--use-megatron-fsdp"], 1, True, "needs --use-distributed-optimizer"),
    (["--use-megatron-fsdp", "--use-distributed-optimizer", "--pipeline-model-parallel-size",
      "2"], 2, True, "pipeline-model-parallel-size"),
    (["--use-megatron-fsdp"] + OFFLOAD, 1, True, "not combined with --optimizer-cpu-offload"),
    (["--use-megatron-fsdp", "--use-distributed-optimizer", "--save", "/tmp/x"], 1, True,
     "fsdp_dtensor"),
    (["--use-megatron-fsdp", "--use-distributed-optimizer"], 1, True,
     "this run has one: there is nothing to shard.*drop --use-megatron-fsdp"),
    (["--use-megatron-fsdp", "--use-distributed-optimizer", "--tensor-model-parallel-size",
      "2"], 2, True, "nothing to shard"),
    (["--use-megatron-fsdp", "--use-distributed-optimizer"] + FULL
     + ["--recompute-cpu-offload", "layer_input"], 2, True, "--recompute-cpu-offload"),
])
def test_impossible_combinations_are_refused(extra, world, cuda, match):
    with pytest.raises(ArgumentsError, match=match):
        _valid(extra, world=world, cuda=cuda)


# ---------------------------------------------------------------- optimizer config workarounds
def test_precision_aware_offload_config_without_transformer_engine():
    """megatron-core 0.16.1's OptimizerConfig raises TypeError under
    use_precision_aware_optimizer when TE is absent; build_optimizer's workaround gives the
    config what __post_init__ sets for the HybridDeviceOptimizer path."""
    from megatron.core.optimizer import OptimizerConfig  # megatron-core on first use

    from megatron.training.loop import precision_aware_without_te  # megatron-core on first use

    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(TypeError):   # the upstream bug this works around
            OptimizerConfig(optimizer="adam", use_distributed_optimizer=True,
                            optimizer_cpu_offload=True, use_precision_aware_optimizer=True)
    config = OptimizerConfig(optimizer="adam", use_distributed_optimizer=True,
                             optimizer_cpu_offload=True, use_precision_aware_optimizer=False)
    precision_aware_without_te(config)
    assert config.use_precision_aware_optimizer
    assert config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    assert config.store_param_remainders is False
    plain = OptimizerConfig(optimizer="adam", use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="optimizer_cpu_offload"):
        precision_aware_without_te(plain)


def test_adam_step_goes_where_the_param_group_expects_it():
    from megatron.training.checkpoint.save_load import (
        adam_step_tensor,  # megatron-core on first use
    )

    param = torch.empty(3, device="meta")   # stands for a CUDA parameter
    fused = adam_step_tensor(7.0, {"fused": True}, param)
    assert fused.device.type == "meta" and fused.dtype == torch.float32
    assert adam_step_tensor(7.0, {"capturable": True}, param).device.type == "meta"
    plain = adam_step_tensor(7.0, {"fused": False, "foreach": True}, param)
    assert plain.device.type == "cpu" and float(plain) == 7.0


def test_restored_adam_step_sits_with_the_tensor_a_sub_optimizer_steps(monkeypatch):
    """HybridDeviceOptimizer (--optimizer-cpu-offload): the state of a model parameter (CUDA)
    is stepped by a CPU sub-optimizer on a CPU copy; a fused group's restored step must sit on
    the CPU, not on the model parameter's device (a resumed run on one H200 failed so)."""
    from megatron.core.optimizer import distrib_optimizer  # megatron-core on first use
    from megatron.core.optimizer.distrib_optimizer import (
        DistributedOptimizer,  # megatron-core on first use
    )

    from megatron.training.checkpoint.save_load import (
        _restore_adam_steps,  # megatron-core on first use
    )

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    model_param = torch.nn.Parameter(torch.zeros(3, device="meta"))   # stands for CUDA
    on_gpu = torch.nn.Parameter(torch.zeros(2, device="meta"))          # stays on the GPU
    cpu_copy = torch.zeros(3)
    inner = torch.optim.AdamW([model_param, on_gpu], foreach=False)
    inner.param_groups[0]["fused"] = True
    inner.param_to_inner_param = {model_param: cpu_copy, on_gpu: on_gpu}
    for p in (model_param, on_gpu):
        inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p)}
    opt = DistributedOptimizer.__new__(DistributedOptimizer)
    opt.optimizer = inner
    _restore_adam_steps(opt, {"optimizer": {"param_groups": [{"step": 5}]}})
    step = inner.state[model_param]["step"]
    assert step.device.type == "cpu" and float(step) == 5.0
    assert inner.state[on_gpu]["step"].device.type == "meta"
