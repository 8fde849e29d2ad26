"""The three GEMMs of a linear layer in float8, with torchao's casts and scaled matmul.

A linear layer ``y = x @ W.T`` runs three GEMMs: the output (``x [n, in]``, ``W [out, in]``),
the input gradient (``dy [n, out] @ W``) and the weight gradient (``dy.T @ x``).
:class:`Float8Gemms` runs each as torchao's float8 training does (``torchao.float8``,
``matmul_with_hp_or_float8_args``): both operands cast with a dynamic scale
(``hp_tensor_to_float8_dynamic``: amax, scale, saturated cast) into torchao's
``Float8TrainingTensor``, whose ``mm`` is ``torch._scaled_mm`` on CUDA, or, with
``emulate``, the same float8 values multiplied in float32 (any device; the CPU tests).
This project's own autograd functions (:mod:`megatron.layers.linear_wgrad`) call these
three methods in place of their bf16 GEMMs, so the tensor-parallel communication around the
GEMMs, sequence parallelism, the SwiGLU inside FC2 and the weight gradient's accumulation
into ``main_grad`` are unchanged; nothing else (attention, norms, the loss) sees float8.

Weight gradient into ``main_grad``: torch._scaled_mm cannot add into an existing tensor, so
:meth:`Float8Gemms.grad_weight` asks for its output in ``main_grad``'s dtype (float32:
``_scaled_mm``'s float32 output with tensorwise scales; torchao rounds the rowwise kernel's
output through bf16) and the caller adds it: no bf16 rounding of a tensorwise weight gradient,
one float32 ``[out, in]`` temporary per GEMM. Where ``main_grad`` holds nothing yet (the
step's first micro-batch: DDP zeroed it and nothing was added since), the caller passes it as
``out`` and a tensorwise GEMM writes it directly, with no temporary and no addition: the same
values (``0 + g == g``), three fewer float32 passes over the weight's size.

The casts and layouts: torchao's eager path runs amax, scale, an upcast to float32, the
multiply, the clamp and the float8 conversion as separate passes over each operand, then copies
an operand whose layout ``torch._scaled_mm`` cannot take (the first must be row-major, the
second column-major: the weight gradient's both, the input gradient's weight) into a
transposed float8 copy. On the GPU those passes cost more than the float8 GEMM saves (torchao's
own speed-ups assume ``torch.compile``). So the casts are one function of plain tensors,
:func:`float8_operands` (torchao's ``tensor_to_scale`` and its saturated cast, so the same
values), compiled once per process on CUDA with static shapes (:func:`compiled_casts`):
an operand's amax, cast and layout change become one reduction and one pass, and an output
gradient that both backward GEMMs take alike (a tensorwise recipe) is cast once, into both
layouts (:meth:`Float8Gemms.cast_grad`). Each compiled call costs the host more than a
kernel launch (guards, the compiled wrapper), which a small GEMM does not hide, so the
operands go in as few calls as the data allows: the forward's two in one, the backward's
three in one (two where the input arrives later: a sequence-parallel gather, FC2's rebuilt
SwiGLU output). The GEMM itself is torchao's ``addmm_float8_unwrapped`` (:func:`scaled_mm`),
called eagerly.
Elsewhere the casts run eagerly, and with ``emulate`` the GEMM multiplies the float8 values
in float32 as torchao's emulation does.

Scaling state: dynamic scaling (both recipes) keeps none; every cast computes its scale from
the tensor it casts, so checkpoints carry nothing float8-specific.
"""

from __future__ import annotations

import dataclasses
from typing import List, NamedTuple, Optional, Tuple

import torch

from megatron.errors import UsageError
from megatron.layers.float8_options import TORCHAO_INSTALL, Float8Options

Tensor = torch.Tensor


class Float8Unavailable(UsageError, RuntimeError):
    """torchao's float8 training is not importable (the message names ``pip install``)."""


def _torchao():
    """torchao's float8 modules (an optional dependency, imported when float8 is asked for)."""
    try:
        from torchao.float8 import config as ao_config  # optional dependency
        from torchao.float8 import float8_scaling_utils as scaling  # optional dependency
        from torchao.float8 import float8_training_tensor as tensor  # optional dependency
    except ImportError as exc:
        raise Float8Unavailable(f"float8 training needs torchao: {TORCHAO_INSTALL} "
                                f"({exc})") from exc
    return ao_config, scaling, tensor


