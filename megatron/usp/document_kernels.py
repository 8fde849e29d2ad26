"""Document-masked local attention of one (query block, key block) pair.

The contract is :class:`megatron.usp.kernels.AttentionKernel`'s, plus a
:class:`DocumentBlock` that says which pairs are visible::

    forward(q, k, v, block, scale)                    -> out [b, h, sq, d], lse [b, h, sq]
    backward(dout, q, k, v, out, lse, block, scale)   -> dq [b, h, sq, d], dk, dv [b, hk, sk, d]

Rows with no visible key in the block get ``out = 0`` and ``lse = -inf`` (and zero gradients),
so the ring's log-sum-exp merge of blocks stays exact; ``backward`` takes the final (merged)
``out`` and ``lse`` of each row, as every kernel here does.

A :class:`DocumentBlock` is built once per micro-batch and ring step
(:func:`build_document_block`) from the tiles of :mod:`megatron.usp.document_mask`; it is
reused by every layer, head chunk and recomputation. Its tiles are grouped by shape
(``q_len, k_len, causal``): one group is one batched kernel call on ``[n, h, L, d]`` slices.
Equally spaced slices (documents of one length packed back to back, or one tile) are strided
views of the block (no copy); other groups are gathered by index.

Kernels (``--document-attention-kernel``):

* ``tiles``: the groups on the run's :class:`AttentionKernel` (``--attention-backend``). On an
  H100/H200 PyTorch's cuDNN op, called on the strided views directly: a block that is one
  document is one dense cuDNN call; equal-length documents are one batched call.
* ``varlen``: PyTorch's flash varlen op (``torch.ops.aten._flash_attention_forward`` /
  ``_backward``, what ``torch.nn.attention.varlen.varlen_attn`` calls,
  :mod:`megatron.usp.flash_varlen`): the block's tiles in one call per kind (causal squares,
  full rectangles, and per window a windowed block's tiles still need) and layer of
  row-disjoint tiles, on gathered ``[tokens, h, d]`` copies. CUDA fp16/bf16 only.
* ``math``: the dense ``[sq, sk]`` mask of the block in float32 (float64 for float64 inputs).
  Exact; O(sq*sk) memory: tiny shapes (the CPU tests).
* ``auto``: the cheapest of these per block by measured cost
  (:mod:`megatron.usp.document_choice`).

No kernel here communicates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron.usp import flash_varlen
from megatron.usp.document_mask import Tile, dense_document_mask, tiles_for_block, token_runs
from megatron.usp.kernels import (
    AttentionKernel,
    _cudnn_attention_usable,
    accum_dtype,
    masked_backward,
    masked_forward,
    masked_scores,
    merge_block_,
)
from megatron.usp.window_kernel import window_backward, window_forward

Tensor = torch.Tensor

from megatron.usp.backend_names import (  # noqa: E402  (torch-free, for --help)
    document_kernel_name_problem,
)


# --------------------------------------------------------------------------- host -> device
def pinned_to_device(array, dtype: Optional[torch.dtype] = None, device=None) -> Tensor:
    """A host array or tensor on ``device`` (as ``dtype`` when given); to a GPU through pinned
    memory and a non-blocking copy, so that moving a micro-batch and its metadata never stalls
    the compute stream (a copy from pageable memory waits for the device)."""
    host = array if isinstance(array, Tensor) else torch.as_tensor(np.ascontiguousarray(array))
    if dtype is not None:
        host = host.to(dtype)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# --------------------------------------------------------------------------- slots
@dataclass
class Slots:
    """``n`` slices of ``length`` tokens of one sample's sequence dim (dim 2 of [b, h, s, ...]).

    ``step`` is set when the starts are equally spaced (a strided view reads them without a
    copy); ``index`` (the ``n*length`` token indices, on the device) when they are not, or when
    equally spaced slices overlap (then writes must accumulate through the index).
    """

    sample: int
    starts: np.ndarray
    length: int
    step: Optional[int]
    disjoint: bool
    index: Optional[Tensor] = None

    @property
    def n(self) -> int:
        return int(self.starts.size)

    def view(self, x: Tensor) -> Tensor:
        """[b, h, s, *rest] -> [n, h, length, *rest] strided view (``step`` must be set)."""
        xs = x[self.sample]
        st = xs.stride()
        size = (self.n, xs.shape[0], self.length) + tuple(xs.shape[2:])
        stride = (self.step * st[1], st[0], st[1]) + tuple(st[2:])
        return xs.as_strided(size, stride, xs.storage_offset() + int(self.starts[0]) * st[1])

    def read(self, x: Tensor) -> Tensor:
        if self.step is not None and self.disjoint:   # overlapping views are gathered instead
            return self.view(x)
        picked = x[self.sample].index_select(1, self.index)          # [h, n*L, *rest]
        return picked.unflatten(1, (self.n, self.length)).movedim(1, 0)

    def put(self, x: Tensor, value: Tensor) -> None:
        """Write ``value`` [n, h, L, *rest] into the slices (they must be disjoint)."""
        if self.step is not None and self.disjoint:
            self.view(x).copy_(value)
        else:
            x[self.sample].index_copy_(1, self.index, value.movedim(0, 1).flatten(1, 2)
                                       .to(x.dtype))

    def add(self, x: Tensor, value: Tensor) -> None:
        """Add ``value`` into the slices (overlaps accumulate)."""
        if self.step is not None and self.disjoint:
            self.view(x).add_(value)
        else:
            x[self.sample].index_add_(1, self.index, value.movedim(0, 1).flatten(1, 2)
                                      .to(x.dtype))


def _make_slots(sample: int, starts: Sequence[int], length: int, device) -> Slots:
    arr = np.asarray(starts, dtype=np.int64)
    step = None
    if arr.size == 1:
        step = 0
    else:
        diffs = np.diff(arr)
        if np.all(diffs == diffs[0]) and diffs[0] > 0:
            step = int(diffs[0])
    ordered = np.sort(arr)
    disjoint = bool(np.all(np.diff(ordered) >= length))
    slots = Slots(sample, arr, length, step, disjoint)
    if step is None or not disjoint:
        idx = (arr[:, None] + np.arange(length)[None, :]).reshape(-1)
        slots.index = pinned_to_device(idx, torch.int64, device)
    return slots


# --------------------------------------------------------------------------- the block
@dataclass
class TileGroup:
    """One batched kernel call: ``n`` tiles of one shape of one sample.

    ``fresh_q`` / ``fresh_k``: no earlier group of the block touched these query rows / key
    columns (the results are written, not accumulated).
    """

    q: Slots
    k: Slots
    causal: bool
    pairs: int
    fresh_q: bool = False
    fresh_k: bool = False
    window: Optional[int] = None


@dataclass
class DocumentBlock:
    """Which (query, key) pairs of a [b, sq] x [b, sk] block are visible, ready to compute.

    Attributes:
        batch, sq, sk: the block's shape.
        causal: causal within documents (else bidirectional within documents).
        tiles: per sample, the :class:`~megatron.usp.document_mask.Tile` list.
        groups: the tiles as batched calls (one shape, one sample, no query row twice), in
            execution order; each group's ``fresh_q`` / ``fresh_k`` say whether it is the
            first to touch its rows / columns.
        q_cover, k_cover: the most groups touching one query row / key column (sums of more
            than two terms are accumulated in float32).
        q_init, k_init: some query row / key column is untouched, or first touched by a group
            that accumulates: the output / gradient buffers must start at 0 (and lse at -inf).
        q_pos, q_seg, k_pos, k_seg: host arrays [b, s] (the ``math`` and ``varlen`` kernels).
        window: the left window of the block's mask (None: none); each group carries the
            window its tiles still need in the kernel's own convention
            (:mod:`megatron.usp.window_kernel`).
    """

    batch: int
    sq: int
    sk: int
    causal: bool
    tiles: List[List[Tile]]
    groups: List[TileGroup]
    q_cover: int
    k_cover: int
    q_init: bool
    k_init: bool
    q_pos: np.ndarray
    q_seg: np.ndarray
    k_pos: np.ndarray
    k_seg: np.ndarray
    device: torch.device = torch.device("cpu")
    window: Optional[int] = None
    _cache: Dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs: the block's useful work (one head)."""
        return sum(g.pairs for g in self.groups)

    def is_dense(self) -> bool:
        """One tile covering the whole block (one document spans it)."""
        return (len(self.groups) == 1 and self.groups[0].q.n == 1 and self.batch == 1
                and self.groups[0].q.length == self.sq and self.groups[0].k.length == self.sk)

    def tensor(self, name: str) -> Tensor:
        """``q_pos`` / ``q_seg`` / ``k_pos`` / ``k_seg`` as an int64 device tensor (cached)."""
        if name not in self._cache:
            self._cache[name] = pinned_to_device(getattr(self, name), torch.int64, self.device)
        return self._cache[name]  # type: ignore[return-value]


