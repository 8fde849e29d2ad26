"""The linear layers' autograd with each weight gradient accumulated straight into ``main_grad``.

megatron-core's tensor-parallel linear layers return each weight gradient as a new tensor in
the parameter dtype (bf16), which DDP's hook then adds to the parameter's ``main_grad`` (the
float32 gradient buffer): per weight a bf16 tensor written and read, one more pass over the
float32 buffer, and a bf16 rounding of every micro-batch's gradient before it is summed.
Its ``gradient_accumulation_fusion`` (on by default in Megatron-LM) has the weight-gradient
GEMM add its float32 accumulator into ``main_grad`` instead, but only through apex's
``fused_weight_gradient_mlp_cuda`` extension: megatron-core 0.16.1 refuses the option
without it. PyTorch's ``torch.addmm(..., out_dtype=torch.float32)`` is the same GEMM
(bf16 operands, float32 accumulation and output, ``C += A @ B`` in cuBLAS's epilogue), so
this module does it with PyTorch (``--gradient-accumulation-fusion``, default on).

:func:`linear` has the contract of megatron-core's
``linear_with_grad_accumulation_and_async_allreduce`` (sequence-parallel all-gather of the
input, the asynchronous all-reduce or reduce-scatter of the input gradient overlapped with
the weight-gradient GEMM) and differs only there. The handshake with megatron-core's DDP is
megatron-core's own: the layer sets ``weight.grad_added_to_main_grad`` and returns an
uninitialised gradient of the weight's shape, so that DDP's hook (which must run on the
main thread under ``overlap_grad_reduce``) fires and skips its own addition. A weight with
no ``main_grad`` (a model outside DDP) or under Megatron-FSDP gets its gradient returned
as usual.

:func:`swiglu_linear` is FC2 with the SwiGLU inside (``--recompute-modules swiglu`` with
the ``usp`` kernels): FC2 keeps FC1's output, not the SwiGLU's, and its backward computes
the input gradient of the GEMM first, then the SwiGLU's backward, which rewrites the
SwiGLU's output over that gradient in the same pass
(:func:`megatron.layers.lean_kernels.swiglu_backward_refill`), and only then the weight
gradient from it. A refill before the backward (:func:`~megatron.layers.lean_kernels.drop_until_backward`)
read FC1's output once more: ``4 * F`` bytes per token and layer in bf16.

On the CPU (the test suite) the same functions run: a bf16 product into a float32 buffer is
computed in float32 from the upcast operands (exact products, float32 sums, as the GEMM).

Float8 (``--fp8-format``): given ``gemms`` (a :class:`megatron.layers.float8_gemms.Float8Gemms`),
the same functions run their three GEMMs through it and nothing else changes; the weight
gradient comes out of the float8 GEMM in ``main_grad``'s dtype and is added there, or, while
``grad_added_to_main_grad`` is still False (megatron-core's DDP resets it when it zeroes the
buffers, so nothing is there yet), written there by the GEMM itself.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.layers import lean_kernels

Tensor = torch.Tensor


def fuses_into_main_grad(weight: Tensor) -> bool:
    """Whether ``weight``'s gradient goes straight into its ``main_grad``: it has one and
    megatron-core's DDP tracks it (``grad_added_to_main_grad``); not under Megatron-FSDP,
    whose own hooks build its gradient buffers."""
    return (hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad")
            and not hasattr(weight, "__fsdp_param__"))


def accumulate_wgrad(main_grad: Tensor, grad_output: Tensor, total_input: Tensor) -> None:
    """``main_grad [out, in] += grad_output.T @ total_input`` for ``grad_output [n, out]`` and
    ``total_input [n, in]`` (one dtype), summed in the GEMM's float32 accumulator and rounded
    once into ``main_grad``'s dtype."""
    a, b = grad_output.t(), total_input
    if main_grad.dtype == a.dtype:
        main_grad.addmm_(a, b)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, a, b, out_dtype=main_grad.dtype, out=main_grad)
    else:   # the CPU has no mixed-dtype addmm: the same sums from upcast operands
        main_grad.addmm_(a.to(main_grad.dtype), b.to(main_grad.dtype))


