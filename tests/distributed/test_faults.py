"""Faults a user meets, end to end through ``tools/launch.py`` (torchrun) on 2 CPU ranks.

* Bad input exits 2 through the launcher, with its message once (rank 0), no traceback.
* kill -9 of the whole job (torchrun and its workers, by PID) during its saves: within
  seconds no process it started survives (megatron-core's checkpoint writer Manager and
  writers, DataLoader workers, the guards themselves).
* A read-only ``--save`` (a read-only tmpfs in a private mount namespace) is refused at
  start-up, exit 2, one line; a full disk (a 3 MiB tmpfs) at the second save: exit 1,
  one line naming the directory, the room needed and the intact first checkpoint, which
  the tracker still names.
* Resuming with another ``--hidden-size``: exit 2, one line naming the flag.
* SIGTERM to the launcher (torchrun then signals each worker's whole group): the ranks
  save at the end of their iteration, the launcher exits 128 + 15, nothing survives.

The mount-namespace tests need root and ``unshare`` (CI runs as root); elsewhere they skip.
See docs/reliability.md for the table of faults.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import tiny_gpt_flags

pytestmark = pytest.mark.slow   # CPU training runs of a minute or more

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
LAUNCH = os.path.join(ROOT, "tools", "launch.py")

TINY = tiny_gpt_flags(llama=False, mock_data=True, vocab_size=512, lr="1e-3", num_workers=0,
                      device="cpu", eval_iters=0, log_interval=1)


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch_cmd(flags, nproc=2):
    return [sys.executable, LAUNCH, "--nproc-per-node", str(nproc), PRETRAIN] + flags


def _errors(text):
    return [line for line in text.splitlines() if "pretrain_gpt.py: error:" in line]


def test_bad_input_exits_2_through_the_launcher_and_says_it_once(tmp_path):
    for flags, words in ((["--ulysses-degree", "3"], "world size 2 is not divisible"),
                         (["--lr", "-1e-3"], "--lr -0.001 must be > 0")):
        proc = subprocess.run(_launch_cmd(TINY + ["--train-iters", "2"] + flags),
                              cwd=str(tmp_path), env=_env(), capture_output=True, text=True,
                              timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out[-4000:]
        assert len(_errors(out)) == 1 and words in _errors(out)[0], out[-4000:]
        assert "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]
        assert "exit status 2" in out


def _unshare_available():
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs "
                            "/mnt"], capture_output=True)
    return probe.returncode == 0


needs_mount_namespace = pytest.mark.skipif(not _unshare_available(),
                                           reason="needs root and unshare -m")


def _in_tmpfs(tmp_path, size, read_only, flags, after=""):
    """Run the launcher in a private mount namespace where ``tmp_path/disk`` is a tmpfs of
    ``size`` (read-only if asked); ``after`` runs there once the job ends (the tmpfs
    vanishes with the namespace)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    remount = f"mount -o remount,ro {disk} && " if read_only else ""
    cmd = " ".join(f"'{c}'" for c in _launch_cmd(flags))
    script = (f"mount -t tmpfs -o size={size} tmpfs {disk} && {remount}"
              f"{{ {cmd}; echo $? > {tmp_path}/status; }}; {after}")
    proc = subprocess.run(["unshare", "-m", "bash", "-c", script], cwd=str(tmp_path),
                          env=_env(), capture_output=True, text=True, timeout=600)
    status = int((tmp_path / "status").read_text())
    return status, proc.stdout + proc.stderr, disk


@needs_mount_namespace
def test_read_only_save_is_refused_at_start_up(tmp_path):
    status, out, disk = _in_tmpfs(tmp_path, "1m", True, TINY + [
        "--train-iters", "2", "--save", str(tmp_path / "disk" / "ckpt"),
        "--metrics-file", str(tmp_path / "metrics.jsonl")])
    assert status == 2, out[-4000:]
    assert len(_errors(out)) == 1 and "--save: " in _errors(out)[0], out[-4000:]
    assert "is not writable (Read-only file system)" in _errors(out)[0]
    assert "Traceback" not in out and not (tmp_path / "metrics.jsonl").exists()


