"""CPU smoke tests of the benchmark tools: they run on gloo ranks and write valid output.

Timings are never asserted. What is asserted: the JSON has the documented fields, every
case of the sweep is there with a status, the numbers that must exist are finite and
positive, and (``--check``) USP's output equals the single-device kernel's to fp32 rounding,
so the benchmark times the right computation. PyTorch's native context parallel cannot run on
the CPU (its CPU SDPA op has no context-parallel handler), so its cases must say ``skipped``
with that reason; it is exercised on the GPU machine.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.bench.attention_bench import main
from megatron.bench.flops import window_attention_fwd_flops
from megatron.shapes import PRESETS, causal_pairs, training_flops, window_pairs
from tests.helpers import free_port

pytestmark = pytest.mark.slow   # CPU training runs of a minute or more

REPO = Path(__file__).resolve().parents[2]

TINY = ["--heads", "4", "--head-dim", "16", "--dtype", "fp32", "--iters", "1"]


def _attention_sweeps(rank, world, out_dir):
    main(["--seq-lens", "64,128", *TINY, "--warmup", "1", "--check",
          "--out", f"{out_dir}/causal.json", "--markdown", f"{out_dir}/causal.md"])
    # GQA, full attention, no SDPA anchor; the process group is reused, not re-created
    main(["--seq-lens", "64", *TINY, "--kv-heads", "2", "--warmup", "0", "--no-causal",
          "--no-sdpa-anchor", "--check", "--out", f"{out_dir}/full.json"])
    # bad input stops every rank before any case, naming the flag (argparse exits with 2)
    try:
        main(["--seq-lens", "64", *TINY, "--splits", "2x2"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--splits 2x2 on 2 ranks was accepted")


def _ok_numbers(r):
    for key in ("fwd_ms", "fwd_bwd_ms", "fwd_tflops_per_gpu", "fwd_bwd_tflops_per_gpu"):
        assert r[key] is not None and math.isfinite(r[key]) and r[key] > 0, (r["label"], key)
    assert len(r["fwd_times_ms"]) == len(r["fwd_bwd_times_ms"]) >= 1


def _check_payload(payload, seq_lens, causal, methods):
    assert payload["tool"] == "bench_attention" and payload["schema_version"] == 1
    meta = payload["metadata"]
    for key in ("date_utc", "command", "device", "versions", "world_size"):
        assert key in meta
    assert meta["versions"]["torch"] and meta["world_size"] == 2
    assert meta["command"].startswith("tools/bench_attention.py --seq-lens")
    cfg = payload["config"]
    assert cfg["causal"] is causal and cfg["effective_splits"] == ["2x1", "1x2"]
    results = payload["results"]
    assert [r["seq_len"] for r in results] == [s for s in seq_lens for _ in methods]
    assert [r["method"] for r in results] == methods * len(seq_lens)
    for r in results:
        if r["method"] == "native-cp":
            assert r["status"] == "skipped" and "CUDA only" in r["note"]
            continue
        assert r["status"] == "ok", r
        _ok_numbers(r)
        assert r["peak_mem_gib"] is None               # CPU: no allocator statistic
        if r["method"] == "usp":
            assert r["efficiency"] > 0 and r["gpus"] == 2
    return results


def test_bench_attention_on_two_gloo_ranks(dist_run, tmp_path):
    dist_run(_attention_sweeps, 2, str(tmp_path), timeout=300)

    methods = ["single-gpu-kernel", "sdpa", "usp", "usp", "native-cp", "native-cp"]
    causal = _check_payload(json.loads((tmp_path / "causal.json").read_text()), [64, 128],
                            True, methods)
    usp = [r for r in causal if r["method"] == "usp"]
    assert [(r["ulysses"], r["ring"]) for r in usp] == [(2, 1), (1, 2)] * 2
    # --check at the first length only: USP equals the single-device kernel (fp32)
    assert all(r["check_rel_err"] < 1e-5 for r in usp[:2])
    assert all(r["check_rel_err"] is None for r in usp[2:])
    md = (tmp_path / "causal.md").read_text()
    assert md.count("| 64 |") == len(methods) and md.count("| 128 |") == len(methods)
    assert "USP U1xR2 (pure ring)" in md and "skipped" in md

    full = _check_payload(json.loads((tmp_path / "full.json").read_text()), [64], False,
                          ["single-gpu-kernel", "usp", "usp", "native-cp", "native-cp"])
    assert all(r["check_rel_err"] < 1e-5 for r in full if r["method"] == "usp")


def _window_sweeps(rank, world, out_dir):
    # W = 8 against chunks of 64 / (2*2) = 16 tokens: on U1xR2 the halo crosses ring ranks
    main(["--seq-lens", "64", *TINY, "--kv-heads", "2", "--warmup", "0", "--window", "8",
          "--check", "--out", f"{out_dir}/window.json", "--markdown", f"{out_dir}/window.md"])
    for bad in (["--window", "0"], ["--window", "8", "--no-causal"]):
        try:
            main(["--seq-lens", "64", *TINY, *bad])
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"{bad} was accepted")


def test_bench_attention_window_on_two_gloo_ranks(dist_run, tmp_path):
    """--window: USP on U2xR1 and U1xR2 equals the window kernel on the whole sequence, and
    the rates count the pairs inside the window."""
    dist_run(_window_sweeps, 2, str(tmp_path), timeout=300)

    payload = json.loads((tmp_path / "window.json").read_text())
    assert payload["config"]["window"] == 8 and payload["metadata"]["versions"]["torch"]
    assert payload["metadata"]["command"].startswith("tools/bench_attention.py --seq-lens 64")
    results = payload["results"]
    assert [(r["method"], r["status"]) for r in results] == [
        ("single-gpu-kernel", "ok"), ("sdpa", "skipped"), ("usp", "ok"), ("usp", "ok"),
        ("native-cp", "skipped"), ("native-cp", "skipped")]
    assert results[0]["label"] == "single GPU (masked window kernel)"
    assert results[1]["note"] == "SDPA takes no sliding window"
    assert results[4]["note"] == "native CP takes no sliding window"
    window_flops = window_attention_fwd_flops(1, 4, 64, 16, 8)
    for r in results[:1] + results[2:4]:
        _ok_numbers(r)
        counted = r["fwd_tflops_per_gpu"] * 1e12 * r["fwd_ms"] / 1e3 * r["gpus"]
        assert counted == pytest.approx(window_flops, rel=1e-9)
    usp = results[2:4]
    assert [(r["ulysses"], r["ring"]) for r in usp] == [(2, 1), (1, 2)]
    assert all(r["efficiency"] > 0 and r["check_rel_err"] < 1e-5 for r in usp)
    assert "causal, window 8" in (tmp_path / "window.md").read_text()


def test_bench_attention_script_under_torchrun(tmp_path):
    """The real entry point: tools/bench_attention.py launched by torchrun, env:// init."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "tools/bench_attention.py", "--seq-lens", "64", *TINY, "--warmup", "0",
           "--peers", "none", "--no-sdpa-anchor", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    progress = [ln for ln in res.stdout.splitlines() if ln.startswith("[bench_attention] S=")]
    assert len(progress) == 3, res.stdout        # single GPU, U2xR1, U1xR2
    results = json.loads(out.read_text())["results"]
    assert [r["label"] for r in results] == [
        "single GPU (torch kernel)", "USP U2xR1 (pure Ulysses)", "USP U1xR2 (pure ring)"]
    for r in results:
        _ok_numbers(r)


