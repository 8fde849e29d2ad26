"""CPU stand-ins for the places where megatron-core 0.16.1 hard-codes CUDA.

This is the only module in Megatron-USP that replaces upstream behaviour. Each shim
names the upstream function it replaces and does what that function does, on the
CPU. :func:`apply_cpu_shims` installs them only when CUDA is absent
(``torch.cuda.is_available()`` is False); on a GPU it does nothing, so the GPU path
runs megatron-core unpatched. It is idempotent.

Shims (upstream -> replacement):

* ``megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.get_emb``
  moves ``inv_freq`` to ``torch.cuda.current_device()`` -> keep it on its device.
* ``megatron.core.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank``
  builds its index with ``pin_memory=True`` and ``.cuda()`` -> same index on the
  embedding's device (also re-bound where ``rotary_pos_embedding`` imported it).
* ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add`` / ``.fork`` use
  the CUDA generator -> track and fork the CPU generator's state, which is what
  dropout and initialisation draw from on the CPU.
* ``megatron.core.utils.GlobalMemoryBuffer.get_tensor`` allocates on
  ``torch.cuda.current_device()`` -> allocates on the CPU.
* ``megatron.core.transformer.utils.get_default_causal_mask`` builds its mask with
  ``device="cuda"`` -> on the CPU (also re-bound in ``fusions.fused_softmax``).
* ``megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed`` calls
  ``torch.cuda.manual_seed`` -> seeds the CPU generator the same way.
"""

from __future__ import annotations

import contextlib
import functools
from typing import List

import torch

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


def apply_cpu_shims() -> List[str]:
    """Install the shims when CUDA is absent; return the names of what is replaced."""
    if torch.cuda.is_available() or _APPLIED:
        return applied_shims()

    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding
    from megatron.core.tensor_parallel import random as tp_random

    rotary_pos_embedding.RotaryEmbedding.get_emb = _rope_get_emb
    _APPLIED.append("rotary_pos_embedding.RotaryEmbedding.get_emb")

    rope_utils.get_pos_emb_on_this_cp_rank = _get_pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _get_pos_emb_on_this_cp_rank
    _APPLIED.append("rope_utils.get_pos_emb_on_this_cp_rank")

    from megatron.core import utils as mcore_utils

    mcore_utils.GlobalMemoryBuffer.get_tensor = _buffer_get_tensor
    _APPLIED.append("utils.GlobalMemoryBuffer.get_tensor")

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

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
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed = _model_parallel_manual_seed
    _APPLIED.append("tensor_parallel.random.model_parallel_cuda_manual_seed")
    return applied_shims()
