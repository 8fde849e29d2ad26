import os

# Ask NVML, not the CUDA driver, whether GPUs exist: initialising CUDA in the pytest
# process would make forked children unable to use it.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.harness import run_on_ranks  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs; skipped without them (run on the device)")
    config.addinivalue_line(
        "markers", "slow: a CPU test of 10 s or more; CI runs it, -m \"not slow\" leaves it out")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def dist_run():
    """``dist_run(fn, world_size, *args, timeout=..., **kwargs)``: see tests/harness.py."""
    return run_on_ranks


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(HF directory, imported checkpoint directory) of SmolLM2-135M-Instruct, built once per
    session (half a minute) and only read by the tests that share it."""
    from tests.unit.test_convert_smollm2 import import_smollm2  # transformers, on first use

    return import_smollm2(tmp_path_factory.mktemp("smollm2"))
