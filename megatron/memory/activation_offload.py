"""Activations kept for full recompute, in host memory between the forward and the recompute.

Under megatron-core's full recompute (``--recompute-granularity full``, its
``CheckpointFunction``) the forward of a layer runs without autograd and keeps one tensor: the
input of the recompute unit (``[s, b, h]``: 2 GiB per layer at 512K tokens and hidden 2048, bf16).
With ``--recompute-keep-core-attn`` each layer also keeps its core-attention output
(:mod:`megatron.memory.kept_attention`). :class:`ActivationOffloader` holds these *items*: on the
device, or (``--recompute-cpu-offload layer_input core_attn``) in pinned host memory, copied there
on a side stream during the forward and brought back on another side stream ahead of the
backward's use, so that the copies overlap compute.

Why not megatron-core 0.16.1's own offloading: ``TransformerConfig.cpu_offloading`` takes its
context from TransformerEngine (``get_cpu_offload_context``; ``TransformerBlock`` asserts it off
without TE) and ``TransformerConfig.__post_init__`` refuses it with any recompute;
``fine_grained_activation_offloading`` offloads what chosen submodules save for backward while
autograd records them, which under full recompute happens only inside the backward's recompute,
where moving it to the host and back gains nothing. Both are CUDA-only.

How the inputs are caught: :func:`install_recompute_offload` puts PyTorch's
``saved_tensors_hooks`` around the decoder's forward (module hooks, no upstream code changed) and
records each layer's ``hidden_states`` argument (layer forward pre-hooks). A tensor saved for
backward while grad mode is off (``CheckpointFunction``'s ``save_for_backward`` is packed inside
``Function.apply``, in no-grad mode) that *is* a recorded layer input becomes an item; everything
else (the RoPE table and masks the checkpoint also saves, the final norm's input) is left alone.

Order and prefetch: items of one decoder forward (a *group*; with pipeline parallelism several
groups are open at once) are used in the backward in the reverse of their creation order
(layer l's input, then its kept attention output, then layer l-1's ...). Taking item i starts
the host-to-device copies of items i-1 .. i-``prefetch``; the newest ``prefetch`` items of a
forward never leave the device (they are needed first). On CUDA::

    forward   compute: | layer l-1 | layer l   | layer l+1 | ...
              D2H:                 | in(l-1)   | in(l)     |        (after the layer is queued)
    backward  compute: ... | recompute + backward of l | of l-1 ...
              H2D:           | in(l-1), attn(l-1) |           (one layer ahead)

Host memory: one pinned buffer per offloaded item, reused from step to step
(:class:`HostBufferPool`); PyTorch's pinned allocator rounds each to a power of two (no waste
for power-of-two sequence lengths and hidden sizes). Bytes per layer and step: the item sizes,
once each way over PCIe.

On the CPU (tests, ``--device cpu``) the same code runs with synchronous copies into separate
CPU buffers, so the numerics of an offloaded run are those of the device run: identical.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

Tensor = torch.Tensor

MIN_OFFLOAD_BYTES = 1 << 20   # smaller tensors are not worth a copy (megatron-core's default)
from megatron.usp.backend_names import OFFLOAD_CHOICES  # noqa: E402  (torch-free, for --help)
from megatron.usp.backend_names import OFFLOAD_PREFETCH as DEFAULT_PREFETCH  # noqa: E402


@dataclass(frozen=True)
class OffloadConfig:
    """What the full-recompute path keeps where (``--recompute-*`` flags; the CLI builds
    it: :attr:`megatron.training.cli.config.RunConfig.offload`)."""

    layer_input: bool = False      # --recompute-cpu-offload layer_input
    core_attn: bool = False        # --recompute-cpu-offload core_attn
    keep_core_attn: bool = False   # --recompute-keep-core-attn
    prefetch: int = DEFAULT_PREFETCH

    @property
    def active(self) -> bool:
        return self.layer_input or self.keep_core_attn


@dataclass(eq=False)
class OffloadItem:
    """One kept tensor: on the device (``device_tensor``) and/or in ``host`` memory."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    group: List["OffloadItem"]
    index: int
    device_tensor: Optional[Tensor] = None
    host: Optional[Tensor] = None
    d2h_done: Optional[object] = None     # torch.cuda.Event on CUDA
    h2d_done: Optional[object] = None
    taken: bool = False

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * torch.empty((), dtype=self.dtype).element_size()


