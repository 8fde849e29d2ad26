"""The benchmark's peer: PyTorch's native context parallel, behind one small adapter.

PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` (experimental, torch >=
2.5) patches ``F.scaled_dot_product_attention`` inside a context so that each call on
sequence-sharded inputs runs ring attention over a 1-D ``DeviceMesh``, and shards the
``buffers`` it is given in place along their sequence dimension. With causal attention it
load-balances by the head-tail ("zigzag") token order: rank ``i`` of ``N`` holds chunks ``i``
and ``2N-1-i`` of ``2N``, the order of :mod:`megatron.usp.token_order`, so USP and the peer run
on the very same local tokens (:meth:`NativeContextParallel.enter` reports whether they match).
K/V rotate with an all-gather (default) or an all-to-all per step
(``set_rotate_method("allgather" | "alltoall")``).

Version differences absorbed here (written against torch 2.13's source, run on torch 2.11 +
cuDNN 9.19 on 2 H200s with both rotate methods, GQA and full attention): the private module moved from ``experimental._attention`` to
``experimental._context_parallel._attention`` (the old path re-exports it);
``set_rotate_method`` and ``_cp_options.enable_load_balance`` are looked up and used only
when present. Causal attention uses the load balancer; non-causal attention must run without
it (torch raises "Load balancing requires is_causal=True"), so it is switched off for the
context and restored after.

Memory: ``context_parallel`` shards its buffers with ``resize_``, which keeps the full-length
storage alive. Idiomatic use shards the token ids, not Q/K/V, so to measure the peer's own
working set the adapter copies the shards into compact tensors and releases the full-length
storage before anything is timed.

CPU: not supported. The CPU SDPA op (``aten._scaled_dot_product_flash_attention_for_cpu``)
has no context-parallel handler ("does not have a sharding strategy registered", torch
2.13), so :func:`unavailable_reason` says so and the benchmark skips the peer on the CPU.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.usp.token_order import shard_for_cp_rank

Tensor = torch.Tensor

ROTATE_METHODS: Tuple[str, ...] = ("allgather", "alltoall")
SDPA_BACKENDS: Tuple[str, ...] = ("cudnn", "flash", "efficient")


def _attention_module():
    """torch's private context-parallel module (where ``_cp_options`` lives), or None."""
    for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the peer cannot run here, or None when it can."""
    if device.type != "cuda":
        return ("PyTorch's native context parallel has no handler for the CPU SDPA op "
                "(aten._scaled_dot_product_flash_attention_for_cpu): it runs on CUDA only")
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401  (optional: torch's experimental API)
    except ImportError as exc:
        return f"torch {torch.__version__} has no context_parallel ({exc}); needs torch >= 2.5"
    if _attention_module() is None:
        return f"torch {torch.__version__}: context-parallel internals not found"
    return None


def sdpa_backend_context(name: str):
    """``sdpa_kernel`` forcing one SDPA backend (``cudnn``, ``flash`` or ``efficient``)."""
    backends = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
                "efficient": "EFFICIENT_ATTENTION"}
    if name not in backends:
        raise ValueError(f"--native-cp-backend {name!r}: choose one of {list(backends)}")
    return sdpa_kernel([getattr(SDPBackend, backends[name])])


class NativeContextParallel:
    """One configured use of ``context_parallel`` over all ranks of the default group.

    Args:
        device: this rank's CUDA device.
        rotate: ``"allgather"`` or ``"alltoall"`` (K/V rotation).
        causal: causal attention (load-balanced) or full attention (not load-balanced).
        backend: the SDPA backend forced inside (``cudnn`` matches the anchors).

    Use::

        with NativeContextParallel(dev, "allgather", True, "cudnn") as cp:
            q, k, v, dout = cp.enter([q_full, k_full, v_full, dout_full])   # [b, h, S/N, d]
            out = cp.attention(q, k, v)                                      # [b, h, S/N, d]

    Inputs of :meth:`enter` are full-sequence [b, h, S, d] tensors (same values on every
    rank); they are consumed (their storage is released).
    """

    def __init__(self, device: torch.device, rotate: str, causal: bool, backend: str = "cudnn"):
        reason = unavailable_reason(device)
        if reason:
            raise RuntimeError(reason)
        if rotate not in ROTATE_METHODS:
            raise ValueError(f"--native-cp-rotate {rotate!r}: choose from {list(ROTATE_METHODS)}")
        self.device = device
        self.rotate = rotate
        self.causal = causal
        self.backend = backend
        self._stack: Optional[contextlib.ExitStack] = None
        self._mesh = None
        self.same_order_as_usp: Optional[bool] = None

    # ------------------------------------------------------------------ options
    def _set_options(self, stack: contextlib.ExitStack) -> None:
        """Rotation method and load balancing for the context; old values restored on exit."""
        mod = _attention_module()
        opts = getattr(mod, "_cp_options", None)
        if opts is not None and hasattr(opts, "enable_load_balance"):
            old_lb = opts.enable_load_balance
            opts.enable_load_balance = self.causal
            stack.callback(setattr, opts, "enable_load_balance", old_lb)
        set_rotate = getattr(mod, "set_rotate_method", None)
        if set_rotate is not None and opts is not None and hasattr(opts, "rotate_method"):
            old_rotate = opts.rotate_method
            set_rotate(self.rotate)
            stack.callback(setattr, opts, "rotate_method", old_rotate)
        elif self.rotate != "allgather":
            raise RuntimeError(f"torch {torch.__version__} cannot set the rotate method "
                               f"(--native-cp-rotate {self.rotate}); use allgather")

    def __enter__(self) -> "NativeContextParallel":
        self._mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        self._stack = contextlib.ExitStack()
        self._set_options(self._stack)
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    # ------------------------------------------------------------------ use
    def enter(self, full: Sequence[Tensor]) -> List[Tensor]:
        """Shard full-sequence [b, h, S, d] tensors the peer's way; enable its SDPA dispatch.

        Returns compact local shards [b, h, S/N, d]. Records in ``same_order_as_usp`` whether
        the shards equal :func:`megatron.usp.token_order.shard_for_cp_rank` of the same inputs.
        """
        from torch.distributed.tensor.experimental import (  # optional: torch's experimental context parallel
            context_parallel,  # optional: torch's experimental context parallel
        )

        if self._stack is None:
            raise RuntimeError("use NativeContextParallel as a context manager")
        rank, world = dist.get_rank(), dist.get_world_size()
        probe = shard_for_cp_rank(full[0], 2, rank, world) if self.causal else None
        buffers = list(full)
        self._stack.enter_context(context_parallel(
            self._mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers),
            no_restore_buffers=set(buffers)))
        local = [b.clone() for b in buffers]     # compact copies of the shards
        for b in buffers:
            b.set_()                             # release the full-length storage
        if probe is not None:
            self.same_order_as_usp = bool(torch.equal(local[0], probe))
        return local

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Ring attention through the patched SDPA on local shards [b, h, S/N, d]."""
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        with sdpa_backend_context(self.backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, **gqa)

    def unshard(self, x: Tensor) -> Tensor:
        """Local [b, h, S/N, d] back to the full sequence in natural order (all ranks)."""
        unshard = getattr(_attention_module(), "context_parallel_unshard", None)
        if unshard is None:
            raise RuntimeError(f"torch {torch.__version__} has no context_parallel_unshard")
        return unshard(self._mesh, [x.contiguous()], [2])[0]
