"""``--optimizer-cpu-offload``: megatron-core's HybridDeviceOptimizer, without its spare copies.

megatron-core 0.16.1's ``HybridDeviceOptimizer`` (HDO) keeps the float32 master weights, Adam
moments and update of a fraction F of the parameters on the CPU and the rest on the GPU.
Measured with Llama-3-8B on one H200 (docs/long_sequences.md), three of its
copies decide whether a long sequence fits, and none of them is state:

* ``get_megatron_optimizer`` builds the HDO twice (once on the model's parameters, again inside
  ``DistributedOptimizer.__init__`` on their shards), and the first one lives on in a
  reference cycle (its sub-optimizers' step hooks close over it) until the garbage collector
  runs: float32 copies of every parameter, (1 - F) on the GPU and F on the host;
* each CPU parameter's gradient gets a pinned float32 buffer of its own, kept between steps
  (4 bytes per offloaded parameter of host memory: 30 GiB for all of Llama-3-8B); and its
  float32 master is made through a pinned bfloat16 copy that PyTorch's pinned-memory cache keeps
  after it is freed (2 more bytes per offloaded parameter);
* the float32 gradients of the GPU-side masters (4 bytes per GPU-side parameter) stay
  allocated after the step, through the next forward and backward.

:class:`StagedHybridDeviceOptimizer` is the same optimizer (a subclass: the same sub-optimizers,
state, parameter split, step hooks and checkpoint format, so megatron-core's
``DistributedOptimizer`` saves and loads it unchanged) with: CPU masters copied straight from
the GPU parameter; the CPU gradients streamed through two reused pinned staging slots, one
sub-optimizer at a time (the next one's D2H copy runs while the CPU steps the current one);
the GPU-side float32 gradients freed after the step; and the Adam moments allocated when the
optimizer is built (as Adam would at its first step), so that the first step's forward and
backward see the memory of every later one. :func:`install_staged_offload` puts it into each
``DistributedOptimizer`` that megatron-core built (with the fraction of :func:`build_fraction`:
0, no host copy, where the GPU has room for its transient float32 copies) and collects the
replaced ones.

The Adam arithmetic is megatron-core's (PyTorch's fused AdamW on each device), so the updates
are bitwise those of the HDO given the same gradients (``tests/gpu/test_offload_optimizer_gpu.py``).
CUDA only, like the HDO; the staging plan below is pure and tested on the CPU.
"""

from __future__ import annotations

import gc
from typing import Dict, List, Sequence, Tuple

import torch
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from megatron.training.checkpoint.save_load import adam_step_tensor, zero_adam_state


def staging_plan(numels: Sequence[int]) -> Tuple[int, int]:
    """(slots, numel per slot) for staging the gradients of sub-optimizers stepped one after
    another, each needing ``numels[i]`` float32 values at once: two slots (the next D2H copy
    lands in one while the CPU steps with the other) when there are two or more sub-optimizers,
    each as large as the largest; none without any."""
    if not numels:
        return 0, 0
    if any(n <= 0 for n in numels):
        raise ValueError(f"staging_plan: every sub-optimizer needs a positive numel, got {list(numels)}")
    return min(2, len(numels)), max(numels)


