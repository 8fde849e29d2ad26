"""Linear layers that apply the elementwise op before them and keep only its input.

A transformer layer keeps, for each linear layer's weight gradient, the linear's input: the
RMSNorm outputs before QKV and FC1 (``2 * s * b * h`` elements per layer) and the SwiGLU
output before FC2 (``s * b * F``). Both are cheap elementwise functions of tensors the layer
keeps anyway (the residual stream, FC1's output), so these modules compute them, feed the
linear layer, free them, and recompute them in the backward just before the linear layer
needs them, with megatron-core's own mechanism for this
(``tensor_parallel.CheckpointWithoutOutput``, the one behind
``recompute_modules=["layernorm"]``). For the 0.85B benchmark model at 32K tokens that is
4 GiB (norms) + 5.5 GiB (SwiGLU) of activations for about 1 % more step time (one extra
norm / SwiGLU forward per layer in the backward).

* :class:`NormColumnParallelLinear` fills the ``linear_qkv`` and ``linear_fc1`` slots, with
  ``input_layernorm`` / ``pre_mlp_layernorm`` set to ``IdentityOp`` (megatron-core's own
  pattern for TransformerEngine's ``LayerNormColumnParallelLinear``). Its norm weight is
  ``layer_norm_weight`` (and ``layer_norm_bias`` for LayerNorm), the names the local spec's
  ``sharded_state_dict_keys_map`` gives the separate norms in checkpoints, so checkpoints load
  either way.
* :class:`SwiGLURowParallelLinear` fills ``linear_fc2`` and takes FC1's ``[.., 2F/tp]``
  output, with the MLP's activation slot set to :class:`PassThroughActivation`.

With the ``usp`` kernels (:mod:`megatron.layers.lean_kernels`) the dropped norm output is
rewritten in place from a gradient hook of the linear layer's output (no recompute graph, no
copy-back) and the op's backward is its own kernel; the SwiGLU runs inside FC2's autograd
function (:func:`megatron.layers.linear_wgrad.swiglu_linear`), whose backward rebuilds its output
in the SwiGLU's backward kernel. With any other kernel megatron-core's
``CheckpointWithoutOutput`` recomputes them (a graph, a new tensor, a copy into the dropped
storage). All free the same bytes.

``--recompute-granularity selective --recompute-modules layernorm`` (Megatron-LM's name, which
megatron-core 0.16.1 implements only with TransformerEngine) and ``... swiglu`` select them
(:func:`megatron.training.model.layer_specs.get_usp_gpt_layer_spec`). Under a recompute that re-runs the
forward without gradients (full recompute's first pass) they keep nothing anyway and just
compute.

Sequence parallelism: the norm runs on this rank's ``[s/(CP*TP), b, h]`` before
megatron-core's column-parallel linear all-gathers; the linear keeps (and discards) that
local tensor and re-gathers it in its backward, so nothing else changes. Norm parameters
carry ``sequence_parallel`` for the TP gradient reduction, as :mod:`megatron.layers.norms` does.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import CheckpointWithoutOutput
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule

from megatron.layers import fused_kernels, lean_kernels, linear_wgrad
from megatron.layers.norms import NORMALIZATIONS

Tensor = torch.Tensor


def _keeps_graph(out: Tensor) -> bool:
    return torch.is_grad_enabled() and out.requires_grad


def _checkpoint_without_output() -> CheckpointWithoutOutput:
    # fp8=None: megatron-core 0.16.1 reads its default (fp8=False) as "FP8 on" and then
    # needs TransformerEngine; None is its spelling of "no FP8".
    return CheckpointWithoutOutput(fp8=None)


def _norm_param(config, size: int, fill: float) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.full((size,), fill, dtype=config.params_dtype))
    param.sequence_parallel = config.sequence_parallel
    return param


class _WgradIntoMainGrad:
    """``_forward_impl`` of megatron-core's parallel linear layers (the method through which
    they run their autograd function) replaced by :func:`megatron.layers.linear_wgrad.linear`
    when ``fuse_wgrad`` (``--gradient-accumulation-fusion``, a constructor argument) is set:
    the weight gradient is added into ``main_grad`` by the GEMM; or when the layer runs in
    float8 (:meth:`run_in_float8`, decided after the model is built:
    :mod:`megatron.layers.float8_policy`). Frozen weights and a deferred embedding weight
    gradient (``grad_output_buffer``) keep megatron-core's path."""

    def __init__(self, *args, fuse_wgrad: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.fuse_wgrad = fuse_wgrad
        self.float8_gemms = None

    def run_in_float8(self, gemms) -> None:
        """Run this layer's GEMMs through ``gemms``
        (:class:`~megatron.layers.float8_gemms.Float8Gemms`); None: in the weight's dtype."""
        self.float8_gemms = gemms

    def _forward_impl(self, input, weight, *args, **kwargs):
        if ((not self.fuse_wgrad and self.float8_gemms is None) or args
                or not weight.requires_grad or kwargs.get("grad_output_buffer") is not None):
            return super()._forward_impl(input, weight, *args, **kwargs)
        return linear_wgrad.linear(input, weight, kwargs.get("bias"),
                                   kwargs.get("allreduce_dgrad", False),
                                   kwargs.get("sequence_parallel", False),
                                   kwargs.get("tp_group"), fuse_wgrad=self.fuse_wgrad,
                                   gemms=self.float8_gemms)


class USPColumnParallelLinear(_WgradIntoMainGrad, ColumnParallelLinear):
    """megatron-core's ``ColumnParallelLinear`` plus ``fuse_wgrad`` (:class:`_WgradIntoMainGrad`)."""


class USPRowParallelLinear(_WgradIntoMainGrad, RowParallelLinear):
    """megatron-core's ``RowParallelLinear`` plus ``fuse_wgrad`` (:class:`_WgradIntoMainGrad`)."""


class NormColumnParallelLinear(USPColumnParallelLinear):
    """``ColumnParallelLinear`` applied to ``norm(x)``; keeps ``x``, not ``norm(x)``.

    Same constructor as :class:`USPColumnParallelLinear` plus ``norm_impl`` (the RMSNorm
    kernel of :func:`megatron.layers.fused_kernels.rms_norm`) and ``residual_grad`` (as
    :mod:`megatron.layers.norms`' ``residual_grad``). Normalisation and epsilon from the config
    (``normalization``, ``layernorm_epsilon``, ``layernorm_zero_centered_gamma``).
    Input ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism); output as the parent's.
    """

    def __init__(self, input_size: int, output_size: int, *, config, norm_impl: str = "torch",
                 residual_grad: bool = False, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.residual_grad = residual_grad
        if config.normalization not in NORMALIZATIONS:
            raise ValueError(f"--normalization {config.normalization!r}: use one of "
                             f"{list(NORMALIZATIONS)}")
        self.normalization = config.normalization
        self.norm_impl = norm_impl
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.layer_norm_weight = _norm_param(config, input_size,
                                             0.0 if self.zero_centered_gamma else 1.0)
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = _norm_param(config, input_size, 0.0)

    def norm(self, x: Tensor) -> Tensor:
        offset = 1.0 if self.zero_centered_gamma else 0.0
        if self.normalization == "RMSNorm":
            return fused_kernels.rms_norm(x, self.layer_norm_weight, self.eps, self.norm_impl,
                                          offset=offset)
        gamma = self.layer_norm_weight + offset if offset else self.layer_norm_weight
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), gamma, self.layer_norm_bias,
                                              self.eps)

    def forward(self, input_: Tensor, weight=None, runtime_gather_output=None):
        if not torch.is_grad_enabled():
            return super().forward(self.norm(input_), weight, runtime_gather_output)
        if self.norm_impl == "usp" and self.normalization == "RMSNorm":
            normed, refill = lean_kernels.rms_norm(
                input_, self.layer_norm_weight, self.eps,
                1.0 if self.zero_centered_gamma else 0.0, refillable=True,
                residual_grad=self.residual_grad)
            out, bias = super().forward(normed, weight, runtime_gather_output)
            if _keeps_graph(out):
                lean_kernels.drop_until_backward(normed, out, refill)
            return out, bias
        ckpt = _checkpoint_without_output()
        normed = ckpt.checkpoint(self.norm, input_)
        out, bias = super().forward(normed, weight, runtime_gather_output)
        if _keeps_graph(out):
            ckpt.discard_output_and_register_recompute(out)
        return out, bias


