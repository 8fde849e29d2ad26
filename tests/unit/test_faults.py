"""The pure parts of docs/reliability.md: checksums, save-failure messages, model-shape
checks, console filters, the process guard's bookkeeping, the launcher's port check.

The end-to-end faults (processes killed, a full or read-only disk, exit codes through the
launcher) are in tests/distributed/test_faults.py.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace

import psutil
import pytest
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.api import CheckpointException

from megatron.training.checkpoint import checksums
from megatron.training.checkpoint.faults import root_os_error, save_failure_message
from megatron.training.checkpoint.writer_watch import (
    Progress,
    WriterDiedError,
    WriterStuckError,
    serving_work,
    stall_bound_s,
    stuck_text,
    writers_watched,
)
from megatron.training.launch import port_problem
from megatron.training.observe.console import OnceLogFilter, OnceWarningPrinter
from megatron.training.process_guard import descendants


# --------------------------------------------------------------------------- checksums
def _files(root, sizes):
    os.makedirs(root, exist_ok=True)
    for name, size in sizes.items():
        with open(os.path.join(root, name), "wb") as f:
            f.write(os.urandom(size))


def test_manifest_round_trip_and_a_flipped_byte_is_named(tmp_path):
    root = str(tmp_path / "iter_0000004")
    _files(root, {"__0_0.distcp": 5000, "__1_0.distcp": 3000, "common.pt": 100,
                  ".metadata": 50})
    names = checksums.checkpoint_files(root)
    checksums.write_manifest(root, checksums.hash_files(root, names))
    manifest = checksums.read_manifest(root)
    assert sorted(manifest) == names and checksums.MANIFEST not in names
    assert checksums.verify_files(root, manifest, names) is None
    with open(os.path.join(root, "__1_0.distcp"), "r+b") as f:
        f.seek(1234)
        b = f.read(1)
        f.seek(1234)
        f.write(bytes([b[0] ^ 1]))
    problem = checksums.verify_files(root, manifest, names)
    assert problem.startswith("__1_0.distcp does not match its checksum")


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("offset", [0, 999, 1000, 1001, 3499])
def test_chunked_digest_catches_a_flip_in_any_piece(tmp_path, offset):
    # 3500 bytes in pieces of 1000: four pieces, the last one short; flips at both edges of a
    # piece boundary and in the last piece.
    root = str(tmp_path)
    _files(root, {"__0_0.distcp": 3500, "empty": 0})
    names = checksums.checkpoint_files(root)
    checksums.write_manifest(root, checksums.hash_files(root, names, 1000), chunk_bytes=1000)
    manifest = checksums.read_manifest(root)
    assert manifest.chunk_bytes == 1000
    assert checksums.verify_files(root, manifest, names) is None
    _flip(os.path.join(root, "__0_0.distcp"), offset)
    assert checksums.verify_files(root, manifest, names).startswith(
        "__0_0.distcp does not match its checksum")


def _hash_file(path, chunk_bytes):
    """One file's digest through ``hash_files``: the version-2 tree over ``chunk_bytes``
    pieces, or (``chunk_bytes=None``, version 1) one streaming hash of the whole file."""
    name = os.path.basename(path)
    return checksums.hash_files(os.path.dirname(path), [name], chunk_bytes)[name][
        checksums.ALGORITHM]


def test_chunked_digest_is_a_tree_over_the_pieces(tmp_path):
    data = os.urandom(2500)
    (tmp_path / "f").write_bytes(data)
    pieces = [xxhash.xxh3_128(data[i:i + 1000]).digest() for i in (0, 1000, 2000)]
    assert _hash_file(str(tmp_path / "f"), 1000) == \
        xxhash.xxh3_128(b"".join(pieces)).hexdigest()
    # version 1: one streaming hash of the whole file
    assert _hash_file(str(tmp_path / "f"), None) == xxhash.xxh3_128(data).hexdigest()
    # the piece size is part of the digest: another size gives another digest
    assert _hash_file(str(tmp_path / "f"), 1000) != \
        _hash_file(str(tmp_path / "f"), 2048)


def test_a_file_that_cannot_be_mapped_is_read_with_the_same_digest(tmp_path, monkeypatch):
    data = os.urandom(2500)
    (tmp_path / "f").write_bytes(data)
    mapped = {n: _hash_file(str(tmp_path / "f"), n) for n in (1000, None)}

    def no_mmap(*a, **k):
        raise OSError("mmap not supported here")

    monkeypatch.setattr(checksums.mmap, "mmap", no_mmap)
    assert {n: _hash_file(str(tmp_path / "f"), n) for n in (1000, None)} == mapped


def test_a_version_1_manifest_is_still_verified(tmp_path):
    root = str(tmp_path)
    _files(root, {"__0_0.distcp": 3000})
    data = (tmp_path / "__0_0.distcp").read_bytes()
    with open(os.path.join(root, checksums.MANIFEST), "w") as f:
        json.dump({"version": 1, "algorithm": "xxh3_128", "files": {"__0_0.distcp": {
            "bytes": 3000, "xxh3_128": xxhash.xxh3_128(data).hexdigest()}}}, f)
    manifest = checksums.read_manifest(root)
    assert manifest.chunk_bytes is None
    assert checksums.verify_files(root, manifest, ["__0_0.distcp"]) is None
    _flip(os.path.join(root, "__0_0.distcp"), 2000)
    assert "does not match" in checksums.verify_files(root, manifest, ["__0_0.distcp"])


def test_a_manifest_of_an_unknown_version_is_refused(tmp_path):
    (tmp_path / checksums.MANIFEST).write_text(json.dumps(
        {"version": 9, "algorithm": "xxh3_128", "files": {}}))
    with pytest.raises(checksums.ChecksumMismatch, match="version 9"):
        checksums.read_manifest(str(tmp_path))


def test_manifest_must_cover_every_file(tmp_path):
    root = str(tmp_path)
    _files(root, {"a": 10, "b": 10})
    with pytest.raises(ValueError, match="lack"):
        checksums.write_manifest(root, checksums.hash_files(root, ["a"]))


def test_each_file_is_hashed_by_exactly_one_rank():
    names = ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__3_0.distcp", "common.pt",
             ".metadata", "metadata.json"]
    for world in (1, 2, 3):
        shares = [checksums.files_of_rank(names, r, world) for r in range(world)]
        assert sorted(n for s in shares for n in s) == sorted(names)
        if world >= 2:
            assert "__1_0.distcp" in shares[1]  # the writer hashes its own files


def test_a_checkpoint_without_manifest_is_not_an_error(tmp_path):
    assert checksums.read_manifest(str(tmp_path)) is None
    (tmp_path / checksums.MANIFEST).write_text("{not json")
    with pytest.raises(checksums.ChecksumMismatch, match="unreadable"):
        checksums.read_manifest(str(tmp_path))


# --------------------------------------------------------------------------- save faults
def test_save_failure_message_names_directory_room_and_what_is_safe(tmp_path):
    root = tmp_path / "ckpt"
    previous = root / "iter_0000002"
    _files(str(previous), {"__0_0.distcp": 4096})
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    wrapped = CheckpointException("write", {1: (RuntimeError("Worker failure"), None)})
    wrapped.failures[1][0].__cause__ = full
    found = root_os_error(wrapped)
    assert found == (full, 1)
    message, storage = save_failure_message(4, str(root / "iter_0000004"), str(root),
                                            str(previous), wrapped, 1000)
    assert storage
    for part in ("saving iteration 4 to", "iter_0000004 failed: [Errno 28] No space left on "
                 "device (rank 1)", "it needs about 0.0 MiB (the size of iter_0000002)",
                 " free. ", f"the last complete checkpoint, {previous}, is intact",
                 f"--load {root} resumes from it", "free some space"):
        assert part in message, (part, message)
    other, storage = save_failure_message(4, "x", str(root), None, ValueError("boom"), 0)
    assert not storage and "no earlier complete checkpoint" in other


# --------------------------------------------------------------------------- model shape
def test_checkpoint_of_another_model_names_the_flags():
    from megatron.training.checkpoint.save_load import (  # megatron-core on first use
        CheckpointError,
        check_model_matches,
    )

    saved = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 172,
             "padded_vocab_size": 8000, "swiglu": True, "seq_length": 64}
    now = Namespace(**dict(saved, hidden_size=128, group_query_attention=False,
                           num_query_groups=None, max_position_embeddings=64))
    with pytest.raises(CheckpointError) as info:
        check_model_matches(saved, vars(now), "/ck/iter_0000005")
    text = str(info.value)
    assert "--hidden-size 64 (this run: --hidden-size 128)" in text
    assert "--group-query-attention --num-query-groups 2 (this run:" in text


def test_another_seq_length_is_said_in_one_line(capsys, monkeypatch):
    from megatron.training.checkpoint.save_load import (
        check_model_matches,  # megatron-core on first use
    )

    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    saved = {"hidden_size": 64, "seq_length": 64}
    check_model_matches(saved, dict(hidden_size=64, seq_length=128,
                                    max_position_embeddings=128), "/ck")
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["note: the checkpoint was trained with --seq-length 64; this run continues "
                   "it with --seq-length 128"]


# --------------------------------------------------------------------------- console
def test_each_warning_once_in_one_line_and_megatron_core_on_rank_0_only():
    for rank0 in (True, False):
        out = io.StringIO()
        printer = OnceWarningPrinter(rank0, out)
        for _ in range(3):
            printer("Apex is not installed.\n  Falling back", UserWarning,
                    "/x/site-packages/megatron/core/models/backends.py", 21)
            printer("ours", UserWarning, "/repo/megatron/training/data/loader.py", 7)
            printer("deprecated", FutureWarning,
                    "/v/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", 83)
        lines = out.getvalue().splitlines()
        expected = (["UserWarning (megatron-core): Apex is not installed. Falling back"]
                    if rank0 else []) + ["UserWarning (/repo/megatron/training/data/loader.py:7): ours"]
        expected += ["FutureWarning (torch): deprecated"] if rank0 else []
        assert lines == expected
        log = OnceLogFilter(rank0)
        rec = logging.LogRecord("megatron.core.datasets", logging.WARNING, "f", 1, "m", None,
                                None)
        assert [log.filter(rec), log.filter(rec)] == [rank0, False]


@pytest.mark.slow
def test_filters_catch_megatron_core_import_warnings():
    """Installed before megatron-core is imported, its fallback warnings come out once."""
    code = ("import logging, warnings\n"
            "from megatron.training.observe.console import install_console_filters\n"
            "logging.basicConfig()\ninstall_console_filters(0)\n"
            "import megatron.core.optimizer\nimport megatron.core.models.gpt.gpt_layer_specs\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("UserWarning (megatron-core): ") for line in lines), lines
    assert len(lines) == len(set(lines)) and "warnings.warn(" not in proc.stderr


# --------------------------------------------------------------------------- guard
def test_descendants_follow_the_parent_links():
    procs = {10: ("S", 1, 10, 100), 11: ("S", 10, 10, 101), 12: ("S", 11, 10, 102),
             20: ("S", 1, 20, 103)}
    assert sorted(descendants(procs, 10)) == [(11, 101), (12, 102)]


def test_guard_kills_what_the_process_left_behind(tmp_path):
    """A process that starts a child (as megatron-core's checkpoint writer starts its
    Manager) and is then killed with SIGKILL: its guard ends the child, then itself."""
    script = tmp_path / "leaver.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from megatron.training.process_guard import start_guard\n"
        "start_guard()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        child = psutil.Process(int(proc.stdout.readline()))
        time.sleep(1.5)  # the guard records the child within POLL_S
        guards = [p for p in psutil.Process(proc.pid).children()
                  if "process_guard.py" in " ".join(p.cmdline())]
        assert len(guards) == 1
        proc.kill()
        proc.wait(timeout=10)
        gone, alive = psutil.wait_procs([child] + guards, timeout=10)
        assert not alive, [p.pid for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()


WORKER_SCRIPT = """
import functools, os, signal, sys, time
import torch
from megatron.training.process_guard import children_ignore_stop_signals, stop_with_the_rank