def weight_grad(param: Optional[Tensor], grad_output: Tensor, total_input: Tensor,
                gemms=None) -> Tensor:
    """What a linear layer's backward returns for its weight (``grad_output [n, out]``,
    ``total_input [n, in]``). ``param``: the weight parameter itself when its gradient goes
    into its ``main_grad`` (:func:`_fused_param`); the gradient is added there and an
    uninitialised stand-in returned for DDP's hook (zeros where megatron-core asks for
    them, ``zero_out_wgrad``). ``None``: the gradient is returned. ``gemms``: the float8
    GEMMs (module docstring; ``grad_output`` then may be its ``cast_grad``), None for the
    input dtype's."""
    if param is None:
        if gemms is not None:
            return gemms.grad_weight(grad_output, total_input, total_input.dtype)
        return grad_output.t().matmul(total_input)
    if gemms is not None and not param.grad_added_to_main_grad:
        # nothing added since DDP zeroed main_grad: the float8 GEMM writes it
        gemms.grad_weight(grad_output, total_input, param.main_grad.dtype,
                          out=param.main_grad)
    elif gemms is not None:
        param.main_grad.add_(gemms.grad_weight(grad_output, total_input,
                                               param.main_grad.dtype))
    else:
        accumulate_wgrad(param.main_grad, grad_output, total_input)
    param.grad_added_to_main_grad = True
    make = torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty
    return make(param.shape, dtype=total_input.dtype, device=total_input.device)


def _fused_param(weight: Tensor, fuse: bool = True) -> Optional[Tensor]:
    """The parameter object, kept on the autograd context at forward time, when its
    gradient goes into ``main_grad``. Not the tensor ``saved_tensors`` gives back: under a
    non-reentrant checkpoint (the tiled MLP) that is another Python object on the same
    storage, and DDP's hook reads ``grad_added_to_main_grad`` (a Python attribute) from the
    parameter."""
    return weight if fuse and fuses_into_main_grad(weight) else None


def _gather_sequence(x: Tensor, tp_group, async_op: bool = False):
    """All-gather ``x [s/tp, ...]`` along the sequence over ``tp_group`` into megatron-core's
    shared buffer (``[s, ...]``); with ``async_op`` also the work handle."""
    from megatron.core.parallel_state import get_global_memory_buffer  # megatron-core on first use

    shape = list(x.shape)
    shape[0] *= tp_group.size()
    out = get_global_memory_buffer().get_tensor(shape, x.dtype, "mpu")
    handle = dist.all_gather_into_tensor(out, x.contiguous(), group=tp_group,
                                         async_op=async_op)
    return (out, handle) if async_op else out


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _forward_gemm(x: Tensor, weight: Tensor, gemms) -> Tensor:
    """``x [..., in] @ weight [out, in].T -> [..., out]`` (float8 through ``gemms``)."""
    if gemms is None:
        return torch.matmul(x, weight.t())
    return gemms.output(_rows(x), weight).view(*x.shape[:-1], weight.shape[0])


def _grad_input_gemm(grad: Tensor, weight: Tensor, gemms, grad_cast=None) -> Tensor:
    """``grad [..., out] @ weight [out, in] -> [..., in]`` (float8: ``grad_cast``, the
    gradient's :meth:`~megatron.layers.float8_gemms.Float8Gemms.cast_grad`)."""
    if gemms is None:
        return grad.matmul(weight)
    return gemms.grad_input(grad_cast, weight).view(*grad.shape[:-1], weight.shape[1])


def _cast_grad(grad_rows: Tensor, gemms, weight: Tensor, input_rows: Optional[Tensor] = None):
    """The output gradient as both backward GEMMs take it: with ``gemms``, cast into float8
    for both in one call with the weight (and ``input_rows``, where already there), or
    itself."""
    return grad_rows if gemms is None else gemms.cast_grad(grad_rows, weight, input_rows)


