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
import os
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