class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return torch.zeros(4)

with children_ignore_stop_signals():
    it = iter(torch.utils.data.DataLoader(
        Numbers(), batch_size=2, num_workers=1, persistent_workers=True,
        worker_init_fn=functools.partial(stop_with_the_rank, os.getpid())))
next(it)
worker = [p for p in __import__("multiprocessing").active_children()][0]
if sys.argv[1] == "group":   # from another process, as torchrun or Slurm sends it
    import subprocess
    subprocess.run(["kill", "-TERM", "--", f"-{os.getpgid(0)}"])
time.sleep(0.5)
next(it)   # a signal from anyone but the rank leaves the worker serving
print(worker.pid, flush=True)
try:
    raise RuntimeError("the rank leaves through an error, its iterator still referenced")
except RuntimeError as exc:
    kept = exc
"""


@pytest.mark.parametrize("first", ["none", "group"])
def test_a_rank_leaving_through_an_error_is_not_held_by_its_workers(tmp_path, first):
    """DataLoader workers started with SIGTERM blocked ignored the SIGTERM that
    multiprocessing's exit handler sends them and were joined with no timeout: the rank
    never exited. Now they obey the rank's own signal, and still ignore a group-wide one
    (what torchrun and Slurm send), which the rank handles."""
    import psutil

    script = tmp_path / "rank.py"
    script.write_text(WORKER_SCRIPT)
    # Its own session and group, ignoring SIGTERM itself as a rank with --save would.
    code = ("import signal, runpy, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"sys.argv = ['rank', '{first}']; runpy.run_path('{script}', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        worker = int(out.split()[0])
        assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == "zombie"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)


def test_a_stopped_rank_asked_to_terminate_is_killed_by_its_guard():
    """A rank stopped with SIGSTOP cannot act on torchrun's SIGTERM; its guard kills it
    once the signal has waited STOPPED_GRACE_S, saying so in one line."""
    from megatron.training.process_guard import STOPPED_GRACE_S

    # It handles SIGTERM (as a rank with --save does); a stopped process with SIGTERM's
    # default action would be killed by the kernel at once.
    code = ("import signal, time; from megatron.training.process_guard import start_guard; "
            "signal.signal(signal.SIGTERM, lambda *a: None); start_guard(); "
            "print('ready', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, RANK="5"))
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.5)   # sent together, SIGTERM (the lower number) is taken first
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        proc.wait(timeout=STOPPED_GRACE_S + 5)
        assert proc.returncode == -signal.SIGKILL
        assert time.monotonic() - t0 <= STOPPED_GRACE_S + 2
        assert "guard: rank 5 " in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)


def test_a_checkpoint_writer_that_dies_ends_the_wait_for_it():
    """megatron-core waits on a JoinableQueue for its forked writers with no timeout; a
    writer killed mid-write used to leave the rank waiting for ever."""
    ctx = mp.get_context("fork")
    count = ctx.JoinableQueue()
    count.put(0)
    t0 = time.monotonic()
    with pytest.raises(WriterDiedError, match=r"killed by signal 9 \(SIGKILL\) mid-write"):
        with writers_watched():
            writer = ctx.Process(target=lambda: (count.get(), os.kill(os.getpid(), 9)))
            writer.start()
            count.join()          # what megatron-core's write_preloaded_data_multiproc does
    assert time.monotonic() - t0 < 5
    writer.join()


def test_progress_is_idle_from_the_last_change_of_its_sample():
    p = Progress()
    assert p.idle_s(((0, (5, 100)),), 10.0) == 0
    assert p.idle_s(((0, (5, 100)),), 14.5) == 4.5
    assert p.idle_s(((0, (5, 101)),), 15.0) == 0       # one byte written: progress
    assert p.idle_s(((0, (5, 101)),), 20.0) == 5.0


def test_stall_bound_and_the_stuck_writer_named():
    assert stall_bound_s(10) == 300 and stall_bound_s(1) == 30
    assert stuck_text(1, [123], 99, 300.0) == (
        "rank 1's checkpoint writer process (pid 123, forked by pid 99) made no progress for "
        "300 s (no CPU time, no bytes written); it was killed")
    assert stuck_text(2, [123, 124], 99, 30).startswith(
        "rank 2's checkpoint writer processes (pid 123, 124, forked by pid 99)")
    assert stuck_text(2, [123, 124], 99, 30).endswith("; they were killed")
    assert stuck_text(0, [], 99, 0.5) == (
        "rank 0's checkpoint write (in its own process, pid 99) made no progress for 0.5 s "
        "(no CPU time, no bytes written)")


def test_a_checkpoint_writer_that_hangs_is_killed_and_ends_the_wait_for_it():
    """A forked writer that stops (here: sleeps) without marking its task done: after the
    bound the rank's wait ends with an error naming the writer, which is killed."""
    ctx = mp.get_context("fork")
    count = ctx.JoinableQueue()
    count.put(0)
    t0 = time.monotonic()
    with pytest.raises(WriterStuckError) as caught:
        with writers_watched(stall_s=1.0, rank=3):
            writer = ctx.Process(target=lambda: (count.get(), time.sleep(600)))
            writer.start()
            count.join()          # what megatron-core's write_preloaded_data_multiproc does
    took = time.monotonic() - t0
    assert 1.0 <= took < 5, took
    assert str(caught.value) == (
        f"rank 3's checkpoint writer process (pid {writer.pid}, forked by pid {os.getpid()}) "
        f"made no progress for 1 s (no CPU time, no bytes written); it was killed")
    writer.join(timeout=5)
    assert writer.exitcode == -signal.SIGKILL


