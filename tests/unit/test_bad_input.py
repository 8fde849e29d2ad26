"""Bad input fails at start-up, on every rank alike, with a message naming the flag.

* Conflicting or impossible flags and world-size mismatches: ``validate_args`` (pure, run
  by every rank before any process group is created) raises; checked here directly, and
  through ``pretrain`` on 2 gloo ranks, which must both raise without hanging.
* An unreadable ``--load`` (missing directory, no tracker, corrupt tracker, tracker naming
  a missing or incomplete directory, truncated data file): rank 0 decides, every rank
  raises the same ``CheckpointError``.
* A NaN loss stops the run with a message naming the iteration, on every rank; with
  ``--skip-nan-steps`` that step is skipped (no optimizer or scheduler step) and the run
  goes on.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron.training.checkpoint import checksums
from megatron.training.cli.arguments import ArgumentsError, parse_args, validate_args
from megatron.training.cli.output_paths import check_output_paths
from megatron.training.data import batch
from megatron.usp.parallel_dims import USPConfigError
from tests.helpers import tiny_gpt_flags

BASE = tiny_gpt_flags(llama=False, train_iters=5, lr="1e-3", mock_data=True, vocab_size=512)

# (extra flags, world size, flag the message must name)
BAD = [
    (["--num-query-groups", "2"], 4, "--group-query-attention"),
    (["--group-query-attention"], 4, "--num-query-groups"),
    (["--group-query-attention", "--num-query-groups", "3"], 4, "--num-query-groups"),
    (["--ulysses-degree", "3"], 4, "world size"),
    (["--ulysses-degree", "2", "--ring-degree", "2", "--tensor-model-parallel-size", "2"], 4,
     "world size"),
    (["--ulysses-degree", "8"], 8, "--ulysses-degree"),
    (["--ulysses-degree", "2", "--ring-degree", "2", "--seq-length", "60"], 4, "--seq-length"),
    (["--context-parallel-size", "2", "--ulysses-degree", "2", "--ring-degree", "2"], 4,
     "--context-parallel-size"),
    (["--ulysses-degree", "auto"], 4, "--ring-degree auto"),
    (["--ulysses-degree", "0"], 4, "--ulysses-degree"),
    (["--global-batch-size", "6"], 4, "--global-batch-size"),
    (["--micro-batch-size", "0"], 4, "--micro-batch-size"),
    (["--pipeline-model-parallel-size", "4", "--num-layers", "6"], 4, "--num-layers"),
    (["--bf16"], 4, "--bf16"),
    (["--device", "cuda"], 4, "--device"),
    (["--attention-dropout", "0.1"], 4, "--attention-dropout"),
    (["--min-lr", "1e-2"], 4, "--min-lr"),
    (["--lr-warmup-iters", "5"], 4, "--lr-warmup-iters"),
    (["--lr-decay-style", "WSD"], 4, "--lr-wsd-decay-iters"),
    (["--recompute-granularity", "full"], 4, "--recompute-method"),
    (["--recompute-method", "uniform"], 4, "--recompute-granularity"),
    (["--save-interval", "10"], 4, "--save"),
    (["--ckpt-step", "3"], 4, "--load"),
    (["--finetune"], 4, "--load"),
    (["--data-path", "/x"], 4, "--mock-data"),
    (["--overlap-param-gather"], 4, "--overlap-param-gather"),
    (["--max-position-embeddings", "32"], 4, "--max-position-embeddings"),
    (["--peak-tflops", "0"], 4, "--peak-tflops"),
    (["--exit-duration-in-mins", "0"], 4, "--exit-duration-in-mins 0.0 must be > 0, e.g."),
    (["--exit-duration-in-mins", "nan"], 4, "--exit-duration-in-mins nan must be > 0"),
    (["--distributed-timeout-minutes", "0"], 4,
     "--distributed-timeout-minutes 0 must be > 0, e.g. --distributed-timeout-minutes 10"),
    (["--distributed-timeout-minutes", "-1"], 4, "--distributed-timeout-minutes -1 must be > 0"),
    # 2*U*R = 4 divides 68, but each CP rank's 34 tokens do not split over TP 4.
    (["--tensor-model-parallel-size", "4", "--ulysses-degree", "2", "--num-attention-heads",
      "8", "--sequence-parallel", "--seq-length", "68"], 8, "try --seq-length 64 or 72"),
    # --lr 0 trains nothing; a negative value reaches
    # validation (argparse alone reads "-1e-3" as a flag); no validation data for --eval-iters.
    (["--lr", "0"], 4, "--lr 0.0 must be > 0"),
    (["--lr", "-1e-3"], 4, "--lr -0.001 must be > 0"),
    (["--min-lr", "-1e-5"], 4, "--min-lr -1e-05 must be >= 0"),
    (["--split", "100,0,0"], 4, "--eval-iters 0"),
    # A kernel package that is missing is found before any process group.
    (["--attention-backend", "flash-attn"], 4, "--attention-backend flash-attn needs a CUDA"),
    # Float8: TransformerEngine's recipes, rowwise with e5m2 gradients, float8 on the CPU.
    (["--fp8-format", "hybrid", "--fp8-recipe", "delayed"], 4,
     "--fp8-recipe delayed is TransformerEngine's recipe"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"], 4, "pass --fp8-format e4m3"),
    (["--fp8-format", "hybrid"], 4, "add --fp8-emulate"),
    (["--fp8-emulate"], 4, "--fp8-emulate needs --fp8-format"),
]


@pytest.mark.parametrize("extra,world,flag", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_flags_name_the_flag(extra, world, flag):
    with pytest.raises((ArgumentsError, USPConfigError)) as info:
        validate_args(parse_args(BASE + extra), world, cuda_available=False)
    assert flag in str(info.value), str(info.value)


def test_split_without_validation_is_fine_without_eval():
    config = validate_args(parse_args(BASE + ["--split", "100,0,0", "--eval-iters", "0"]), 4,
                           cuda_available=False)
    assert config.args.split == "100,0,0"


def test_missing_backend_package_on_gpu_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith(("flash_attn",
                                                                  "transformer_engine"))
                        else real(name, *a))
    for name, hint in (("flash-attn", "pip install flash-attn"), ("te", "transformer-engine")):
        with pytest.raises(ArgumentsError, match=f"--attention-backend {name}: .*{hint}"):
            validate_args(parse_args(BASE + ["--attention-backend", name]), 4,
                          cuda_available=True)


def test_missing_torchao_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ArgumentsError, match="--fp8-format .*pip install torchao"):
        validate_args(parse_args(BASE + ["--fp8-format", "hybrid", "--fp8-emulate"]), 4,
                      cuda_available=False)


def test_output_paths_are_checked(tmp_path):
    """--save naming a file, or under a file, fails at start-up naming the flag."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for flags, match in ((["--save", str(a_file)], "--save: .* is not a directory"),
                         (["--save", str(a_file / "sub")], "--save: .* is not writable"),
                         (["--metrics-file", str(a_file / "m.jsonl")],
                          "--metrics-file: .* is not a directory .the folder of"),
                         (["--metrics-file", str(tmp_path)], "--metrics-file .* is a directory")):
        args = validate_args(parse_args(BASE + flags), 1, cuda_available=False)
        with pytest.raises(ArgumentsError, match=match):
            check_output_paths(args)
    ok = validate_args(parse_args(BASE + ["--save", str(tmp_path / "new" / "ckpt")]), 1,
                       cuda_available=False)
    check_output_paths(ok)
    assert (tmp_path / "new" / "ckpt").is_dir() and not list((tmp_path / "new" / "ckpt").iterdir())


