"""Float8 flags (Megatron-LM's ``--fp8-format`` / ``--fp8-recipe``) and their start-up check.

The names and the checks live torch-free in :mod:`megatron.layers.float8_options`; this module
adds the flags to the parser and turns them into the run's
:class:`~megatron.layers.float8_options.Float8Options` (None: no float8).
"""

from __future__ import annotations

from typing import Optional, Tuple

from megatron.layers.float8_options import (
    FP8_FORMATS,
    FP8_LINEAR_CHOICES,
    FP8_RECIPES,
    TE_ONLY_RECIPES,
    Float8Options,
    device_problem,
    recipe_problem,
    torchao_importable,
)
from megatron.training.cli.errors import ArgumentsError


def add_fp8_args(group) -> None:
    """The float8 flags (the training group)."""
    group.add_argument("--fp8-format", default=None, choices=FP8_FORMATS,
                       help="run QKV, the attention projection, FC1 and FC2 in float8 through "
                            "torchao (pip install torchao; a GPU of compute capability >= 8.9): "
                            "e4m3 for every operand, or hybrid (e4m3 forward, e5m2 gradients). "
                            "Attention, norms and the loss stay in bf16 (docs/numerics.md)")
    group.add_argument("--fp8-recipe", default=None, choices=FP8_RECIPES + TE_ONLY_RECIPES,
                       help="with --fp8-format: tensorwise (default; one dynamic scale per "
                            "tensor) or rowwise (one per row, needs --fp8-format e4m3). "
                            "Megatron-LM's delayed, mxfp8 and blockwise are TransformerEngine's "
                            "and refused")
    group.add_argument("--fp8-linears", default=None, choices=FP8_LINEAR_CHOICES,
                       help="with --fp8-format: auto (default; each linear shape is timed once "
                            "in bf16 and float8 at start-up and stays bf16 unless float8 is 5%% "
                            "faster) or all (every linear whose dimensions are multiples of 16)")
    group.add_argument("--fp8-output-layer", action="store_true",
                       help="with --fp8-format and --fused-linear-cross-entropy: the output "
                            "layer's GEMMs (logits and their two gradients) are a float8 "
                            "candidate too, chosen by --fp8-linears like the others. Off by "
                            "default, as in Megatron-LM and torchtitan: the logits then carry "
                            "float8's rounding (docs/numerics.md)")
    group.add_argument("--fp8-emulate", action="store_true",
                       help="with --fp8-format, for tests and debugging: torchao's emulation "
                            "(float8 rounding, float32 matmuls) on any device, the CPU included; "
                            "slower than bf16")


def fp8_options(args, device: str, capability: Optional[Tuple[int, int]]
                ) -> Optional[Float8Options]:
    """The run's float8 choices, or None without ``--fp8-format``. ``capability``: the CUDA
    device's compute capability (None on the CPU). Raises :class:`ArgumentsError` naming the
    flag for a recipe this project does not run, a device or install that cannot run it, or
    a float8 flag without ``--fp8-format``."""
    if args.fp8_format is None:
        given = [flag for flag, value in (("--fp8-recipe", args.fp8_recipe),
                                          ("--fp8-linears", args.fp8_linears),
                                          ("--fp8-emulate", args.fp8_emulate or None),
                                          ("--fp8-output-layer",
                                           args.fp8_output_layer or None))
                 if value is not None]
        if given:
            raise ArgumentsError(f"{given[0]} needs --fp8-format; add --fp8-format hybrid "
                                 f"(or e4m3), or drop {given[0]}")
        return None
    recipe = args.fp8_recipe or "tensorwise"
    problem = (recipe_problem(args.fp8_format, recipe)
               or device_problem(device, capability, args.fp8_emulate, torchao_importable()))
    if problem:
        raise ArgumentsError(problem)
    if args.use_megatron_fsdp:
        raise ArgumentsError("--fp8-format with --use-megatron-fsdp is not verified; drop one "
                             "of them")
    if args.fp8_output_layer and not args.fused_linear_cross_entropy:
        raise ArgumentsError("--fp8-output-layer runs the output layer inside the fused loss; "
                             "add --fused-linear-cross-entropy (or drop --fp8-output-layer)")
    return Float8Options(format=args.fp8_format, recipe=recipe,
                         linears=args.fp8_linears or "auto", emulate=args.fp8_emulate,
                         output_layer=args.fp8_output_layer)


__all__ = ["add_fp8_args", "fp8_options"]
