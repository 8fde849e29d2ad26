"""bench_e2e for long sequences: the Llama-3-8B preset, layer slices, host-memory peaks,
find-max-seq with the chosen recompute, and the depth arithmetic of megatron.bench.depth."""

import json

import pytest

from megatron.bench import depth
from megatron.bench.cli import BenchConfigError
from megatron.bench.e2e import cli as e2e_cli
from megatron.bench.e2e import command, config, output, summary, sweep
from megatron.memory import activation_offload


def _cfg(**kw):
    base = dict(seq_lens=[65536], splits=[(1, 1)], nproc_per_node=1, iters=2, warmup=1,
                device="cuda", model="llama3-8b")
    base.update(kw)
    return config.E2EConfig(**base)


def _records(times_ms, gpu=(10.0, 12.0), host=(30.0, 31.0)):
    out = [{"kind": "run", "layout": "TP1 U1 R1 DP1 PP1", "world_size": 1, "args": {}}]
    for i, t in enumerate(times_ms):
        out.append({"kind": "train", "iteration": i + 1, "step_time_s": t / 1e3, "lm_loss": 9.0,
                    "tflops_per_gpu": 400.0, "mfu": 400.0 / 989, "mem_gib": gpu[i],
                    "host_mem_gib": host[i], "skipped": False})
    return out


def test_llama3_8b_preset_is_valid_pretrain_gpt_flags():
    arguments = pytest.importorskip("megatron.training.cli.arguments")
    cfg = _cfg(extra_args=["--recompute-keep-core-attn", "--mlp-tile-tokens", "8192"])
    args = arguments.parse_args(command.pretrain_args(cfg, config.RunSpec(262144, 1, 1, "full", 2),
                                                  "m.jsonl"))
    arguments.validate_args(args, world_size=1, cuda_available=True)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (32, 4096, 32)
    assert (args.num_query_groups, args.ffn_hidden_size, args.rotary_base) == (8, 14336, 500000)
    assert arguments.padded_vocab_size(args.vocab_size + 1, 128, 1) == 128256
    assert args.fused_linear_cross_entropy and args.linear_cross_entropy_chunk_tokens == 2048
    assert args.recompute_keep_core_attn and args.mlp_tile_tokens == 8192
    # 8.03B parameters, 6.98B of them in the 32 layers
    layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert 32 * layer + 2 * 128256 * 4096 + 4096 == 8_030_261_248


def test_a_slice_changes_the_flags_and_the_flop_count():
    arguments = pytest.importorskip("megatron.training.cli.arguments")
    spec = config.RunSpec(262144, 1, 1, "full", 2)
    whole, sliced = _cfg(), _cfg(num_layers=2)
    args = arguments.parse_args(command.pretrain_args(sliced, spec, "m.jsonl"))
    assert args.num_layers == 2 and sliced.shape.hidden_size == 4096
    outcome = config.RunOutcome("ok", 0, _records([1000.0, 1000.0]), "l", [])
    r_whole, r_slice = summary.summarize(whole, spec, outcome), summary.summarize(sliced, spec, outcome)
    assert r_slice.num_layers == 2 and r_whole.num_layers == 32
    assert r_slice.flops_per_iteration < r_whole.flops_per_iteration / 8
    assert r_slice.peak_mem_gib == 12.0 and r_slice.peak_host_gib == 31.0
    assert "host peak 31.0 GiB" in output.progress_line(r_slice)

    with pytest.raises(BenchConfigError, match="--num-layers 40"):
        e2e_cli.validate_config(_cfg(num_layers=40, pretrain_script=__file__))


def test_find_max_seq_uses_selective_recompute_when_asked():
    calls = []

    def run(cfg, spec):
        calls.append(spec)
        ok = spec.seq_len <= 131072
        return config.RunOutcome("ok" if ok else "oom", 0 if ok else 1,
                              _records([1.0, 1.0]) if ok else [], "l", [])

    cfg = _cfg(find_max_seq=True, start_seq=65536, max_seq=1 << 20, recompute="selective")
    results, longest = sweep.find_max_seq(cfg, runner=run)
    assert [c.recompute for c in calls] == ["selective"] * 3 and longest == {"1x1": 131072}
    assert results[0].peak_host_gib == 31.0 and results[0].mfu is not None


