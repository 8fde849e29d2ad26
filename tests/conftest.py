import pytest
import torch

from tests.harness import run_on_ranks


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs; skipped without them (run on the device)")
    config.addinivalue_line("markers", "slow: long CPU test (still run in CI)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def dist_run():
    """``dist_run(fn, world_size, *args, timeout=..., **kwargs)``: see tests/harness.py."""
    return run_on_ranks
