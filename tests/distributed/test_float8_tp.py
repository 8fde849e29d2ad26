"""Float8 linear layers under tensor parallelism (TP = 2, gloo, torchao's emulation on the
CPU), with and without Megatron sequence parallelism: QKV (column-parallel; the input
all-gathered forward and backward, its gradient reduce-scattered), the attention projection
(row-parallel, output reduce-scattered), FC1 and FC2 with the SwiGLU inside FC2, and plain
FC2. Each layer runs once in float32 and once in float8 on the same inputs; on each rank
its output, its input gradient and its weight gradient (this rank's shard, added into
``main_grad`` over two micro-batches) must have SQNR > 20 dB against the float32 run, and
below 60 dB (float8 really ran). Both recipes (tensorwise hybrid, rowwise e4m3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.layers.float8_gemms import Float8Gemms
from megatron.layers.float8_options import Float8Options
from megatron.training.cpu_shims import apply_cpu_shims
from megatron.usp.parallel_dims import ParallelDims
from tests.helpers import swiglu_mlp_config

SEQ, BATCH, HIDDEN, FFN = 32, 2, 64, 128
FLOOR_DB, CEILING_DB = 20.0, 60.0


def sqnr_db(got, want) -> float:
    want = want.double()
    return float(10 * torch.log10(want.pow(2).sum() / (got.double() - want).pow(2).sum()))


def _layers(sp: bool):
    """{kind: (module, input width per rank (full sequence or its shard))}."""
    from megatron.core.parallel_state import (
        get_tensor_model_parallel_group,  # megatron-core on first use
    )
    from megatron.core.tensor_parallel import (
        model_parallel_cuda_manual_seed,  # megatron-core on first use
    )

    from megatron.layers.fused_linears import (  # megatron-core on first use
        SwiGLURowParallelLinear,
        USPColumnParallelLinear,
        USPRowParallelLinear,
    )

    config = swiglu_mlp_config(HIDDEN, FFN, tensor_model_parallel_size=2, sequence_parallel=sp,
                               params_dtype=torch.float32, use_te_activation_func=True)
    model_parallel_cuda_manual_seed(1234)
    group = get_tensor_model_parallel_group()
    init = config.init_method
    common = dict(config=config, init_method=init, bias=False, fuse_wgrad=True, tp_group=group)
    row = dict(common, input_is_parallel=True, skip_bias_add=True)
    return {
        "QKV": USPColumnParallelLinear(HIDDEN, 3 * HIDDEN, gather_output=False, **common),
        "proj": USPRowParallelLinear(HIDDEN, HIDDEN, **row),
        "FC1": USPColumnParallelLinear(HIDDEN, 2 * FFN, gather_output=False, **common),
        "FC2+SwiGLU": SwiGLURowParallelLinear(FFN, HIDDEN, swiglu_impl="usp", **row),
        "FC2": USPRowParallelLinear(FFN, HIDDEN, **row),
    }


def _input_width(kind: str) -> tuple:
    """(rows are the sequence shard, feature width on this rank)."""
    return {"QKV": (True, HIDDEN), "FC1": (True, HIDDEN), "proj": (False, HIDDEN // 2),
            "FC2+SwiGLU": (False, FFN), "FC2": (False, FFN // 2)}[kind]


def _run_layer(layer, x, probe):
    """Two micro-batches; (outputs, input grads, the weight's main_grad)."""
    layer.weight.main_grad = torch.zeros_like(layer.weight)
    layer.weight.grad_added_to_main_grad = False
    outs, dxs = [], []
    for _ in range(2):
        xi = x.clone().requires_grad_(True)
        out, _ = layer(xi)
        out.backward(probe)
        assert layer.weight.grad_added_to_main_grad
        outs.append(out.detach())
        dxs.append(xi.grad)
        layer.weight.grad = None
    return torch.cat(outs), torch.cat(dxs), layer.weight.main_grad.clone()


def _run(rank, world_size, fmt, recipe):
    from megatron.usp.parallel_state import initialize_usp_parallel  # megatron-core on first use

    apply_cpu_shims()
    initialize_usp_parallel(ParallelDims(2, tp=2))
    gemms = Float8Gemms(Float8Options(fmt, recipe, "all", emulate=True))
    gen = torch.Generator().manual_seed(11 + rank)    # TP ranks hold different shards
    for sp in (False, True):
        for kind, layer in _layers(sp).items():
            shard_rows, width = _input_width(kind)
            rows = SEQ // 2 if (sp and shard_rows) else SEQ
            out_rows = SEQ // 2 if (sp and not shard_rows) else SEQ
            x = torch.randn(rows, BATCH, width, generator=gen)
            out_width = layer(x)[0].shape[-1]
            probe = torch.randn(out_rows, BATCH, out_width, generator=gen)
            layer.run_in_float8(None)
            want = _run_layer(layer, x, probe)
            layer.run_in_float8(gemms)
            got = _run_layer(layer, x, probe)
            for name, g, w in zip(("output", "input grad", "weight grad"), got, want):
                db = sqnr_db(g, w)
                assert FLOOR_DB < db < CEILING_DB, (
                    f"rank {rank} {kind} sp={sp} {fmt} {recipe} {name}: {db:.1f} dB")


def test_float8_linears_under_tp_tensorwise_hybrid(dist_run):
    dist_run(_run, 2, "hybrid", "tensorwise", timeout=240)


def test_float8_linears_under_tp_rowwise_e4m3(dist_run):
    dist_run(_run, 2, "e4m3", "rowwise", timeout=240)


def _auto_choice(rank, world_size, out):
    """``--fp8-linears auto`` on 2 ranks: every shape timed (both ways), the output layer's
    too (``--fp8-output-layer``), the timings averaged over the world, so both ranks make the
    same choice and print the same report."""
    from megatron.layers.float8_policy import apply_float8  # megatron-core on first use
    from megatron.usp.parallel_state import initialize_usp_parallel  # megatron-core on first use

    apply_cpu_shims()
    initialize_usp_parallel(ParallelDims(2, tp=2))
    layers = _layers(sp=True)
    model = torch.nn.ModuleDict({"linear_qkv": layers["QKV"], "linear_proj": layers["proj"],
                                 "linear_fc1": layers["FC1"], "linear_fc2": layers["FC2+SwiGLU"]})
    tokens = {kind: SEQ * BATCH for kind in ("QKV", "proj", "FC1", "FC2", "output")}
    output = _OutputLayer()
    report = apply_float8([model], Float8Options(linears="auto", emulate=True,
                                                 output_layer=True),
                          tokens, torch.device("cpu"), torch.float32, dist.group.WORLD,
                          output_models=[output])
    assert len(report) == 6 and report[0].startswith("fp8 (tensorwise hybrid, emulated"), report
    assert all("(high " in line and " ms, float8 " in line for line in report[1:]), report
    assert report[5].startswith(f"  output {SEQ * BATCH} x 32 -> 80: "), report
    reports = [None] * world_size
    dist.all_gather_object(reports, report)
    assert reports[0] == reports[1], reports
    on = [m.float8_gemms is not None for m in model.values()] + [output.gemms is not None]
    assert on == [line.split(": ")[1].startswith("float8") for line in report[1:]], (on, report)


class _OutputLayer:
    """What apply_float8 asks of a model whose output layer is a candidate."""

    gemms = "unset"

    def output_float8_shape(self):
        return 32, 80

    def run_output_in_float8(self, gemms):
        self.gemms = gemms


def test_auto_choice_is_timed_and_agreed_over_ranks(dist_run):
    dist_run(_auto_choice, 2, {}, timeout=240)
