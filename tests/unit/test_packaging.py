"""Our code and megatron-core share the ``megatron`` namespace, installed either way."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

IMPORTS = (
    "import megatron.core, megatron.usp.parallel_dims, megatron.usp.token_order;"
    "import megatron.planner, megatron.bench.flops;"
    "import megatron.core.parallel_state;"
    "print(megatron.usp.parallel_dims.__file__)"
)


def test_no_namespace_init():
    assert not (REPO / "megatron" / "__init__.py").exists()


def test_editable_install_imports_beside_megatron_core(tmp_path):
    out = subprocess.run([sys.executable, "-c", IMPORTS], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert str(REPO) in out.stdout


@pytest.mark.slow
def test_non_editable_install_imports_beside_megatron_core(tmp_path):
    target = tmp_path / "site"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(REPO)],
        capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert (target / "megatron" / "usp" / "parallel_dims.py").exists()
    assert not (target / "megatron" / "__init__.py").exists()
    site_packages = Path(__import__("megatron.core").core.__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=f"{target}{os.pathsep}{site_packages}",
               PYTHONNOUSERSITE="1")
    out = subprocess.run([sys.executable, "-S", "-c", IMPORTS], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert str(target) in out.stdout


def test_every_package_of_ours_is_installed():
    """Each folder under megatron/ is a package that setup.py ships (a missing one imports
    from the source tree's root and nowhere else)."""
    ours = sorted(p.name for p in (REPO / "megatron").iterdir()
                  if p.is_dir() and any(p.glob("*.py")))
    shipped = re.findall(r'"megatron\.(\w+)\*"', (REPO / "setup.py").read_text())
    assert sorted(shipped) == ours
    code = "import " + ", ".join(f"megatron.{name}" for name in ours)
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
