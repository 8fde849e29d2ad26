"""Kernel choices and whether each can run here, without importing torch: the
``--attention-backend`` names, the ``--fused-kernels`` names (and the kernel each uses per op),
the ``--document-attention-kernel`` names, and the ``--recompute-cpu-offload`` items.

:mod:`megatron.usp.kernels` builds the kernels; this module only answers the start-up
question "can this backend run on this device with the installed packages?", so that
``pretrain_gpt.py`` can refuse a missing backend before any process group exists and
``--help`` stays fast (nothing here imports torch or the optional packages: only
``importlib.util.find_spec`` is used).
"""

from __future__ import annotations

import importlib.util
from typing import Dict, Optional, Tuple

from megatron.errors import UsageError

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


# --------------------------------------------------------------------------- --fused-kernels
FUSED_KERNEL_CHOICES: Tuple[str, ...] = ("auto", "usp", "liger", "compile", "torch")
LIGER_INSTALL = "pip install liger-kernel   (or pip install -e .[peers])"

# The implementation each choice uses per op. "usp" is this project's Triton kernels
# (megatron.layers.lean_kernels for RMSNorm and SwiGLU, written into given outputs so the lean
# layers refill in place; megatron.layers.qkv_rope for RoPE with megatron's QKV split); on the
# CPU the same functions run plain PyTorch math. The others are the libraries', by
# measurement (tools/bench_fused_kernels.py, one H200, the 0.85B model's shapes at 32K and 64K
# tokens, forward + backward; the table is in docs/performance.md): Liger's SwiGLU and
# RoPE beat megatron-core's TorchScript SwiGLU, its unfused RoPE and Inductor's; PyTorch's own
# RMSNorm kernel stays under liger and compile (faster than both, its weight gradient
# included). "usp" beat "liger" end to end, so "auto" is "usp" on CUDA.
OP_IMPL: Dict[str, Dict[str, str]] = {
    "torch": {"rms_norm": "torch", "swiglu": "torch", "rope": "torch"},
    "compile": {"rms_norm": "torch", "swiglu": "compile", "rope": "compile"},
    "liger": {"rms_norm": "torch", "swiglu": "liger", "rope": "liger"},
    "usp": {"rms_norm": "usp", "swiglu": "usp", "rope": "usp"},
}
# Every kernel implementation an op may be given (the values of OP_IMPL).
KERNEL_IMPLS: Tuple[str, ...] = ("torch", "compile", "liger", "usp")


def op_impl(choice: str, op: str) -> str:
    """The kernel of ``op`` (rms_norm, swiglu, rope) under a resolved ``--fused-kernels``."""
    return OP_IMPL[choice][op]


class FusedKernelsUnavailable(UsageError, ValueError):
    """``--fused-kernels`` names an implementation that cannot run here."""


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def liger_importable() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def resolve_fused_kernels(name: str, cuda: bool) -> str:
    """The implementation ``--fused-kernels name`` means on this machine.

    Raises:
        FusedKernelsUnavailable: an unknown name, ``liger`` without the package or without
            CUDA, ``compile`` without CUDA; the message names the flag and a valid value.
    """
    if name not in FUSED_KERNEL_CHOICES:
        raise FusedKernelsUnavailable(
            f"--fused-kernels {name!r} is not known; choose one of {list(FUSED_KERNEL_CHOICES)}")
    if name == "auto":
        return ("usp" if triton_importable() else "torch") if cuda else "torch"
    if name == "usp" and cuda and not triton_importable():
        raise FusedKernelsUnavailable(
            "--fused-kernels usp runs Triton kernels on the GPU and Triton is not importable "
            "(pip install triton, which PyTorch's CUDA wheels bring); or use --fused-kernels "
            "torch")
    if name in ("liger", "compile") and not cuda:
        raise FusedKernelsUnavailable(
            f"--fused-kernels {name} runs Triton kernels, which need a CUDA GPU; on the CPU use "
            f"--fused-kernels torch (or auto)")
    if name == "liger" and not liger_importable():
        raise FusedKernelsUnavailable(
            f"--fused-kernels liger needs Liger's kernels: {LIGER_INSTALL}; or use "
            f"--fused-kernels auto")
    return name


# --------------------------------------------------------------------------- --recompute-cpu-offload
# What full recompute keeps that can wait in host memory (megatron.memory.activation_offload).
OFFLOAD_CHOICES: Tuple[str, ...] = ("layer_input", "core_attn")
# How many of a forward's newest offloaded items stay on the device (they are needed first);
# also what megatron.bench.depth needs to know about a slice's GPU bytes.
OFFLOAD_PREFETCH = 2


# --------------------------------------------------------------------------- --document-attention-kernel
DOCUMENT_KERNEL_NAMES: Tuple[str, ...] = ("auto", "tiles", "varlen", "math")


def document_kernel_name_problem(name: str, device: str, low_precision: bool) -> Optional[str]:
    """Why ``--document-attention-kernel name`` cannot run on ``device`` with bf16 / fp16
    (``low_precision``) or float32 inputs, or None."""
    if name not in DOCUMENT_KERNEL_NAMES:
        return (f"--document-attention-kernel {name!r} is not known; choose one of "
                f"{list(DOCUMENT_KERNEL_NAMES)}")
    if name == "varlen" and (device != "cuda" or not low_precision):
        return ("--document-attention-kernel varlen needs CUDA and --bf16 (PyTorch's flash "
                "varlen op); use --document-attention-kernel tiles (or auto)")
    return None
