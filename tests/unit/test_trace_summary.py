"""trace_summary: busy time per stream, compute-stream gaps and categories from a trace."""

import json

from megatron.bench.trace_summary import category, main, summarize


def _k(name, ts, dur, tid=7, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


TRACE = {"traceEvents": [
    _k("void at::native::elementwise_kernel<128, 4>", 0, 100),          # pack copy
    _k("ncclDevKernel_SendRecv", 100, 400, tid=37),                    # a2a on NCCL's stream
    _k("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 500, 1000),  # 400 us exposed
    _k("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 1520, 2000),  # 20 us: below 50
    _k("nvjet_sm90_tst_256x128", 3600, 300),                           # 80 us gap
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9999, "tid": 1},
]}


def test_summary_numbers():
    s = summarize(TRACE)
    assert s["span_ms"] == 3.9 and s["compute_stream"] == "7"
    assert s["streams"] == {"7": {"kernels": 4, "busy_ms": 3.4}, "37": {"kernels": 1,
                                                                         "busy_ms": 0.4}}
    assert [round(g["gap_us"]) for g in s["largest_gaps"]] == [400, 80]
    assert s["gaps_ms"] == 0.48
    assert s["by_category_ms"] == {"attention backward": 2.0, "attention forward": 1.0,
                                   "nccl": 0.4, "gemm": 0.3, "copy / strided elementwise": 0.1}


def test_categories_and_empty_trace():
    assert category("ncclDevKernel_AllGather") == "nccl"
    assert category("flash_fwd_kernel") == "attention forward"
    assert category("Memcpy DtoD (Device -> Device)") == "copy / strided elementwise"
    assert category("triton_poi_fused_silu") == "other"
    assert summarize({"traceEvents": []})["span_ms"] == 0.0


def test_cli_prints(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRACE))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "compute-stream idle gaps: 0.48 ms" in out and "(compute)" in out


def _host(name, ts, dur, cat="cpu_op", corr=None, tid=1):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _kc(name, ts, dur, corr):
    e = _k(name, ts, dur)
    e["args"] = {"correlation": corr}
    return e


CALLER_TRACE = {"traceEvents": [
    # an autograd function's backward launching a Triton kernel through an aten op
    _host("autograd::engine::evaluate_function: _RMSNormBackward", 0, 50),
    _host("_RMSNormBackward", 1, 40),
    _host("aten::empty", 2, 3),
    _host("cuLaunchKernel", 10, 5, cat="cuda_driver", corr=1),
    # the optimizer's step: two launches
    _host("Optimizer.step#AdamW.step", 100, 50),
    _host("aten::_fused_adamw_", 101, 40),
    _host("cudaLaunchKernel", 110, 5, cat="cuda_runtime", corr=2),
    _host("cudaLaunchKernel", 120, 5, cat="cuda_runtime", corr=3),
    # a bare aten op at top level, and a GEMM that is left out of the table
    _host("aten::add_", 200, 20),
    _host("cudaLaunchKernel", 205, 5, cat="cuda_runtime", corr=4),
    _host("aten::mm", 300, 20),
    _host("cudaLaunchKernel", 305, 5, cat="cuda_runtime", corr=5),
    _kc("rms_bwd", 1000, 30, 1),
    _kc("multi_tensor_apply_kernel", 1100, 20, 2),
    _kc("multi_tensor_apply_kernel", 1200, 25, 3),
    _kc("vectorized_elementwise_kernel", 1300, 10, 4),
    _kc("nvjet_sm90_tst_256x128", 1400, 90, 5),
    _kc("vectorized_elementwise_kernel", 1500, 7, 99),      # no launch recorded
]}


def test_device_time_by_caller():
    got = summarize(CALLER_TRACE)["by_caller"]
    assert {k: (v["ms"], v["kernels"]) for k, v in got.items()} == {
        "Optimizer.step#AdamW.step": (0.045, 2), "_RMSNormBackward": (0.03, 1),
        "aten::add_": (0.01, 1), "(no host event)": (0.007, 1)}
    assert list(got)[0] == "Optimizer.step#AdamW.step"
    assert got["Optimizer.step#AdamW.step"]["by_kernel"] == {
        "multi_tensor_apply_kernel": {"ms": 0.045, "kernels": 2}}
    assert got["_RMSNormBackward"]["by_kernel"] == {"rms_bwd": {"ms": 0.03, "kernels": 1}}


def test_cli_prints_callers(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(CALLER_TRACE))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "device time by caller" in out and "_RMSNormBackward" in out
    kernel_lines = [line.strip() for line in out.splitlines() if line.startswith(" " * 8)]
    assert kernel_lines == []                            # kernels only when asked for
    assert main([str(path), "--kernels", "2", "--gaps", "1"]) == 0
    out = capsys.readouterr().out
    kernel_lines = [line.split()[0] for line in out.splitlines() if line.startswith(" " * 8)]
    assert kernel_lines == ["multi_tensor_apply_kernel", "rms_bwd", "vectorized_elementwise_kernel",
                            "vectorized_elementwise_kernel"]
    assert out.count(" us at ") == 1                     # one gap listed