@needs_mount_namespace
def test_full_disk_during_a_save_keeps_the_last_checkpoint(tmp_path):
    ckpt = tmp_path / "disk" / "ckpt"
    status, out, _ = _in_tmpfs(
        tmp_path, "3m", False,
        TINY + ["--train-iters", "4", "--save", str(ckpt), "--save-interval", "2",
                "--ulysses-degree", "2", "--metrics-file", str(tmp_path / "metrics.jsonl")],
        after=f"cat {ckpt}/latest_checkpointed_iteration.txt > {tmp_path}/tracker; "
              f"ls {ckpt} > {tmp_path}/listing")
    assert status == 1, out[-6000:]
    errors = _errors(out)
    assert len(errors) == 1, out[-6000:]
    # torch's writer loses the errno ("unexpected pos"): the room left tells.
    for part in (f"saving iteration 4 to {ckpt}/iter_0000004 failed: the disk is full",
                 "it needs about", "MiB (the size of iter_0000002)", "MiB free",
                 f"the last complete checkpoint, {ckpt}/iter_0000002, is intact"):
        assert part in errors[0], (part, errors[0])
    assert "Traceback" not in out, out[-6000:]
    assert (tmp_path / "tracker").read_text().strip() == "2"
    assert "iter_0000004\n" not in (tmp_path / "listing").read_text()


def test_kill_9_of_the_job_during_saves_leaves_nothing_running(tmp_path):
    psutil = pytest.importorskip("psutil")
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        _launch_cmd(TINY + ["--train-iters", "100000", "--save", str(ckpt),
                            "--save-interval", "1", "--ulysses-degree", "2",
                            "--num-workers", "1"]),
        cwd=str(tmp_path), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    started = []
    try:
        deadline = time.monotonic() + 300
        tracker = ckpt / "latest_checkpointed_iteration.txt"
        while time.monotonic() < deadline and proc.poll() is None:
            if tracker.exists() and int(tracker.read_text() or 0) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None and tracker.exists(), "the job did not save twice"
        job = psutil.Process(proc.pid)
        started = job.children(recursive=True)
        workers = [p for p in job.children() if PRETRAIN in " ".join(p.cmdline())]
        assert len(workers) == 2
        # megatron-core's writer Manager (spawned at the first save) is among them.
        assert len(started) > len(workers) + 2, [p.cmdline()[:3] for p in started]
        for p in [job] + workers:  # the launcher and the ranks, by PID, all at once
            os.kill(p.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(started, timeout=15)
        assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in started:  # a failed assertion must not leave them running either
            try:
                p.kill()
            except psutil.Error:
                pass


def test_resume_with_another_model_names_the_flag(tmp_path):
    ckpt = tmp_path / "ckpt"
    env = _env()
    first = subprocess.run([sys.executable, PRETRAIN] + TINY + ["--train-iters", "1",
                                                                "--save", str(ckpt)],
                           cwd=str(tmp_path), env=env, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    second = subprocess.run([sys.executable, PRETRAIN] + TINY + [
        "--train-iters", "2", "--load", str(ckpt), "--hidden-size", "128"],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    errors = _errors(second.stderr)
    assert len(errors) == 1 and "--hidden-size 64 (this run: --hidden-size 128)" in errors[0]
    assert "Traceback" not in second.stderr and "shape mismatch" not in second.stderr


def test_sigterm_to_the_launcher_saves_and_exits(tmp_path):
    """SIGTERM to torchrun (Slurm's time limit, a Ctrl-C'd shell) reaches every process of
    each worker's group: the checkpoint writer's Manager and the DataLoader workers must
    survive it so that the rank's SIGTERM save works (before, it failed: "Broken pipe")."""
    psutil = pytest.importorskip("psutil")
    ckpt = tmp_path / "ckpt"
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.Popen(
        _launch_cmd(TINY + ["--train-iters", "100000", "--save", str(ckpt),
                            "--save-interval", "2", "--ulysses-degree", "2",
                            "--num-workers", "1", "--metrics-file", str(metrics)]),
        cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    started = []
    try:
        tracker = ckpt / "latest_checkpointed_iteration.txt"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not tracker.exists():
            time.sleep(0.2)
        assert proc.poll() is None and tracker.exists(), "no first checkpoint"
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
        assert "SIGTERM received: saving at iteration" in out and not _errors(out), out[-4000:]
        with open(metrics) as f:
            last = max(r["iteration"] for r in map(json.loads, f) if r["kind"] == "train")
        assert int(tracker.read_text()) == last and (ckpt / f"iter_{last:07d}").is_dir()
        _, alive = psutil.wait_procs(started, timeout=15)
        assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in started:
            try:
                p.kill()
            except psutil.Error:
                pass
