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