def float8_linear_config(options: Float8Options):
    """torchao's ``Float8LinearConfig`` of ``options``: its recipe (``tensorwise`` or
    ``rowwise``), the format's float8 dtypes and ``emulate``."""
    ao_config, _, _ = _torchao()
    config = ao_config.Float8LinearConfig.from_recipe_name(options.recipe)
    if options.recipe == "tensorwise" and options.format == "e4m3":
        # torchao's tensorwise default is hybrid (e5m2 output gradients)
        config = dataclasses.replace(
            config, cast_config_grad_output=ao_config.CastConfig(
                target_dtype=ao_config.e4m3_dtype),
            cast_config_grad_output_for_grad_weight=None)
    return dataclasses.replace(config, emulate=options.emulate)


def scaled_float8_bits(t: Tensor, float8_dtype: torch.dtype, granularity,
                       axiswise_dim, round_scales_to_power_of_2: bool):
    """``(bits, scale)`` of ``t`` in ``float8_dtype`` with a dynamic scale (torchao's
    ``tensor_to_scale``, then the cast its ``Float8TrainingTensor`` constructor makes: float32
    times the scale, saturated): plain tensors."""
    from torchao.float8 import float8_utils  # optional dependency
    scale = float8_utils.tensor_to_scale(t, float8_dtype, False, None, granularity,
                                         axiswise_dim, round_scales_to_power_of_2)
    return float8_utils.to_fp8_saturated(t.to(torch.float32) * scale, float8_dtype), scale


class CastSpec(NamedTuple):
    """How one operand is cast: torchao's ``CastConfig`` (dtype, granularity) with the axis
    of its scale (``get_maybe_axiswise_dim``: None for tensorwise) and the power-of-2
    rounding of its config; ``transpose``: the GEMM takes the cast operand transposed. A tuple
    of constants, so the compiled :func:`float8_operands` guards on its values: every
    :class:`Float8Gemms` of a process shares one graph per kind of cast."""

    dtype: torch.dtype
    granularity: object
    axiswise_dim: object
    round_scales_to_power_of_2: bool
    transpose: bool = False


Uses = Tuple[Tuple[CastSpec, bool], ...]


def _operands_of(t: Tensor, uses: Uses) -> List[Tensor]:
    """``t`` cast for each of its ``uses``, flattened ``(bits, scale)`` per use."""
    casts = {}
    out: List[Tensor] = []
    for spec, column_major in uses:
        key = spec._replace(transpose=False)
        if key not in casts:
            casts[key] = scaled_float8_bits(t, spec.dtype, spec.granularity, spec.axiswise_dim,
                                            spec.round_scales_to_power_of_2)
        bits, scale = casts[key]
        if spec.transpose:
            bits, scale = bits.t(), (scale.t() if scale.dim() > 1 else scale)
        out += [bits.t().contiguous().t() if column_major else bits.contiguous(), scale]
    return out


def float8_operands(tensors: Tuple[Tensor, ...], uses: Tuple[Uses, ...]) -> Tuple[Tensor, ...]:
    """Each of ``tensors`` cast into float8 for each of its ``uses`` (``(spec,
    column_major)``: how it is cast, and the layout the GEMM takes it in), flattened
    ``(bits, scale)`` per use, tensor after tensor. Uses of one tensor whose casts differ
    only in ``transpose`` (a tensorwise recipe's output gradient, taken by both backward
    GEMMs) share one scale and one cast: on CUDA, where this function is compiled, one read
    of the tensor for its amax and one for the values, written in both layouts. The
    operands of one GEMM (or of both backward GEMMs) go in one call: one compiled call's
    host cost instead of one per operand."""
    out: List[Tensor] = []
    for t, t_uses in zip(tensors, uses):
        out += _operands_of(t, t_uses)
    return tuple(out)


