"""Every script in examples/ runs, on CPU, with a tiny model, so none goes stale.

The GPU scripts run unchanged except for the environment overrides they document
(GPUS_PER_NODE, MASTER_PORT, RUN_DIR, PRECISION=fp32, the degrees) and extra flags appended
through "$@" (a tiny model, 3 iterations, ``--device cpu``), which win over the script's own
because argparse keeps the last value. Each run must exit 0, log 3 iterations to its metrics
file and publish a checkpoint at iteration 3.

The Slurm template is run locally as the batch script it is (``bash``), with stand-ins for
``srun`` (one node: drops srun's options and runs the task) and ``scontrol`` on PATH, so its
own srun line launches examples/pretrain_usp.sh; the stand-in records the srun options.

The context-extension recipe runs on a tiny imported Llama (a word-level tokenizer, random
words as documents) from 128 to 512 tokens on 4 CPU processes (U2 x R2).

The quick start (the README's main job) runs end to end: install check, corpus, DP 4 and
U2 x R2 runs of examples/pretrain_cpu.sh, compare_loss and the PNG.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest

from tests.helpers import free_port, tiny_gpt_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
# Each script and the test that runs it (pretrain_cpu.sh runs twice inside the quick
# start, pretrain_usp.sh inside the Slurm template).
RUN_BY = {
    "extend_context.sh": "test_extend_context",
    "pretrain_cpu.sh": "test_quickstart",
    "pretrain_dp.sh": "test_gpu_script_on_cpu",
    "pretrain_tp_usp.sh": "test_gpu_script_on_cpu",
    "pretrain_usp.sh": "test_slurm_template_runs_its_srun_line",
    "quickstart_cpu.sh": "test_quickstart",
    "slurm_usp.sbatch": "test_slurm_template_runs_its_srun_line",
}
SCRIPTS = sorted(RUN_BY)
TINY = tiny_gpt_flags(
    llama=False, ffn_hidden_size=128, num_query_groups=2, max_position_embeddings=64,
    micro_batch_size=1, global_batch_size=4, train_iters=3, lr_warmup_iters=1,
    save_interval=3, eval_interval=3, eval_iters=1, log_interval=1, device="cpu",
    num_workers=0, make_vocab_size_divisible_by=32)

# For the CPU scripts, which already have a small model: smaller still, 3 iterations.
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "64",
         "--max-position-embeddings", "64", "--num-workers", "0", "--lr-warmup-iters", "1"]


def _env(**overrides):
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(MASTER_PORT=str(free_port()), PRECISION="fp32")
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def _run(script, env, args=(), timeout=420, cwd=ROOT):
    proc = subprocess.run(["bash", os.path.join(EXAMPLES, script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-6000:])
    return proc


def _check_run_dir(run_dir, iterations=3, tensorboard=True):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r["iteration"] for r in records if r["kind"] == "train"]
    assert train == list(range(1, iterations + 1))
    ckpt = os.path.join(run_dir, "checkpoints")
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == iterations
    assert os.path.isdir(os.path.join(ckpt, f"iter_{iterations:07d}"))
    if tensorboard:
        events = os.listdir(os.path.join(run_dir, "tensorboard"))
        assert any(name.startswith("events.out.tfevents") for name in events)
    return [r for r in records if r["kind"] == "run"][-1]["layout"]


def test_every_example_is_tested():
    assert sorted(os.listdir(EXAMPLES)) == SCRIPTS
    for test in set(RUN_BY.values()):
        assert callable(globals()[test])


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", os.path.join(EXAMPLES, script)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    mode = os.stat(os.path.join(EXAMPLES, script)).st_mode
    assert mode & stat.S_IXUSR, f"{script} is not executable"


@pytest.mark.slow
@pytest.mark.parametrize("script,nproc,env,layout", [
    ("pretrain_dp.sh", 2, {}, "TP1 U1 R1 DP2 PP1"),
    ("pretrain_tp_usp.sh", 4, {"TP_SIZE": 2, "ULYSSES_DEGREE": 1, "RING_DEGREE": 2},
     "TP2 U1 R2 DP1 PP1"),
])
def test_gpu_script_on_cpu(script, nproc, env, layout, tmp_path):
    run_dir = str(tmp_path / "run")
    _run(script, _env(GPUS_PER_NODE=nproc, RUN_DIR=run_dir, **env), TINY)
    assert _check_run_dir(run_dir) == layout


@pytest.mark.slow
def test_slurm_template_runs_its_srun_line(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "srun.log"
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        "# test stand-in for Slurm's srun on one node: record, drop the options, run the task\n"
        f'echo "$@" > "{log}"\n'
        'while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done\n'
        "export SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0\n"
        'exec "$@"\n')
    (bin_dir / "scontrol").write_text(
        "#!/usr/bin/env bash\n"
        '[ "$1 $2" = "show hostnames" ] && echo localhost\n')
    for name in ("srun", "scontrol"):
        os.chmod(bin_dir / name, 0o755)
    run_dir = str(tmp_path / "run")
    env = _env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="node1",
               SLURM_JOB_NUM_NODES=1, SLURM_SUBMIT_DIR=ROOT, GPUS_PER_NODE=2,
               ULYSSES_DEGREE=2, RING_DEGREE=1, RUN_DIR=run_dir)
    _run("slurm_usp.sbatch", env, TINY, cwd=str(tmp_path))
    assert _check_run_dir(run_dir) == "TP1 U2 R1 DP1 PP1"
    srun_args = log.read_text()
    assert srun_args.startswith("--kill-on-bad-exit=1 --ntasks-per-node=1 bash -c")
    assert "examples/pretrain_usp.sh" in srun_args


@pytest.mark.slow
def test_quickstart(tmp_path):
    out = tmp_path / "quickstart"
    proc = _run("quickstart_cpu.sh", _env(QUICKSTART_DIR=str(out), TRAIN_ITERS=3),
                SMALL, timeout=600)
    png = out / "loss_dp4_vs_u2r2.png"
    assert f"Loss-comparison PNG: {png}" in proc.stdout
    assert "OK: the curves agree within the tolerance" in proc.stdout
    assert png.stat().st_size > 10_000
    assert _check_run_dir(str(out / "dp4"), tensorboard=False) == "TP1 U1 R1 DP4 PP1"
    assert _check_run_dir(str(out / "u2r2"), tensorboard=False) == "TP1 U2 R2 DP1 PP1"
    assert "validation loss at iteration 3" in proc.stdout


@pytest.mark.slow
def test_extend_context(tmp_path):
    from tests.distributed.test_convert_hf_training import save_word_tokenizer, write_corpus
    from tests.unit.test_convert_hf import make_hf_model

    hf_dir, work = tmp_path / "hf", tmp_path / "work"
    make_hf_model("llama").save_pretrained(str(hf_dir))
    save_word_tokenizer(str(hf_dir))
    write_corpus(str(tmp_path / "docs.jsonl"))
    long_docs = [" ".join(f"w{4 + (i * 7 + j) % 250}" for j in range(600)) for i in range(2)]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                 for t in long_docs))
    proc = _run("extend_context.sh", _env(
        HF_DIR=hf_dir, WORK_DIR=work, DATA_JSONL=tmp_path / "docs.jsonl",
        EVAL_DATA=tmp_path / "long.jsonl", TRAIN_ITERS=3, PASSKEY_TRIALS=1), timeout=600)
    assert "context 128 -> 512 tokens, RoPE: --rotary-base 63496" in proc.stdout
    with open(work / "metrics.jsonl") as f:
        train = [r["iteration"] for r in map(json.loads, f) if r["kind"] == "train"]
    assert train == [1, 2, 3]
    with open(work / "hf_extended" / "config.json") as f:
        config = json.load(f)
    assert config["max_position_embeddings"] == 512 and config["rope_theta"] == 63496
    for name, (positions, base) in {"before": (128, 10000), "after": (512, 63496)}.items():
        with open(work / f"eval_{name}.json") as f:
            result = json.load(f)
        assert result["model"]["layout"] == "TP1 U2 R2"
        assert (result["model"]["max_position_embeddings"], result["model"]["rotary_base"]) \
            == (positions, base)
        assert [b["end"] for b in result["perplexity"]["buckets"]][-1] == 512
        assert {(c["length"], c["depth"]) for c in result["passkey"]["cells"]} == {
            (n, d) for n in (128, 512) for d in (0.0, 0.5, 1.0)}
        assert (work / f"eval_{name}.md").read_text() in proc.stdout
