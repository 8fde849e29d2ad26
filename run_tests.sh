#!/usr/bin/env bash
# The one test command: creates or refreshes .venv, installs Megatron-USP with its
# test extras (torch 2.13.0 CPU from the local file where one exists), runs ruff and
# pytest. Extra arguments go to pytest, e.g. `bash run_tests.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")"
. tools/setup_venv.sh
ruff check .
python -m pytest "$@"