def _row_disjoint_layers(tiles: Sequence[Tile], sq: int) -> List[List[Tile]]:
    """Split tiles of one shape into layers in which no query row appears twice."""
    layers: List[Tuple[np.ndarray, List[Tile]]] = []
    for t in sorted(tiles, key=lambda t: (t.q_start, t.k_start)):
        free = [layer for layer in layers if not layer[0][t.q_start:t.q_start + t.q_len].any()]
        if not free:
            layers.append((np.zeros(sq, dtype=bool), []))
            free = [layers[-1]]
        rows, members = free[0]
        rows[t.q_start:t.q_start + t.q_len] = True
        members.append(t)
    return [members for _, members in layers]


class _Coverage:
    """Counts how often each row of one side is touched, in execution order."""

    def __init__(self, batch: int, size: int) -> None:
        self.count = np.zeros((batch, size), dtype=np.int64)
        self.init = False

    def touch(self, sample: int, starts: Sequence[int], length: int, disjoint: bool) -> bool:
        """Record a group's slices; returns whether the group writes them fresh."""
        row = self.count[sample]
        touched = [bool(row[a:a + length].any()) for a in starts]
        untouched = [not bool(row[a:a + length].all()) for a in starts]
        fresh = disjoint and not any(touched)
        if not fresh and any(untouched):
            self.init = True            # accumulates onto a row nothing wrote yet
        for a in starts:
            row[a:a + length] += 1
        return fresh


