"""The float8 flags' names, the run's float8 choices, and whether they can run here (torch-free).

``--fp8-format`` and ``--fp8-recipe`` keep Megatron-LM's names where they mean the same thing
here; the GEMMs are torchao's float8 training path (:mod:`megatron.layers.float8_gemms`), not
TransformerEngine's, so only the recipes torchao implements with dynamic scaling are offered:

========================  ==========================================================
``--fp8-format e4m3``     every GEMM operand in ``float8_e4m3fn``
``--fp8-format hybrid``   inputs and weights in e4m3, output gradients in ``float8_e5m2``
``--fp8-recipe tensorwise``  one scale per tensor, computed from its amax at every cast
``--fp8-recipe rowwise``  one scale per row (torchao's recipe: all operands e4m3, scales
                          rounded down to powers of two); needs ``--fp8-format e4m3``
========================  ==========================================================

Megatron-LM's ``delayed``, ``mxfp8`` and ``blockwise`` recipes are TransformerEngine's and are
refused, naming the valid values. Like :mod:`megatron.usp.backend_names`, nothing here imports
torch or torchao (``--help`` and start-up checks stay fast); the device's compute capability is
passed in.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional, Tuple

FP8_FORMATS: Tuple[str, ...] = ("e4m3", "hybrid")
FP8_RECIPES: Tuple[str, ...] = ("tensorwise", "rowwise")
# Megatron-LM's recipes that only TransformerEngine implements.
TE_ONLY_RECIPES: Tuple[str, ...] = ("delayed", "mxfp8", "blockwise")
FP8_LINEAR_CHOICES: Tuple[str, ...] = ("auto", "all")
# torch._scaled_mm's float8 kernels: Ada (8.9) and Hopper (9.0) and later.
MIN_CAPABILITY: Tuple[int, int] = (8, 9)
TORCHAO_INSTALL = "pip install torchao   (or pip install -e .[fp8])"
DEFAULT_MARGIN = 0.05


@dataclass(frozen=True)
class Float8Options:
    """What the run asked of float8 (the flags in brackets).

    Attributes:
        format: ``e4m3`` or ``hybrid`` (``--fp8-format``).
        recipe: ``tensorwise`` or ``rowwise`` (``--fp8-recipe``).
        linears: ``auto`` (each linear shape runs in float8 only where a timing says it is
            faster by ``margin``) or ``all`` (``--fp8-linears``).
        emulate: torchao's emulation (float8 rounding, float32 matmul) instead of
            ``torch._scaled_mm``: runs on any device; for tests and debugging
            (``--fp8-emulate``).
        margin: float8 must be at least this fraction faster than bf16 to be chosen.
        output_layer: the output layer's three GEMMs (inside the fused output-layer loss)
            are a candidate as well, chosen like the others (``--fp8-output-layer``).
    """

    format: str = "hybrid"
    recipe: str = "tensorwise"
    linears: str = "auto"
    emulate: bool = False
    margin: float = DEFAULT_MARGIN
    output_layer: bool = False

    def short(self) -> str:
        mode = ", emulated" if self.emulate else ""
        return f"{self.recipe} {self.format}{mode}"


def torchao_importable() -> bool:
    return importlib.util.find_spec("torchao") is not None


def recipe_problem(fmt: str, recipe: str) -> Optional[str]:
    """Why ``--fp8-format fmt --fp8-recipe recipe`` is not a recipe this project runs, or None."""
    if fmt not in FP8_FORMATS:
        return f"--fp8-format {fmt!r}: use one of {', '.join(FP8_FORMATS)}"
    if recipe in TE_ONLY_RECIPES:
        return (f"--fp8-recipe {recipe} is TransformerEngine's recipe, not available here "
                f"(float8 runs through torchao); use --fp8-recipe tensorwise or rowwise")
    if recipe not in FP8_RECIPES:
        return f"--fp8-recipe {recipe!r}: use one of {', '.join(FP8_RECIPES)}"
    if recipe == "rowwise" and fmt != "e4m3":
        return ("--fp8-recipe rowwise casts every operand to e4m3 (torchao's rowwise recipe); "
                "pass --fp8-format e4m3, or use --fp8-recipe tensorwise with hybrid")
    return None


def device_problem(device: str, capability: Optional[Tuple[int, int]], emulate: bool,
                   torchao_ok: bool) -> Optional[str]:
    """Why float8 cannot run on ``device`` (``cuda`` with ``capability``, or ``cpu``), or None.

    Without ``emulate`` the device must be a CUDA GPU of compute capability >= 8.9 (Ada,
    Hopper and later: ``torch._scaled_mm``); then torchao must be importable."""
    if emulate:
        return None if torchao_ok else f"--fp8-format needs torchao: {TORCHAO_INSTALL}"
    if device != "cuda":
        return (f"--fp8-format needs a CUDA GPU of compute capability >= 8.9 (Ada/Hopper); "
                f"this run is on the {device} (tests and debugging: add --fp8-emulate)")
    if capability is None or tuple(capability) < MIN_CAPABILITY:
        have = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return (f"--fp8-format needs a GPU of compute capability >= 8.9 (Ada/Hopper); this "
                f"one has {have}; drop --fp8-format to train in bf16")
    return None if torchao_ok else f"--fp8-format needs torchao: {TORCHAO_INSTALL}"


__all__ = ["FP8_FORMATS", "FP8_RECIPES", "TE_ONLY_RECIPES", "FP8_LINEAR_CHOICES",
           "MIN_CAPABILITY", "TORCHAO_INSTALL", "Float8Options", "torchao_importable",
           "recipe_problem", "device_problem"]
