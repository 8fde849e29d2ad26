"""The ``--attention-backend`` names and whether each can run here, without importing torch.

:mod:`megatron.usp.kernels` builds the kernels; this module only answers the start-up
question "can this backend run on this device with the installed packages?", so that
``pretrain_gpt.py`` can refuse a missing backend before any process group exists and
``--help`` stays fast (nothing here imports torch or the optional packages: only
``importlib.util.find_spec`` is used).
"""

from __future__ import annotations

import importlib.util
from typing import Dict, Optional, Tuple

BACKEND_NAMES: Tuple[str, ...] = ("auto", "torch", "math", "flash-attn", "te")

INSTALL_HINTS: Dict[str, str] = {
    "flash-attn": "pip install flash-attn --no-build-isolation  (FlashAttention-2 >= 2.6), or "
    "build FlashAttention-3 from flash-attention/hopper (module flash_attn_interface)",
    "te": "pip install --no-build-isolation transformer-engine[pytorch]",
}

# Backend -> the top-level modules any one of which provides it.
_PACKAGES: Dict[str, Tuple[str, ...]] = {
    "flash-attn": ("flash_attn_interface", "flash_attn"),
    "te": ("transformer_engine",),
}


def backend_installed(name: str) -> bool:
    """True when ``name`` needs no package, or one of its packages is importable."""
    modules = _PACKAGES.get(name)
    return modules is None or any(importlib.util.find_spec(m) is not None for m in modules)


def backend_problem(name: str, device: str) -> Optional[str]:
    """Why ``--attention-backend name`` cannot run on ``device`` ("cuda" or "cpu"), or None.

    ``auto``, ``torch`` and ``math`` run everywhere; ``flash-attn`` and ``te`` need CUDA and
    their package. The message names the flag, the install command and a backend that runs.
    """
    if name not in _PACKAGES:
        return None
    if device != "cuda":
        return (f"--attention-backend {name} needs a CUDA GPU (this run is on the {device}); "
                f"use --attention-backend torch (or auto)")
    if not backend_installed(name):
        return (f"--attention-backend {name}: the package is not installed; "
                f"{INSTALL_HINTS[name]}; or use --attention-backend torch (or auto)")
    return None
