"""Faults a user meets, end to end through ``tools/launch.py`` (torchrun) on 2 or 4 CPU ranks.

* Bad input exits 2 through the launcher, with its message once (rank 0), no traceback.
* kill -9 of the whole job (torchrun and its workers, by PID) during its saves: within
  seconds no process it started survives (megatron-core's checkpoint writer Manager,
  DataLoader workers, the guards themselves).
* A read-only ``--save`` (a read-only tmpfs in a private mount namespace) is refused at
  start-up, exit 2, one line; a full disk (a 3 MiB tmpfs) at the second save: exit 1,
  one line naming the directory, the room needed and the intact first checkpoint, which
  the tracker still names.
* Resuming with another ``--hidden-size``: exit 2, one line naming the flag.
* SIGTERM to the launcher (torchrun then signals each worker's whole group): the ranks
  save at the end of their iteration, the launcher exits 128 + 15, nothing survives.
* Every rank exits promptly, 4 ranks (U2 x R2) with a DataLoader worker each: a full disk,
  a checkpoint write that hangs, kill -9 or SIGSTOP of one rank, Ctrl-C (SIGINT) to
  the launcher; each test states its bound (GONE_S, SIGNAL_SAVE_S) and checks that nothing
  the job started is left and which rank the launcher names. Usage errors always print.

The mount-namespace tests need root and ``unshare`` (CI runs as root); elsewhere they skip.
See docs/reliability.md for the table of faults.
"""

from __future__ import annotations

import json
import os
import re
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


# ----------------------------------------------------------------- every rank exits promptly
# Four ranks (U2 x R2), each with a DataLoader worker: the ranks' helpers used to keep a rank
# that left through an error from ever exiting (multiprocessing joined its workers, which
# ignored the SIGTERM it sent them). Each test measures how long the job takes to be gone
# after the fault and checks that nothing the job started is left.
U2R2 = TINY + ["--ulysses-degree", "2", "--ring-degree", "2", "--num-workers", "1"]
GONE_S = 20          # every process gone this long after a rank's fault
SIGNAL_SAVE_S = 30   # ... after a signal that makes the ranks save first (torchrun's grace)
TIMEOUT_MIN = 1      # --distributed-timeout-minutes for the stalled-peer test


