"""RMSNorm and LayerNorm of the GPT layer spec: plain PyTorch, Megatron-sequence-parallel aware.

Why not megatron-core's own norms: ``WrappedTorchNorm`` (``torch.nn.RMSNorm`` /
``torch.nn.LayerNorm``, what the local spec and ``TransformerBlock`` fall back to without
TransformerEngine or apex) asserts ``not config.sequence_parallel``; ``FusedLayerNorm`` needs
apex and has no RMSNorm; ``TENorm`` needs TransformerEngine. These two modules compute what
``WrappedTorchNorm`` computes (the same ``torch.nn.functional.rms_norm`` / ``layer_norm``
call, the same parameter names, so checkpoints load either way) and mark their parameters
the way megatron-core's fused norms do.

Sequence-parallel contract. With ``--sequence-parallel`` the norms run in the
sequence-parallel region: a rank's input is ``[s/(CP*TP), b, h]``, its 1/TP of the CP rank's
tokens, so the weight (and bias) gradient of one TP rank is a partial sum over its tokens.
Every parameter carries ``sequence_parallel = config.sequence_parallel``; megatron-core's
``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) sums the gradients
of parameters so marked over the TP group when ``config.sequence_parallel`` is on: one
all-reduce per step of every marked gradient coalesced, 4 bytes per norm parameter (float32
main grads; 2 with bf16 gradient reduction). Without sequence parallelism every TP rank sees
the same tokens and the gradients already agree; the attribute is then ``False`` and nothing
is reduced.

Constructor: ``(config, hidden_size, eps)``, as megatron-core's ``build_module`` calls norms
(``TransformerLayer``'s input / pre-MLP norms, ``SelfAttention``'s q / k norms with
``hidden_size = kv_channels``, ``TransformerBlock``'s final norm). Parameters are created in
``config.params_dtype`` on the default device (the model is moved afterwards).
``config.layernorm_zero_centered_gamma`` stores ``gamma - 1`` (initialised to 0) and applies
``weight + 1``, as megatron-core's fused norms do. ``config.persist_layer_norm`` and
``config.memory_efficient_layer_norm`` choose apex kernels (same math) and are ignored.

Kernel: ``impl`` (the layer spec passes ``--fused-kernels``' choice) selects the RMSNorm
kernel of :func:`megatron.layers.fused_kernels.rms_norm` (``torch``, ``compile``, ``liger`` or
``usp``);
the parameters and their names do not depend on it, so a checkpoint loads under any choice.
LayerNorm always uses PyTorch's kernel (no model of this project's presets uses it).
"""

from __future__ import annotations

from typing import Type

import torch
import torch.nn.functional as F

from megatron.layers.fused_kernels import KERNEL_IMPLS, rms_norm

NORMALIZATIONS = ("RMSNorm", "LayerNorm")


def _new_param(config, hidden_size: int, fill: float) -> torch.nn.Parameter:
    """A 1-D parameter of ``hidden_size`` filled with ``fill``, marked for the SP reduction."""
    param = torch.nn.Parameter(torch.full((hidden_size,), fill, dtype=config.params_dtype))
    # Read by megatron-core's finalize_model_grads: sum this gradient over the TP group.
    param.sequence_parallel = config.sequence_parallel
    return param


class _Norm(torch.nn.Module):
    """What both norms share: the constructor megatron-core calls, ``weight``, ``eps``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, impl: str = "torch"):
        super().__init__()
        if impl not in KERNEL_IMPLS:
            raise ValueError(f"norm impl {impl!r}; use one of {list(KERNEL_IMPLS)}")
        self.impl = impl
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.weight = _new_param(config, hidden_size, 0.0 if self.zero_centered_gamma else 1.0)

    def gamma(self) -> torch.Tensor:
        """The scale applied: ``weight + 1`` when zero-centred, else ``weight``."""
        return self.weight + 1 if self.zero_centered_gamma else self.weight

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, impl={self.impl}, "
                f"sequence_parallel={self.weight.sequence_parallel}")


class RMSNorm(_Norm):
    """``y = x / sqrt(mean(x^2 over h) + eps) * weight`` over the last dimension.

    Input: ``[..., hidden_size]`` (in the layers ``[s_local, b, h]``; ``s_local = s/(CP*TP)``
    with sequence parallelism), any floating dtype; output: the same shape and dtype.
    Parameter ``weight [hidden_size]`` (ones, or zeros when zero-centred).
    ``residual_grad`` (the layer spec's input and pre-MLP norms): the gradient the input
    receives as the sublayer's residual is added in the norm's backward where the kernel can
    (:mod:`megatron.layers.residual`).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, impl: str = "torch",
                 residual_grad: bool = False):
        super().__init__(config, hidden_size, eps, impl)
        self.residual_grad = residual_grad

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.weight, self.eps, self.impl,
                        offset=1.0 if self.zero_centered_gamma else 0.0,
                        residual_grad=self.residual_grad)


class LayerNorm(_Norm):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension.

    Input and output as :class:`RMSNorm`. Parameters ``weight`` (ones, or zeros when
    zero-centred) and ``bias`` (zeros), both ``[hidden_size]``.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, impl: str = "torch"):
        super().__init__(config, hidden_size, eps, impl)
        self.bias = _new_param(config, hidden_size, 0.0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(hidden, self.normalized_shape, self.gamma(), self.bias, self.eps)


def norm_class(normalization: str) -> Type[torch.nn.Module]:
    """The norm module for ``normalization`` (``"RMSNorm"`` or ``"LayerNorm"``); any other
    name raises ValueError naming ``--normalization``."""
    if normalization == "RMSNorm":
        return RMSNorm
    if normalization == "LayerNorm":
        return LayerNorm
    raise ValueError(
        f"--normalization {normalization!r} is not supported; use one of {list(NORMALIZATIONS)}")
