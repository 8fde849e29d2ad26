"""tools/plan_parallel.py and tools/bench_links.py end to end: the table, JSON, errors,
--validate, and a calibration file measured by bench_links on gloo ranks feeding the
planner."""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron.planner import (
    Layout,
    Workload,
    estimate,
    get_hardware,
    load_calibration,
    load_model,
)
from megatron.planner.cost_model import DEFAULT_ASSUMPTIONS, logits_bytes, rank_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plan_parallel = _load_tool("plan_parallel")
bench_links = _load_tool("bench_links")


def run_cli(capsys, *args):
    rc = plan_parallel.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_script_prints_a_ranked_table_with_reasons():
    """Run as users do, in a fresh interpreter (the issue's example command line)."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "plan_parallel.py"), "--model", "llama3-8b",
         "--seq-length", "131072", "--gpus", "64", "--gpus-per-node", "8", "--gpu-memory", "141",
         "--intra-node-bw", "300", "--inter-node-bw", "45", "--top", "5"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  TP"))
    rows = [line for line in lines[header + 2:header + 7]]
    assert len(rows) == 5 and rows[0].split()[0] == "1"
    assert "[1] command line" in out and "datasheet" in out
    assert "why #1:" in out and "rule 'order TP -> Ulysses -> Ring -> DP -> PP'" in out


def test_json_output_and_fixed_degrees(capsys):
    rc, out, _ = run_cli(capsys, "--model", "llama2-7b", "--seq-length", "65536", "--gpus",
                         "16", "--hardware", "a800", "--tensor-model-parallel-size", "2",
                         "--ulysses-degree", "auto", "--top", "3", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert [p["rank"] for p in doc["plans"]] == [1, 2, 3]
    assert all(p["tensor_model_parallel_size"] == 2 for p in doc["plans"])
    assert doc["fixed"] == {"tp": 2}
    assert doc["plans"][0]["megatron_config"]["sequence_parallel"] is True


def test_model_file_and_calibration_file(tmp_path, capsys):
    model = tmp_path / "mine.json"
    model.write_text(json.dumps(dict(num_layers=4, hidden_size=1024, num_attention_heads=8,
                                     num_query_groups=8, ffn_hidden_size=4096,
                                     vocab_size=32000, swiglu=False)))
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"schema": "megatron-usp-calibration/1", "source": "unit test",
                               "matmul_tflops": 123.0}))
    rc, out, _ = run_cli(capsys, "--model", str(model), "--seq-length", "16384", "--gpus", "4",
                         "--calibration", str(cal), "--top", "2")
    assert rc == 0
    assert "model mine:" in out and "matmul 123 TFLOP/s" in out and "(unit test)" in out


def test_impossible_request_exits_2_naming_the_limit(capsys):
    rc, _, err = run_cli(capsys, "--model", "llama2-7b", "--seq-length", "1048576", "--gpus",
                         "8", "--hardware", "a800")
    assert rc == 2 and "Binding limit: activations" in err and "--gpus 16" in err
    rc, out, _ = run_cli(capsys, "--model", "llama2-7b", "--seq-length", "131072", "--gpus",
                         "12", "--gpus-per-node", "12", "--ulysses-degree", "3", "--json")
    assert rc == 2
    doc = json.loads(out)
    assert doc["binding_limit"] == "attention heads" and doc["suggestions"]


def test_missing_arguments_and_presets(capsys):
    with pytest.raises(SystemExit):
        plan_parallel.main(["--model", "llama2-7b"])
    assert "--seq-length, --gpus" in capsys.readouterr().err
    rc, out, _ = run_cli(capsys, "--list-presets")
    assert rc == 0 and "llama-0.85b" in out and "h200-measured" in out and "[1] datasheet" in out


def test_validate_exit_status(tmp_path, capsys):
    w = Workload(load_model("llama-0.85b"), 65536, 2, 8, global_batch_size=1)
    pred = estimate(w, Layout.of(1, 1, 2, 1, 1, 1, "none"), get_hardware("h200-measured"))
    runs = [{"name": "r2", "model": "llama-0.85b", "seq_length": 65536, "gpus": 2,
             "gpus_per_node": 8, "global_batch_size": 1,
             "layout": {"ring_degree": 2, "zero_stage": 1},
             "measured_step_time_s": pred.step_time_s * 1.1}]
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"schema": "megatron-usp-measurements/1",
                                "hardware": "h200-measured", "runs": runs}))
    rc, out, _ = run_cli(capsys, "--validate", str(path))
    assert rc == 0 and "all within 25%" in out
    rc, out, _ = run_cli(capsys, "--validate", str(path), "--tolerance", "0.05", "--json")
    assert rc == 1 and json.loads(out)["ok"] is False


def _bench_on_ranks(rank, world_size, out_path):
    doc = bench_links.run_benchmark([0.0625, 0.25], iters=3, warmup=1, kernels=False)
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
    else:
        assert doc is None


def test_bench_links_writes_a_calibration_the_planner_reads(dist_run, tmp_path, capsys):
    out = str(tmp_path / "links.json")
    dist_run(_bench_on_ranks, 2, out, timeout=120)
    cal = load_calibration(out)
    link = cal.intra_node
    assert link.group_size == 2 and cal.inter_node is None
    for value in (link.all_to_all_gbps, link.p2p_gbps, link.collective_gbps, link.latency_us):
        assert value > 0
    assert "bench_links.py, backend gloo, 2 ranks on 1 node(s)" in cal.sources["intra_node"]
    rc, text, _ = run_cli(capsys, "--model", "llama-0.85b", "--seq-length", "32768", "--gpus",
                          "2", "--hardware", "h200-measured", "--calibration", out, "--top", "2")
    assert rc == 0 and "(calibrated)" in text and "bench_links.py" in text


def test_the_loss_the_plan_assumes(capsys):
    """The plan counts (and its command runs) the fused output layer and loss; the unfused
    loss keeps full-sequence float32 logits: Llama-3-8B at 256K on one GPU, 125 GiB of them."""
    model, lay, gib = load_model("llama3-8b"), Layout.of(1, 1, 1, 1, 1, 1, "full"), 2**30
    n, h, v = 262144, model.hidden_size, model.vocab_size
    sh = rank_shapes(model, lay, 1, n, DEFAULT_ASSUMPTIONS)
    kept, transient = logits_bytes(model, lay, sh, DEFAULT_ASSUMPTIONS)
    assert kept == 2 * n * h * 2 + 4 * n + 4 * v * h and transient == 8192 * v * 10
    plain = replace(DEFAULT_ASSUMPTIONS, loss_chunk_tokens=None)
    assert logits_bytes(model, lay, sh, plain) == (4 * n * v, 6 * n * v)
    assert 4 * n * v / gib > 125 and kept / gib < 7

    args = ["--model", "llama3-8b", "--seq-length", "131072", "--gpus", "8", "--json"]
    rc, out, _ = run_cli(capsys, *args, "--ring-degree", "8")
    rc_plain, out_plain, _ = run_cli(capsys, *args, "--ring-degree", "8", "--plain-cross-entropy")
    assert rc == rc_plain == 0
    fused, unfused = json.loads(out)["plans"][0], json.loads(out_plain)["plans"][0]
    assert "--fused-linear-cross-entropy" in fused["pretrain_flags"]
    assert "--fused-linear-cross-entropy" not in unfused["pretrain_flags"]
    assert fused["memory_gib"] < unfused["memory_gib"]
    rc, _, err = run_cli(capsys, *args[:-1], "--linear-cross-entropy-chunk-tokens", "0")
    assert rc == 2 and "--linear-cross-entropy-chunk-tokens 0 must be >= 1" in err


TINY_MODELS = {
    "llama": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_query_groups": 2, "ffn_hidden_size": 128, "vocab_size": 512, "swiglu": True},
    "gpt": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512,
            "untied_embeddings": False, "normalization": "LayerNorm",
            "position_embedding_type": "learned_absolute", "add_bias_linear": True},
    # window layers 1 and 3 of 4: the pattern is a shell glob unless the command quotes it
    "window": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
               "num_query_groups": 2, "ffn_hidden_size": 128, "vocab_size": 512, "swiglu": True,
               "window_size": 16, "window_attn_skip_freq": [1, 0, 1, 0]},
}


@pytest.mark.parametrize("name,gpus", [("llama", 2), ("gpt", 1), ("window", 2)])
def test_the_printed_command_trains_the_planned_model(tmp_path, capsys, name, gpus):
    """A model file through the planner: its printed command (on the CPU without --bf16,
    which needs a GPU; plus the data and LR flags it leaves to the user) passes validation
    and trains a step, and the model it builds has the parameters the plan counted, so no
    architecture flag (norm, positions, biases, GQA, SwiGLU, tied output) is missing; a
    windowed model trains with the window the plan costed (the metrics' FLOP count says
    which layers have it)."""
    import dataclasses
    import re

    from megatron.shapes import padded_vocab_size

    model_file = tmp_path / f"{name}.json"
    model_file.write_text(json.dumps(TINY_MODELS[name]))
    ring = ["--ring-degree", "2"] if name == "window" else []     # the halo ring runs
    rc, out, _ = run_cli(capsys, "--model", str(model_file), "--seq-length", "128",
                         "--gpus", str(gpus), "--gpus-per-node", "8", "--top", "1", *ring)
    assert rc == 0
    command = shlex.split(out.split("run #1 (add the data, LR and output flags):\n")[1])
    assert command[:3] == ["torchrun", "--nproc-per-node", str(gpus)] and "--bf16" in command
    assert " ".join(ring) in " ".join(command)
    flags = [f for f in command[command.index("pretrain_gpt.py") + 1:] if f != "--bf16"]
    run = flags + ["--lr", "1e-3", "--train-iters", "1", "--mock-data", "--vocab-size", "512",
                   "--eval-iters", "0", "--num-workers", "0", "--device", "cpu",
                   "--metrics-file", str(tmp_path / "metrics.jsonl")]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(gpus)] if gpus > 1 else [sys.executable])
    proc = subprocess.run(launch + [os.path.join(ROOT, "pretrain_gpt.py")] + run, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"lm loss \(mean of 1 iter\): \d", proc.stdout), proc.stdout[-2000:]
    built = int(re.search(r"number of parameters on rank 0 [^:]*: (\d+)", proc.stdout)[1])
    planned = dataclasses.replace(load_model(str(model_file)),
                                  vocab_size=padded_vocab_size(513, 128, 1))  # 512 + EOD
    positions = 128 * 64 if name == "gpt" else 0
    assert built == planned.total_params() + positions
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    counted = {r["flops_count"] for r in records if r.get("kind") == "train"}
    assert counted == {"dense causal, window 16 on 2 of 4 layers" if name == "window"
                       else "dense causal"}