def test_bench_attention_chunk_sweep_and_profiles(tmp_path):
    """--overlap-chunks times every valid G per split (invalid ones are reported as skipped)
    and --profile-dir writes a kernel table and a Chrome trace per distributed case."""
    out, prof = tmp_path / "r.json", tmp_path / "prof"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "tools/bench_attention.py", "--seq-lens", "64", "--heads", "4", "--kv-heads", "2",
           "--head-dim", "8", "--dtype", "fp32", "--iters", "1", "--warmup", "0",
           "--peers", "none", "--no-sdpa-anchor", "--no-single-gpu",
           "--overlap-chunks", "auto,1,2", "--profile-dir", str(prof), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    got = [(r["label"], r["status"], r["overlap_chunks"]) for r in results]
    # 2 KV heads: U2 leaves 1 KV head per rank (only G = 1); the ring of 2 can cut 2.
    assert got == [
        ("USP U2xR1 Gauto (pure Ulysses)", "ok", 1), ("USP U2xR1 G1 (pure Ulysses)", "ok", 1),
        ("USP U2xR1 G2 (pure Ulysses)", "skipped", None),
        ("USP U1xR2 Gauto (pure ring)", "ok", 1), ("USP U1xR2 G1 (pure ring)", "ok", 1),
        ("USP U1xR2 G2 (pure ring)", "ok", 2)], got
    assert "choose one of [1]" in results[2]["note"]
    stems = sorted(p.name for p in prof.iterdir())
    assert stems == sorted(f"64_USP_U{u}xR{r}_G{g}_pure_{kind}.{ext}"
                           for u, r, kind, gs in ((2, 1, "Ulysses", ("auto", "1")),
                                                  (1, 2, "ring", ("auto", "1", "2")))
                           for g in gs for ext in ("txt", "json")), stems
    table = (prof / "64_USP_U1xR2_G2_pure_ring.txt").read_text()
    assert "wall" in table and "Self CPU" in table
    json.loads((prof / "64_USP_U1xR2_G2_pure_ring.json").read_text())


@pytest.mark.skipif(not (REPO / "pretrain_gpt.py").exists(),
                    reason="pretrain_gpt.py is not in this checkout yet")