class StagedHybridDeviceOptimizer(HybridDeviceOptimizer):
    """megatron-core's ``HybridDeviceOptimizer`` holding only its state (module docstring).

    Same constructor arguments as the HDO. The CPU gradients pass through
    ``self.staging`` (pinned when ``pin_cpu_grads``): ``staging_plan`` slots of the largest CPU
    sub-optimizer's numel, instead of one buffer per parameter.
    """

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)  # calls _get_sub_optimizer_param_groups below
        numels = [sum(p.numel() for g in opt.param_groups for p in g["params"])
                  for opt in self.cpu_optimizers]
        slots, per_slot = staging_plan(numels)
        self.staging: List[torch.Tensor] = []
        if slots:
            flat = torch.empty(slots * per_slot, dtype=torch.float32, device="cpu",
                               pin_memory=self.pin_cpu_grads)
            self.staging = [flat[i * per_slot:(i + 1) * per_slot] for i in range(slots)]
        self._slot_read: List = [None] * slots   # H2D copy-back events reading each slot
        self._allocate_adam_states()

    # ------------------------------------------------------------------ parameter split
    def _get_sub_optimizer_param_groups(self, offload_fraction: float):
        """The HDO's split (parameters in order, to the CPU until the fraction of the GPU
        numel is reached) and its five maps, the CPU copy made in one D2H copy into its final
        dtype (the HDO goes through a pinned copy in the parameter's dtype first)."""
        params = [p for group in self.param_groups for p in group["params"]]
        budget = offload_fraction * sum(p.numel() for p in params if p.is_cuda)
        moved = 0
        cpu_groups, gpu_groups = [], []
        gpu_to_cpu: Dict[torch.Tensor, torch.Tensor] = {}
        cpu_to_gpu: Dict[torch.Tensor, torch.Tensor] = {}
        to_fp32: Dict[torch.Tensor, torch.Tensor] = {}
        for group in self.param_groups:
            on_cpu, on_gpu = dict(group, params=[]), dict(group, params=[])
            for param in group["params"]:
                wants_fp32 = self.param_update_in_fp32 and param.dtype != torch.float32
                dtype = torch.float32 if wants_fp32 else param.dtype
                if moved < budget and param.is_cuda:
                    inner = torch.empty(param.shape, dtype=dtype, device="cpu")
                    inner.copy_(param.detach())
                    moved += param.numel()
                    gpu_to_cpu[param], cpu_to_gpu[inner] = inner, param
                elif wants_fp32:
                    inner = param.detach().clone().float()
                else:
                    inner = param
                if wants_fp32:
                    to_fp32[param] = inner
                (on_gpu if inner.is_cuda else on_cpu)["params"].append(inner)
            for bucket, out in ((on_gpu, gpu_groups), (on_cpu, cpu_groups)):
                if bucket["params"]:
                    out.append(bucket)
        return cpu_groups, gpu_groups, gpu_to_cpu, cpu_to_gpu, to_fp32

    # ------------------------------------------------------------------ state
    def _allocate_adam_states(self) -> None:
        """Adam's zero moments and step for every parameter now, as ``torch.optim.Adam(W)``
        would create them at its first step (same dtypes, devices and step placement)."""
        for opt in self.sub_optimizers:
            if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
                zero_adam_state(opt)
        self._sync_sub_optimizers_state_to_hdo()

    def _move_new_state_to_right_device(self):
        """After a checkpoint load, each state tensor goes to its parameter's device (Adam's
        ``step`` where :func:`adam_step_tensor` puts it). megatron-core's version sends the
        state of every sub-optimizer that is an instance of the CPU class to the CPU; without
        TransformerEngine or Apex both classes are ``torch.optim.AdamW``, so a resumed run with
        a fraction below 1 had its GPU moments on the CPU ("exp_avgs is on cpu", one H200)."""
        for opt in self.sub_optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    state = opt.state.get(p)
                    if not state:
                        continue
                    orig = self.inner_param_to_orig_param.get(p, p)
                    for key, value in list(state.items()):
                        if not torch.is_tensor(value):
                            continue
                        if key == "step":
                            moved = adam_step_tensor(float(value), group, p)
                        else:
                            moved = value.to(p.device)
                        state[key] = moved
                        if orig in self.state:
                            self.state[orig][key] = moved

    # ------------------------------------------------------------------ step
    def _register_param_copy_back_gpu_hook(self):
        """No step hooks: :meth:`step` copies the new values back itself (the HDO's CPU hook
        copies from pageable float32 memory; here they go through a pinned staging slot)."""

    def _model_grad(self, param: torch.Tensor):
        return getattr(param, "decoupled_grad", param.grad)

    def _cpu_params(self, index: int):
        """The parameters (CPU masters) of CPU sub-optimizer ``index``, in staging order."""
        for group in self.cpu_optimizers[index].param_groups:
            yield from group["params"]

    def _stage(self, index: int) -> torch.cuda.Event:
        """D2H copy of CPU sub-optimizer ``index``'s gradients (as float32) into its staging
        slot, on the D2H stream, once the slot's previous H2D copy-back has been read; the CPU
        parameters' ``.grad`` become views of the slot."""
        slot_index = index % len(self.staging)
        slot = self.staging[slot_index]
        offset = 0
        with torch.cuda.stream(self._d2h_stream):
            if self._slot_read[slot_index] is not None:
                self._d2h_stream.wait_event(self._slot_read[slot_index])
            for cpu_param in self._cpu_params(index):
                grad = self._model_grad(self.cpu_copys_map_gpu_param[cpu_param])
                if grad is None:
                    cpu_param.grad = None
                    continue
                view = slot[offset:offset + cpu_param.numel()].view(cpu_param.shape)
                offset += cpu_param.numel()
                view.copy_(grad, non_blocking=True)
                cpu_param.grad = view
            return self._d2h_stream.record_event()

    def _copy_back(self, index: int) -> None:
        """CPU sub-optimizer ``index``'s new values to their GPU parameters: cast on the CPU
        into the (now free) staging slot, in the GPU parameter's dtype, then one pinned H2D
        copy each on the H2D stream; the slot is free again once that event has passed."""
        slot_index = index % len(self.staging)
        slot, offset = self.staging[slot_index], 0
        with torch.cuda.stream(self._h2d_stream):
            for cpu_param in self._cpu_params(index):
                gpu_param = self.cpu_copys_map_gpu_param[cpu_param]
                staged = slot.view(gpu_param.dtype)[offset:offset + cpu_param.numel()]
                offset += cpu_param.numel()
                staged = staged.view(cpu_param.shape)
                staged.copy_(cpu_param.detach())
                gpu_param.data.copy_(staged, non_blocking=True)
            self._slot_read[slot_index] = self._h2d_stream.record_event()

    def step(self, closure=None):
        """The HDO's step: param groups (lr, wd) to the sub-optimizers, the GPU sub-optimizer
        on float32 copies of its gradients (freed after it) and its masters cast back to the
        parameters, then each CPU sub-optimizer on its staged gradients and its values copied
        back; the default stream waits for the copies."""
        self._sync_hdo_param_groups_to_sub_optimizers()
        current = torch.cuda.current_stream()
        self._d2h_stream.wait_stream(current)   # the gradients are final
        self._h2d_stream.wait_stream(current)   # and nothing reads the parameters any more
        pending = self._stage(0) if self.cpu_optimizers else None   # overlaps the GPU step

        gpu_masters = []
        for param, master in self.param_to_fp32_param.items():
            if param in self.gpu_params_map_cpu_copy:
                continue
            grad = self._model_grad(param)
            master.grad = None if grad is None else grad.to(master.dtype)
            if master.grad is not None:
                gpu_masters.append((param, master))
        if self.gpu_optimizer is not None:
            self.gpu_optimizer.step(closure)
        for param, master in gpu_masters:
            master.grad = None
            param.data.copy_(master)

        for i, cpu_optimizer in enumerate(self.cpu_optimizers):
            following = self._stage(i + 1) if i + 1 < len(self.cpu_optimizers) else None
            pending.synchronize()
            cpu_optimizer.step(closure)
            for cpu_param in self._cpu_params(i):
                cpu_param.grad = None
            self._copy_back(i)
            pending = following
        current.wait_stream(self._h2d_stream)
        self._sync_sub_optimizers_state_to_hdo()

    def dummy_step(self):
        """No-op: the state exists from the start (megatron-core calls this before loading a
        checkpoint into an HDO whose state is still empty)."""
        if not self.state:
            self._allocate_adam_states()


