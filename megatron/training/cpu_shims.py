"""CPU stand-ins for the places where megatron-core 0.16.1 hard-codes CUDA.

This is the only module in Megatron-USP that replaces upstream behaviour. Each shim
names the upstream function it replaces and does what that function does, on the
CPU. :func:`apply_cpu_shims` installs them only when CUDA is absent
(``torch.cuda.is_available()`` is False); on a GPU it does nothing, so the GPU path
runs megatron-core unpatched. It is idempotent.

Shims (upstream -> replacement):

* ``megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.get_emb``
  moves ``inv_freq`` to ``torch.cuda.current_device()`` -> keep it on its device.
* ``megatron.core.models.common.embeddings.yarn_rotary_pos_embedding.YarnRotaryEmbedding
  .get_emb`` moves its two frequency sets to ``torch.cuda.current_device()`` -> the same
  table and concentration factor on their device.
* ``megatron.core.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank``
  builds its index with ``pin_memory=True`` and ``.cuda()`` -> same index on the
  embedding's device (also re-bound where ``rotary_pos_embedding`` and
  ``yarn_rotary_pos_embedding`` imported it).
* ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add`` / ``.fork`` use
  the CUDA generator -> track and fork the CPU generator's state, which is what
  dropout and initialisation draw from on the CPU.
* ``megatron.core.utils.GlobalMemoryBuffer.get_tensor`` allocates on
  ``torch.cuda.current_device()`` -> allocates on the CPU.
* ``megatron.core.transformer.utils.get_default_causal_mask`` builds its mask with
  ``device="cuda"`` -> on the CPU (also re-bound in ``fusions.fused_softmax``).
* ``megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed`` calls
  ``torch.cuda.manual_seed`` -> seeds the CPU generator the same way.
* ``megatron.core.tensor_parallel.random._get_all_rng_states`` /
  ``_set_all_rng_states`` (activation recompute's RNG save/restore) read and write the
  CUDA generator -> the CPU generator and the tracker's states only (on the CPU the
  tracker's states are CPU generator states, see ``CudaRNGStatesTracker.add`` above).

Training-loop shims (upstream functions whose bodies allocate with ``device="cuda"`` or
``torch.cuda.current_device()``, call ``torch.cuda.synchronize()``, or test
``tensor.type() == "torch.cuda.FloatTensor"`` to mean "a float32 tensor"). Each is replaced
by a wrapper that runs the unchanged upstream body inside :func:`cuda_requests_on_cpu`,
which sends those requests to the CPU (see its docstring); nothing else is altered:

* ``distributed.distributed_data_parallel.DistributedDataParallel.__init__`` (grad and
  param buffers on ``torch.cuda.current_device()``).
* ``pipeline_parallel.schedules.forward_backward_no_pipelining``,
  ``forward_backward_pipelining_without_interleaving`` and
  ``forward_backward_pipelining_with_interleaving`` (token counter on ``"cuda"``;
  p2p shape buffers on the current CUDA device; ``torch.cuda.synchronize``).
* ``optimizer.get_megatron_optimizer`` (``DistributedOptimizer`` and the mixed-precision
  optimizers check ``param.type()`` against CUDA type strings and put ``found_inf`` and
  the loss scale on ``"cuda"``).
* ``step``, ``prepare_grads``, ``step_with_ready_grads``, ``state_dict``,
  ``load_state_dict`` and ``sharded_state_dict`` of every optimizer class in
  ``optimizer.optimizer`` and ``optimizer.distrib_optimizer`` that defines them
  (``step``'s grad-norm and clipping buffers on ``"cuda"`` and
  ``clip_grad_by_total_norm_fp32``'s ``torch.cuda.FloatTensor`` assert, the distributed
  optimizer's gather buffers). The training loop's own step computes the norm and clips
  with :mod:`megatron.training.optim.grad_clip`, which needs no shim.
* ``dist_checkpointing.serialization.save`` and ``load`` (also re-bound in
  ``dist_checkpointing``): the writer's ``torch.cuda.synchronize()`` after staging, the
  save finalisation's failure flag on ``torch.cuda.current_device()``, the exchange
  buffers of the load.

Megatron sequence-parallel shims (``--sequence-parallel``; the same wrapper, so a model run
outside the schedules, e.g. a forward-parity test, works on the CPU too):

* ``tensor_parallel.mappings._gather_along_first_dim`` and
  ``tensor_parallel.mappings._reduce_scatter_along_first_dim`` (the sequence all-gather /
  reduce-scatter of the embedding, the row-parallel linears and their backward; output on
  ``torch.cuda.current_device()``).
* ``tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward`` (the
  column-parallel linears' input-gradient reduce-scatter buffer on
  ``torch.cuda.current_device()``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, List

import torch
from torch.overrides import TorchFunctionMode

_APPLIED: List[str] = []


def applied_shims() -> List[str]:
    """Names of the upstream functions currently replaced (empty on a GPU machine)."""
    return list(_APPLIED)


# --------------------------------------------------------------------------- RoPE
def _rope_get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """Replaces ``RotaryEmbedding.get_emb``: the same table, left on inv_freq's device."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _yarn_get_emb(self, max_seq_len: int, offset: int = 0):
    """Replaces ``YarnRotaryEmbedding.get_emb``: the same (table, concentration factor), left
    on the frequencies' device."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (  # megatron-core on first use
        _yarn_get_concentration_factor,
    )

    from megatron.training.model.gpt_model import rope_inv_freq  # megatron-core on first use

    inv_freq = rope_inv_freq(self)
    seq = torch.arange(max_seq_len, device=inv_freq.device, dtype=inv_freq.dtype) + offset
    freqs = torch.outer(seq, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    return emb, _yarn_get_concentration_factor(self.scaling_factor, self.mscale,
                                               self.mscale_all_dim)


def _get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Replaces ``rope_utils.get_pos_emb_on_this_cp_rank``: chunks c and 2CP-1-c of 2CP."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size = cp_group.size()
    cp_rank = cp_group.rank()
    idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    shape = pos_emb.shape
    pos_emb = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _buffer_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    """Replaces ``GlobalMemoryBuffer.get_tensor``: a reused CPU buffer of at least the size."""
    required = 1
    for d in tensor_shape:
        required *= d
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required:
        buf = torch.empty(required, dtype=dtype, device="cpu", requires_grad=False)
        self.buffer[(name, dtype)] = buf
    return buf[0:required].view(*tensor_shape)


@functools.lru_cache(maxsize=8)
def _default_causal_mask(sq: int) -> torch.Tensor:
    """Replaces ``transformer.utils.get_default_causal_mask``: True above the diagonal."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