def test_bench_e2e_tiny_model_under_torchrun(tmp_path):
    """tools/bench_e2e.py launching pretrain_gpt.py on 2 CPU ranks (R=2), 2 iterations.

    One launch of pretrain_gpt.py (~20 s on 2 cores); the sweep logic over lengths, splits and
    recompute is tested without processes in tests/unit/test_bench_tools.py.
    """
    out, md = tmp_path / "e2e.json", tmp_path / "e2e.md"
    cmd = [sys.executable, "tools/bench_e2e.py", "--model", "tiny", "--seq-lens", "128",
           "--splits", "1x2", "--nproc-per-node", "2", "--iters", "2", "--warmup", "1",
           "--extra-args", "--num-workers 0", "--peers", "hf",
           "--log-dir", str(tmp_path / "logs"), "--out", str(out), "--markdown", str(md)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["tool"] == "bench_e2e"
    runs = payload["results"]
    assert [(r["seq_len"], r["stack"], r["ulysses"], r["ring"], r["recompute"])
            for r in runs] == [(128, "megatron-usp", 1, 2, "none"), (128, "hf", 1, 1, "none")]
    peer = runs[1]                       # Hugging Face's Llama, trained in its own process
    assert peer["status"] == "ok" and peer["tokens_per_s"] > 0 and peer["last_loss"] > 0
    assert payload["peer_ratios"][0]["peer"] == "hf"
    r = runs[0]
    assert r["status"] == "ok", r
    assert r["iterations_measured"] == 1 and r["global_batch_size"] == 1
    for key in ("tokens_per_s", "tflops_per_gpu", "iter_ms", "flops_per_iteration", "last_loss"):
        assert r[key] is not None and r[key] > 0, key
    assert r["mfu"] is None                         # CPU: no peak rate to compare with
    assert (tmp_path / "logs" / "S128_U1xR2_none.metrics.jsonl").exists()
    assert payload["metadata"]["device"]["type"] == "cpu"
    assert "| 128 | megatron-usp | 1x2 | none | ok |" in md.read_text()
    assert res.stdout.count("[bench_e2e] S=128 U1xR2") == 1


@pytest.mark.skipif(not (REPO / "pretrain_gpt.py").exists(),
                    reason="pretrain_gpt.py is not in this checkout")
def test_bench_e2e_packed_documents_count_useful_flops(tmp_path):
    """--docs fixed:32 at S=128: the runs train on written documents of 32 tokens (four per
    sequence), and TFLOP/s and MFU (against --peak-tflops 1) count their pairs, 4 * 32^2/2,
    not the dense 128^2/2; the Hugging Face peer trains the same sequences, position ids
    restarting per document."""
    out, md = tmp_path / "e2e.json", tmp_path / "e2e.md"
    cmd = [sys.executable, "tools/bench_e2e.py", "--model", "tiny", "--seq-lens", "128",
           "--splits", "1x2", "--nproc-per-node", "2", "--iters", "3", "--warmup", "1",
           "--extra-args", "--num-workers 0", "--peers", "hf", "--docs", "fixed:32",
           "--peak-tflops", "1", "--log-dir", str(tmp_path / "logs"), "--out", str(out),
           "--markdown", str(md)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["flops_count"] == "useful (documents)"
    assert payload["documents"]["data"].endswith("docs-fixed-32/documents")
    useful = training_flops(PRESETS["tiny"], 128, 4 * 32 * 32 / 2)
    ours, peer = payload["results"]
    for r, gpus in ((ours, 2), (peer, 1)):
        assert r["status"] == "ok", r
        assert r["flops_count"] == "useful (documents)" and r["documents_per_iteration"] == 4
        assert r["attention_pairs"] == 4 * 32 * 32 / 2
        assert r["flops_per_iteration"] == pytest.approx(useful, rel=1e-12)
        assert r["tflops_per_gpu"] == pytest.approx(useful / (r["iter_ms"] / 1e3) / gpus / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 1.0)
    assert "document mask from position_ids" in peer["attention_path"]
    # the run's log says, once, which cost table its document kernels were chosen by
    logs = "".join(p.read_text() for p in (tmp_path / "logs").rglob("*.log"))
    assert logs.count("document kernel costs (fixed, cpu float32,") == 1, logs[-3000:]
    text = md.read_text()
    assert "FLOPs: useful (documents)" in text and "| useful (documents) |" in text


@pytest.mark.skipif(not (REPO / "pretrain_gpt.py").exists(),
                    reason="pretrain_gpt.py is not in this checkout")
def test_a_ceiling_run_profiles_one_iteration_after_the_measured_ones(tmp_path):
    """A one-GPU run beside a ceiling trains --iters + 1 iterations and profiles the last
    (pretrain_gpt.py --profile, here on one CPU process): the trace lands where the bench
    reads it, the measured iterations and their documents stop at --iters, and a trace
    without GEMM kernels (the CPU's) leaves the ceiling's own GEMM time in place."""
    from megatron.bench.e2e import cli, config, documents, launch, summary

    cfg = config.E2EConfig(seq_lens=[128], model="tiny", splits=[(1, 1)], iters=3, warmup=1,
                           device="cpu", log_dir=str(tmp_path), docs="fixed:32",
                           nproc_per_node=1, extra_args=["--num-workers", "0"])
    documents.prepare_documents(cfg.docs, cfg.log_dir, cli.eod_id(cfg),
                                cli.documents_tokens(cfg), cfg.seed)
    spec = config.RunSpec(128, 1, 1, "none", 3, profile_step=True)
    outcome = launch.run_training(cfg, spec)
    assert outcome.status == "ok", outcome.note
    assert [r["iteration"] for r in outcome.records if r.get("kind") == "train"] == [1, 2, 3, 4]
    assert (tmp_path / "S128_U1xR1_none_profile" / "rank0_iters4-4.json").exists()
    assert outcome.step_gemm_ms is None
    assert len(outcome.attention_pairs) == 4
    r = summary.summarize(cfg, spec, outcome)
    assert r.status == "ok" and r.iterations_measured == 2
    assert r.attention_pairs == 4 * 32 * 32 / 2


def test_bench_checkpoint_tiny_model_on_the_cpu(tmp_path):
    """tools/bench_checkpoint.py (benchmarks/checkpoint_cost.sh
    runs it at 0.85B) saves with and without checksums and verifies one checkpoint."""
    out = tmp_path / "cost.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "bench_checkpoint.py"),
                           "--model", "tiny", "--seq-length", "64", "--saves", "1",
                           "--save-dir", str(tmp_path / "ckpt"), "--out", str(out)],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["model"] == "tiny" and result["checkpoint_bytes"] > 0
    assert [len(v) for v in result["save_s"].values()] == [1, 1]
    assert result["verify_s"] > 0 and "overhead" in result
    assert not (tmp_path / "ckpt").exists()  # the saves are removed


# --------------------------------------------------------------------------- packed documents
def _document_sweeps(rank, world, out_dir):
    main(["--seq-lens", "256", *TINY, "--kv-heads", "2", "--warmup", "0",
          "--docs", "fixed:32,lognormal", "--out", f"{out_dir}/docs.json",
          "--markdown", f"{out_dir}/docs.md"])


def test_bench_attention_documents_on_two_gloo_ranks(dist_run, tmp_path):
    """--docs: document-masked USP per split, with spreads and ring traffic in the JSON."""
    dist_run(_document_sweeps, 2, str(tmp_path), timeout=300)
    payload = json.loads((tmp_path / "docs.json").read_text())
    assert payload["tool"] == "bench_attention --docs"
    results = payload["results"]
    assert [(r["mix"], r["ulysses"], r["ring"]) for r in results] == [
        ("fixed:32", 2, 1), ("fixed:32", 1, 2), ("lognormal", 2, 1), ("lognormal", 1, 2)]
    for r in results:
        assert r["status"] == "ok", r
        _ok_numbers(r)
        assert r["useful_pairs"] > 0 and 0 <= r["work_spread"] <= r["zigzag_work_spread"] + 1e-12
        assert r["kv_messages"] + r["kv_messages_skipped"] == r["ring"] * (r["ring"] - 1)
    # 32-token documents tile the zigzag chunks: the ring ranks share none, nothing is sent
    fixed_ring = results[1]
    assert fixed_ring["kv_messages"] == 0 and fixed_ring["ring_bytes_skipped"] > 0
    assert "useful TFLOP/s/GPU" in (tmp_path / "docs.md").read_text()


def test_bench_attention_document_kernels_and_balance_report(tmp_path):
    """One process: --doc-kernels on the CPU (varlen skipped there) and --balance-report."""
    out = tmp_path / "kernels.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench_attention.py"), "--seq-lens", "128",
         *TINY, "--warmup", "0", "--docs", "fixed:16", "--doc-kernels",
         "dense,tiles,tiles-copy,varlen,per-document,auto,auto-recurring,packed-recurring",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    by_kernel = {r["kernel"]: r for r in results}
    assert set(by_kernel) == {"dense", "tiles", "tiles-copy", "varlen", "per-document", "auto",
                              "auto-recurring", "packed-recurring"}
    assert by_kernel["varlen"]["status"] == "skipped"
    for name in ("tiles-copy", "per-document", "auto", "auto-recurring", "packed-recurring"):
        assert by_kernel[name]["rel_err_vs_tiles"] < 1e-5, by_kernel[name]
    assert by_kernel["auto"]["auto_choice"] == "math" and by_kernel["tiles"]["tile_calls"] == 1
    # the CPU table charges no plan builds: recurring shapes change nothing there
    assert by_kernel["auto-recurring"]["auto_choice"] == "math"
    assert {r["auto_choice"] for r in results
            if r["status"] == "ok" and r["kernel"] != "packed-recurring"} == {"math"}
    assert by_kernel["packed-recurring"]["auto_choice"].startswith("batched 8 / varlen 0")
    assert "auto -> math" in proc.stderr + proc.stdout
    ring_out = tmp_path / "ring.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench_attention.py"), "--seq-lens", "256",
         *TINY, "--warmup", "0", "--docs", "lognormal,uniform:64", "--doc-kernels",
         "dense,tiles,per-document,auto", "--doc-kernels-split", "2x2", "--out",
         str(ring_out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(ring_out.read_text())["results"]
    # a remote block reads its halo, shorter than the rank's block: every kernel runs on it
    # (math, which needs the exact key count, included)
    short = [r for r in results if r["mix"] == "uniform:64" and r["kernel"] != "per-document"]
    assert short and all(r["status"] == "ok" for r in short), short
    ring = {r["kernel"]: r for r in results if r["mix"] == "lognormal"}
    assert ring["per-document"]["status"] == "skipped"
    choices = ring["auto"]["auto_choice"].split(",")
    assert 1 <= len(choices) <= 2 and set(choices) <= {"tiles", "math"}
    assert ring["tiles"]["auto_choice"] == ring["auto"]["auto_choice"]
    assert ring["tiles"]["label"] == "tiles U2xR2 rank 0" and ring["tiles"]["ring"] == 2
    assert f"auto -> {ring['auto']['auto_choice']}" in proc.stderr + proc.stdout
    report_json = tmp_path / "balance.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench_attention.py"), "--docs", "lognormal",
         "--seq-lens", "4096", "--splits", "1x2,2x2", "--balance-report",
         "--balance-samples", "4", "--out", str(report_json)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(report_json.read_text())["results"]
    assert [(r["ulysses"], r["ring"]) for r in rows] == [(1, 2), (2, 2)]
    for r in rows:
        assert r["spread_max"] <= 0.05 and r["spread_max"] <= r["zigzag_spread_max"]
        # only the keys of crossing documents move: more bytes skipped than whole messages
        assert r["kv_messages_skipped_mean"] < r["kv_bytes_skipped_mean"] < 1