# What megatron-core's two HybridDeviceOptimizer builds hold at once, per parameter, before
# the staged one replaces them: a float32 copy each, on the GPU (fraction 0) or on the host.
BUILD_BYTES_PER_PARAM = 8


def build_fraction(num_params: int, gpu_free_bytes: int, headroom: float = 0.9) -> float:
    """The offload fraction to have megatron-core build its (replaced) HybridDeviceOptimizer
    with: 0 (float32 copies on the GPU, nothing on the host) when its two builds' copies fit
    in ``headroom`` of the free GPU memory, else 1 (the copies on the host, as megatron-core
    would make them for a full offload; its pinned bfloat16 intermediates stay in PyTorch's
    pinned cache). Llama-3-8B on one H200: 64 GB of copies, ~100 GiB free: 0; on an 80 GB
    GPU: 1."""
    if num_params < 0 or gpu_free_bytes < 0:
        raise ValueError(f"build_fraction: counts must be >= 0, got {num_params}, {gpu_free_bytes}")
    return 0.0 if BUILD_BYTES_PER_PARAM * num_params <= headroom * gpu_free_bytes else 1.0


def gpu_free_bytes() -> int:
    """Free GPU memory for new tensors: the device's free bytes plus what PyTorch's caching
    allocator holds unused."""
    free, _ = torch.cuda.mem_get_info()
    return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


def install_staged_offload(optimizer, offload_fraction: float) -> int:
    """Replace the ``HybridDeviceOptimizer`` inside each ``DistributedOptimizer`` of
    ``optimizer`` (a megatron-core optimizer, chained or not, built with the fraction of
    :func:`build_fraction`) by a :class:`StagedHybridDeviceOptimizer` over the same
    param groups with ``offload_fraction``, each after collecting the one it replaces (its
    float32 copies are in reference cycles); then return the cached GPU blocks they leave.
    Returns how many were replaced."""
    replaced = 0
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, HybridDeviceOptimizer) or isinstance(
                inner, StagedHybridDeviceOptimizer):
            continue
        groups = inner.param_groups
        for group in groups:
            group["offload_fraction"] = offload_fraction
        defaults = dict(inner.defaults, offload_fraction=offload_fraction)
        sub.optimizer = None
        del inner
        gc.collect()
        sub.optimizer = StagedHybridDeviceOptimizer(groups, **defaults)
        replaced += 1
    if replaced and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return replaced