# A helper process: a main thread that spins in bursts (what a Manager's once-a-second
# shutdown check can be charged as) and a serving thread that works only when told to.
_HELPER = """
import sys, threading, time

def serve():
    line = sys.stdin.readline()            # idle until told
    end = time.monotonic() + float(line)
    while time.monotonic() < end:
        sum(range(1000))

threading.Thread(target=serve).start()
print("ready", flush=True)
while True:
    end = time.monotonic() + 0.02
    while time.monotonic() < end:
        pass
    time.sleep(0.05)
"""


@pytest.mark.parametrize("serving_s", [0.0, 3.0])
def test_a_helper_counts_by_its_serving_threads_only(serving_s):
    """A write waiting on a helper process (megatron-core's results-queue Manager): the
    helper's main thread keeps waking (a Manager checks once a second whether to stop), which
    is not progress, so a write that waits on an idle helper is stuck after the bound; work
    in its serving thread (unpickling the writers' results) is progress."""
    helper = subprocess.Popen([sys.executable, "-c", _HELPER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert helper.stdout.readline() == "ready\n"
        assert serving_work(helper.pid)[2] == 1        # the serving thread alone
        t0 = time.monotonic()
        helper.stdin.write(f"{serving_s}\n")
        helper.stdin.flush()
        if serving_s:
            with writers_watched(stall_s=1.0, helpers=[helper.pid]):
                time.sleep(serving_s - 0.5)     # waits on the helper, which works throughout
        else:
            with pytest.raises(WriterStuckError):
                with writers_watched(stall_s=1.0, helpers=[helper.pid]):
                    time.sleep(30)
            assert time.monotonic() - t0 < 5
    finally:
        helper.kill()
        helper.wait()
    assert serving_work(helper.pid) is None


def test_a_slow_writer_that_keeps_writing_is_not_stuck(tmp_path):
    """Progress is work done, not completion: a writer that writes a byte every 0.3 s for
    three times the bound finishes undisturbed."""
    path = str(tmp_path / "shard")

    def slow():
        with open(path, "wb", buffering=0) as f:
            for _ in range(10):
                f.write(b"x")
                time.sleep(0.3)

    ctx = mp.get_context("fork")
    with writers_watched(stall_s=1.0, files=[path]):
        writer = ctx.Process(target=slow)
        writer.start()
        writer.join()
    assert writer.exitcode == 0 and os.path.getsize(path) == 10


_UNINTERRUPTIBLE = """
import signal, time
from megatron.training.checkpoint import writer_watch

writer_watch.GRACE_S = 0.5
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})   # as in a call deaf to signals
with writer_watch.writers_watched(stall_s=1.0, rank=2,
                                  last_words=lambda exc: f"x.py: error: {exc}"):
    time.sleep(60)
print("not reached")
"""


def test_a_stuck_write_that_cannot_be_interrupted_ends_the_process_in_one_line():
    proc = subprocess.run([sys.executable, "-c", _UNINTERRUPTIBLE], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stdout == ""
    assert re.fullmatch(r"x\.py: error: rank 2's checkpoint write \(in its own process, pid "
                        r"\d+\) made no progress for 1 s \(no CPU time, no bytes written\)\n",
                        proc.stderr), proc.stderr[-3000:]


_WRITES = """
import json, os, sys, time

import psutil
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from megatron.training.checkpoint import shard_writer
from megatron.training.checkpoint.writer_watch import WriterStuckError
from megatron.training.cpu_shims import apply_cpu_shims

apply_cpu_shims()
root, port = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
forks = []
os.register_at_fork(before=lambda: forks.append(1))


def state():
    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(20000.0)),
            "b": ShardedTensor.from_rank_offsets("b", torch.ones(3000))}


def request(name):
    path = os.path.join(root, name)
    os.makedirs(path)
    return path, dist_checkpointing.save(state(), path, async_sharded_save=True)


out = {"pid": os.getpid()}
path, req = request("own")
forks.clear()
shard_writer.run(req, own_process=True, stall_s=30.0)
out["own_forks"] = len(forks)
loaded = dist_checkpointing.load(state(), path)
out["own_loads"] = bool(torch.equal(loaded["w"], torch.arange(20000.0))
                        and torch.equal(loaded["b"], torch.ones(3000)))

path, req = request("forked")
helpers = {p.pid for p in psutil.Process().children()}   # the writer's Manager
FileSystemWriterAsync.write_preloaded_data = staticmethod(lambda *a, **k: time.sleep(600))
t0 = time.monotonic()
try:
    shard_writer.run(req, own_process=False, stall_s=1.0)
except WriterStuckError as exc:
    out["error"] = str(exc)
out["took"] = time.monotonic() - t0
time.sleep(0.5)
out["left"] = [p.pid for p in psutil.Process().children()
               if p.pid not in helpers and p.status() != psutil.STATUS_ZOMBIE]
print(json.dumps(out))
"""


def test_the_cpu_save_forks_no_writer_and_a_hung_forked_writer_is_named(tmp_path):
    """megatron-core's save request run by shard_writer at one gloo rank: in the rank's own
    process it forks nothing and writes a checkpoint that loads; with megatron-core's forked
    writers (the GPU path), writers made to hang are killed and named after the bound."""
    from tests.helpers import free_port

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", _WRITES, str(tmp_path), str(free_port())],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["own_forks"] == 0 and out["own_loads"], out
    assert re.fullmatch(rf"rank 0's checkpoint writer process(es)? \(pid [\d, ]+, forked by pid "
                        rf"{out['pid']}\) made no progress for 1 s \(no CPU time, no bytes "
                        rf"written\); (it was|they were) killed", out["error"]), out
    assert 1.0 <= out["took"] < 10 and out["left"] == [], out


_HUNG_SAVE = """
import json, os, sys, time

import psutil
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from megatron.training.checkpoint import save_load
from megatron.training.cli.arguments import parse_args
from megatron.training.loop import pretrain

root, tiny = sys.argv[1], json.loads(sys.argv[2])
flags = tiny + ["--save", root, "--load", root]
pretrain(parse_args(flags))
helpers = {p.pid for p in psutil.Process().children()}   # the writer's Manager
write = FileSystemWriterAsync.write_preloaded_data
FileSystemWriterAsync.write_preloaded_data = staticmethod(lambda *a, **k: time.sleep(600))
save_load.stall_bound_s = lambda minutes: 1.0
out = {"pid": os.getpid()}
t0 = time.monotonic()
try:
    pretrain(parse_args(flags + ["--train-iters", "2"]))
except save_load.CheckpointSaveError as exc:
    out.update(error=str(exc), primary=exc.primary, status=exc.exit_status)
out["took"] = time.monotonic() - t0
out["left"] = [p.pid for p in psutil.Process().children()
               if p.pid not in helpers and p.status() != psutil.STATUS_ZOMBIE]
out["after"] = sorted(os.listdir(root))
out["intact"] = save_load.intact_problem(os.path.join(root, "iter_0000001"))
FileSystemWriterAsync.write_preloaded_data = write
out["resumed_from"] = pretrain(parse_args(flags + ["--train-iters", "2"])).loaded_from
print(json.dumps(out))
"""


def test_a_save_whose_write_hangs_fails_in_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """A checkpoint write that makes no progress (here: a writer that sleeps) ends the save
    after the bound with the failed save's one line, naming the rank and its pid; nothing
    of the failed save is left, the last checkpoint stays intact and the resume the line
    advises works."""
    root = str(tmp_path / "ckpt")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", _HUNG_SAVE, root, json.dumps(_TINY)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.get("error") == (
        f"saving iteration 2 to {root}/iter_0000002 failed: WriterStuckError: rank 0's "
        f"checkpoint write (in its own process, pid {out['pid']}) made no progress for 1 s (no "
        f"CPU time, no bytes written). Nothing was published: the last complete checkpoint, "
        f"{root}/iter_0000001, is intact and --load {root} resumes from it."), out
    assert out["primary"] and out["status"] == 1 and out["took"] < 60, out
    assert out["left"] == [] and out["intact"] is None, out
    assert out["after"] == ["iter_0000001", "latest_checkpointed_iteration.txt",
                            "metrics.jsonl"], out
    assert out["resumed_from"] == f"{root}/iter_0000001", out


def test_launcher_names_the_rank_that_ended_the_job():
    """torchrun's own "first failure" compares whole seconds; the killed rank, not one
    that lost it or that torchrun stopped, is named."""
    from megatron.training.launch import failure_line
    from megatron.training.peer_faults import PEER_LOST_STATUS

    lost, term = PEER_LOST_STATUS, -signal.SIGTERM
    line, status = failure_line("p.py", {0: (lost, 10.0), 1: (term, 10.0), 2: (-9, 10.0),
                                         3: (lost, 10.0)})
    assert "rank 2 was killed by signal 9 (SIGKILL) first" in line and status == 1
    assert "rank(s) 0, 1, 3 stopped after it" in line
    line, status = failure_line("p.py", {0: (2, 11.0), 1: (term, 11.0)})
    assert "rank 0 exited with status 2 first" in line and status == 2
    line, status = failure_line("p.py", {1: (lost, 12.0), 3: (lost, 12.0)})
    assert "rank(s) 1, 3 lost contact with another rank" in line and status == 1


def test_peer_failures_are_told_from_other_errors():
    from megatron.training.peer_faults import peer_failure_text, peer_lost

    gloo = RuntimeError("[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                        "60000ms for recv operation to complete")
    assert peer_failure_text(gloo) == "Timed out waiting 60000ms for recv operation to complete"
    reset = RuntimeError("[/x/pair.cc:537] Read error [127.0.0.1]:35766: Connection reset by "
                         "peer. This is typically caused by a remote worker hanging")
    assert peer_failure_text(reset) == "Read error [127.0.0.1]:35766: Connection reset by peer"
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = gloo
    assert peer_failure_text(wrapped) is not None
    assert peer_failure_text(RuntimeError("shape mismatch")) is None
    lost = peer_lost(gloo, 3, 1)
    assert lost.exit_status == 3 and str(lost).startswith("rank 3 lost contact")
    assert "--distributed-timeout-minutes 1" in str(lost)


# --------------------------------------------------------------------------- launcher
def test_busy_master_port_is_named():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        problem = port_problem("localhost", port)
    assert problem and f"--master-port {port} (MASTER_PORT) is already in use" in problem
    assert "MASTER_PORT=" in problem
    assert port_problem("localhost", port) is None  # released: free again


# --------------------------------------------------------------------------- resume: optimizer
@pytest.mark.parametrize("saved,now,fix", [
    # fp32 buffer saved (the default under --bf16), resumed with the opt-out
    ({"bf16": True, "accumulate_allreduce_grads_in_fp32": True},
     {"bf16": True, "accumulate_allreduce_grads_in_fp32": False}, "drop --grad-reduce-in-bf16"),
    # a checkpoint of the old default (bf16 accumulation), resumed with the new default
    ({"bf16": True}, {"bf16": True, "accumulate_allreduce_grads_in_fp32": True},
     "add --grad-reduce-in-bf16"),
    ({"bf16": False}, {"bf16": True, "accumulate_allreduce_grads_in_fp32": True}, "drop --bf16"),
])
def test_another_grad_buffer_dtype_is_refused_by_name(saved, now, fix):

    from megatron.training.checkpoint.save_load import (  # megatron-core on first use
        CheckpointError,
        _check_optimizer_compatible,
    )

    saved = dict(saved, use_distributed_optimizer=True)
    current = dict(use_distributed_optimizer=True, **now)
    with pytest.raises(CheckpointError, match="--no-load-optim") as err:
        _check_optimizer_compatible(saved, current, "ckpt")
    assert fix in str(err.value) and "gradient buffers" in str(err.value)


def test_the_same_grad_buffer_dtype_loads():

    from megatron.training.checkpoint.save_load import (
        _check_optimizer_compatible,  # megatron-core on first use
    )

    for values in ({"bf16": True, "accumulate_allreduce_grads_in_fp32": True},
                   {"bf16": True, "accumulate_allreduce_grads_in_fp32": False},
                   {"bf16": False, "accumulate_allreduce_grads_in_fp32": False},
                   {"bf16": False, "accumulate_allreduce_grads_in_fp32": True}):
        _check_optimizer_compatible(dict(values, use_distributed_optimizer=True),
                                    dict(use_distributed_optimizer=True, **values),
                                    "ckpt")
    # fp32 training: the flag does not change the buffer, old or new checkpoints alike
    _check_optimizer_compatible({"use_distributed_optimizer": True, "bf16": False},
                                dict(use_distributed_optimizer=True, bf16=False,
                                     accumulate_allreduce_grads_in_fp32=True),
                                "ckpt")


# --------------------------------------------------------------------------- room to save
_TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
         "--vocab-size", "500", "--num-workers", "0", "--eval-iters", "0",
         "--save-interval", "1"]
_LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
          "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "2",
          "--untie-embeddings-and-output-weights"]


def _tensor_bytes(path):
    """The tensor payload of a saved checkpoint, from its DCP metadata."""
    import math

    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    return sum(math.prod(m.size) * m.properties.dtype.itemsize
               for m in meta.values() if hasattr(m, "size"))


_SAVES = """
import json, os, sys
from megatron.core import dist_checkpointing
from megatron.training.checkpoint import faults
from megatron.training.checkpoint.room import checkpoint_bytes
from megatron.training.cli.arguments import ArgumentsError, parse_args, validate_args
from megatron.training.loop import pretrain

root, tiny, runs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = []
for i, extra in enumerate(runs):
    args = parse_args(tiny + extra + ["--save", os.path.join(root, str(i))])
    pretrain(args)
    path = os.path.join(root, str(i), "iter_0000001")
    padded = dist_checkpointing.load_common_state_dict(path)["args"]["padded_vocab_size"]
    config = validate_args(args, 1, cuda_available=False).with_padded_vocab(padded)
    out.append([extra, checkpoint_bytes(config), path, faults.directory_bytes(path)])
faults.free_bytes = lambda path: out[-1][1] - 1
try:
    pretrain(parse_args(tiny + runs[-1] + ["--save", os.path.join(root, "full")]))
except ArgumentsError as exc:
    out.append(str(exc))
print(json.dumps(out))
"""


def test_room_for_one_checkpoint_is_known_from_the_flags_and_checked(tmp_path):
    """The estimate equals the tensor bytes of real tiny checkpoints (plain and distributed
    optimizer; GPT and Llama-style flags); a --save without that room is refused at
    start-up naming the need and the free space, before anything is trained."""
    import json

    runs = [[], ["--use-distributed-optimizer"], _LLAMA,
            _LLAMA + ["--use-distributed-optimizer"]]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", _SAVES, str(tmp_path), json.dumps(_TINY),
                           json.dumps(runs)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *saves, refusal = json.loads(proc.stdout.strip().splitlines()[-1])
    for extra, need, path, on_disk in saves:
        assert need == _tensor_bytes(path), (extra, need, _tensor_bytes(path))
        assert need <= on_disk <= 1.2 * need, (extra, need, on_disk)
    assert re.fullmatch(r"--save \S+: one checkpoint of this model needs about .* MiB "
                        r"\(weights and optimizer state\) and \S+ has .* MiB free; .*", refusal)
    assert not os.path.exists(tmp_path / "full" / "iter_0000001")


def test_room_message_names_need_and_free():
    from megatron.training.checkpoint.room import room_problem

    assert room_problem("/ckpt", 10 << 30, 10 << 30) is None
    assert room_problem("/ckpt", 10 << 30, None) is None
    msg = room_problem("/ckpt", 12 << 30, 3 << 30)
    assert msg == ("--save /ckpt: one checkpoint of this model needs about 12.00 GiB (weights "
                   "and optimizer state) and /ckpt has 3.00 GiB free; free 9.00 GiB there or "
                   "pass --save on a disk with room")


def test_a_silent_failing_rank_waits_for_torchrun_but_no_longer():
    """A rank other than 0 that leaves rank 0 to print the error waits for torchrun's
    SIGTERM (rank 0 has printed and exited by then), and returns at once on it."""
    code = ("import time; from megatron.training.exit_paths import leave_the_message_to_rank_0; "
            "print('waiting', flush=True); t = time.monotonic(); "
            "leave_the_message_to_rank_0(); print(round(time.monotonic() - t, 1), flush=True)")
    env = dict(os.environ, TORCHELASTIC_RUN_ID="x", WORLD_SIZE="4", RANK="1")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "waiting"
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0 and float(out) < 3.0


ORPHAN_SCRIPT = """
import multiprocessing as mp, os, sys, time
from megatron.training.process_guard import quiet_once_the_rank_is_gone

def worker(rank_pid, marks):
    sys.excepthook = quiet_once_the_rank_is_gone(rank_pid, sys.excepthook)
    while os.getppid() == rank_pid:
        time.sleep(0.01)
    with open(marks, "a") as f:
        f.write("before ")
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError:
        sys.excepthook(*sys.exc_info())   # what multiprocessing's resource_sharer does
    with open(marks, "a") as f:
        f.write("after")

p = mp.get_context("fork").Process(target=worker, args=(os.getpid(), sys.argv[1]))
p.start()
os._exit(0)   # the rank is gone, its worker still running
"""


def test_a_worker_whose_rank_is_gone_ends_quietly(tmp_path):
    """A DataLoader worker's error reported after its rank was killed (multiprocessing's
    resource_sharer thread, connection reset) printed a traceback into the job's output;
    now the worker ends without one."""
    script, marks = tmp_path / "rank.py", tmp_path / "marks"
    script.write_text(ORPHAN_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(marks)], capture_output=True,
                          text=True, timeout=60)   # returns once the worker closed the pipes
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marks.read_text() == "before ", proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_worker_error_while_the_rank_lives_is_reported(monkeypatch):
    """While the rank is alive the hook hands the exception on (and does not exit)."""
    from megatron.training import process_guard

    monkeypatch.setattr(process_guard, "RANK_GONE_WAIT_S", 0.1)
    seen = []
    hook = process_guard.quiet_once_the_rank_is_gone(os.getppid(), lambda *a: seen.append(a))
    exc = ConnectionResetError(104, "Connection reset by peer")
    hook(type(exc), exc, None)
    assert seen == [(type(exc), exc, None)]
    assert not process_guard.rank_gone(os.getppid())