def scaled_mm(a_bits: Tensor, a_scale: Tensor, b_bits: Tensor, b_scale: Tensor,
              out_dtype: torch.dtype, use_fast_accum: bool, emulate: bool,
              out: Optional[Tensor] = None) -> Tensor:
    """``a @ b`` of two cast operands (``a`` row-major, ``b`` column-major), in ``out_dtype``:
    torchao's ``addmm_float8_unwrapped`` (``torch._scaled_mm`` with the inverse scales) or,
    emulated, the float8 values times their inverse scales multiplied in float32.
    ``out``: a row-major tensor of ``out_dtype`` that receives the product; with tensorwise
    scales the GEMM writes it directly (no temporary), else the product is copied in."""
    if emulate:
        product = torch.mm(a_bits.float() / a_scale, b_bits.float() / b_scale).to(out_dtype)
        return product if out is None else out.copy_(product)
    if out is not None and a_scale.dim() == 0 and b_scale.dim() == 0:
        return torch._scaled_mm(a_bits, b_bits, scale_a=a_scale.reciprocal(),
                                scale_b=b_scale.reciprocal(), out_dtype=out_dtype,
                                use_fast_accum=use_fast_accum, out=out)
    if out is not None:
        return out.copy_(scaled_mm(a_bits, a_scale, b_bits, b_scale, out_dtype,
                                   use_fast_accum, emulate))
    from torchao.float8.float8_ops import addmm_float8_unwrapped  # optional dependency
    # one operand tensorwise and the other axiswise: the tensorwise scale repeated
    if a_scale.dim() < 2 <= b_scale.dim():
        a_scale = a_scale.reshape(1, 1).expand(a_bits.shape[0], 1).contiguous()
    elif b_scale.dim() < 2 <= a_scale.dim():
        b_scale = b_scale.reshape(1, 1).expand(1, b_bits.shape[1]).contiguous()
    return addmm_float8_unwrapped(a_bits, a_scale, b_bits, b_scale, out_dtype,
                                  use_fast_accum=use_fast_accum)


_COMPILED_CAST = None
# graphs of the compiled cast function a process may build: one per (tensor shape, kind of
# cast); a model has a few of each (its distinct linear shapes), far below this
CAST_GRAPHS_LIMIT = 64


def compiled_casts():
    """:func:`float8_operands` compiled with static shapes, one graph per tensor shape and
    kind of cast (compiled for dynamic shapes the casts ran slower, enough to give back most
    of float8's gain: docs/performance.md), under a recompile limit that holds every shape
    of a model. torchao's guard against the Triton float8 store miscompile is switched on
    first."""
    _avoid_the_float8_store_miscompile()
    compiled = torch.compile(float8_operands, dynamic=False)

    def cast(tensors: Tuple[Tensor, ...], uses: Tuple[Uses, ...]) -> Tuple[Tensor, ...]:
        with torch._dynamo.config.patch(recompile_limit=CAST_GRAPHS_LIMIT):
            return compiled(tensors, uses)

    return cast


def _cast_function(device: torch.device):
    """The cast function for tensors on ``device``: on CUDA :func:`compiled_casts`, built
    once per process; eager elsewhere."""
    global _COMPILED_CAST
    if device.type != "cuda":
        return float8_operands
    if _COMPILED_CAST is None:
        _COMPILED_CAST = compiled_casts()
    return _COMPILED_CAST


def _avoid_the_float8_store_miscompile() -> None:
    """What torchao's ``convert_to_float8_training`` does before any float8 kernel compiles:
    inductor's NaN-propagating min/max codegen can make Triton mis-lower a neighbouring
    transposed 1-byte store, writing bytes that read as NaN/Inf in float8 (a Triton bug that
    torchao's ``float8._inductor_patch`` describes), and the casts here write transposed
    float8. torchao's patch switches that codegen to an equivalent ``tl.where`` form;
    torchao releases without it need none."""
    try:
        from torchao.float8._inductor_patch import (  # optional dependency
            _patch_inductor_min_max_codegen,
        )
    except ImportError:
        return
    _patch_inductor_min_max_codegen()