def build_document_block(q_pos: np.ndarray, q_seg: np.ndarray, k_pos: np.ndarray,
                         k_seg: np.ndarray, causal: bool, device=None,
                         window: Optional[int] = None) -> Optional[DocumentBlock]:
    """The :class:`DocumentBlock` of queries (positions, segments) ``[b, sq]`` on keys ``[b, sk]``
    (``window``: a left window, causal only).

    Returns None when no pair is visible (the ring then skips the block entirely).
    """
    q_pos, q_seg, k_pos, k_seg = (np.atleast_2d(np.asarray(a, dtype=np.int64))
                                  for a in (q_pos, q_seg, k_pos, k_seg))
    device = torch.device(device) if device is not None else torch.device("cpu")
    batch, sq = q_pos.shape
    sk = k_pos.shape[1]
    per_sample = [tiles_for_block(token_runs(q_pos[i], q_seg[i]), token_runs(k_pos[i], k_seg[i]),
                                  causal, window) for i in range(batch)]
    if not any(per_sample):
        return None
    groups: List[TileGroup] = []
    q_cov, k_cov = _Coverage(batch, sq), _Coverage(batch, sk)
    for sample, tiles in enumerate(per_sample):
        by_shape: Dict[Tuple[int, int, bool, Optional[int]], List[Tile]] = {}
        for t in tiles:
            by_shape.setdefault((t.q_len, t.k_len, t.causal, t.window), []).append(t)
        # Largest calls first: they are the fresh writes, the small ones accumulate onto them.
        shapes = sorted(by_shape.items(), key=lambda kv: -sum(t.pairs for t in kv[1]))
        for (lq, lk, causal_tile, tile_window), same_shape in shapes:
            for ts in _row_disjoint_layers(same_shape, sq):
                group = TileGroup(_make_slots(sample, [t.q_start for t in ts], lq, device),
                                  _make_slots(sample, [t.k_start for t in ts], lk, device),
                                  causal_tile, sum(t.pairs for t in ts), window=tile_window)
                group.fresh_q = q_cov.touch(sample, [t.q_start for t in ts], lq, True)
                group.fresh_k = k_cov.touch(sample, [t.k_start for t in ts], lk,
                                            group.k.disjoint)
                groups.append(group)
    q_init = q_cov.init or not q_cov.count.all()
    k_init = k_cov.init or not k_cov.count.all()
    return DocumentBlock(batch, sq, sk, causal, per_sample, groups, int(q_cov.count.max()),
                         int(k_cov.count.max()), q_init, k_init, q_pos, q_seg, k_pos, k_seg,
                         device, window)