class _Linear(torch.autograd.Function):
    """``input [s, b, in] -> [s, b, out]`` (``[s/tp, ...]`` in with sequence parallelism)."""

    @staticmethod
    def forward(ctx, input_, weight, bias, allreduce_dgrad, sequence_parallel, tp_group,
                fuse_wgrad, gemms):
        ctx.save_for_backward(input_, weight)
        ctx.param = _fused_param(weight, fuse_wgrad)
        ctx.gemms = gemms
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel = allreduce_dgrad, sequence_parallel
        ctx.tp_group = tp_group
        total_input = _gather_sequence(input_, tp_group) if sequence_parallel else input_
        output = _forward_gemm(total_input, weight, gemms)
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        tp_group = ctx.tp_group
        handle = None
        if ctx.sequence_parallel:   # re-gather the input while the input gradient is computed
            total_input, handle = _gather_sequence(input_, tp_group, async_op=True)
        else:
            total_input = input_
        # without the gather the input is here already: its cast joins the gradient's
        grad_cast = _cast_grad(_rows(grad_output), ctx.gemms, weight,
                               None if handle is not None else _rows(total_input))
        grad_input = _grad_input_gemm(grad_output, weight, ctx.gemms, grad_cast)
        if handle is not None:
            handle.wait()
        input_rows = _rows(total_input)
        # The input gradient's reduction runs while the weight gradient is computed.
        if ctx.sequence_parallel:
            sub_grad_input = torch.empty(input_.shape, dtype=input_.dtype, device=input_.device)
            handle = dist.reduce_scatter_tensor(sub_grad_input, grad_input, group=tp_group,
                                                async_op=True)
        elif ctx.allreduce_dgrad:
            handle = dist.all_reduce(grad_input, group=tp_group, async_op=True)
        grad_weight = weight_grad(ctx.param, grad_cast, input_rows, ctx.gemms)
        grad_bias = _rows(grad_output).sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        if ctx.sequence_parallel:
            grad_input = sub_grad_input
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class _SwiGLULinear(torch.autograd.Function):
    """``x [s, b, 2F] -> SwiGLU(x) @ weight.T [s, b, out]``, keeping ``x`` only."""

    @staticmethod
    def forward(ctx, x, weight, fuse_wgrad, gemms):
        x = x.contiguous()
        act = lean_kernels.swiglu(x)                       # [s, b, F], freed on return
        ctx.save_for_backward(x, weight)
        ctx.param = _fused_param(weight, fuse_wgrad)
        ctx.gemms = gemms
        return _forward_gemm(act, weight, gemms)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_rows = _rows(grad_output.contiguous())               # [n, out]
        grad_cast = _cast_grad(grad_rows, ctx.gemms, weight)
        grad_act = _grad_input_gemm(grad_rows, weight, ctx.gemms, grad_cast)   # [n, F]
        # dx from grad_act, and grad_act's storage rewritten with SwiGLU(x), in one pass
        grad_x = lean_kernels.swiglu_backward_refill(grad_act, _rows(x))
        grad_weight = weight_grad(ctx.param, grad_cast, grad_act, ctx.gemms)
        return grad_x.view(x.shape), grad_weight, None, None


def linear(input_: Tensor, weight: Tensor, bias: Optional[Tensor], allreduce_dgrad: bool,
           sequence_parallel: bool, tp_group, fuse_wgrad: bool = True,
           gemms=None) -> Tensor:
    """megatron-core's ``linear_with_grad_accumulation_and_async_allreduce`` (no deferred
    embedding weight gradient) with the weight gradient added into ``weight.main_grad``
    where DDP keeps one (``fuse_wgrad``; else returned). ``allreduce_dgrad``: all-reduce the
    input gradient over ``tp_group``; ``sequence_parallel``: all-gather the input along the
    sequence (forward and backward) and reduce-scatter its gradient; at most one of the two.
    ``gemms``: a :class:`~megatron.layers.float8_gemms.Float8Gemms` running the three
    GEMMs in float8 (the communication is unchanged), or None."""
    if allreduce_dgrad and sequence_parallel:
        raise ValueError("allreduce_dgrad and sequence_parallel exclude each other")
    return _Linear.apply(input_, weight, bias, allreduce_dgrad, sequence_parallel, tp_group,
                         fuse_wgrad, gemms)


def swiglu_linear(x: Tensor, weight: Tensor, fuse_wgrad: bool = True, gemms=None) -> Tensor:
    """``SwiGLU(x) @ weight.T`` for FC1's output ``x [..., 2F]`` (gate then up, megatron's
    order) and this rank's FC2 weight ``[out, F]``; no communication (the row-parallel
    layer reduces the output). The SwiGLU output is not kept: the backward rebuilds it in
    the SwiGLU's backward pass. With ``fuse_wgrad`` the weight gradient goes into
    ``main_grad`` as for :func:`linear`; without, it is returned. ``gemms``: float8 GEMMs as
    for :func:`linear`."""
    if x.shape[-1] != 2 * weight.shape[-1]:
        raise ValueError(f"SwiGLU + linear: input {tuple(x.shape)} does not fit weight "
                         f"{tuple(weight.shape)} (need [..., {2 * weight.shape[-1]}])")
    return _SwiGLULinear.apply(x, weight, fuse_wgrad, gemms)