# --------------------------------------------------------------------------- RNG
def _tracker_add(self, name, seed):
    """Replaces ``CudaRNGStatesTracker.add``: a named CPU generator state seeded with ``seed``."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


@contextlib.contextmanager
def _tracker_fork(self, name="model-parallel-rng"):
    """Replaces ``CudaRNGStatesTracker.fork``: swap the CPU generator to state ``name``."""
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    orig_state = torch.get_rng_state()
    orig_name = self._current_state_name
    if orig_name != "default-rng":
        self.states_[orig_name] = orig_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        if orig_name != "default-rng":
            orig_state = self.states_[orig_name]
        torch.set_rng_state(orig_state)
        self._current_state_name = orig_name


def _get_all_rng_states():
    """Replaces ``random._get_all_rng_states``: (CPU state, no CUDA state, tracker states)."""
    from megatron.core.tensor_parallel.random import (  # megatron-core on first use
        get_cuda_rng_tracker,  # megatron-core on first use
    )

    return torch.get_rng_state(), None, get_cuda_rng_tracker().get_states()


def _set_all_rng_states(cpu_rng_state, cuda_rng_state, cuda_rng_state_tracker):
    """Replaces ``random._set_all_rng_states``: restore the CPU state and the tracker's."""
    from megatron.core.tensor_parallel.random import (  # megatron-core on first use
        get_cuda_rng_tracker,  # megatron-core on first use
    )

    torch.set_rng_state(cpu_rng_state)
    get_cuda_rng_tracker().set_states(cuda_rng_state_tracker)