class HostBufferPool:
    """Host buffers by (numel, dtype), pinned when copies go to a CUDA device; reused.

    A buffer handed back with an event is reused only after that event (its last
    host-to-device copy) completed.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: Dict[Tuple[int, torch.dtype], List[Tuple[Tensor, Optional[object]]]] = {}
        self.allocated_bytes = 0

    def get(self, numel: int, dtype: torch.dtype) -> Tensor:
        free = self._free.get((numel, dtype))
        if free:
            buf, ready = free.pop()
            if ready is not None:
                ready.synchronize()
            return buf
        buf = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
        self.allocated_bytes += buf.numel() * buf.element_size()
        return buf

    def put(self, buf: Tensor, ready: Optional[object]) -> None:
        self._free.setdefault((buf.numel(), buf.dtype), []).append((buf, ready))

    def reserve(self, numel: int, dtype: torch.dtype, count: int) -> None:
        """Allocate ``count`` buffers now (pinning 2 GiB takes a while; better at start-up,
        where a host out-of-memory also shows before training)."""
        have = len(self._free.get((numel, dtype), []))
        bufs = [self.get(numel, dtype) for _ in range(max(0, count - have))]
        for buf in bufs:
            self.put(buf, None)


class _Copies:
    """Device <-> host copies: on two side streams for CUDA, synchronous otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)

    def to_host(self, src: Tensor, host: Tensor) -> Optional[object]:
        """Copy ``src`` into ``host``; returns the event that marks the copy done (CUDA)."""
        if not self.cuda:
            host.view(src.shape).copy_(src)
            return None
        # The D2H stream reads src after the compute stream has produced it; src's memory
        # is not reused before the copy ends (record_stream), though the caller drops it.
        self.d2h.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.d2h):
            host.view(src.shape).copy_(src, non_blocking=True)
            src.record_stream(self.d2h)
            return self.d2h.record_event()

    def to_device(self, item: OffloadItem) -> None:
        """Start bringing ``item.host`` back; sets ``device_tensor`` (and ``h2d_done``)."""
        dst = torch.empty(item.shape, dtype=item.dtype, device=item.device)
        if not self.cuda:
            dst.copy_(item.host.view(item.shape))
            item.device_tensor = dst
            return
        # dst is allocated on the compute stream: its block may still be read or written by
        # compute work queued before now, so the H2D stream starts after that work.
        self.h2d.wait_stream(torch.cuda.current_stream(item.device))
        if item.d2h_done is not None:
            self.h2d.wait_event(item.d2h_done)
        with torch.cuda.stream(self.h2d):
            dst.copy_(item.host.view(item.shape), non_blocking=True)
            item.h2d_done = self.h2d.record_event()
        item.device_tensor = dst

    def wait_arrival(self, item: OffloadItem) -> None:
        if self.cuda and item.h2d_done is not None:
            torch.cuda.current_stream(item.device).wait_event(item.h2d_done)


@dataclass
class OffloadStats:
    """Counters of one offloader (read by tests and the logs)."""

    kept: int = 0
    offloaded: int = 0
    offloaded_bytes: int = 0
    prefetched: int = 0
    reloaded_on_demand: int = 0
    taken: int = 0


