#!/usr/bin/env bash
# The one test command: creates or refreshes .venv, installs Megatron-USP with its
# test extras (torch 2.13.0 CPU from the local file where one exists), runs ruff and
# pytest. Extra arguments go to pytest, e.g. `bash run_tests.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
STAMP=.venv/.megatron-usp-installed
if [ ! -f "$STAMP" ] || [ setup.py -nt "$STAMP" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0" || python -m pip install -q "torch>=2.6"
  python -m pip install -q -e ".[test]"
  touch "$STAMP"
fi
ruff check .
python -m pytest "$@"