def _stream_rows(path):
    payload = json.loads(path.read_text())
    assert payload["tool"] == "bench_attention --docs" and payload["config"]["doc_stream"] == 3
    return payload, payload["results"]


def _check_stream_row(r, samples=3):
    assert r["status"] == "ok", r
    assert r["stream_samples"] == samples and r["label"].endswith(f", stream of {samples}")
    assert len(r["fwd_bwd_times_ms"]) == samples and r["fwd_times_ms"] == []
    assert r["stream_max_ms"] >= r["stream_mean_ms"] > 0 and r["fwd_bwd_ms"] > 0
    assert r["fwd_bwd_tflops_per_gpu"] > 0 and r["useful_pairs"] > 0
    assert len(set(r["stream_seeds"])) == samples and r["vs_fastest"] >= 1.0


def test_bench_attention_document_stream(tmp_path):
    """--doc-stream 3: each kernel on its own three samples, the choosing kernels first, their
    choices tallied over the stream, every row's ratio to the fastest; and with
    --doc-kernels-split 1x2 on what ring rank 0 computes of each sample."""
    out, md = tmp_path / "stream.json", tmp_path / "stream.md"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench_attention.py"), "--seq-lens", "128",
         *TINY, "--warmup", "1", "--docs", "fixed:16,lognormal", "--doc-kernels",
         "tiles,auto,packed", "--doc-stream", "3", "--out", str(out), "--markdown", str(md)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload, results = _stream_rows(out)
    assert payload["stream"]["kernel_order"] == ["auto", "packed", "tiles"]
    assert [(r["mix"], r["kernel"], r["stream_position"]) for r in results] == [
        (mix, k, i) for mix in ("fixed:16", "lognormal")
        for i, k in enumerate(("auto", "packed", "tiles"), 1)]
    for mix in ("fixed:16", "lognormal"):
        rows = {r["kernel"]: r for r in results if r["mix"] == mix}
        for r in rows.values():
            _check_stream_row(r)
        assert sorted(r["stream_rank"] for r in rows.values())[0] == 1
        assert min(r["vs_fastest"] for r in rows.values()) == 1.0
        assert not set(rows["auto"]["stream_seeds"]) & set(rows["tiles"]["stream_seeds"])
        assert rows["tiles"]["auto_choice"] is None
    fixed = {r["kernel"]: r for r in results if r["mix"] == "fixed:16"}
    # eight 16-token documents a sample; the CPU table charges no builds
    assert fixed["packed"]["auto_choice"] == "batched 24 / varlen 0 documents"
    assert fixed["packed"]["stream_sample_choices"] == ["batched 8 / varlen 0"] * 3
    assert fixed["auto"]["auto_choice"].endswith(" 3 blocks")
    assert fixed["tiles"]["documents"] == 3 * 8
    text = md.read_text()
    assert "stream of 3 distinct micro-batches" in text and "vs fastest (rank)" in text
    assert "| 128 | fixed:16 | packed, stream of 3 |" in text
    assert "vs fastest:" in proc.stderr + proc.stdout

    ring_out = tmp_path / "ring_stream.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench_attention.py"), "--seq-lens", "256",
         *TINY, "--warmup", "0", "--docs", "lognormal", "--doc-kernels", "tiles,auto,packed",
         "--doc-stream", "3", "--doc-kernels-split", "1x2", "--out", str(ring_out)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, ring = _stream_rows(ring_out)
    ring = {r["kernel"]: r for r in ring}
    assert ring["packed"]["status"] == "skipped"
    for name in ("tiles", "auto"):
        _check_stream_row(ring[name])
        assert ring[name]["label"] == f"{name} U1xR2 rank 0, stream of 3"
        assert ring[name]["ring"] == 2
    per_sample = [c.split(",") for c in ring["auto"]["stream_sample_choices"]]
    assert len(per_sample) == 3 and all(1 <= len(c) <= 2 for c in per_sample)
    tally = ring["auto"]["auto_choice"]
    assert tally.endswith(" blocks") and sum(
        int(part.split()[1]) for part in tally[:-len(" blocks")].split(" / ")) == sum(
        map(len, per_sample))


