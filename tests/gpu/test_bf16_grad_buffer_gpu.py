"""bf16 training on one GPU with the float32 gradient buffer (the default) and without it.

``pretrain_gpt.py --bf16 --use-distributed-optimizer`` on a tiny model (mock data, 4
micro-batches per step) runs 8 steps straight, and 4 steps + a resume to 8, for each of the
two gradient buffers. Every run must finish with finite losses, and a resume of the same
setting must continue the straight run's curve to bf16 accuracy (1e-2 relative: cuDNN's
attention backward is not bitwise reproducible; on one H200 it was bitwise). A checkpoint of
one setting resumed with the other is refused at start-up naming the flag (exit 2):
megatron-core keys the distributed optimizer's state by the buffer dtype, so it cannot load
(it raised a KeyError deep in dist_checkpointing before the check). The buffer's dtype
itself is checked in ``tests/unit/test_grad_precision.py`` and, in bf16 on CPU, in
``tests/distributed/test_bf16_grad_accumulation.py``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import tiny_gpt_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = tiny_gpt_flags(
    hidden_size=256, seq_length=512, max_position_embeddings=None,
    untie_embeddings_and_output_weights=True, mock_data=True, vocab_size=1024,
    micro_batch_size=1, global_batch_size=4, train_iters=8, lr="1e-3", lr_warmup_iters=2,
    seed=1234, bf16=True, use_distributed_optimizer=True, eval_iters=0, num_workers=0,
    log_interval=4, device="cuda")


def _pretrain(extra, cwd, expect_rc=0):
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)   # a plain one-process run
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *ARGS,
                           *extra], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _losses(path):
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: r["lm_loss"] for r in records if r["kind"] == "train"}


@pytest.mark.gpu
@pytest.mark.parametrize("opt_out", [False, True], ids=["fp32-buffer", "bf16-buffer"])
def test_bf16_training_saves_and_resumes(tmp_path, opt_out):
    flag = ["--grad-reduce-in-bf16"] if opt_out else []
    other = [] if opt_out else ["--grad-reduce-in-bf16"]
    straight, ckpt = tmp_path / "straight.jsonl", tmp_path / "ckpt"
    _pretrain(flag + ["--metrics-file", str(straight)], tmp_path)
    _pretrain(flag + ["--save", str(ckpt), "--exit-interval", "4",
                      "--metrics-file", str(tmp_path / "first.jsonl")], tmp_path)
    for name, flags in (("same", flag), ("switched", other)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        shutil.copytree(ckpt, run_dir / "ckpt")
        resume = flags + ["--load", str(run_dir / "ckpt"), "--save", str(run_dir / "ckpt"),
                          "--metrics-file", str(run_dir / "metrics.jsonl")]
        if name == "switched":
            proc = _pretrain(resume, tmp_path, expect_rc=2)
            # checkpoint with the fp32 buffer resumed with the opt-out: drop it; and back
            fix = "add --grad-reduce-in-bf16" if opt_out else "drop --grad-reduce-in-bf16"
            assert "gradient buffers" in proc.stderr and fix in proc.stderr, proc.stderr[-2000:]
            assert "--no-load-optim" in proc.stderr, proc.stderr[-2000:]
            continue
        _pretrain(resume, tmp_path)
        resumed = _losses(run_dir / "metrics.jsonl")
        assert sorted(resumed) == [5, 6, 7, 8], (name, resumed)
        assert all(math.isfinite(v) for v in resumed.values()), (name, resumed)
        reference = _losses(straight)
        for it, loss in resumed.items():
            assert abs(loss - reference[it]) <= 1e-2 * abs(reference[it]), (it, loss)