# --------------------------------------------------------------------------- training loop
def _names_cuda(device) -> bool:
    """Whether a ``device=`` argument asks for a CUDA device (an int is a CUDA ordinal)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaRequestsToCpuMode(TorchFunctionMode):
    """Torch-function mode: CUDA ``device=`` arguments become ``"cpu"``; ``Tensor.cuda()``
    returns the tensor; ``Tensor.type()`` (no argument) reports the CUDA type string
    (``torch.cuda.FloatTensor`` for a CPU float32 tensor), which is what upstream compares
    against when it means "a float32 / bfloat16 / float16 tensor"."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _names_cuda(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


_CPU_MODE_DEPTH = [0]


@contextlib.contextmanager
def cuda_requests_on_cpu():
    """Run upstream code written for one CUDA device on the CPU.

    Inside the context: tensor factories given a CUDA ``device`` allocate on the CPU,
    ``Tensor.cuda()`` is the identity, ``Tensor.type()`` names the CUDA type,
    ``torch.cuda.current_device()`` returns ``"cpu"`` and ``torch.cuda.synchronize()`` does
    nothing (CPU work is synchronous). Both ``torch.cuda`` functions are restored on exit.
    Re-entrant; used only by the wrappers :func:`apply_cpu_shims` installs and, for the
    rest of a save that ``dist_checkpointing.save`` hands back, by
    :func:`megatron.training.checkpoint.shard_writer.run`, so it never runs on a machine
    with CUDA.
    """
    if _CPU_MODE_DEPTH[0]:
        _CPU_MODE_DEPTH[0] += 1
        try:
            yield
        finally:
            _CPU_MODE_DEPTH[0] -= 1
        return
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    _CPU_MODE_DEPTH[0] += 1
    try:
        with _CudaRequestsToCpuMode():
            yield
    finally:
        _CPU_MODE_DEPTH[0] -= 1
        torch.cuda.current_device, torch.cuda.synchronize = saved