class ActivationOffloader:
    """Keeps full-recompute activations (module docstring), one instance per model chunk.

    ``keep(tensor, to_host)`` makes an item of the open group and returns it; ``take(item)``
    returns the tensor on its device (each item is taken once). ``forward_started`` /
    ``forward_finished`` bracket one decoder forward (:func:`install_recompute_offload` calls
    them).
    """

    def __init__(self, device: torch.device, config: OffloadConfig,
                 min_offload_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.device = torch.device(device)
        self.config = config
        self.min_offload_bytes = min_offload_bytes
        self.pool = HostBufferPool(pin=self.device.type == "cuda")
        self._copies = _Copies(self.device)
        self._group: Optional[List[OffloadItem]] = None
        self._layer_inputs: Dict[int, weakref.ref] = {}
        self.stats = OffloadStats()

    def reserve(self, shape: Tuple[int, ...], dtype: torch.dtype, count: int) -> None:
        """Pre-allocate host buffers for ``count`` offloaded items of ``shape``."""
        numel = 1
        for d in shape:
            numel *= d
        if numel * torch.empty((), dtype=dtype).element_size() >= self.min_offload_bytes:
            self.pool.reserve(numel, dtype, count)

    # ----------------------------------------------------------------- groups
    @property
    def recording(self) -> bool:
        """Whether a training forward of the decoder is running (items go to its group)."""
        return self._group is not None

    def forward_started(self) -> None:
        if self._group is not None:
            raise RuntimeError("ActivationOffloader: a decoder forward started inside another")
        self._group = []
        self._layer_inputs.clear()

    def forward_finished(self) -> None:
        self._group = None
        self._layer_inputs.clear()

    def note_layer_input(self, hidden_states: Tensor) -> None:
        """Record a layer's input: if a checkpoint saves it, it becomes an item."""
        if self._group is not None and isinstance(hidden_states, Tensor):
            self._layer_inputs[id(hidden_states)] = weakref.ref(hidden_states)

    # ----------------------------------------------------------------- items
    def keep(self, tensor: Tensor, to_host: bool) -> OffloadItem:
        """Make ``tensor`` an item of the open group (to host memory if ``to_host``)."""
        if self._group is None:
            raise RuntimeError("ActivationOffloader.keep outside a training forward of the "
                               "decoder (install_recompute_offload was not applied)")
        group = self._group
        item = OffloadItem(tensor.shape, tensor.dtype, tensor.device, group, len(group),
                           device_tensor=tensor)
        if to_host and item.nbytes >= self.min_offload_bytes:
            item.host = self.pool.get(tensor.numel(), tensor.dtype)
            item.d2h_done = self._copies.to_host(tensor, item.host)
            self.stats.offloaded += 1
            self.stats.offloaded_bytes += item.nbytes
        group.append(item)
        self.stats.kept += 1
        # The newest `prefetch` items stay on the device; the one that leaves that window
        # keeps only its host copy.
        leaving = len(group) - 1 - self.config.prefetch
        if leaving >= 0 and group[leaving].host is not None:
            group[leaving].device_tensor = None
        return item

    def take(self, item: OffloadItem) -> Tensor:
        """The item's tensor on its device; starts bringing back the next ones (in backward
        order). Raises if the item was already taken."""
        if item.taken:
            raise RuntimeError(
                "an offloaded activation was read twice (backward with retain_graph=True, or "
                "torch.autograd.grad through a recompute); not supported with "
                "--recompute-cpu-offload / --recompute-keep-core-attn")
        if item.device_tensor is None:
            self._copies.to_device(item)
            self.stats.reloaded_on_demand += 1
        self._copies.wait_arrival(item)
        tensor, item.device_tensor, item.taken = item.device_tensor, None, True
        if item.host is not None:
            self.pool.put(item.host, item.h2d_done)
            item.host = None
        self.stats.taken += 1
        for j in range(item.index - 1, max(-1, item.index - 1 - self.config.prefetch), -1):
            nxt = item.group[j]
            if not nxt.taken and nxt.device_tensor is None:
                self._copies.to_device(nxt)
                self.stats.prefetched += 1
        return tensor

    # ----------------------------------------------------------------- saved tensors
    def _is_layer_input(self, tensor: Tensor) -> bool:
        ref = self._layer_inputs.get(id(tensor))
        return ref is not None and ref() is tensor

    def _pack(self, tensor: Tensor):
        # A checkpoint's save_for_backward is packed in no-grad mode (inside Function.apply).
        if (torch.is_grad_enabled() or isinstance(tensor, torch.nn.Parameter)
                or not self._is_layer_input(tensor)):
            return tensor
        return self.keep(tensor, to_host=self.config.layer_input)

    def _unpack(self, packed):
        return self.take(packed) if isinstance(packed, OffloadItem) else packed

    def saved_tensors_hooks(self):
        """The pack / unpack hooks for the decoder's forward (only layer inputs move)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


@dataclass
class _HookState:
    offloader: ActivationOffloader
    contexts: List[contextlib.AbstractContextManager] = field(default_factory=list)


def install_recompute_offload(decoder: torch.nn.Module, offloader: ActivationOffloader
                              ) -> List[torch.utils.hooks.RemovableHandle]:
    """Bracket ``decoder``'s training forwards for ``offloader`` (PyTorch module hooks).

    ``decoder`` is megatron-core's ``TransformerBlock`` (``GPTModel.decoder``); its ``layers``
    get forward pre-hooks that record their ``hidden_states``. The saved-tensor hooks are
    installed only when ``config.layer_input`` is set (otherwise only the kept attention
    outputs are items). Returns the hook handles.
    """
    state = _HookState(offloader)
    use_saved_tensor_hooks = offloader.config.layer_input

    def before(module, args):
        if not (module.training and torch.is_grad_enabled()):
            return
        offloader.forward_started()
        if use_saved_tensor_hooks:
            ctx = offloader.saved_tensors_hooks()
            ctx.__enter__()
            state.contexts.append(ctx)

    def after(module, args, output):
        if not offloader.recording:
            return
        while state.contexts:
            state.contexts.pop().__exit__(None, None, None)
        offloader.forward_finished()

    def layer_input(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        offloader.note_layer_input(hidden)

    handles = [decoder.register_forward_pre_hook(before),
               decoder.register_forward_hook(after, always_call=True)]
    handles += [layer.register_forward_pre_hook(layer_input, with_kwargs=True)
                for layer in decoder.layers]
    return handles


__all__ = ["OFFLOAD_CHOICES", "OffloadConfig", "OffloadItem", "HostBufferPool",
           "ActivationOffloader", "OffloadStats", "install_recompute_offload"]
