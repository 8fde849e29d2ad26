#!/usr/bin/env bash
# The one test command: creates or refreshes .venv, installs Megatron-USP with its
# test extras (torch 2.13.0 CPU from the local file where one exists), runs ruff and
# pytest. Extra arguments go to pytest, e.g. `bash run_tests.sh tests/unit -x`.
# CI runs everything. For the inner loop, leave out the tests marked slow (the CPU
# training runs, example scripts, checkpoint and fault drills), a few minutes on 2 cores:
#   bash run_tests.sh -m "not slow"       (or, with .venv set up: python -m pytest -m "not slow")
# The GPU tier (tests/gpu, skipped without CUDA): python tools/run_gpu_tests.py --out DIR
set -euo pipefail
cd "$(dirname "$0")"
. tools/setup_venv.sh
ruff check .
python -m pytest "$@"