# --------------------------------------------------------------------------- imported model
def test_imported_model_recipe_on_the_cpu(tmp_path):
    """benchmarks/imported_model.sh with a tiny model on 4 gloo ranks (U2 x R2): builds the
    Hugging Face model, imports it, trains it from the checkpoint and from scratch with the
    same flags, and writes both runs' figures and their ratios."""
    out = tmp_path / "imported"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(SHAPE="tiny", SEQ_LEN="256", DEVICE="cpu", NPROC="4", ULYSSES_DEGREE="2",
               RING_DEGREE="2", ITERS="3", WARMUP="1", OUT_DIR=str(out),
               MASTER_PORT=str(free_port()))
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "imported_model.sh")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    result = json.loads((out / "imported_model.json").read_text())
    for name in ("imported", "scratch"):
        run = result[name]
        assert run["layout"] == "TP1 U2 R2 DP1 PP1" and run["iterations"] == 2
        assert run["args"]["seq_length"] == 256 and run["tokens_per_s"] > 0
    assert result["imported"]["args"]["load"] == str(out / "imported")
    assert result["scratch"]["args"]["load"] is None
    assert result["tokens_per_s_ratio"] > 0 and "imported / scratch" in proc.stdout
    assert result["metadata"]["command"]


# --------------------------------------------------------------------------- GPU recipes on the CPU
def _recipe_env(**settings):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", **settings)
    return env


def _run_recipe(name, env, extra="--num-workers 0"):
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / name), "--extra-args", extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def _e2e_row(path, stack="megatron-usp"):
    """The one row of ``stack`` in a bench_e2e JSON, checked to have trained."""
    payload = json.loads(path.read_text())
    assert payload["tool"] == "bench_e2e" and payload["metadata"]["device"]["type"] == "cpu"
    (row,) = [r for r in payload["results"] if r["stack"] == stack]
    assert row["status"] == "ok", row
    assert row["tokens_per_s"] > 0 and row["iterations_measured"] == 2
    assert row["recompute"] == ("lean" if stack == "megatron-usp" else "none")
    return payload, row


