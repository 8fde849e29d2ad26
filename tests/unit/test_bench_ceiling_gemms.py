"""bench_e2e's ceiling counts the step's GEMMs where they ran faster than timed alone.

The ceiling times each GEMM of a step alone on random data; the one-GPU training runs then
train one iteration more than measured, profiled, and the share of the ceiling takes that
iteration's GEMM kernel time where it is lower. No training process: runs and traces are
faked."""

import json

import numpy as np
import pytest

from megatron.bench.e2e import ceilings, command, config, launch, output, summary, sweep

# 2 layers of 50 ms linears, a 20 ms output layer (GEMMs 120 ms), attention 70 ms per layer
CEILING = dict(seq_len=128, ceiling_ms=260.0, ceiling_mfu=0.5, num_layers=2,
               linears_ms_per_layer=50.0, output_layer_ms=20.0,
               ceiling_ms_per_sequence=[250.0, 270.0, 260.0])


def _cfg(tmp_path, **kw):
    base = dict(seq_lens=[128], model="tiny", splits=[(1, 1)], iters=3, warmup=1,
                device="cpu", log_dir=str(tmp_path), nproc_per_node=1)
    base.update(kw)
    return config.E2EConfig(**base)


def _row(step_gemm_ms, **kw):
    base = dict(iterations_measured=3, iter_ms=400.0, iter_ms_each=[400.0] * 3,
                tokens_per_s=1.0, tokens_per_s_per_gpu=1.0, tflops_per_gpu=1.0,
                step_gemm_ms=step_gemm_ms)
    base.update(kw)
    return config.E2EResult(128, 1, 1, "lean", 1, 1, "ok", **base)


def test_the_share_counts_the_step_gemms_where_they_were_faster():
    r = _row(110.0)                              # 10 ms under the 120 ms timed alone
    ceilings.apply_ceiling(r, {128: CEILING})
    assert r.ceiling_gemm_ms == pytest.approx(120.0)
    assert r.ceiling_share == pytest.approx(250.0 / 400.0)
    assert r.ceiling_mfu == pytest.approx(0.5 * 260.0 / 250.0)
    assert "GEMMs 110.0 ms in the profiled step, 120.0 ms timed alone: counts the step's" \
        in output.progress_line(r)


@pytest.mark.parametrize("step_gemm_ms", [None, 120.0, 131.5])
def test_the_share_keeps_the_ceiling_where_the_step_was_not_faster(step_gemm_ms):
    r = _row(step_gemm_ms)
    ceilings.apply_ceiling(r, {128: CEILING})
    assert r.ceiling_share == pytest.approx(260.0 / 400.0)
    assert r.ceiling_mfu == pytest.approx(0.5)
    line = output.progress_line(r)
    assert ("no profiled iteration" in line) == (step_gemm_ms is None)


def test_the_steady_share_takes_the_same_gemms():
    r = _row(100.0, docs="lognormal", flops_count="useful (documents)", steady_iterations=2,
             iter_ms_steady=300.0, iter_steady=[True, False, True])
    ceilings.apply_ceiling(r, {128: CEILING})
    assert r.ceiling_share_steady == pytest.approx(((250.0 + 260.0) / 2 - 20.0) / 300.0)


def test_a_profiled_run_trains_one_more_iteration_and_profiles_it(tmp_path):
    cfg = _cfg(tmp_path)
    spec = config.RunSpec(128, 1, 1, "lean", 3, profile_step=True)
    args = command.pretrain_args(cfg, spec, "m.jsonl")
    assert args[args.index("--train-iters") + 1] == "4"
    assert args[args.index("--profile-step-start") + 1] == "4"
    assert args[args.index("--profile-step-end") + 1] == "5"
    assert args[args.index("--profile-ranks") + 1] == "0"
    assert args[args.index("--profile-dir") + 1] == str(tmp_path / "S128_U1xR1_lean_profile")
    assert spec.profile_trace(str(tmp_path)).endswith("S128_U1xR1_lean_profile/rank0_iters4-4.json")
    plain = command.pretrain_args(cfg, config.RunSpec(128, 1, 1, "lean", 3), "m.jsonl")
    assert "--profile" not in plain and plain[plain.index("--train-iters") + 1] == "3"


def test_the_profiled_iteration_is_not_measured(tmp_path):
    cfg = _cfg(tmp_path)
    records = [{"kind": "train", "iteration": i + 1, "step_time_s": t, "lm_loss": 5.0,
                "mem_gib": 1.0} for i, t in enumerate([0.9, 0.1, 0.3, 5.0])]
    spec = config.RunSpec(128, 1, 1, "lean", 3, profile_step=True)
    r = summary.summarize(cfg, spec, config.RunOutcome("ok", 0, records, "l", [],
                                                       step_gemm_ms=42.0))
    assert r.iterations_measured == 2 and r.iter_ms == pytest.approx(200.0)
    assert r.step_gemm_ms == 42.0


def _event(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 7, "pid": 0}


def test_the_gemm_time_is_read_from_the_profiled_trace(tmp_path):
    trace = {"traceEvents": [
        _event("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 0, 1500.0),
        _event("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 2000, 500.0),
        _event("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 3000, 4000.0),
        _event("triton_poi_fused_mul_silu_0", 8000, 250.0),
        _event("aten::mm", 0, 9000.0, cat="cpu_op")]}
    path = tmp_path / "rank0_iters4-4.json"
    path.write_text(json.dumps(trace))
    assert launch.profiled_gemm_ms(str(path)) == pytest.approx(2.0)
    assert "gemm" in (tmp_path / "rank0_iters4-4.summary.txt").read_text()
    assert launch.profiled_gemm_ms(str(tmp_path / "missing.json")) is None
    path.write_text(json.dumps({"traceEvents": [_event("triton_poi_fused_add_0", 0, 9.0)]}))
    assert launch.profiled_gemm_ms(str(path)) is None


def test_the_sweep_profiles_one_gpu_runs_with_a_ceiling_only(tmp_path):
    seen = []

    def runner(cfg, spec):
        seen.append(spec.profile_step)
        return config.RunOutcome("error", 1, [], "l", [], note="faked")

    sweep.throughput_sweep(_cfg(tmp_path, recompute="lean"), runner, ceilings={128: CEILING})
    sweep.throughput_sweep(_cfg(tmp_path, recompute="lean"), runner, ceilings={})
    sweep.throughput_sweep(_cfg(tmp_path, recompute="lean", nproc_per_node=2), runner,
                           ceilings={128: CEILING})
    assert seen == [True, False, False]


def test_the_ceiling_documents_stop_at_the_measured_iterations(tmp_path, monkeypatch):
    """The documents the ceiling times are those of iterations --warmup+1..--iters of the
    profiled run (which trains one more)."""
    asked = []

    class Batches:
        global_batch = 1
        lengths = [np.array([10 * i, 128 - 10 * i]) for i in range(1, 5)]   # iterations 1..4

    def batches_of(cfg, spec):
        asked.append(spec)
        return Batches()

    monkeypatch.setattr(ceilings, "trained_batches_of", batches_of)
    cfg = _cfg(tmp_path, ceiling="on")
    got = ceilings.measured_documents(cfg)
    assert asked[0].profile_step and asked[0].train_iters == 4
    assert got == {128: [[20, 108], [30, 98]]}