def _out_buffers(q: Tensor, block: DocumentBlock) -> Tuple[Tensor, Tensor]:
    """(out, lse) to fill: float32 when a row sums more than two groups; zeros / -inf only
    when the block needs them (:attr:`DocumentBlock.q_init`)."""
    dtype = q.dtype if block.q_cover <= 2 else accum_dtype(q.dtype)
    lse_dtype = accum_dtype(q.dtype)
    if not block.q_init:
        return (torch.empty(q.shape, dtype=dtype, device=q.device),
                torch.empty(q.shape[:3], dtype=lse_dtype, device=q.device))
    return (torch.zeros(q.shape, dtype=dtype, device=q.device),
            torch.full(q.shape[:3], float("-inf"), dtype=lse_dtype, device=q.device))


# --------------------------------------------------------------------------- interface
class DocumentKernel(ABC):
    """Document-masked attention of one block (module docstring). Stateless, shareable."""

    name: str = "abstract"

    @abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, block: DocumentBlock, scale: float
                ) -> Tuple[Tensor, Tensor]:
        """out [b, h, sq, d] (q's dtype), lse [b, h, sq] (accum dtype); -inf / 0 where no key."""

    @abstractmethod
    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 block: DocumentBlock, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
        """dq [b, h, sq, d], dk/dv [b, hk, sk, d] in the inputs' dtypes (zeros where unseen)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# --------------------------------------------------------------------------- math (dense mask)
class MathDocumentKernel(DocumentKernel):
    """The block's dense mask in float32 (float64 for float64); exact, O(sq*sk) memory."""

    name = "math"

    def _scores(self, q: Tensor, k: Tensor, block: DocumentBlock, scale: float) -> Tensor:
        visible = dense_document_mask(block.tensor("q_pos"), block.tensor("q_seg"),
                                      block.tensor("k_pos"), block.tensor("k_seg"),
                                      block.causal, block.window)             # [b, sq, sk]
        return masked_scores(q, k, ~visible[:, None, None], scale)   # [b, hk, g, sq, sk]

    def forward(self, q, k, v, block, scale):
        return masked_forward(self._scores(q, k, block, scale), v, q.dtype)

    def backward(self, dout, q, k, v, out, lse, block, scale):
        scores = self._scores(q, k, block, scale)
        return masked_backward(scores, dout, q, k, v, out, lse, scale)


# --------------------------------------------------------------------------- tiles
def _strided_cudnn_ok(kernel: AttentionKernel, q: Tensor) -> bool:
    return (kernel.name == "torch" and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and _cudnn_attention_usable())


