#!/usr/bin/env bash
# The README's main job, on a fresh CPU machine: install Megatron-USP, build the built-in
# corpus, pretrain a tiny Llama-style GPT with USP (Ulysses 2 x Ring 2 on 4 CPU processes)
# beside the data-parallel baseline (DP 4) on the same data, seed and global batch, and
# compare the two loss curves (tools/compare_loss.py: table, PNG, exit status).
#
#   bash examples/quickstart_cpu.sh [extra pretrain_gpt.py flags for both runs]
#
# Environment: QUICKSTART_DIR (runs/quickstart; its dp4/ and u2r2/ are replaced)
# TRAIN_ITERS (40) TOLERANCE (1e-5, the largest relative per-step loss difference). The two
# layouts sum in different orders, so fp32 rounding differences (~1e-7) grow chaotically after
# ~50 steps to ~1e-3 by step 100 and stay there: for longer runs use TOLERANCE 5e-3 (see
# benchmarks/results/loss_curves/cpu-2026-11-30/).
# PYTHON (python3, for the venv) MASTER_PORT (unset: a free port). About 2 minutes on 2 cores.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${QUICKSTART_DIR:-runs/quickstart}
TRAIN_ITERS=${TRAIN_ITERS:-40}
TOLERANCE=${TOLERANCE:-1e-5}

# 1. Install into .venv and activate it (the same script run_tests.sh uses).
. tools/setup_venv.sh

# 2. The built-in corpus (Python standard library prose) and its SentencePiece tokenizer.
echo "== building the default corpus (cached after the first time)"
python tools/build_default_corpus.py

# 3. The same model, data, seed and global batch: DP 4, then U2 x R2 (fresh runs: their
#    folders are emptied, nothing else in $OUT is touched).
rm -rf "$OUT/dp4" "$OUT/u2r2"
echo "== DP 4 baseline ($TRAIN_ITERS steps)"
RUN_DIR="$OUT/dp4" ULYSSES_DEGREE=1 RING_DEGREE=1 TRAIN_ITERS="$TRAIN_ITERS" \
  bash examples/pretrain_cpu.sh "$@"
echo "== USP: Ulysses 2 x Ring 2 ($TRAIN_ITERS steps)"
RUN_DIR="$OUT/u2r2" ULYSSES_DEGREE=2 RING_DEGREE=2 TRAIN_ITERS="$TRAIN_ITERS" \
  bash examples/pretrain_cpu.sh "$@"

# 4. Compare the curves.
echo "== comparing the loss curves"
python tools/compare_loss.py "$OUT/dp4/metrics.jsonl" "$OUT/u2r2/metrics.jsonl" \
  --labels "DP 4" "U2 x R2" --tolerance "$TOLERANCE" --print-every 10 \
  --png "$OUT/loss_dp4_vs_u2r2.png"
echo
echo "Loss-comparison PNG: $(cd "$OUT" && pwd)/loss_dp4_vs_u2r2.png"
