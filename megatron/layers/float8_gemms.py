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
one float32 ``[out, in]`` temporary per GEMM.

The casts: torchao's eager cast runs amax, scale, an upcast to float32, the multiply, the clamp
and the float8 conversion as separate passes over the operand, which on the GPU costs more than
the float8 GEMM saves (torchao's own speed-ups assume ``torch.compile``). On CUDA each cast is
therefore one compiled function of plain tensors (:func:`scaled_float8_bits`: the same
torchao functions, so the same values) and the result is wrapped in the tensor subclass after;
elsewhere the function runs eagerly.

Scaling state: dynamic scaling (both recipes) keeps none; every cast computes its scale from
the tensor it casts, so checkpoints carry nothing float8-specific.
"""

from __future__ import annotations

import dataclasses

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
    times the scale, saturated): plain tensors, so the whole cast compiles into few kernels."""
    from torchao.float8 import float8_utils  # optional dependency
    scale = float8_utils.tensor_to_scale(t, float8_dtype, False, None, granularity,
                                         axiswise_dim, round_scales_to_power_of_2)
    return float8_utils.to_fp8_saturated(t.to(torch.float32) * scale, float8_dtype), scale


_COMPILED_BITS = None


def _bits_function(device: torch.device):
    """:func:`scaled_float8_bits`, compiled once per process for CUDA operands (dynamic
    shapes: one graph per cast kind, not per linear shape); eager elsewhere."""
    global _COMPILED_BITS
    if device.type != "cuda":
        return scaled_float8_bits
    if _COMPILED_BITS is None:
        _COMPILED_BITS = torch.compile(scaled_float8_bits, dynamic=True)
    return _COMPILED_BITS


class Float8Gemms:
    """The output, input-gradient and weight-gradient GEMMs of a linear layer in float8.

    Operands are high-precision (bf16 or float32) tensors; each method casts both with a
    dynamic scale and returns the product in the first operand's dtype unless told otherwise.
    Stateless apart from the configuration: one object can serve every linear layer.
    """

    def __init__(self, options: Float8Options):
        _, scaling, tensor = _torchao()
        self.options = options
        self.config = config = float8_linear_config(options)
        self._scaling, self._tensor = scaling, tensor
        gemm = [config.gemm_config_output, config.gemm_config_grad_input,
                config.gemm_config_grad_weight]
        # One ScaledMMConfig per GEMM, as torchao's Float8Linear builds them.
        self.mm_config = tensor.LinearMMConfig(*(
            tensor.ScaledMMConfig(config.emulate, g.use_fast_accum, False,
                                  config.pad_inner_dim) for g in gemm))

    def _cast(self, t: Tensor, cast_config, role: str, axis: int):
        """torchao's ``hp_tensor_to_float8_dynamic`` of ``t``, its cast compiled on CUDA."""
        granularity = cast_config.scaling_granularity
        axiswise_dim = self._scaling.get_maybe_axiswise_dim(axis, granularity)
        bits, scale = _bits_function(t.device)(t, cast_config.target_dtype, granularity,
                                               axiswise_dim,
                                               self.config.round_scales_to_power_of_2)
        return self._tensor.Float8TrainingTensor(
            bits, scale, t.dtype, linear_mm_config=self.mm_config,
            gemm_input_role=self._tensor.GemmInputRole[role], axiswise_dim=axiswise_dim)

    def output(self, x_rows: Tensor, weight: Tensor) -> Tensor:
        """``x_rows [n, in] @ weight [out, in].T -> [n, out]``."""
        c = self.config
        x8 = self._cast(x_rows, c.cast_config_input, "INPUT", -1)
        w8_t = self._cast(weight.t(), c.cast_config_weight, "WEIGHT", 0)
        return torch.mm(x8, w8_t)

    def grad_input(self, grad_rows: Tensor, weight: Tensor) -> Tensor:
        """``grad_rows [n, out] @ weight [out, in] -> [n, in]``."""
        c = self.config
        g8 = self._cast(grad_rows, c.cast_config_grad_output, "GRAD_OUTPUT", -1)
        w8_t = self._cast(weight.t(), c.cast_config_weight_for_grad_input, "WEIGHT", -1)
        return torch.mm(g8, w8_t.t())

    def grad_weight(self, grad_rows: Tensor, input_rows: Tensor,
                    out_dtype: torch.dtype) -> Tensor:
        """``grad_rows [n, out].T @ input_rows [n, in] -> [out, in]`` in ``out_dtype``
        (the float32 of ``main_grad``: the scaled GEMM writes float32, module docstring)."""
        c = self.config
        g8 = self._cast(grad_rows, c.cast_config_grad_output_for_grad_weight,
                        "GRAD_OUTPUT", 0)
        x8 = self._cast(input_rows, c.cast_config_input_for_grad_weight, "INPUT", 0)
        if g8._orig_dtype != out_dtype:   # the product's dtype is its first operand's
            g8 = self._tensor.Float8TrainingTensor(g8._data, g8._scale, out_dtype,
                                                   g8._linear_mm_config,
                                                   g8._gemm_input_role, g8._axiswise_dim)
        return torch.mm(g8.t(), x8)


__all__ = ["Float8Gemms", "Float8Unavailable", "float8_linear_config"]