def test_usage_errors_print_on_rank_0_only(monkeypatch, capsys):
    """Every rank parses the same command line; only rank 0 says what is wrong."""
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as info:
            parse_args(BASE + ["--ulysses-degree", "two"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert ("--ulysses-degree" in err) is printed, err


def test_help_needs_neither_torch_nor_megatron_core():
    """--help is fast because it imports only the argument module."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import runpy, sys; sys.argv = ['pretrain_gpt.py', '--help']\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "bad = [m for m in ('torch', 'megatron.core') if m in sys.modules]\n"
            "assert not bad, bad\nprint('HELP-OK')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "HELP-OK" in proc.stdout, proc.stderr[-2000:]
    assert "--ulysses-degree" in proc.stdout


def test_missing_required_flags_are_listed():
    with pytest.raises(ArgumentsError, match="--num-layers.*--hidden-size"):
        validate_args(parse_args(["--lr", "1e-3", "--train-iters", "3"]), 1,
                      cuda_available=False)
    with pytest.raises(ArgumentsError, match="--lr"):
        validate_args(parse_args([a for a in BASE if a not in ("--lr", "1e-3")]), 1,
                      cuda_available=False)


def test_tokenizer_model_without_data_path():
    argv = [a for a in BASE if a not in ("--mock-data",)] + ["--tokenizer-model", "/t.model"]
    with pytest.raises(ArgumentsError, match="--data-path"):
        validate_args(parse_args(argv), 1, cuda_available=False)


@pytest.mark.parametrize("argv_tail", [["--data-path", ""], ["--data-path", "--split", "99,1,0"],
                                       ["--data-path", " ", "--tokenizer-model", "t.model"]],
                         ids=["empty-string", "followed-by-a-flag", "blank"])
def test_empty_data_path_is_refused(argv_tail):
    """An unset shell variable after --data-path must not train on the default corpus."""
    argv = [a for a in BASE if a not in ("--mock-data",)] + argv_tail
    with pytest.raises(ArgumentsError, match="--data-path was given no prefix.*drop --data-path"):
        validate_args(parse_args(argv), 1, cuda_available=False)


def test_missing_data_prefix_names_its_files_before_the_tokenizer(tmp_path):
    from megatron.training.cli.input_paths import check_input_paths
    from megatron.training.data.errors import DataConfigError

    prefix = str(tmp_path / "corpus_text_document")
    argv = [a for a in BASE if a not in ("--mock-data",)] + ["--data-path", prefix]
    config = validate_args(parse_args(argv), 1, cuda_available=False)
    with pytest.raises(DataConfigError, match=f"missing {prefix}.idx and {prefix}.bin"):
        check_input_paths(config)
    for ext in (".idx", ".bin"):
        (tmp_path / f"corpus_text_document{ext}").write_bytes(b"")
    with pytest.raises(ArgumentsError, match="--data-path needs --tokenizer-model"):
        check_input_paths(config)


@pytest.mark.slow
def test_command_line_reports_one_error_line():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, os.path.join(root, "pretrain_gpt.py")] + BASE
                          + ["--ulysses-degree", "3"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2
    assert "pretrain_gpt.py: error: world size 1 is not divisible" in proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- on ranks
def _bad_flags_on_ranks(rank, world_size):
    from megatron.training.loop import pretrain  # megatron-core on first use

    for extra, kind, flag in (
        (["--ulysses-degree", "3"], USPConfigError, "world size"),
        (["--num-attention-heads", "6", "--ulysses-degree", "4", "--hidden-size", "96"],
         USPConfigError, "--ulysses-degree"),
        (["--global-batch-size", "3"], ArgumentsError, "--global-batch-size"),
        # 65 tokens do not split over TP 2 (sequence parallelism).
        (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "65"],
         ArgumentsError, "--sequence-parallel: the 65 tokens.*try --seq-length 64 or 66"),
    ):
        with pytest.raises(kind, match=flag):
            pretrain(parse_args(BASE + ["--num-workers", "0"] + extra))


def test_bad_flags_fail_on_every_rank_without_hanging(dist_run):
    dist_run(_bad_flags_on_ranks, 2, timeout=120)


def _fake_complete_checkpoint(path, with_checksums=False):
    """A complete checkpoint directory as far as the file checks go: a real PyTorch DCP
    save (.metadata and data files) plus megatron-core's metadata.json and common.pt
    (and, ``with_checksums``, the manifest save_checkpoint writes)."""
    os.makedirs(path)
    dcp.save({"w": torch.arange(1000, dtype=torch.float32)}, checkpoint_id=path, no_dist=True)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    torch.save({"iteration": 3}, os.path.join(path, "common.pt"))
    if with_checksums:
        checksums.write_manifest(path, checksums.hash_files(path,
                                                            checksums.checkpoint_files(path)))


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _bad_load_on_ranks(rank, world_size, root):
    from megatron.training.checkpoint.save_load import (
        CheckpointError,
        iteration_dir,
        locate_checkpoint_on_all_ranks,
    )  # megatron-core on first use
    from megatron.training.loop import pretrain  # megatron-core on first use

    def args(load, save=None, step=None):
        return parse_args(BASE + ["--load", load] + (["--save", save] if save else [])
                          + (["--ckpt-step", str(step)] if step is not None else []))

    def locate(a):
        return locate_checkpoint_on_all_ranks(a.load, a.save, a.ckpt_step)

    cases = {}
    if rank == 0:
        good = os.path.join(root, "good")
        _fake_complete_checkpoint(iteration_dir(good, 3))
        write_tracker_args = (good, 3)
        from megatron.training.checkpoint.save_load import (
            write_tracker,  # megatron-core on first use
        )

        write_tracker(*write_tracker_args)
        empty = os.path.join(root, "empty")
        os.makedirs(empty)
        garbage = os.path.join(root, "garbage")
        os.makedirs(garbage)
        _write(os.path.join(garbage, "latest_checkpointed_iteration.txt"), "iter_3?\n")
        dangling = os.path.join(root, "dangling")
        os.makedirs(dangling)
        _write(os.path.join(dangling, "latest_checkpointed_iteration.txt"), "7\n")
        nometa = os.path.join(root, "nometa")
        _fake_complete_checkpoint(iteration_dir(nometa, 2))
        os.remove(os.path.join(iteration_dir(nometa, 2), "metadata.json"))
        _write(os.path.join(nometa, "latest_checkpointed_iteration.txt"), "2\n")
        truncated = os.path.join(root, "truncated")
        _fake_complete_checkpoint(iteration_dir(truncated, 5))
        data = [f for f in os.listdir(iteration_dir(truncated, 5)) if f.endswith(".distcp")]
        with open(os.path.join(iteration_dir(truncated, 5), data[0]), "r+b") as f:
            f.truncate(100)
        _write(os.path.join(truncated, "latest_checkpointed_iteration.txt"), "5\n")
        untracked = os.path.join(root, "untracked")
        _fake_complete_checkpoint(iteration_dir(untracked, 4))
        # Issues 4 and 5: bytes changed in place (same size), with an older good checkpoint
        # beside it; and a truncated latest one beside an older good one.
        for name in ("bitflip", "truncated_with_older"):
            for it in (2, 6):
                _fake_complete_checkpoint(iteration_dir(os.path.join(root, name), it), True)
            _write(os.path.join(root, name, "latest_checkpointed_iteration.txt"), "6\n")
        # The older checkpoints are corrupt too: the hint must verify them, not suggest them.
        for it in (2, 4, 6):
            _fake_complete_checkpoint(iteration_dir(os.path.join(root, "two_flipped"), it), True)
        _write(os.path.join(root, "two_flipped", "latest_checkpointed_iteration.txt"), "6\n")
        for it in (2, 6):
            _fake_complete_checkpoint(iteration_dir(os.path.join(root, "all_flipped"), it), True)
        _write(os.path.join(root, "all_flipped", "latest_checkpointed_iteration.txt"), "6\n")
        for name, it in (("bitflip", 6), ("two_flipped", 6), ("two_flipped", 4),
                         ("all_flipped", 6), ("all_flipped", 2)):
            flip = iteration_dir(os.path.join(root, name), it)
            data = sorted(f for f in os.listdir(flip) if f.endswith(".distcp"))[0]
            with open(os.path.join(flip, data), "r+b") as f:
                f.seek(200)
                byte = f.read(1)
                f.seek(200)
                f.write(bytes([byte[0] ^ 0xFF]))
        cut = iteration_dir(os.path.join(root, "truncated_with_older"), 6)
        with open(os.path.join(cut, data), "r+b") as f:
            f.truncate(100)
    dist.barrier()
    j = lambda name: os.path.join(root, name)  # noqa: E731
    cases = [
        (args(j("missing")), "no such directory"),
        (args(j("empty")), "no latest_checkpointed_iteration.txt"),
        (args(j("garbage")), "corrupt"),
        (args(j("dangling")), "iter_0000007 does not exist"),
        (args(j("nometa")), "metadata.json is missing"),
        (args(j("truncated")), "corrupt"),
        (args(j("untracked")), "--ckpt-step 4"),
        (args(j("good"), step=9), "iter_0000009 does not exist"),
        (args(j("bitflip")), r"__0_0.distcp does not match its checksum .*the newest intact "
                             r"older checkpoint .* is iteration 2, its checksums verified; "
                             r"to resume from it, pass --load \S+ --ckpt-step 2$"),
        (args(j("truncated_with_older")), r"corrupt: __0_0.distcp holds 100 bytes.*"
                                          r"intact older checkpoint.*--ckpt-step 2$"),
        (args(j("truncated")), "holds no older checkpoint$"),
        (args(j("two_flipped")), r"is iteration 2, its checksums verified \(iteration\(s\) 4 "
                                 r"between are corrupt too\); .*--ckpt-step 2$"),
        (args(j("all_flipped")), r"does not match its checksum.*holds no intact older "
                                 r"checkpoint \(iteration\(s\) 2 are corrupt too\)$"),
    ]
    for a, message in cases:
        with pytest.raises(CheckpointError, match=message):
            locate(a)
    # The same directory as --save: a missing or empty one is a fresh start.
    assert locate(args(j("missing"), save=j("missing"))) is None
    assert locate(args(j("empty"), save=j("empty"))) is None
    found = locate(args(j("good")))
    assert found == (3, iteration_dir(j("good"), 3))
    # Following the advice loads the older one (its checksums match).
    assert locate(args(j("bitflip"), step=2))[0] == 2
    assert locate(args(j("untracked"), step=4))[0] == 4
    # And through pretrain: the error reaches every rank before the load's collectives.
    with pytest.raises(CheckpointError, match="no such directory"):
        pretrain(parse_args(BASE + ["--num-workers", "0", "--load", j("missing")]))


def test_unreadable_load_fails_on_every_rank(dist_run, tmp_path):
    dist_run(_bad_load_on_ranks, 2, str(tmp_path), timeout=180)


# --------------------------------------------------------------------------- NaN
NAN_ITERATION = 3


def _poisoned_forward_step(num_microbatches):
    """The default forward step, with a NaN loss in every micro-batch of NAN_ITERATION."""
    calls = [0]

    def step(ctx, data_iterator, model):
        output, loss_func = batch.forward_step(ctx, data_iterator, model)
        iteration = calls[0] // num_microbatches + 1
        calls[0] += 1
        if iteration == NAN_ITERATION and ctx.last_stage:
            output = output * float("nan")
        return output, loss_func

    return step


def _nan_on_ranks(rank, world_size, metrics_dir):
    from megatron.training.loop import NonFiniteLossError, pretrain  # megatron-core on first use

    common = BASE + ["--num-workers", "0", "--ulysses-degree", "2", "--micro-batch-size", "1",
                     "--global-batch-size", "2", "--eval-iters", "0",
                     "--lr-warmup-iters", "4"]
    with pytest.raises(NonFiniteLossError, match=f"iteration {NAN_ITERATION}: lm loss is nan"):
        pretrain(parse_args(common), forward_step_func=_poisoned_forward_step(2))

    metrics = os.path.join(metrics_dir, "skip.jsonl")
    result = pretrain(parse_args(common + ["--skip-nan-steps", "--metrics-file", metrics]),
                      forward_step_func=_poisoned_forward_step(2))
    assert result.iteration == 5
    assert result.skipped_iterations == [NAN_ITERATION]
    assert math.isnan(result.losses[NAN_ITERATION])
    assert all(math.isfinite(v) for k, v in result.losses.items() if k != NAN_ITERATION)
    if rank == world_size - 1:  # the logging rank wrote the metrics
        with open(metrics) as f:
            rec = {r["iteration"]: r for r in map(json.loads, f) if r["kind"] == "train"}
        assert rec[NAN_ITERATION]["skipped"] is True
        assert rec[NAN_ITERATION]["grad_norm"] is None
        # Warmup is linear in optimizer steps: the skipped step did not advance the LR.
        assert rec[NAN_ITERATION]["lr"] == rec[NAN_ITERATION - 1]["lr"]
        assert rec[NAN_ITERATION + 1]["lr"] > rec[NAN_ITERATION]["lr"]


def test_nan_loss_stops_or_is_skipped(dist_run, tmp_path):
    dist_run(_nan_on_ranks, 2, str(tmp_path), timeout=240)


def _nan_grad_forward_step(num_microbatches):
    """The default forward step; in NAN_ITERATION the first parameter's gradient becomes
    NaN (0 * d sqrt(x)/dx at x = 0) while the loss stays finite."""
    calls = [0]

    def step(ctx, data_iterator, model):
        output, loss_func = batch.forward_step(ctx, data_iterator, model)
        iteration = calls[0] // num_microbatches + 1
        calls[0] += 1
        if iteration == NAN_ITERATION:
            p = next(model.parameters())
            output = output + 0.0 * torch.sqrt((p - p.detach()).sum())
        return output, loss_func

    return step


def _nan_grad_on_ranks(rank, world_size, metrics_dir):
    from megatron.training.loop import NonFiniteLossError, pretrain  # megatron-core on first use

    common = BASE + ["--num-workers", "0", "--ulysses-degree", "2", "--micro-batch-size", "1",
                     "--global-batch-size", "2", "--eval-iters", "0",
                     "--lr-warmup-iters", "4"]
    with pytest.raises(NonFiniteLossError,
                       match=f"iteration {NAN_ITERATION}: grad norm is nan with a finite lm "
                             f"loss .*weights are unchanged.*--clip-grad 1.0 is set"):
        pretrain(parse_args(common), forward_step_func=_nan_grad_forward_step(2))

    metrics = os.path.join(metrics_dir, "skip_grad.jsonl")
    result = pretrain(parse_args(common + ["--skip-nan-steps", "--metrics-file", metrics]),
                      forward_step_func=_nan_grad_forward_step(2))
    assert result.iteration == 5 and result.skipped_iterations == [NAN_ITERATION]
    # The NaN step was not applied: the weights, hence every later loss, stay finite.
    assert all(math.isfinite(v) for v in result.losses.values()), result.losses
    if rank == world_size - 1:
        with open(metrics) as f:
            rec = {r["iteration"]: r for r in map(json.loads, f) if r["kind"] == "train"}
        assert rec[NAN_ITERATION]["skipped"] is True
        assert rec[NAN_ITERATION]["lr"] == rec[NAN_ITERATION - 1]["lr"]


def test_nan_grad_norm_stops_before_the_step_or_is_skipped(dist_run, tmp_path):
    """A NaN grad norm under a finite loss is never applied; --skip-nan-steps skips
    it (before, the run stopped anyway, after applying it)."""
    dist_run(_nan_grad_on_ranks, 2, str(tmp_path), timeout=240)


def test_nonfinite_grad_message_fits_the_clip_setting():
    from megatron.training.loop import nonfinite_grad_message  # megatron-core on first use

    assert "set --clip-grad 1.0" in nonfinite_grad_message(3, float("nan"), 2.0, 0.0)
    set_already = nonfinite_grad_message(3, float("inf"), 2.0, 1.0)
    assert "--clip-grad 1.0 is set" in set_already and "set --clip-grad" not in set_already