class PassThroughActivation(MegatronModule):
    """The MLP's activation slot when FC2 applies the SwiGLU itself: returns FC1's output.
    (megatron-core's ``IdentityOp`` has no ``sharded_state_dict``, which the MLP asks of
    every child.)"""

    def __init__(self, config):
        super().__init__(config=config)

    def forward(self, x: Tensor) -> Tensor:
        return x


class SwiGLURowParallelLinear(USPRowParallelLinear):
    """``RowParallelLinear`` (FC2) applied to ``SwiGLU(x)``; keeps FC1's output ``x``.

    Same constructor as :class:`USPRowParallelLinear` plus ``swiglu_impl``
    (:func:`megatron.layers.fused_kernels.swiglu`). Input ``[s, b, 2F/tp]`` (gate and up
    columns of this TP rank's features, as FC1 writes them); output as the parent's.
    With the ``usp`` kernels the SwiGLU runs inside FC2's autograd function
    (:func:`megatron.layers.linear_wgrad.swiglu_linear`), whose backward rebuilds the output
    in the SwiGLU's own backward pass; with the others megatron-core's recompute does.
    """

    def __init__(self, input_size: int, output_size: int, *, config, swiglu_impl: str = "torch",
                 **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        if not self.input_is_parallel:
            raise ValueError("SwiGLURowParallelLinear takes FC1's TP-parallel output: "
                             "input_is_parallel must be True")
        self.swiglu_impl = swiglu_impl

    def activation(self, x: Tensor) -> Tensor:
        return fused_kernels.swiglu(x, self.swiglu_impl)

    def _forward_impl(self, input, weight, *args, **kwargs):
        if self.swiglu_impl != "usp" or not weight.requires_grad:
            return super()._forward_impl(input, weight, *args, **kwargs)
        # Row-parallel: no communication inside (megatron-core passes no bias either).
        return linear_wgrad.swiglu_linear(input, weight, fuse_wgrad=self.fuse_wgrad,
                                          gemms=self.float8_gemms)

    def forward(self, input_: Tensor):
        if self.swiglu_impl == "usp" and self.weight.requires_grad:
            return super().forward(input_)      # the SwiGLU runs in _forward_impl
        if not torch.is_grad_enabled():
            return super().forward(self.activation(input_))
        ckpt = _checkpoint_without_output()
        act = ckpt.checkpoint(self.activation, input_)
        out, bias = super().forward(act)
        if _keeps_graph(out):
            ckpt.discard_output_and_register_recompute(out)
        return out, bias