def test_depth_fit_is_affine_and_predicts_full_depth():
    a = depth.DepthPoint(layers=2, gpu_gib=30.0, host_gib=40.0, step_s=10.0)
    b = depth.DepthPoint(layers=4, gpu_gib=36.0, host_gib=50.0, step_s=16.0)
    fit = depth.fit_depth(b, a)
    assert (fit.gpu_gib.fixed, fit.gpu_gib.per_layer) == (24.0, 3.0)
    assert (fit.host_gib.fixed, fit.host_gib.per_layer) == (30.0, 5.0)
    v = depth.verdict(fit, 32, gpu_gib=139.0, host_gib=125.0)
    assert v.gpu_gib == 120.0 and v.fits_gpu and v.host_gib == 190.0 and not v.fits_host
    assert v.max_layers_gpu == 38 and v.max_layers_host == 19 and not v.fits
    assert not v.fits_combined and v.step_s == 100.0     # 310 GiB > 139 + 125
    with pytest.raises(ValueError, match="different depth"):
        depth.fit_depth(a, a)


def test_depth_command_reads_two_bench_files(tmp_path, capsys):
    files = []
    for layers, gpu, host, ms in ((1, 40.0, 35.0, 9000.0), (2, 44.0, 41.0, 15000.0)):
        path = tmp_path / f"L{layers}.json"
        result = {"status": "ok", "num_layers": layers, "peak_mem_gib": gpu,
                  "peak_host_gib": host, "iter_ms": ms}
        path.write_text(json.dumps({"config": {"extra_args": ["--optimizer-offload-fraction",
                                                              "1.0"]},
                                    "results": [{"status": "oom"}, result]}))
        files.append(str(path))
    out = tmp_path / "fit.json"
    assert depth.main(files + ["--full-layers", "32", "--gpu-gib", "139", "--host-gib", "125",
                               "--out", str(out)]) == 0
    fit = json.loads(out.read_text())
    assert fit["verdict"]["gpu_gib"] == pytest.approx(36.0 + 32 * 4.0)
    assert fit["verdict"]["fits"] is False and "does not fit" in capsys.readouterr().out
    bad = tmp_path / "half.json"
    bad.write_text(json.dumps({"config": {"extra_args": ["--optimizer-offload-fraction", "0.5"]},
                               "results": []}))
    with pytest.raises(SystemExit):
        depth.main([files[0], str(bad), "--full-layers", "32", "--gpu-gib", "1",
                    "--host-gib", "1"])


def test_depth_refuses_offload_slices_shallower_than_the_prefetch_window(tmp_path):
    """With --recompute-cpu-offload a 1- or 2-layer slice keeps every input on the GPU
    (the offloader's prefetch window): its per-layer GPU bytes would be wrong."""
    assert depth.DEFAULT_PREFETCH == activation_offload.DEFAULT_PREFETCH
    files = {}
    for layers in (1, 2, 3, 4):
        path = tmp_path / f"L{layers}.json"
        result = {"status": "ok", "num_layers": layers, "peak_mem_gib": 40.0 + layers,
                  "peak_host_gib": 3.0 + 4 * layers, "iter_ms": 1000.0 * layers}
        path.write_text(json.dumps({"config": {"extra_args": ["--recompute-cpu-offload",
                                                              "layer_input"]},
                                    "results": [result]}))
        files[layers] = str(path)
    cap = ["--full-layers", "16", "--gpu-gib", "139", "--host-gib", "125"]
    with pytest.raises(SystemExit):
        depth.main([files[1], files[2]] + cap)
    assert depth.main([files[3], files[4]] + cap) == 0