class _Job:
    """The launcher in its own session, its output read line by line with arrival times."""

    def __init__(self, cmd, cwd, env=None):
        import threading

        self.proc = subprocess.Popen(cmd, cwd=str(cwd), env=env or _env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines = []            # (monotonic time, line)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.started = []

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def out(self):
        return "\n".join(line for _, line in self.lines)

    def when(self, words, timeout=300):
        """The time the first line holding ``words`` arrived (waits for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if words in line:
                    return t
            assert self.proc.poll() is None or self._reader.is_alive(), self.out[-4000:]
            time.sleep(0.1)
        raise AssertionError(f"no line with {words!r}:\n{self.out[-4000:]}")

    def ranks(self):
        """The ranks' processes by global rank (torchrun's direct children)."""
        import psutil

        return {int(p.environ()["RANK"]): p for p in psutil.Process(self.proc.pid).children()
                if PRETRAIN in " ".join(p.cmdline())}

    def snapshot(self):
        import psutil

        self.started = psutil.Process(self.proc.pid).children(recursive=True)

    def gone_within(self, t0, bound):
        """Wait for the launcher and everything it started; return the seconds after ``t0``."""
        import psutil

        try:
            self.proc.wait(timeout=max(1.0, t0 + bound - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        psutil.wait_procs(self.started, timeout=max(0.1, t0 + bound - time.monotonic()))
        alive = [p for p in self.started if p.is_running() and p.status() != "zombie"]
        assert self.proc.poll() is not None and not alive, (
            f"still running {time.monotonic() - t0:.1f} s after the fault: "
            f"{[(p.pid, p.status(), p.cmdline()[:3]) for p in alive]}\n{self.out[-5000:]}")
        self._reader.join(timeout=5)
        return time.monotonic() - t0

    def close(self):
        import psutil

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for p in self.started:
            try:
                p.kill()
            except psutil.Error:
                pass


def _one_launch_line(out):
    lines = [line for line in out.splitlines() if line.startswith("launch: ")]
    assert len(lines) == 1, out[-6000:]
    return lines[0]


def _first_checkpoint(job, ckpt):
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.proc.poll() is None and not tracker.exists():
        time.sleep(0.2)
    assert job.proc.poll() is None and tracker.exists(), job.out[-4000:]
    time.sleep(1.0)   # into the next iterations
    job.snapshot()


@pytest.mark.parametrize("fault", ["kill -9", "SIGSTOP"])
def test_a_dead_or_stalled_rank_ends_the_job_promptly(tmp_path, fault):
    """kill -9 of rank 2: every process is gone within GONE_S s; SIGSTOP of rank 2: within
    --distributed-timeout-minutes plus GONE_S s (the others wait that long for it). One
    launcher line names rank 2; no traceback; the published checkpoint is intact."""
    pytest.importorskip("psutil")
    ckpt = tmp_path / "ckpt"
    job = _Job(_launch_cmd(U2R2 + ["--train-iters", "100000", "--save", str(ckpt),
                                   "--save-interval", "3", "--distributed-timeout-minutes",
                                   str(TIMEOUT_MIN)], nproc=4), tmp_path)
    try:
        _first_checkpoint(job, ckpt)
        victim = job.ranks()[2]
        t0 = time.monotonic()
        victim.send_signal(signal.SIGKILL if fault == "kill -9" else signal.SIGSTOP)
        bound = GONE_S + (60 * TIMEOUT_MIN if fault == "SIGSTOP" else 0)
        took = job.gone_within(t0, bound)
        out = job.out
        assert took <= bound, (took, out[-4000:])
        assert job.proc.returncode == 1, out[-6000:]
        assert "rank 2 was killed by signal 9 (SIGKILL) first" in _one_launch_line(out)
        assert "Traceback" not in out, out[-6000:]
        if fault == "SIGSTOP":
            assert "guard: rank 2 " in out and "is stopped (SIGSTOP)" in out, out[-4000:]
            assert "Timed out waiting" in out, out[-4000:]
        last = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
        assert (ckpt / f"iter_{last:07d}" / "checksums.json").is_file()
        print(f"{fault}: every process gone {took:.1f} s after the fault")
    finally:
        job.close()


@needs_mount_namespace
def test_full_disk_on_four_ranks_exits_promptly_and_removes_the_partial_save(tmp_path):
    """A 3 MiB tmpfs fills during the second save: one line naming the directory and the
    intact first checkpoint, every process gone within GONE_S s of it, no ``.tmp`` left."""
    pytest.importorskip("psutil")
    disk = tmp_path / "disk"
    disk.mkdir()
    ckpt = disk / "ckpt"
    cmd = " ".join(f"'{c}'" for c in _launch_cmd(
        U2R2 + ["--train-iters", "6", "--save", str(ckpt), "--save-interval", "2"], nproc=4))
    script = (f"mount -t tmpfs -o size=3m tmpfs {disk} && {{ {cmd}; echo $? > "
              f"{tmp_path}/status; }}; cat {ckpt}/latest_checkpointed_iteration.txt > "
              f"{tmp_path}/tracker; ls -a {ckpt} > {tmp_path}/listing; "
              f"ls {ckpt}/iter_0000002 > {tmp_path}/first")
    job = _Job(["unshare", "-m", "bash", "-c", script], tmp_path)
    try:
        job.when("saved checkpoint at iteration 2")
        job.snapshot()
        t0 = job.when("saving iteration 4 to")
        took = job.gone_within(t0, GONE_S)
        out = job.out
        assert int((tmp_path / "status").read_text()) == 1, out[-6000:]
        errors = _errors(out)
        assert len(errors) == 1 and "the disk is full" in errors[0], out[-6000:]
        assert f"the last complete checkpoint, {ckpt}/iter_0000002, is intact" in errors[0]
        assert "rank 0 exited with status 1 first" in _one_launch_line(out)
        assert "Traceback" not in out, out[-6000:]
        assert (tmp_path / "tracker").read_text().strip() == "2"
        listing = (tmp_path / "listing").read_text().split()
        assert "iter_0000002" in listing and not [n for n in listing if "0000004" in n], listing
        assert "checksums.json" in (tmp_path / "first").read_text()
        print(f"full disk: every process gone {took:.1f} s after the error line")
    finally:
        job.close()


@pytest.mark.parametrize("save_interval", [None, 1, 1000])
def test_ctrl_c_to_the_launcher_saves_like_sigterm_or_says_it_did_not(tmp_path, save_interval):
    """SIGINT (Ctrl-C) to the launcher: with --save the ranks save at the end of their
    iteration (save interval 1: the signal lands during saves) and exit; without, rank 0
    says that nothing was saved. Exit 130, no traceback, nothing left running."""
    pytest.importorskip("psutil")
    ckpt = tmp_path / "ckpt"
    metrics = tmp_path / "metrics.jsonl"
    flags = U2R2 + ["--train-iters", "100000", "--metrics-file", str(metrics)]
    if save_interval:
        flags += ["--save", str(ckpt), "--save-interval", str(save_interval)]
    job = _Job(_launch_cmd(flags, nproc=4), tmp_path)
    try:
        job.when(" iteration        3/")
        job.snapshot()
        t0 = time.monotonic()
        job.proc.send_signal(signal.SIGINT)
        took = job.gone_within(t0, SIGNAL_SAVE_S if save_interval else GONE_S)
        out = job.out
        assert job.proc.returncode == 130, out[-6000:]
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-6000:]
        assert "launch: received SIGINT" in _one_launch_line(out)
        if save_interval:
            with open(metrics) as f:
                last = max(r["iteration"] for r in map(json.loads, f) if r["kind"] == "train")
            assert f"SIGINT received: saving at iteration {last} and exiting" in out, out[-4000:]
            assert f"saved checkpoint at iteration {last}" in out, out[-4000:]
            assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) == last
            assert not list(ckpt.glob("*.tmp"))
        else:
            assert not re.search(r"saved checkpoint at iteration \d", out), out[-4000:]
            assert len(_errors(out)) == 0, out[-4000:]
            assert re.search(r"SIGINT received: stopping at iteration \d+ without a "
                             r"checkpoint \(no --save\)", out), out[-4000:]
        print(f"SIGINT, --save-interval {save_interval}: gone {took:.1f} s after it")
    finally:
        job.close()


def test_usage_errors_are_always_printed_through_the_launcher(tmp_path):
    """A trailing --seq-length with no value, 20 launches of 4 ranks (5 at a time): each
    exits 2 and prints the message once. (Rank 0 was sometimes stopped by torchrun before
    it printed, when another rank failed first.)"""
    cmd = _launch_cmd(TINY[:6] + ["--mock-data", "--train-iters", "2", "--seq-length"],
                      nproc=4)
    for _ in range(4):
        procs = [subprocess.Popen(cmd, cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for _ in range(5)]
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 2, out[-3000:]
            assert len(_errors(out)) == 1 and "--seq-length: expected one argument" in out
            assert "Traceback" not in out, out[-3000:]


# A test-only sitecustomize: rank 1's second checkpoint write never finishes.
_HANG_SECOND_WRITE = """
import os, sys, time