def test_packed_documents_recipe_kernel_parts_on_the_cpu(tmp_path):
    """benchmarks/packed_documents.sh PARTS=kernels,stream at tiny shapes: the kernels on one
    repeated sample per mix, then on a stream of 3 samples per kernel; a PARTS naming no part
    is refused in one line."""
    out = tmp_path / "docs"
    env = _recipe_env(PARTS="kernels,stream", SEQ_LEN="128", STREAM_SEQ_LENS="256",
                      MIXES="fixed:16,lognormal", HEADS="4", KV_HEADS="2", HEAD_DIM="16",
                      DTYPE="fp32", STREAM="3", LAYERS="2", OUT_DIR=str(out))
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "packed_documents.sh")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert sorted(p.name for p in out.iterdir()) == [
        "doc_kernels_128.json", "doc_kernels_128.md", "doc_stream3_256.json",
        "doc_stream3_256.md"]
    repeated = json.loads((out / "doc_kernels_128.json").read_text())["results"]
    assert {r["kernel"] for r in repeated} == {
        "dense", "tiles", "varlen", "per-document", "auto", "packed", "auto-recurring",
        "packed-recurring"}
    assert all(r["stream_samples"] is None for r in repeated)
    payload, stream = _stream_rows(out / "doc_stream3_256.json")
    assert payload["stream"]["kernel_order"] == ["auto", "packed", "tiles", "varlen",
                                                 "per-document"]
    assert payload["stream"]["layers"] == 2
    for mix in ("fixed:16", "lognormal"):
        rows = [r for r in stream if r["mix"] == mix]
        assert [r["kernel"] for r in rows] == payload["stream"]["kernel_order"]
        for r in rows:
            if r["kernel"] == "varlen":
                assert r["status"] == "skipped"     # no flash varlen op on the CPU
            else:
                _check_stream_row(r)
    for parts in ("kernel", "kernels,bogus"):
        bad = subprocess.run(["bash", str(REPO / "benchmarks" / "packed_documents.sh")],
                             cwd=REPO, env=_recipe_env(PARTS=parts, OUT_DIR=str(tmp_path / "bad")),
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and not (tmp_path / "bad").exists()
        assert bad.stderr.strip() == (f"error: PARTS={parts}: name e2e, kernels or stream, "
                                      f"e.g. PARTS=kernels,stream")


def test_sliding_window_recipe_runs_the_parts_asked_for(tmp_path):
    """PARTS=kernel runs (a) alone; a PARTS naming neither part is refused in one line."""
    out = tmp_path / "window"
    env = _recipe_env(MODEL="tiny", SEQ_LEN="256", WINDOW="32", HEADS="4", KV_HEADS="2",
                      HEAD_DIM="16", OUT_DIR=str(out), PARTS="kernel")
    _run_recipe("sliding_window.sh", env)
    assert sorted(p.name for p in out.iterdir()) == ["window_kernel_256.json",
                                                     "window_kernel_256.md"]
    bad = subprocess.run(["bash", str(REPO / "benchmarks" / "sliding_window.sh")], cwd=REPO,
                         env=_recipe_env(PARTS="kernels", OUT_DIR=str(tmp_path / "bad")),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and not (tmp_path / "bad").exists()
    assert bad.stderr.strip() == ("error: PARTS=kernels: name kernel, train or both, "
                                  "e.g. PARTS=kernel,train")


def test_sliding_window_recipe_on_the_cpu(tmp_path):
    """benchmarks/sliding_window.sh with the tiny model at 256 tokens, W = 32 on one layer of
    two, one round: the window layer's attention against the window kernel (--check), the
    all-full and the hybrid run (the caller's --extra-args added to the window flags), and
    the speed-up summary against the FLOP count."""
    out = tmp_path / "window"
    env = _recipe_env(MODEL="tiny", SEQ_LEN="256", WINDOW="32", HEADS="4", KV_HEADS="2",
                      HEAD_DIM="16", ROUNDS="1", ITERS="3", WARMUP="1", OUT_DIR=str(out))
    proc = _run_recipe("sliding_window.sh", env)

    kernel = json.loads((out / "window_kernel_256.json").read_text())
    assert kernel["config"]["window"] == 32 and kernel["config"]["dtype"] == "bf16"
    assert [(r["label"], r["status"]) for r in kernel["results"]] == [
        ("single GPU (masked window kernel)", "ok"), ("USP U1xR1", "ok")]
    for r in kernel["results"]:
        _ok_numbers(r)
    usp = kernel["results"][1]
    assert usp["efficiency"] > 0 and usp["check_rel_err"] < 1e-2
    assert "causal, window 32" in (out / "window_kernel_256.md").read_text()

    count = "dense causal, window 32 on 1 of 2 layers"
    full, full_row = _e2e_row(out / "window_full_256_r1.json")
    hybrid, hybrid_row = _e2e_row(out / "window_hybrid_256_r1.json")
    assert full["flops_count"] == full_row["flops_count"] == "dense causal"
    assert hybrid["flops_count"] == hybrid_row["flops_count"] == count
    assert f"FLOPs: {count}" in (out / "window_hybrid_256_r1.md").read_text()
    tiny = PRESETS["tiny"]
    hybrid_pairs = (causal_pairs(256) + window_pairs([256], 32)) / 2
    assert full_row["flops_per_iteration"] == training_flops(tiny, 256, causal_pairs(256))
    assert hybrid_row["flops_per_iteration"] == pytest.approx(
        training_flops(tiny, 256, hybrid_pairs), rel=1e-6)
    for name, row in (("window_full_256_r1", full_row), ("window_hybrid_256_r1", hybrid_row)):
        assert row["command"].endswith("--num-workers 0")
        assert Path(row["log_path"]).parent == out / "logs" / name     # a log per run
    assert "--window-size 32 --window-attn-skip-freq 2" in hybrid_row["command"]
    assert "--window-size" not in full_row["command"]

    speedup = json.loads((out / "window_speedup_256.json").read_text())
    assert speedup["tool"] == "window_speedup" and speedup["seq_len"] == 256
    assert speedup["full_runs"] == speedup["hybrid_runs"] == 1
    assert speedup["hybrid_flops_count"] == count
    assert speedup["predicted_speedup"] == pytest.approx(
        full_row["flops_per_iteration"] / hybrid_row["flops_per_iteration"])
    assert speedup["measured_speedup"] == pytest.approx(
        full_row["iter_ms"] / hybrid_row["iter_ms"])
    assert speedup["share_of_predicted"] > 0 and isinstance(speedup["within_tolerance"], bool)
    assert speedup["metadata"]["device"]["type"] == "cpu"
    summary = (out / "window_speedup_256.md").read_text()
    assert summary.startswith("hybrid over full: measured") and summary in proc.stdout


def test_fp8_recipe_on_the_cpu(tmp_path):
    """benchmarks/fp8.sh with the tiny model and a one-layer slice of it at 128 tokens, one
    round: per model a bf16 run beside the Hugging Face peer (the slice's peer trains the same
    one layer) and a float8 run with every linear in torchao's emulated float8, the output
    layer too (``FP8_OUTPUT_LAYER=1``; both runs with the fused loss it needs)."""
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    out = tmp_path / "fp8"
    env = _recipe_env(MODELS="tiny:2:tiny tiny:1:tiny_1l", SEQ_LENS="128", ROUNDS="1",
                      ITERS="3", WARMUP="1", PEERS="hf", FP8_EMULATE="1", FP8_LINEARS="all",
                      FP8_OUTPUT_LAYER="1", OUT_DIR=str(out))
    _run_recipe("fp8.sh", env, "--num-workers 0 --fused-linear-cross-entropy")

    assert {p.name for p in out.glob("*.json")} == {
        f"fp8_{name}_{kind}.json" for name in ("tiny", "tiny_1l")
        for kind in ("bf16", "fp8", "speedup")}
    for name, layers in (("tiny", 2), ("tiny_1l", 1)):
        bf16, ours = _e2e_row(out / f"fp8_{name}_bf16.json")
        _, peer = _e2e_row(out / f"fp8_{name}_bf16.json", stack="hf")
        assert bf16["config"]["shape"]["num_layers"] == ours["num_layers"] == layers
        assert peer["num_layers"] == layers
        assert peer["flops_per_iteration"] == ours["flops_per_iteration"]
        assert [(x["peer"], x["tokens_per_s_ratio"] > 0) for x in bf16["peer_ratios"]] == [
            ("hf", True)]
        assert "--fp8-format" not in ours["command"]
        assert "| 128 | hf | 1x1 | none | ok |" in (out / f"fp8_{name}_bf16.md").read_text()

        fp8, row = _e2e_row(out / f"fp8_{name}_fp8.json")
        assert [r["stack"] for r in fp8["results"]] == ["megatron-usp"]   # no peer
        assert row["num_layers"] == layers
        assert row["flops_per_iteration"] == ours["flops_per_iteration"]
        assert ("--fp8-format hybrid --fp8-recipe tensorwise --fp8-linears all "
                "--fp8-output-layer --fp8-emulate --num-workers 0 --fused-linear-cross-entropy"
                ) in row["command"]
        assert "| 128 | megatron-usp | 1x1 | lean | ok |" in (
            out / f"fp8_{name}_fp8.md").read_text()
        log = Path(row["log_path"])
        assert log.parent == out / "logs" / f"fp8_{name}_fp8"
        # the layers share one shape per kind: QKV, proj, FC1, FC2 and the output layer,
        # all in float8
        assert ("fp8 (tensorwise hybrid, emulated, --fp8-linears all): 5 of 5 linear shapes "
                "in float8") in log.read_text()
        ratio = json.loads((out / f"fp8_{name}_speedup.json").read_text())
        [length] = ratio["lengths"]
        assert length["seq_len"] == 128 and length["rounds"] == 1
        assert length["speedup"] == pytest.approx(row["tokens_per_s"] / ours["tokens_per_s"])
        assert "float8 over bf16" in (out / f"fp8_{name}_speedup.md").read_text()


DRIFT_RUNS = ("bf16", "bf16_chunk64", "fp8_hybrid_tensorwise", "fp8_hybrid_tensorwise_output")


def _drift_recipe(out, **settings):
    """benchmarks/fp8_drift.sh in its CPU mode, 50 steps, the output layer in float8 in a
    run of its own (FP8_OUTPUT_LAYER=1), results in ``out``."""
    env = _recipe_env(**{"DEVICE": "cpu", "STEPS": "50", "OUT_DIR": str(out),
                         "FP8_OUTPUT_LAYER": "1", **settings})
    return subprocess.run(["bash", str(REPO / "benchmarks" / "fp8_drift.sh"), "--num-workers",
                           "0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _train_records(path):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "train"]


def test_fp8_drift_recipe_resumes_onto_the_uninterrupted_curves(tmp_path):
    """benchmarks/fp8_drift.sh on the CPU (tiny model, float32, emulated float8): one
    invocation straight through, and one stopped at iteration 20 (EXIT_INTERVAL) then run
    again. The resumed runs record each iteration once and match the straight ones bit for
    bit; only each run's last checkpoint is kept; the drift test judges each float8 run (the
    linears, and the linears with the output layer inside the fused loss) against the pair's
    band (float32's reduction-order band is ~1e-6 %, so float8's rounding lies outside it:
    exit 1); a run once complete is not trained again."""
    pytest.importorskip("torchao")
    straight = _drift_recipe(tmp_path / "straight")
    assert straight.returncode == 1, (straight.stdout[-3000:], straight.stderr[-3000:])
    out = tmp_path / "resumed"
    first = _drift_recipe(out, EXIT_INTERVAL="20")
    assert first.returncode == 3, (first.stdout[-3000:], first.stderr[-3000:])
    assert ("unfinished of 50 steps: bf16 at 20, bf16_chunk64 at 20, fp8_hybrid_tensorwise "
            "at 20, fp8_hybrid_tensorwise_output at 20; run the same command again"
            ) in first.stdout
    assert not (out / "summary.json").exists()
    second = _drift_recipe(out)
    assert second.returncode == 1, (second.stdout[-3000:], second.stderr[-3000:])
    for name in DRIFT_RUNS:
        assert f"{name}: iteration 20 -> 50" in second.stdout
        resumed = _train_records(out / f"{name}.jsonl")
        assert [r["iteration"] for r in resumed] == list(range(1, 51)), name
        want = _train_records(tmp_path / "straight" / f"{name}.jsonl")
        assert [(r["lm_loss"], r["grad_norm"]) for r in resumed] == [
            (r["lm_loss"], r["grad_norm"]) for r in want], name
        ckpt = tmp_path / "resumed_ckpt" / "checkpoints" / name
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "iter_0000050", "latest_checkpointed_iteration.txt"]
    fp8_log = (out / "logs" / "fp8_hybrid_tensorwise.log").read_text()
    assert "--fp8-linears all): 4 of 4 linear shapes in float8" in fp8_log
    output_log = (out / "logs" / "fp8_hybrid_tensorwise_output.log").read_text()
    assert "--fp8-linears all): 5 of 5 linear shapes in float8" in output_log
    assert "  output 64 x 64 -> " in output_log      # chunks of the pair's 64 tokens

    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_status"] == 1 and summary["iterations"] == [1, 50]
    drift = summary["drift"]
    assert drift["window"] == [6, 25]                     # STEPS/10+1 : STEPS/2
    assert [r["label"] for r in drift["runs"]] == ["fp8 hybrid tensorwise",
                                                   "fp8 hybrid tensorwise output"]
    for fp8 in drift["runs"]:
        assert fp8["steps"] == 20 and fp8["drifts"] is True and "outside" in fp8["message"]
    [pair] = drift["pairs"]
    assert pair["label"] == "bf16 vs bf16_chunk64" and 0 < abs(pair["mean_signed_rel_diff"]) < 1e-6
    assert (out / "drift.png").stat().st_size > 0
    assert "FAIL: fp8 hybrid tensorwise drifts" in (out / "compare.txt").read_text()
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert total < 2 << 20

    again = _drift_recipe(out)             # all done: the comparison only
    assert again.returncode == 1 and " -> 50" not in again.stdout
    assert "comparison over iterations 6:25: exit status 1" in again.stdout


def test_fp8_drift_recipe_refuses_a_bad_setting_in_one_line(tmp_path):
    out = tmp_path / "drift"
    bad = _drift_recipe(out, RECIPES="hybrid:rowwise")
    assert bad.returncode == 2 and not out.exists() and bad.stdout == ""
    assert bad.stderr.strip() == (
        'error: RECIPES="hybrid:rowwise": hybrid:rowwise is not one of tensorwise, rowwise, '
        'hybrid:tensorwise, e4m3:tensorwise, e4m3:rowwise (rowwise scales need e4m3), e.g. '
        'RECIPES="tensorwise rowwise"')
    bad = _drift_recipe(out, FP8_OUTPUT_LAYER="yes")
    assert bad.returncode == 2 and not out.exists() and bad.stdout == ""
    assert bad.stderr.strip() == "error: FP8_OUTPUT_LAYER=yes: 0 or 1, e.g. FP8_OUTPUT_LAYER=1"


def test_e2e_and_longest_sequence_recipes_on_the_cpu(tmp_path):
    """benchmarks/e2e_vs_hf_liger.sh (the tiny model against Hugging Face, Liger being
    CUDA-only) and benchmarks/longest_sequence.sh (full recompute keeping each layer's
    attention output, the MLP over tiles) at tiny shapes on the CPU."""
    out = tmp_path / "e2e"
    _run_recipe("e2e_vs_hf_liger.sh", _recipe_env(
        MODEL="tiny", SEQ_LENS="128", ROUNDS="1", ITERS="3", WARMUP="1", PEERS="hf",
        OUT_DIR=str(out)))
    payload, row = _e2e_row(out / "e2e_vs_hf_liger.json")
    assert payload["peer_ratios"][0]["peer"] == "hf" and row["seq_len"] == 128
    out = tmp_path / "longest"
    _run_recipe("longest_sequence.sh", _recipe_env(MODEL="tiny", SEQ_LEN="256", TILE="64",
                                                   OUT_DIR=str(out)))
    payload = json.loads((out / "e2e_256.json").read_text())
    (row,) = payload["results"]
    assert row["status"] == "ok" and row["recompute"] == "full" and row["seq_len"] == 256
    assert "--recompute-keep-core-attn --mlp-tile-tokens 64" in row["command"]


def test_gpu_tests_recipe_records_skips_without_a_gpu(tmp_path):
    """benchmarks/gpu_tests.sh on a machine without a GPU: every test skipped, and a dated
    record (JSON and markdown) that says so."""
    out = tmp_path / "gpu"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_tests.sh"),
                           "tests/gpu/test_adam_state_gpu.py"], cwd=REPO,
                          env=_recipe_env(OUT_DIR=str(out), BUDGET_S="120"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    (record,) = out.glob("gpu_tests_*.json")
    assert (out / (record.stem + ".md")).exists()
    tests = json.loads(record.read_text())["tests"]
    assert tests and {t["outcome"] for t in tests} == {"skipped"}


def test_attention_and_checkpoint_cost_recipes_on_the_cpu(tmp_path):
    """benchmarks/attention.sh on two gloo ranks at tiny shapes (later flags override the
    recipe's), and benchmarks/checkpoint_cost.sh with the tiny model."""
    out = tmp_path / "attention"
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "attention.sh"), "--heads", "4", "--kv-heads", "2",
         "--head-dim", "16", "--dtype", "fp32", "--peers", "none", "--iters", "2",
         "--warmup", "1"], cwd=REPO, capture_output=True, text=True, timeout=300,
        env=_recipe_env(NGPUS="2", SEQ_LENS="256", OUT_DIR=str(out)))
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    rows = json.loads((out / "attention.json").read_text())["results"]
    usp = [r for r in rows if r["method"] == "usp"]
    assert {(r["ulysses"], r["ring"]) for r in usp} == {(2, 1), (1, 2)}
    assert all(r["status"] == "ok" and r["check_rel_err"] is not None
               and r["check_rel_err"] < 1e-5 for r in usp), usp
    out = tmp_path / "cost"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "checkpoint_cost.sh")], cwd=REPO,
                          env=_recipe_env(MODEL="tiny", SAVE_DIR=str(tmp_path / "saves"),
                                          OUT_DIR=str(out)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    payload = json.loads((out / "checkpoint_cost.json").read_text())
    assert payload["model"] == "tiny" and payload["device"] == "cpu"
    assert payload["checkpoint_bytes"] > 0 and payload["verify_s"] > 0
    assert set(payload["median_s"]) == {"with_checksums", "without_checksums"}


# Each recipe in benchmarks/ and the test that runs it on the CPU.
RECIPES_RUN_BY = {
    "attention.sh": "test_attention_and_checkpoint_cost_recipes_on_the_cpu",
    "checkpoint_cost.sh": "test_attention_and_checkpoint_cost_recipes_on_the_cpu",
    "e2e_vs_hf_liger.sh": "test_e2e_and_longest_sequence_recipes_on_the_cpu",
    "fp8.sh": "test_fp8_recipe_on_the_cpu",
    "fp8_drift.sh": "test_fp8_drift_recipe_resumes_onto_the_uninterrupted_curves",
    "gpu_tests.sh": "test_gpu_tests_recipe_records_skips_without_a_gpu",
    "imported_model.sh": "test_imported_model_recipe_on_the_cpu",
    "longest_sequence.sh": "test_e2e_and_longest_sequence_recipes_on_the_cpu",
    "packed_documents.sh": "test_packed_documents_recipe_kernel_parts_on_the_cpu",
    "sliding_window.sh": "test_sliding_window_recipe_on_the_cpu",
}


def test_every_recipe_is_run_by_a_test():
    """A recipe added to benchmarks/ needs a CPU run here (and an entry above)."""
    assert sorted(p.name for p in (REPO / "benchmarks").glob("*.sh")) == sorted(RECIPES_RUN_BY)
    source = Path(__file__).read_text()
    for recipe, test in RECIPES_RUN_BY.items():
        assert callable(globals().get(test)), test
        assert f'"{recipe}"' in source, recipe