def _on_cpu(fn: Callable) -> Callable:
    """``fn`` run inside :func:`cuda_requests_on_cpu` (same signature, same result)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cuda_requests_on_cpu():
            return fn(*args, **kwargs)

    wrapper.__usp_cpu_shim__ = True
    return wrapper


# ``prepare_grads`` and ``step_with_ready_grads`` are the pieces of ``step`` the training
# loop calls itself (megatron/training/loop.py, guarded_optimizer_step), to check the
# loss and the grad norm before anything is applied.
_OPTIMIZER_METHODS = ("step", "prepare_grads", "step_with_ready_grads",
                      "state_dict", "load_state_dict", "sharded_state_dict")


def _apply_training_loop_shims() -> None:
    from megatron.core import dist_checkpointing  # megatron-core on first use
    from megatron.core import optimizer as mcore_optimizer  # megatron-core on first use
    from megatron.core.dist_checkpointing import serialization  # megatron-core on first use
    from megatron.core.distributed import (  # megatron-core on first use
        distributed_data_parallel as ddp_mod,  # megatron-core on first use
    )
    from megatron.core.optimizer import distrib_optimizer  # megatron-core on first use
    from megatron.core.optimizer import optimizer as optimizer_mod  # megatron-core on first use
    from megatron.core.pipeline_parallel import schedules  # megatron-core on first use

    ddp_mod.DistributedDataParallel.__init__ = _on_cpu(ddp_mod.DistributedDataParallel.__init__)
    _APPLIED.append("distributed_data_parallel.DistributedDataParallel.__init__")

    for name in ("forward_backward_no_pipelining",
                 "forward_backward_pipelining_without_interleaving",
                 "forward_backward_pipelining_with_interleaving"):
        setattr(schedules, name, _on_cpu(getattr(schedules, name)))
        _APPLIED.append(f"pipeline_parallel.schedules.{name}")

    mcore_optimizer.get_megatron_optimizer = _on_cpu(mcore_optimizer.get_megatron_optimizer)
    _APPLIED.append("optimizer.get_megatron_optimizer")

    for module in (optimizer_mod, distrib_optimizer):
        for cls in vars(module).values():
            if not (isinstance(cls, type) and cls.__module__ == module.__name__):
                continue
            for meth in _OPTIMIZER_METHODS:
                if meth in vars(cls):
                    setattr(cls, meth, _on_cpu(vars(cls)[meth]))
                    _APPLIED.append(f"{module.__name__.split('.', 2)[-1]}.{cls.__name__}.{meth}")

    for name in ("save", "load"):
        wrapped = _on_cpu(getattr(serialization, name))
        setattr(serialization, name, wrapped)
        setattr(dist_checkpointing, name, wrapped)
        _APPLIED.append(f"dist_checkpointing.serialization.{name}")


def _apply_sequence_parallel_shims() -> None:
    from megatron.core.tensor_parallel import layers, mappings  # megatron-core on first use

    for name in ("_gather_along_first_dim", "_reduce_scatter_along_first_dim"):
        # Called through the module's globals by the autograd Functions there.
        setattr(mappings, name, _on_cpu(getattr(mappings, name)))
        _APPLIED.append(f"tensor_parallel.mappings.{name}")

    linear = layers.LinearWithGradAccumulationAndAsyncCommunication
    # autograd looks ``backward`` up on the Function class at every backward pass.
    linear.backward = staticmethod(_on_cpu(vars(linear)["backward"].__func__))
    _APPLIED.append("tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication"
                    ".backward")


def apply_cpu_shims() -> List[str]:
    """Install the shims when CUDA is absent; return the names of what is replaced."""
    if torch.cuda.is_available() or _APPLIED:
        return applied_shims()

    from megatron.core.models.common.embeddings import (  # megatron-core on first use
        rope_utils,
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )
    from megatron.core.tensor_parallel import random as tp_random  # megatron-core on first use

    rotary_pos_embedding.RotaryEmbedding.get_emb = _rope_get_emb
    _APPLIED.append("rotary_pos_embedding.RotaryEmbedding.get_emb")

    yarn_rotary_pos_embedding.YarnRotaryEmbedding.get_emb = _yarn_get_emb
    _APPLIED.append("yarn_rotary_pos_embedding.YarnRotaryEmbedding.get_emb")

    rope_utils.get_pos_emb_on_this_cp_rank = _get_pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _get_pos_emb_on_this_cp_rank
    yarn_rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _get_pos_emb_on_this_cp_rank
    _APPLIED.append("rope_utils.get_pos_emb_on_this_cp_rank")

    from megatron.core import utils as mcore_utils  # megatron-core on first use

    mcore_utils.GlobalMemoryBuffer.get_tensor = _buffer_get_tensor
    _APPLIED.append("utils.GlobalMemoryBuffer.get_tensor")

    from megatron.core.fusions import fused_softmax  # megatron-core on first use
    from megatron.core.transformer import utils as transformer_utils  # megatron-core on first use

    transformer_utils.get_default_causal_mask = _default_causal_mask
    fused_softmax.get_default_causal_mask = _default_causal_mask
    _APPLIED.append("transformer.utils.get_default_causal_mask")

    tp_random.CudaRNGStatesTracker.add = _tracker_add
    tp_random.CudaRNGStatesTracker.fork = _tracker_fork
    _APPLIED.append("tensor_parallel.random.CudaRNGStatesTracker.add")
    _APPLIED.append("tensor_parallel.random.CudaRNGStatesTracker.fork")

    # model_parallel_cuda_manual_seed calls torch.cuda.manual_seed, which on a CPU build
    # is queued and never runs; seed the CPU generator the same way instead.
    upstream_seed = tp_random.model_parallel_cuda_manual_seed

    def _model_parallel_manual_seed(seed: int, *args, **kwargs):
        """Replaces ``model_parallel_cuda_manual_seed``: also seeds the CPU generator."""
        torch.manual_seed(seed)
        return upstream_seed(seed, *args, **kwargs)

    tp_random.model_parallel_cuda_manual_seed = _model_parallel_manual_seed
    from megatron.core import tensor_parallel  # megatron-core on first use

    tensor_parallel.model_parallel_cuda_manual_seed = _model_parallel_manual_seed
    _APPLIED.append("tensor_parallel.random.model_parallel_cuda_manual_seed")

    tp_random._get_all_rng_states = _get_all_rng_states
    tp_random._set_all_rng_states = _set_all_rng_states
    _APPLIED.append("tensor_parallel.random._get_all_rng_states")
    _APPLIED.append("tensor_parallel.random._set_all_rng_states")

    _apply_training_loop_shims()
    _apply_sequence_parallel_shims()
    return applied_shims()