if os.environ.get("RANK") == "1" and sys.argv[0].endswith("pretrain_gpt.py"):
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    _write, _dirs = FileSystemWriterAsync.write_preloaded_data, set()

    def _hang_in_the_second_save(transform_list, i, bucket, *args, **kwargs):
        _dirs.add(os.path.dirname(bucket[0]))
        if len(_dirs) > 1:
            time.sleep(3600)
        return _write(transform_list, i, bucket, *args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(_hang_in_the_second_save)
"""


def test_a_checkpoint_write_that_hangs_ends_the_job_promptly(tmp_path):
    """Rank 1's second checkpoint write never finishes (a writer waiting on a lock, a stuck
    file system): after the bound, half of --distributed-timeout-minutes (30 s at 1), rank 1
    says so in one line naming itself and its pid, the directory and the intact first
    checkpoint; the others lose contact with it; every process is gone within GONE_S s of
    that line; the tracker still names the first checkpoint, intact, and no ``.tmp`` is
    left."""
    pytest.importorskip("psutil")
    from megatron.training.checkpoint.save_load import (
        intact_problem,  # megatron-core on first use
    )

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_HANG_SECOND_WRITE)
    env = _env()
    env["PYTHONPATH"] = str(site) + os.pathsep + env["PYTHONPATH"]
    ckpt = tmp_path / "ckpt"
    job = _Job(_launch_cmd(U2R2 + ["--train-iters", "100000", "--save", str(ckpt),
                                   "--save-interval", "1", "--distributed-timeout-minutes",
                                   "1"], nproc=4), tmp_path, env=env)
    try:
        job.when("saved checkpoint at iteration 1")
        job.snapshot()
        pid = job.ranks()[1].pid
        hung = job.when(" iteration        2/")
        t0 = job.when("made no progress", timeout=120)
        took = job.gone_within(t0, GONE_S)
        out = job.out
        assert t0 - hung >= 25, out[-6000:]     # not before the bound
        assert job.proc.returncode == 1, out[-6000:]
        errors = [e for e in _errors(out) if "lost contact" not in e]
        assert len(errors) == 1, out[-6000:]
        assert (f"pretrain_gpt.py: error: saving iteration 2 to {ckpt}/iter_0000002 failed: "
                f"WriterStuckError: rank 1's checkpoint write (in its own process, pid {pid}) "
                f"made no progress for 30 s (no CPU time, no bytes written). Nothing was "
                f"published: the last complete checkpoint, {ckpt}/iter_0000001, is intact and "
                f"--load {ckpt} resumes from it.") in errors[0], out[-6000:]
        assert "rank 1 exited with status 1 first" in _one_launch_line(out)
        assert "Traceback" not in out, out[-6000:]
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1\n"
        assert intact_problem(str(ckpt / "iter_0000001")) is None
        assert not list(ckpt.glob("*.tmp")), list(ckpt.iterdir())
        print(f"hung write: every process gone {took:.1f} s after its line")
    finally:
        job.close()
