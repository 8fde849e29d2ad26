"""``--profile``: flag validation, the iteration window, and the files a real run writes."""

import json
import os

import pytest
import torch

from megatron.training.cli.arguments import ArgumentsError, parse_args, validate_args
from megatron.training.observe.profiling import StepProfiler
from tests.helpers import tiny_gpt_flags

BASE = tiny_gpt_flags(llama=False, num_attention_heads=8, train_iters=6, lr="1e-3",
                      mock_data=True, vocab_size=1000, num_workers=0, eval_iters=0,
                      global_batch_size=4)


def _valid(extra, world=2):
    return validate_args(parse_args(BASE + extra), world, cuda_available=False)


@pytest.mark.parametrize("extra, flag", [
    (["--profile-step-start", "0"], "--profile-step-start 0"),
    (["--profile-step-start", "4", "--profile-step-end", "4"], "--profile-step-end 4"),
    (["--profile-step-start", "7", "--profile-step-end", "9"], "--train-iters 6"),
    (["--profile-step-start", "2", "--profile-ranks", "0", "2"], "--profile-ranks 2"),
])
def test_bad_profile_flags_name_the_flag(extra, flag):
    with pytest.raises(ArgumentsError) as e:
        _valid(["--profile"] + extra)
    msg = str(e.value)
    assert flag in msg and ("e.g." in msg or "pick" in msg), msg


def test_profile_defaults():
    config = _valid(["--profile", "--train-iters", "20"])
    args = config.args
    assert (args.profile_step_start, args.profile_step_end, args.profile_ranks) == (10, 12, [0])
    assert config.profile_dir == "profile"
    config = _valid(["--profile", "--tensorboard-dir", "/tb", "--profile-step-start", "2",
                     "--profile-step-end", "4"])
    assert config.profile_dir == os.path.join("/tb", "profile")
    # without --profile nothing is checked or filled in
    assert _valid(["--profile-step-start", "0"]).profile_dir is None


def test_window_and_ranks(tmp_path):
    config = _valid(["--profile", "--profile-step-start", "2", "--profile-step-end", "4",
                     "--profile-dir", str(tmp_path)])
    args = config.args

    def profiler(rank):
        return StepProfiler(rank in args.profile_ranks, args.profile_step_start,
                            args.profile_step_end, config.profile_dir, rank=rank,
                            device=torch.device("cpu"))

    idle, prof = profiler(1), profiler(0)
    for it in range(1, 7):
        for p in (idle, prof):
            p.before(it)
        torch.ones(8).sum()
        assert (prof._prof is not None) == (it in (2, 3)), it
        for p in (idle, prof):
            p.after(it)
    assert idle.written is None and prof.written == f"{tmp_path}/rank0_iters2-3"
    assert sorted(os.listdir(tmp_path)) == ["rank0_iters2-3.json", "rank0_iters2-3.txt"]


def _profiled_run(rank, world_size, out_dir):
    from megatron.training.loop import pretrain  # megatron-core on first use

    args = parse_args(BASE + ["--profile", "--profile-step-start", "3", "--profile-step-end",
                              "5", "--profile-ranks", "0", "1", "--profile-dir", out_dir,
                              "--ring-degree", "2"])
    result = pretrain(args)
    assert result.iteration == 6


def test_a_training_run_writes_one_profile_per_rank(dist_run, tmp_path):
    dist_run(_profiled_run, 2, str(tmp_path), timeout=180)
    names = sorted(os.listdir(tmp_path))
    assert names == [f"rank{r}_iters3-4.{ext}" for r in (0, 1) for ext in ("json", "txt")]
    table = (tmp_path / "rank0_iters3-4.txt").read_text()
    assert "ProfilerStep" not in table and "Self CPU" in table
    trace = json.loads((tmp_path / "rank1_iters3-4.json").read_text())
    assert trace["traceEvents"]
