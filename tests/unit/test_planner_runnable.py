"""The planner recommends only what pretrain_gpt.py here can run, and says how to run it.

Every ranked layout of a few presets (its printed ``pretrain_gpt.py`` flags plus the run's
LR, length and data flags) passes ``pretrain_gpt.py``'s own argument validation; none is
ZeRO-2/3 (Megatron-FSDP: not recommended until verified on GPUs) or selective recompute of ``layernorm`` without
TransformerEngine (refused by the arguments); docs/reliability.md lists the fault.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from dataclasses import replace

import pytest

from megatron.planner import DEFAULT_ASSUMPTIONS, Workload, get_hardware, plan_layouts
from megatron.planner.capabilities import FULL_MEGATRON, Capabilities, runnable
from megatron.planner.cost_model import Layout, estimate
from megatron.planner.plan import plan_from
from megatron.shapes import PRESETS
from megatron.training.cli.arguments import parse_args, validate_args

# (model, sequence, GPUs, GPUs per node, hardware): the Llama-3-8B at 128K on 8
# GPUs (whose rows 1-4 were ZeRO-2), the 0.85B benchmark model, a 2-node 7B.
CASES = [("llama3-8b", 131072, 8, 8, "h200"), ("llama-0.85b", 65536, 2, 8, "h200"),
         ("llama2-7b", 32768, 16, 8, "h100"), ("llama2-7b", 262144, 8, 8, "l20"),
         ("mistral-7b-v0.1", 131072, 8, 8, "h200")]
RUN = ["--lr", "1e-4", "--train-iters", "10", "--mock-data", "--eval-iters", "0"]


@pytest.mark.parametrize("model,seq,gpus,per_node,hw", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_every_ranked_layout_passes_pretrain_validation(model, seq, gpus, per_node, hw):
    result = plan_layouts(Workload(PRESETS[model], seq, gpus, per_node), hw, top=10)
    assert result.ranked
    te = importlib.util.find_spec("transformer_engine") is not None
    for ranked in result.ranked:
        plan = plan_from(result, ranked)
        assert plan.zero_stage in (0, 1), plan.estimate.layout.short()
        flags = plan.pretrain_flags
        if plan.recompute == "selective" and not te:
            after = flags[flags.index("--recompute-modules") + 1:]
            modules = after[:next(i for i, f in enumerate(after) if f.startswith("--"))]
            assert modules == ["mlp"], flags
        # the loss the memory model assumed is in the flags (the fused one, 8192-token chunks)
        assert flags[flags.index("--fused-linear-cross-entropy") + 1:][:2] == [
            "--linear-cross-entropy-chunk-tokens", "8192"]
        vocab = ["--vocab-size", str(PRESETS[model].vocab_size)]
        dims = validate_args(parse_args(flags + RUN + vocab), gpus, cuda_available=True).dims
        assert (dims.ulysses, dims.ring, dims.dp) == (
            plan.ulysses_degree, plan.ring_degree, plan.data_parallel_size)
        assert plan.command().startswith(f"torchrun --nproc-per-node {min(per_node, gpus)}")
        assert plan.command().endswith(shlex.join(flags))


def test_a_windowed_plan_prints_the_window_it_costed():
    """A hybrid pattern given as a list survives the printed command (quoted for the shell)
    and ``pretrain_gpt.py`` builds exactly the planned shape from it, window included."""
    model = replace(PRESETS["llama-0.85b"], window_size=4096,
                    window_attn_skip_freq=[1, 0, 1, 1] * 4)
    result = plan_layouts(Workload(model, 65536, 8, 8), "h200", top=5)
    for ranked in result.ranked:
        plan = plan_from(result, ranked)
        assert "'[1,0,1,1,1,0,1,1,1,0,1,1,1,0,1,1]'" in plan.command()
        argv = shlex.split(plan.command())
        assert argv[argv.index("pretrain_gpt.py") + 1:] == plan.pretrain_flags
        vocab = ["--vocab-size", str(model.vocab_size)]
        config = validate_args(parse_args(plan.pretrain_flags + RUN + vocab), 8,
                               cuda_available=True)
        assert replace(config.with_padded_vocab(model.vocab_size).model_shape(),
                       name=model.name, kv_channels=None) == model
        assert config.window_attn_skip_freq == [1, 0, 1, 1] * 4


def test_capability_table_refuses_what_has_no_flag():
    caps = Capabilities()
    assert runnable(Layout.of(1, 2, 1, 1, 1, 1, "none"), caps) is None
    for stage in (2, 3):
        reason = runnable(Layout.of(1, 2, 1, 1, 1, stage, "none"), caps)
        assert reason and "Megatron-FSDP" in reason and "--use-distributed-optimizer" in reason
    # A study of the full Megatron stack keeps them, but gets no flags to run here.
    assert runnable(Layout.of(1, 2, 1, 1, 1, 3, "none"), FULL_MEGATRON) is None
    result = plan_layouts(Workload(PRESETS["llama2-7b"], 262144, 8, 8), "l20",
                          fixed={"zero_stage": 3}, top=1, capabilities=FULL_MEGATRON)
    assert "not runnable" in plan_from(result, result.best).command()


def test_selective_recompute_memory_follows_the_modules():
    """Without layernorm recompute the norm outputs stay: selective needs more memory."""
    w = Workload(PRESETS["llama3-8b"], 131072, 8, 8)
    lay = Layout.of(1, 8, 1, 1, 1, 1, "selective")
    with_norms = estimate(w, lay, get_hardware("h200"), DEFAULT_ASSUMPTIONS)
    mlp_only = estimate(w, lay, get_hardware("h200"),
                        replace(DEFAULT_ASSUMPTIONS, selective_recompute_modules=("mlp",)))
    assert mlp_only.memory.activations > with_norms.memory.activations


def test_cli_prints_the_command(capsys):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(
        "plan_parallel", os.path.join(root, "tools", "plan_parallel.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--model", "llama3-8b", "--seq-length", "131072", "--gpus", "8",
                 "--hardware", "h200", "--top", "4"]) == 0
    out = capsys.readouterr().out
    assert "run #1" in out and "torchrun --nproc-per-node 8 pretrain_gpt.py " in out
    assert "ZeRO-2 is megatron-core's Megatron-FSDP" in out  # counted among the rejections