def _cudnn_views_forward(q, k, v, causal, scale):
    """PyTorch's cuDNN attention on strided [n, h, L, d] views (last dim contiguous), no copy."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return res[0], res[1].reshape(q.shape[:3]).float()


def _cudnn_views_backward(dout, q, k, v, out, lse, causal, scale):
    # dout is given the strides of out (cuDNN reads both with out's strides).
    if dout.stride() != out.stride():
        dout = torch.empty_like(out).copy_(dout)
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.float().unsqueeze(-1).contiguous(), zero, zero, None, None, None,
        q.shape[2], k.shape[2], 0.0, causal, scale=scale)


class TileDocumentKernel(DocumentKernel):
    """The block's tile groups as batched calls of an :class:`AttentionKernel`.

    Args:
        kernel: the local kernel for each group (causal squares and full rectangles).
        views: on CUDA with PyTorch's cuDNN op, pass the strided views of equally spaced
            groups straight to cuDNN (no gather copy). ``False`` makes every input contiguous
            (the bench compares both; the results are the same).
    """

    name = "tiles"

    def __init__(self, kernel: AttentionKernel, views: bool = True) -> None:
        self.kernel = kernel
        self.views = views
        # (direction, dtype, q shape, k shape, causal) cuDNN refused on views: those calls go
        # through ``kernel`` (which copies, and falls back itself where cuDNN cannot run).
        self._refused: set = set()

    def _use_views(self, key, q: Tensor) -> bool:
        return (self.views and key not in self._refused and q.stride(-1) == 1
                and _strided_cudnn_ok(self.kernel, q))

    def _fwd(self, q, k, v, causal, scale, window=None):
        if window is not None:          # the window kernel: flash's own window, else a mask
            return window_forward(q, k, v, causal, window, scale)
        key = ("fwd", q.dtype, tuple(q.shape), tuple(k.shape), causal)
        if self._use_views(key, q):
            try:
                return _cudnn_views_forward(q, k, v, causal, scale)
            except RuntimeError:
                self._refused.add(key)
        return self.kernel.forward(q, k, v, causal, scale)

    def _bwd(self, dout, q, k, v, out, lse, causal, scale, window=None):
        if window is not None:
            return window_backward(dout, q, k, v, out, lse, causal, window, scale)
        key = ("bwd", q.dtype, tuple(q.shape), tuple(k.shape), causal)
        if self._use_views(key, q):
            try:
                return _cudnn_views_backward(dout, q, k, v, out, lse, causal, scale)
            except RuntimeError:
                self._refused.add(key)
        return self.kernel.backward(dout, q, k, v, out, lse, causal, scale)

    def forward(self, q, k, v, block, scale):
        if block.is_dense():
            g = block.groups[0]
            out, lse = self._fwd(q, k, v, g.causal, scale, g.window)
            return out, lse.to(accum_dtype(q.dtype))
        if _one_tiling_group(block):
            # Equal documents over the whole block: the batched call's own output is the
            # block's output when its memory is laid out [h, n*L, d] (no copy).
            g = block.groups[0]
            o_g, l_g = self._fwd(g.q.read(q), g.k.read(k), g.k.read(v), g.causal, scale,
                                 g.window)
            out = _as_block(o_g)
            lse = l_g.transpose(0, 1).reshape(1, q.shape[1], q.shape[2])
            return (out if out is not None else _as_block_copy(o_g)), lse.to(accum_dtype(q.dtype))
        out, lse = _out_buffers(q, block)
        for g in block.groups:
            o_g, l_g = self._fwd(g.q.read(q), g.k.read(k), g.k.read(v), g.causal, scale,
                                 g.window)
            if g.fresh_q:
                g.q.put(out, o_g)
                g.q.put(lse, l_g.to(lse.dtype))
            elif g.q.step is not None and g.q.disjoint:
                merge_block_(g.q.view(out), g.q.view(lse), o_g, l_g)
            else:
                acc_o, acc_l = g.q.read(out), g.q.read(lse)       # gathered copies
                merge_block_(acc_o, acc_l, o_g, l_g)
                g.q.put(out, acc_o)
                g.q.put(lse, acc_l)
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, block, scale):
        if block.is_dense():
            g = block.groups[0]
            return self._bwd(dout, q, k, v, out, lse, g.causal, scale, g.window)
        if _one_tiling_group(block) and _tiles_side(block.groups[0].k, block.sk):
            g = block.groups[0]
            grads = self._bwd(g.q.read(dout), g.q.read(q), g.k.read(k), g.k.read(v),
                              g.q.read(out), g.q.read(lse), g.causal, scale, g.window)
            return tuple(_as_block(t) if _as_block(t) is not None else _as_block_copy(t)
                         for t in grads)
        dq = _grad_buffer(q, block.q_cover, block.q_init)
        dk = _grad_buffer(k, block.k_cover, block.k_init)
        dv = _grad_buffer(v, block.k_cover, block.k_init)
        for g in block.groups:
            dq_g, dk_g, dv_g = self._bwd(g.q.read(dout), g.q.read(q), g.k.read(k), g.k.read(v),
                                         g.q.read(out), g.q.read(lse), g.causal, scale,
                                         g.window)
            (g.q.put if g.fresh_q else g.q.add)(dq, dq_g)
            (g.k.put if g.fresh_k else g.k.add)(dk, dk_g)
            (g.k.put if g.fresh_k else g.k.add)(dv, dv_g)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _tiles_side(slots: Slots, size: int) -> bool:
    """The slots are equal back-to-back slices covering ``0..size`` of one sample."""
    return (slots.step == slots.length and slots.n * slots.length == size
            and int(slots.starts[0]) == 0)


def _one_tiling_group(block: DocumentBlock) -> bool:
    """One batched call whose query slices tile the whole block (equal documents)."""
    return (block.batch == 1 and len(block.groups) == 1 and block.groups[0].fresh_q
            and _tiles_side(block.groups[0].q, block.sq))


def _as_block(x: Tensor) -> Optional[Tensor]:
    """[n, h, L, d] laid out as [h, n*L, d] in memory -> the [1, h, n*L, d] view, else None."""
    t = x.transpose(0, 1)
    if not t.is_contiguous():
        return None
    return t.reshape(1, t.shape[0], t.shape[1] * t.shape[2], t.shape[3])


def _as_block_copy(x: Tensor) -> Tensor:
    """[n, h, L, d] -> [1, h, n*L, d] (a copy)."""
    t = x.transpose(0, 1)
    return t.reshape(1, t.shape[0], t.shape[1] * t.shape[2], t.shape[3])


def _grad_buffer(like: Tensor, cover: int, init: bool) -> Tensor:
    """A gradient accumulator shaped like ``like``: float32 for sums of more than two terms,
    zeros when some slot is untouched or accumulated before it is written."""
    dtype = like.dtype if cover <= 2 else accum_dtype(like.dtype)
    if init:
        return torch.zeros(like.shape, dtype=dtype, device=like.device)
    return torch.empty(like.shape, dtype=dtype, device=like.device)


# --------------------------------------------------------------------------- varlen
@dataclass
class _VarlenCall:
    """One varlen call: row-disjoint tiles of one causal flag and window, packed as
    sequences."""

    causal: bool
    window: Optional[int]
    q_sample: Tensor
    q_token: Tensor
    k_sample: Tensor
    k_token: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    fresh: bool


def _varlen_calls(block: DocumentBlock) -> List[_VarlenCall]:
    """Tiles packed into calls: per causal flag and window (each tile's own, in the op's
    bottom-right convention), layers in which no query row repeats."""
    if "varlen" in block._cache:
        return block._cache["varlen"]  # type: ignore[return-value]
    layers: List[Tuple[Tuple[bool, Optional[int]], List[Tuple[int, Tile]]]] = []
    kinds = sorted({(t.causal, t.window) for ts in block.tiles for t in ts},
                   key=lambda kw: (not kw[0], kw[1] is not None, kw[1] or 0))
    for kind in kinds:
        pending = [(i, t) for i, ts in enumerate(block.tiles) for t in ts
                   if (t.causal, t.window) == kind]
        while pending:
            used: Dict[int, np.ndarray] = {}
            layer, rest = [], []
            for i, t in pending:
                rows = used.setdefault(i, np.zeros(block.sq, dtype=bool))
                if rows[t.q_start:t.q_start + t.q_len].any():
                    rest.append((i, t))
                    continue
                rows[t.q_start:t.q_start + t.q_len] = True
                layer.append((i, t))
            layers.append((kind, layer))
            pending = rest
    seen = np.zeros((block.batch, block.sq), dtype=bool)
    calls = []
    dev = block.device
    for (causal, window), layer in layers:
        qs = [np.full(t.q_len, i) for i, t in layer]
        qt = [np.arange(t.q_start, t.q_start + t.q_len) for _, t in layer]
        ks = [np.full(t.k_len, i) for i, t in layer]
        kt = [np.arange(t.k_start, t.k_start + t.k_len) for _, t in layer]
        q_sample, q_token = np.concatenate(qs), np.concatenate(qt)
        fresh = not seen[q_sample, q_token].any()
        seen[q_sample, q_token] = True
        cu_q = np.concatenate([[0], np.cumsum([t.q_len for _, t in layer])])
        cu_k = np.concatenate([[0], np.cumsum([t.k_len for _, t in layer])])

        def dt(a, dtype=torch.int64):
            return pinned_to_device(a, dtype, dev)

        calls.append(_VarlenCall(causal, window, dt(q_sample), dt(q_token),
                                 dt(np.concatenate(ks)),
                                 dt(np.concatenate(kt)), dt(cu_q, torch.int32),
                                 dt(cu_k, torch.int32), max(t.q_len for _, t in layer),
                                 max(t.k_len for _, t in layer), fresh))
    block._cache["varlen"] = calls
    return calls


def _tokens(x: Tensor, sample: Tensor, token: Tensor) -> Tensor:
    """[b, h, s, *rest] -> [T, h, *rest] (a gathered copy)."""
    return x.movedim(2, 1)[sample, token]


class VarlenDocumentKernel(DocumentKernel):
    """PyTorch's flash varlen op over the block's tiles (module docstring); CUDA fp16/bf16."""

    name = "varlen"

    def _check(self, q: Tensor, block: DocumentBlock) -> None:
        if not flash_varlen.usable(q):
            raise ValueError(
                f"--document-attention-kernel varlen needs CUDA fp16/bf16 tensors and PyTorch's "
                f"flash varlen op; got {q.dtype} on {q.device}; use --document-attention-kernel "
                f"tiles")

    def forward(self, q, k, v, block, scale):
        self._check(q, block)
        out = torch.zeros(q.shape, dtype=accum_dtype(q.dtype) if block.q_cover > 2 else q.dtype,
                          device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=accum_dtype(q.dtype), device=q.device)
        out_t, lse_t = out.movedim(2, 1), lse.movedim(2, 1)       # [b, s, h, d], [b, s, h]
        for c in _varlen_calls(block):
            o, l_hT = flash_varlen.forward(
                _tokens(q, c.q_sample, c.q_token), _tokens(k, c.k_sample, c.k_token),
                _tokens(v, c.k_sample, c.k_token), c.cu_q, c.cu_k, c.max_q, c.max_k, c.causal,
                scale, c.window)
            l_t = l_hT.transpose(0, 1).to(lse.dtype)                # [T, h]
            if c.fresh:
                out_t[c.q_sample, c.q_token] = o.to(out.dtype)
                lse_t[c.q_sample, c.q_token] = l_t
            else:
                acc_o = out_t[c.q_sample, c.q_token].transpose(0, 1).unsqueeze(0)  # [1, h, T, d]
                acc_l = lse_t[c.q_sample, c.q_token].transpose(0, 1).unsqueeze(0).contiguous()
                merge_block_(acc_o, acc_l, o.transpose(0, 1).unsqueeze(0),
                             l_t.transpose(0, 1).unsqueeze(0))
                out_t[c.q_sample, c.q_token] = acc_o[0].transpose(0, 1)
                lse_t[c.q_sample, c.q_token] = acc_l[0].transpose(0, 1)
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, block, scale):
        self._check(q, block)
        acc = accum_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for c in _varlen_calls(block):
            lse_c = lse.movedim(2, 1)[c.q_sample, c.q_token].transpose(0, 1).float().contiguous()
            g_q, g_k, g_v = flash_varlen.backward(
                _tokens(dout, c.q_sample, c.q_token), _tokens(q, c.q_sample, c.q_token),
                _tokens(k, c.k_sample, c.k_token), _tokens(v, c.k_sample, c.k_token),
                _tokens(out, c.q_sample, c.q_token), lse_c, c.cu_q, c.cu_k, c.max_q, c.max_k,
                c.causal, scale, c.window)
            dq.movedim(2, 1).index_put_((c.q_sample, c.q_token), g_q.to(acc), accumulate=True)
            dk.movedim(2, 1).index_put_((c.k_sample, c.k_token), g_k.to(acc), accumulate=True)
            dv.movedim(2, 1).index_put_((c.k_sample, c.k_token), g_v.to(acc), accumulate=True)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------- names
def document_kernel_problem(name: str, device: str, dtype: torch.dtype) -> Optional[str]:
    """Why ``--document-attention-kernel name`` cannot run on ``device``/``dtype``, or None
    (:func:`megatron.usp.backend_names.document_kernel_name_problem`)."""
    return document_kernel_name_problem(name, device, dtype in (torch.float16, torch.bfloat16))