class Float8Gemms:
    """The output, input-gradient and weight-gradient GEMMs of a linear layer in float8.

    Operands are high-precision (bf16 or float32) tensors; each method casts both with a
    dynamic scale and returns the product in the first operand's dtype unless told otherwise.
    Stateless apart from the configuration: one object can serve every linear layer.
    """

    def __init__(self, options: Float8Options):
        _torchao()
        self.options = options
        self.config = c = float8_linear_config(options)
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim  # optional

        def spec(cast_config, axis, transpose=False):
            g = cast_config.scaling_granularity
            return CastSpec(cast_config.target_dtype, g, get_maybe_axiswise_dim(axis, g),
                            c.round_scales_to_power_of_2, transpose)

        # the casts torchao's matmul_with_hp_or_float8_args makes, GEMM by GEMM
        self.casts = {
            "output": (spec(c.cast_config_input, -1), spec(c.cast_config_weight, 0)),
            "grad_input": (spec(c.cast_config_grad_output, -1),
                           spec(c.cast_config_weight_for_grad_input, -1, transpose=True)),
            "grad_weight": (spec(c.cast_config_grad_output_for_grad_weight, 0, transpose=True),
                            spec(c.cast_config_input_for_grad_weight, 0)),
        }
        self.fast_accum = {"output": c.gemm_config_output.use_fast_accum,
                           "grad_input": c.gemm_config_grad_input.use_fast_accum,
                           "grad_weight": c.gemm_config_grad_weight.use_fast_accum}

    def _cast(self, *operands: Tuple[Tensor, Uses]) -> Tuple[Tensor, ...]:
        """:func:`float8_operands` of ``(tensor, uses)`` pairs in one call, compiled on CUDA.
        The tensors go in detached: the callers are autograd functions that compute their own
        gradients, and a compiled function guards on ``requires_grad``, so a tensor that
        sometimes carries it (a weight, an input that needs its gradient) would compile a
        graph per pattern and soon hit dynamo's recompile limit, after which every cast runs
        eagerly."""
        tensors = tuple(t.detach() for t, _ in operands)
        return _cast_function(tensors[0].device)(tensors, tuple(u for _, u in operands))

    def _mm(self, gemm: str, a_bits: Tensor, a_scale: Tensor, b_bits: Tensor,
            b_scale: Tensor, out_dtype: torch.dtype, out: Optional[Tensor] = None) -> Tensor:
        return scaled_mm(a_bits, a_scale, b_bits, b_scale, out_dtype, self.fast_accum[gemm],
                         self.config.emulate, out)

    def output(self, x_rows: Tensor, weight: Tensor) -> Tensor:
        """``x_rows [n, in] @ weight [out, in].T -> [n, out]`` (both operands cast in one
        call)."""
        a_spec, b_spec = self.casts["output"]
        ops = self._cast((x_rows, ((a_spec, False),)), (weight.t(), ((b_spec, True),)))
        return self._mm("output", *ops, x_rows.dtype)

    def cast_grad(self, grad_rows: Tensor, weight: Optional[Tensor] = None,
                  input_rows: Optional[Tensor] = None) -> "Float8Grad":
        """The backward's operands cast in one call: the output gradient ``[n, out]`` for
        both backward GEMMs (one cast for both where the recipe scales them alike) and, when
        given, the weight ``[out, in]`` for the input gradient's GEMM and the input
        ``[n, in]`` for the weight gradient's."""
        (gi_spec, w_spec), (gw_spec, x_spec) = self.casts["grad_input"], self.casts["grad_weight"]
        operands = [(grad_rows, ((gi_spec, False), (gw_spec, False)))]
        if weight is not None:
            operands.append((weight.t(), ((w_spec, True),)))
        if input_rows is not None:
            operands.append((input_rows, ((x_spec, True),)))
        ops = self._cast(*operands)
        pairs = iter([list(ops[i:i + 2]) for i in range(0, len(ops), 2)])
        return Float8Grad(grad_rows.dtype, next(pairs), next(pairs),
                          next(pairs) if weight is not None else None,
                          next(pairs) if input_rows is not None else None)

    def grad_input(self, grad: "Float8Grad | Tensor", weight: Tensor) -> Tensor:
        """``grad [n, out] @ weight [out, in] -> [n, in]`` (the weight cast as its
        transpose, scaled along ``in`` as torchao's rowwise recipe does). ``grad``: the
        output gradient or its :meth:`cast_grad`, whose casts for this GEMM are used (the
        weight's too, if it holds one) and released."""
        a_spec, b_spec = self.casts["grad_input"]
        if not isinstance(grad, Float8Grad):     # this GEMM's casts alone, in one call
            ops = self._cast((grad, ((a_spec, False),)), (weight.t(), ((b_spec, True),)))
            return self._mm("grad_input", *ops, grad.dtype)
        a, grad.for_grad_input = grad.for_grad_input, None
        b, grad.weight_cast = grad.weight_cast, None
        if b is None:
            b = self._cast((weight.t(), ((b_spec, True),)))
        return self._mm("grad_input", *a, *b, grad.dtype)

    def grad_weight(self, grad: "Float8Grad | Tensor", input_rows: Tensor,
                    out_dtype: torch.dtype, out: Optional[Tensor] = None) -> Tensor:
        """``grad [n, out].T @ input_rows [n, in] -> [out, in]`` in ``out_dtype`` (the
        float32 of ``main_grad``: the scaled GEMM writes float32, module docstring), into
        ``out`` if given (:func:`scaled_mm`). ``grad``: the output gradient or its
        :meth:`cast_grad` (whose cast of the input is used if it holds one)."""
        a_spec, b_spec = self.casts["grad_weight"]
        if not isinstance(grad, Float8Grad):     # this GEMM's casts alone, in one call
            ops = self._cast((grad, ((a_spec, False),)), (input_rows, ((b_spec, True),)))
            return self._mm("grad_weight", *ops, out_dtype, out)
        return self._mm("grad_weight", *grad.for_grad_weight,
                        *self._input_operand(grad, input_rows), out_dtype, out)

    def _input_operand(self, grad: "Float8Grad", input_rows: Tensor):
        """The weight-gradient GEMM's second operand: the input's cast ``grad`` holds
        (released from it), else cast now."""
        b, grad.input_cast = grad.input_cast, None
        if b is None:
            b = self._cast((input_rows, ((self.casts["grad_weight"][1], True),)))
        return b

    def add_grad_weight(self, grad: "Float8Grad", input_rows: Tensor, acc: Tensor,
                        written: bool, block_rows: int) -> None:
        """``acc [out, in] (+)= grad.T @ input_rows`` in ``acc``'s dtype (float32).
        ``written`` False: ``acc`` holds nothing yet and receives the product (the GEMM
        writes it, :func:`scaled_mm`); True: the product is added, ``block_rows`` rows of it
        at a time, so the temporary is ``block_rows x in`` (the output layer's ``out`` is
        the vocabulary: a whole ``[V, H]`` float32 temporary would be gigabytes)."""
        if not written:
            self.grad_weight(grad, input_rows, acc.dtype, out=acc)
            return
        b = self._input_operand(grad, input_rows)
        a_bits, a_scale = grad.for_grad_weight
        rows = a_bits.shape[0]
        per_row = a_scale.dim() >= 2 and a_scale.shape[0] == rows
        for r0 in range(0, rows, block_rows):
            r1 = min(r0 + block_rows, rows)
            acc[r0:r1] += self._mm("grad_weight", a_bits[r0:r1],
                                   a_scale[r0:r1] if per_row else a_scale, *b, acc.dtype)


class Float8Grad:
    """The backward's operands cast by :meth:`Float8Gemms.cast_grad`: the output gradient's
    ``[bits, scale]`` for the input gradient's GEMM and for the weight gradient's
    (``[out, n]``, row-major), and, where they were cast with it, the weight's for the input
    gradient's GEMM and the input's for the weight gradient's. Each but the weight
    gradient's output gradient is released once its GEMM has used it."""

    __slots__ = ("dtype", "for_grad_input", "for_grad_weight", "weight_cast", "input_cast")

    def __init__(self, dtype: torch.dtype, for_grad_input: Optional[List[Tensor]],
                 for_grad_weight: List[Tensor], weight_cast: Optional[List[Tensor]] = None,
                 input_cast: Optional[List[Tensor]] = None):
        self.dtype = dtype
        self.for_grad_input = for_grad_input
        self.for_grad_weight = for_grad_weight
        self.weight_cast = weight_cast
        self.input_cast = input_cast


__all__ = ["CastSpec", "Float8Gemms", "Float8Grad", "Float8Unavailable", "float8_linear_config",
           "compiled_casts", "float8_operands", "scaled_mm"]
