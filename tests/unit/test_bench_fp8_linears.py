"""``tools/bench_fp8_linears.py`` on the CPU: the tiny preset's four linear shapes, emulated
float8 (``usp``) against bf16, torchao's rows skipped with their reason, the JSON and markdown
outputs, and one refusal per bad flag (one line naming the flag and a valid value).

Nothing here asserts a speed: only that the tool runs, times and writes what it says.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron.bench import fp8_linears_bench as fb
from megatron.bench.cli import BenchConfigError
from megatron.layers.float8_policy import LinearShape
from megatron.shapes import PRESETS

pytest.importorskip("torchao")


def _tiny_linears():
    """(kind, in, out) of the tiny preset's linears, from the preset's own numbers."""
    s = PRESETS["tiny"]
    d = s.kv_channels or s.hidden_size // s.num_attention_heads
    q = s.num_attention_heads * d
    return {"QKV": (s.hidden_size, q + 2 * s.num_query_groups * d),
            "proj": (q, s.hidden_size),
            "FC1": (s.hidden_size, 2 * s.ffn_hidden_size),
            "FC2": (s.ffn_hidden_size, s.hidden_size)}


def test_tiny_on_the_cpu_times_bf16_and_emulated_float8(tmp_path):
    out, md = tmp_path / "fp8.json", tmp_path / "fp8.md"
    argv = ["--model", "tiny", "--tokens", "64", "--device", "cpu", "--fp8-format", "e4m3",
            "--recipes", "tensorwise,rowwise", "--impls", "bf16,usp,torchao", "--iters", "2",
            "--warmup", "1", "--profile", "--out", str(out), "--markdown", str(md)]
    assert fb.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["tool"] == "bench_fp8_linears" and payload["metadata"]["command"]
    assert payload["config"]["emulate"] is True
    rows = payload["results"]
    want = _tiny_linears()
    assert len(rows) == 2 * len(want) * 3
    for recipe in ("tensorwise", "rowwise"):
        group = [r for r in rows if r["recipe"] == recipe and r["tokens"] == 64]
        assert {r["kind"]: (r["in_features"], r["out_features"]) for r in group} == want
        for kind in want:
            by_impl = {r["impl"]: r for r in group if r["kind"] == kind}
            bf16, usp, ao = by_impl["bf16"], by_impl["usp"], by_impl["torchao"]
            assert bf16["status"] == usp["status"] == "ok"
            assert bf16["fwd_bwd_ms"] > 0 and usp["fwd_bwd_ms"] > 0
            assert usp["ratio_vs_bf16"] == pytest.approx(bf16["fwd_bwd_ms"] / usp["fwd_bwd_ms"])
            assert bf16["ratio_vs_bf16"] == pytest.approx(1.0)
            assert usp["tflops"] > 0 and usp["kernels"] and usp["profile_device_ms"] > 0
            assert ao["status"] == "skipped" and "CUDA" in ao["note"]
            assert ao["fwd_bwd_ms"] is None and ao["ratio_vs_bf16"] is None
    text = md.read_text()
    for kind in want:
        assert f"| {kind} |" in text
    assert "skipped" in text and "CPU ops by self time" in text


def _refusal(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        fb.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,flag,valid", [
    (["--model", "tiny,nope"], "--model nope", "llama-0.85b"),
    (["--impls", "bf16,fast"], "--impls fast", "bf16,usp"),
    (["--recipes", "rowwise", "--fp8-format", "hybrid"], "--recipes rowwise",
     "--fp8-format e4m3"),
    (["--tokens", "32q"], "--tokens", "32k"),
])
def test_bad_flags_are_refused_in_one_line(capsys, argv, flag, valid):
    line = _refusal(capsys, ["--device", "cpu"] + argv)
    assert line.startswith(f"bench_fp8_linears.py: error: {flag}") and valid in line


def test_cuda_without_a_gpu_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _refusal(capsys, ["--model", "tiny", "--device", "cuda"])
    assert "error: --device cuda" in line and "--device cpu" in line


def test_token_counts_off_16_are_refused_for_real_float8_only(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # refused before any use
    line = _refusal(capsys, ["--model", "tiny", "--device", "cuda", "--tokens", "100",
                             "--impls", "bf16,usp"])
    assert "error: --tokens 100" in line and "--tokens 112" in line
    cfg = fb.Fp8BenchConfig(models=["tiny"], tokens=[100], recipes=["tensorwise"])
    with pytest.raises(BenchConfigError, match="--tokens 100"):   # default impls: float8
        fb.check_config(cfg, cuda_available=True)
    fb.check_config(fb.Fp8BenchConfig(models=["tiny"], tokens=[100], recipes=["tensorwise"],
                                      impls=["bf16"]), cuda_available=True)
    fb.check_config(fb.Fp8BenchConfig(models=["tiny"], tokens=[100], recipes=["tensorwise"],
                                      device="cpu"), cuda_available=False)    # emulated


def test_default_impls_are_those_the_device_runs():
    cfg = fb.Fp8BenchConfig(models=["tiny"], tokens=[64], recipes=["tensorwise"], device="cpu")
    cpu = torch.device("cpu")
    assert fb.resolve_impls(cfg, cpu, None, torchao_ok=True) == ["bf16", "usp"]
    assert fb.resolve_impls(cfg, cpu, None, torchao_ok=False) == ["bf16"]
    gpu = torch.device("cuda", 0)
    assert fb.resolve_impls(cfg, gpu, (9, 0), torchao_ok=True) == list(fb.IMPLS)
    assert fb.resolve_impls(cfg, gpu, (8, 0), torchao_ok=True) == ["bf16"]
    odd = LinearShape(64, 100, 64)
    assert "multiple of 16" in fb.skip_reason("torchao", gpu, (9, 0), True, odd)


def test_a_case_that_fails_is_a_row_not_a_crash(tmp_path, monkeypatch):
    def broken(impl, ops, options):
        raise RuntimeError("no kernel for this shape\nsecond line")

    monkeypatch.setattr(fb, "make_step", broken)
    out = tmp_path / "fp8.json"
    assert fb.main(["--model", "tiny", "--tokens", "64", "--device", "cpu", "--impls",
                    "bf16,usp", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 8 and {r["status"] for r in rows} == {"error"}
    assert rows[0]["note"] == "RuntimeError: no kernel for this shape"
    assert all(r["ratio_vs_bf16"] is None for r in rows)
