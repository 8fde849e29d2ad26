"""Checkpoints end to end, through ``pretrain_gpt.py`` under ``torchrun`` (2 CPU ranks).

* Bitwise resume: 10 steps straight vs 5 + resume 5, same layout (U2), with hidden dropout
  on (so the restored RNG states matter), the distributed optimizer (sharded state), and
  the data position (consumed samples) restored: losses 6..10 identical to the bit.
* Resharded resume: the U2 checkpoint of iteration 5 resumed as U2, R2 and DP2 (dropout
  off): the three curves agree to 1e-5 relative (the distributed optimizer's sharded
  state is re-read under each layout).
* Other TP / PP: a DP2 checkpoint (plain optimizer) resumed as PP2 and as TP2 continues
  the same curve to 1e-5 relative.
* Crash during a save: a process killed in the middle of writing iteration 4 leaves
  ``iter_0000004.tmp`` only; the tracker still names iteration 2, which loads; the next run
  resumes from 2 and publishes 4.
* SIGTERM to one rank: both ranks save at the end of the same iteration and exit 0.

These run as real subprocesses (megatron-core's checkpoint writer forks writer processes,
which the harness's daemonic ranks may not do), so they use torchrun, as users do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron.training.checkpoint import checksums
from megatron.training.data.corpus import ensure_default_corpus
from tests.helpers import free_port, tiny_gpt_flags

pytestmark = pytest.mark.slow   # CPU training runs of a minute or more

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")

MODEL = tiny_gpt_flags(max_position_embeddings=None,
                       untie_embeddings_and_output_weights=True,
                       make_vocab_size_divisible_by=32)
TRAINING = [
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--min-lr", "2e-4",
    "--weight-decay", "0.1", "--seed", "1234", "--log-interval", "5", "--eval-iters", "0",
    "--num-workers", "0", "--device", "cpu",
]


def _torchrun(args, cwd, nproc=2, timeout=300, check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), PRETRAIN] + args
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-6000:])
    return proc


def _losses(path):
    out = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec["kind"] == "train":
                out[rec["iteration"]] = rec["lm_loss"]
    return out


def _train_iterations(path):
    """The iterations of the train records, in file order."""
    with open(path) as f:
        return [r["iteration"] for r in map(json.loads, f) if r["kind"] == "train"]


def _tracker(save_dir):
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read())


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """U2, dropout 0.1, distributed optimizer, 10 steps, checkpoints at 5 and 10."""
    d = tmp_path_factory.mktemp("straight")
    _torchrun(MODEL + TRAINING + [
        "--ulysses-degree", "2", "--hidden-dropout", "0.1", "--use-distributed-optimizer",
        "--train-iters", "10", "--save", str(d / "ckpt"), "--save-interval", "5",
        "--metrics-file", str(d / "metrics.jsonl")], cwd=str(d))
    return d


def test_straight_run_published_checkpoints(straight_run):
    ckpt = straight_run / "ckpt"
    assert _tracker(str(ckpt)) == 10
    names = sorted(os.listdir(ckpt))
    assert names == ["iter_0000005", "iter_0000010", "latest_checkpointed_iteration.txt"]
    from megatron.core import dist_checkpointing  # megatron-core on first use

    from megatron.training.checkpoint.save_load import verify_complete  # megatron-core on first use

    verify_complete(str(ckpt / "iter_0000005"))
    # Every file of a published checkpoint has its checksum, and they match.

    manifest = checksums.read_manifest(str(ckpt / "iter_0000005"))
    names = checksums.checkpoint_files(str(ckpt / "iter_0000005"))
    assert sorted(manifest) == names and any(n.endswith(".distcp") for n in names)
    assert checksums.verify_files(str(ckpt / "iter_0000005"), manifest, names) is None
    # Without data flags the run records the default corpus it resolved, in the metrics
    # file's run record and in the checkpoint's args (start-up leaves ``args`` as given).
    corpus = ensure_default_corpus()
    resolved = {"data_path": [corpus.data_prefix], "tokenizer_model": corpus.tokenizer_model}
    with open(straight_run / "metrics.jsonl") as f:
        run = json.loads(f.readline())
    assert run["kind"] == "run"
    saved = dist_checkpointing.load_common_state_dict(str(ckpt / "iter_0000005"))["args"]
    for recorded in (run["args"], saved):
        assert {k: recorded[k] for k in resolved} == resolved


def test_resume_is_bitwise(straight_run, tmp_path):
    proc = _torchrun(MODEL + TRAINING + [
        "--ulysses-degree", "2", "--hidden-dropout", "0.1", "--use-distributed-optimizer",
        "--train-iters", "10", "--load", str(straight_run / "ckpt"), "--ckpt-step", "5",
        "--metrics-file", str(tmp_path / "resumed.jsonl")], cwd=str(tmp_path))
    assert "loaded checkpoint" in proc.stdout and "at iteration 5 (consumed samples 40)" in \
        proc.stdout
    straight = _losses(str(straight_run / "metrics.jsonl"))
    resumed = _losses(str(tmp_path / "resumed.jsonl"))
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    for it in resumed:
        assert resumed[it] == straight[it], (it, resumed[it], straight[it])


def test_resume_under_other_layouts(straight_run, tmp_path):
    curves = {}
    for name, layout in (("u2", ["--ulysses-degree", "2"]), ("r2", ["--ring-degree", "2"]),
                         ("dp2", ["--micro-batch-size", "1"])):
        metrics = str(tmp_path / f"{name}.jsonl")
        _torchrun(MODEL + TRAINING + layout + [
            "--hidden-dropout", "0.0", "--use-distributed-optimizer", "--train-iters", "10",
            "--load", str(straight_run / "ckpt"), "--ckpt-step", "5",
            "--metrics-file", metrics], cwd=str(tmp_path))
        curves[name] = _losses(metrics)
    assert sorted(curves["u2"]) == [6, 7, 8, 9, 10]
    for name in ("r2", "dp2"):
        for it, ref in curves["u2"].items():
            assert abs(curves[name][it] - ref) <= 1e-5 * abs(ref), (name, it)
    # Loaded weights, not fresh ones: a fresh start is at ~ln(8000) = 8.99 nats.
    assert curves["u2"][6] < 8.9


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """DP2 with the plain (replicated) optimizer, 6 steps, a checkpoint at 3."""
    d = tmp_path_factory.mktemp("plain")
    _torchrun(MODEL + TRAINING + [
        "--train-iters", "6", "--save", str(d / "ckpt"), "--save-interval", "3",
        "--metrics-file", str(d / "metrics.jsonl")], cwd=str(d))
    return d


@pytest.mark.parametrize("layout", [["--pipeline-model-parallel-size", "2"],
                                    ["--tensor-model-parallel-size", "2"]],
                         ids=["pp2", "tp2"])
def test_resume_into_pipeline_or_tensor_parallel(plain_run, layout, tmp_path):
    """The DP2 checkpoint continues under PP2 (megatron-core's 1F1B schedule over gloo) or
    TP2 (model and optimizer state resharded) on the same curve."""
    metrics = str(tmp_path / "resumed.jsonl")
    _torchrun(MODEL + TRAINING + layout + [
        "--train-iters", "6", "--load", str(plain_run / "ckpt"), "--ckpt-step", "3",
        "--micro-batch-size", "4", "--metrics-file", metrics], cwd=str(tmp_path))
    straight = _losses(str(plain_run / "metrics.jsonl"))
    resumed = _losses(metrics)
    assert sorted(resumed) == [4, 5, 6]
    for it, value in resumed.items():
        assert abs(value - straight[it]) <= 1e-5 * abs(straight[it]), (it, value, straight[it])


_CRASH_DRIVER = textwrap.dedent("""
    import os
    import sys


    def main():
        from megatron.training.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
        from megatron.training.checkpoint import shard_writer

        real_run = shard_writer.run
        calls = []

        def crashing_run(request, *args, **kwargs):
            calls.append(request)
            if len(calls) == 2:  # the second save: iteration 4
                request.finalize_fns.clear()  # killed before .metadata and metadata.json
                real_run(request, *args, **kwargs)
                os._exit(17)  # no clean-up, no exception handlers: a crash
            return real_run(request, *args, **kwargs)

        shard_writer.run = crashing_run
        from megatron.training.cli.arguments import parse_args
        from megatron.training.loop import pretrain

        pretrain(parse_args(sys.argv[1:]))


    if __name__ == "__main__":
        main()
""")



def _run_crashing(driver, args, tmp_path, env):
    """Run the driver in its own session; after it dies, kill what it left behind.

    A crashed process runs no exit handlers, so the helper process megatron-core's
    checkpoint writer started (a multiprocessing manager) outlives it, as it would after
    a real crash; it is in the driver's process group, which is ended here.
    """
    log = tmp_path / "crash.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(driver)] + args, cwd=str(tmp_path),
                                env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return returncode, log.read_text()


def test_crash_during_save_is_never_loaded(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    common = MODEL + TRAINING + ["--train-iters", "4", "--save", ckpt, "--load", ckpt,
                                 "--save-interval", "2", "--micro-batch-size", "8"]
    driver = tmp_path / "crash_driver.py"
    driver.write_text(_CRASH_DRIVER)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("MASTER_ADDR", None)
    returncode, output = _run_crashing(driver, common, tmp_path, env)
    assert returncode == 17, output[-4000:]
    assert _tracker(ckpt) == 2
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004.tmp",
                                        "latest_checkpointed_iteration.txt", "metrics.jsonl"]

    from megatron.training.checkpoint.save_load import (
        locate_checkpoint,  # megatron-core on first use
    )

    assert locate_checkpoint(ckpt, ckpt, None) == (2, os.path.join(ckpt, "iter_0000002"))
    with pytest.raises(Exception, match="iteration 4"):
        locate_checkpoint(ckpt, ckpt, 4)  # the half-written one is not a checkpoint

    resumed = subprocess.run([sys.executable, PRETRAIN] + common, cwd=str(tmp_path), env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "loaded checkpoint" in resumed.stdout and "at iteration 2" in resumed.stdout
    assert _tracker(ckpt) == 4
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004",
                                        "latest_checkpointed_iteration.txt", "metrics.jsonl"]
    # the crashed run had recorded iterations 3 and 4: they went, and were trained again
    assert "dropped 2 line(s) of iterations after 2" in resumed.stdout
    assert _train_iterations(os.path.join(ckpt, "metrics.jsonl")) == [1, 2, 3, 4]


def _single_process_env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def test_exit_duration_saves_stops_and_resumes(tmp_path):
    """--exit-duration-in-mins shorter than start-up: the first iteration ends past it, so the
    run saves there and exits 0; the rerun with --load trains the rest, each iteration
    recorded once."""
    ckpt = str(tmp_path / "ckpt")
    metrics = str(tmp_path / "metrics.jsonl")
    common = MODEL + TRAINING + ["--train-iters", "4", "--save", ckpt, "--load", ckpt,
                                 "--metrics-file", metrics]

    def run(extra):
        proc = subprocess.run([sys.executable, PRETRAIN] + common + extra, cwd=str(tmp_path),
                              env=_single_process_env(), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
        return proc.stdout

    out = run(["--exit-duration-in-mins", "1e-4"])
    assert "--exit-duration-in-mins 0.0001 reached" in out
    assert "saving at iteration 1 and exiting" in out
    assert _tracker(ckpt) == 1 and _train_iterations(metrics) == [1]
    out = run([])
    assert "loaded checkpoint" in out and _tracker(ckpt) == 4
    assert _train_iterations(metrics) == [1, 2, 3, 4]


def test_sigterm_saves_and_exits_zero(tmp_path):
    psutil = pytest.importorskip("psutil")
    ckpt = str(tmp_path / "ckpt")
    metrics = str(tmp_path / "metrics.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), PRETRAIN] + MODEL + TRAINING + [
        "--ulysses-degree", "2", "--train-iters", "100000", "--save", ckpt,
        "--metrics-file", metrics, "--log-interval", "1"]
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(metrics) and len(_losses(metrics)) >= 3:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if PRETRAIN in " ".join(p.cmdline())]
        assert len(workers) == 2
        workers[-1].send_signal(signal.SIGTERM)  # one rank only, as a node-local kill does
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "SIGTERM received: saving at iteration" in out
    last = max(_losses(metrics))
    assert _tracker(ckpt) == last
    assert os.path.isdir(os.path.join(ckpt, f"iter_{last:07d}"))
    assert last < 100000
