"""``--record-memory-history``'s summary: the peak of a synthetic allocation trace and what
is alive at it (the recording itself needs CUDA and is exercised on the GPU machine)."""

from __future__ import annotations

import pickle

import pytest
import torch

from megatron.training.cli.arguments import ArgumentsError, parse_args, validate_args
from megatron.training.observe import memory_snapshot as ms
from tests.helpers import tiny_gpt_flags


def _frame(path, name, line=1):
    return {"filename": path, "name": name, "line": line}


ATTN = [_frame("/x/megatron/usp/kernels.py", "_cudnn_forward", 3)]
MLP = [_frame("/y/site-packages/torch/nn/functional.py", "silu"),
       _frame("/y/site-packages/megatron/core/transformer/mlp.py", "forward", 9)]
OPT = [_frame("/y/site-packages/megatron/core/optimizer/optimizer.py", "step", 5)]


def _snapshot():
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": OPT},
        {"action": "alloc", "addr": 2, "size": 50, "frames": ATTN},
        {"action": "alloc", "addr": 3, "size": 30, "frames": MLP},     # peak: 180
        {"action": "free_requested", "addr": 2, "size": 50, "frames": ATTN},
        {"action": "free_completed", "addr": 2, "size": 50, "frames": ATTN},
        {"action": "alloc", "addr": 4, "size": 40, "frames": MLP},     # 170
    ]
    segments = [{"address": 0, "blocks": [
        {"size": 1, "state": "inactive"},
        {"size": 100, "state": "active_allocated"},     # addr 1: traced
        {"size": 7, "state": "active_allocated"},       # addr 101: not in the trace
    ]}]
    return {"device_traces": [trace], "segments": segments}


def test_peak_and_what_is_alive_there():
    s = ms.summarize(_snapshot())
    assert s["peak_bytes"] == 180 and s["peak_index"] == 2 and s["events"] == 6
    assert dict(s["by_category"]) == {"optimizer state": 100, "attention": 50, "MLP": 30}
    sites = {site: (cat, b, n) for site, cat, b, n in s["by_site"]}
    assert sites["megatron/usp/kernels.py:3 _cudnn_forward"] == ("attention", 50, 1)
    assert sites["megatron/core/transformer/mlp.py:9 forward"] == ("MLP", 30, 1)
    assert s["untracked_bytes"] == 7
    text = ms.format_summary(s)
    assert "peak of traced allocations" in text and "[attention]" in text


def test_cli_reads_a_pickle(tmp_path, capsys):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot()))
    assert ms.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "top 2 allocation sites" in out and out.count("[") == 2


def test_per_rank_path_and_cpu_is_off():
    assert ms.snapshot_path_for_rank("/a/snap.pickle", 3) == "/a/snap.rank3.pickle"

    history = ms.MemoryHistory(True, 2, "/tmp/s{seq_length}.pickle", 4096, 0,
                               torch.device("cpu"))
    assert not history.enabled and not history.after(2)
    assert history.path == "/tmp/s4096.rank0.pickle"


def test_the_flag_is_refused_on_the_cpu():
    base = tiny_gpt_flags(llama=False, train_iters=3, lr="1e-3", mock_data=True,
                          vocab_size=1000)
    with pytest.raises(ArgumentsError, match="--record-memory-history"):
        validate_args(parse_args(base + ["--record-memory-history"]), 1, cuda_available=False)
    with pytest.raises(ArgumentsError, match="--memory-snapshot-iteration"):
        validate_args(parse_args(base + ["--record-memory-history",
                                         "--memory-snapshot-iteration", "9"]), 1,
                      cuda_available=True)
