"""``--document-attention-kernel``: the kernel of each document block, ``auto`` by measured cost.

``auto`` prices every candidate kernel of a :class:`~megatron.usp.document_kernels.DocumentBlock`
with the cost table of the in-place path (:class:`~megatron.usp.packed_documents.KernelCosts`,
timed once per process on CUDA, fixed on the CPU) and takes the cheapest:

* ``tiles``: one batched call per tile group, :meth:`KernelCosts.tile_call` (a causal square
  is priced as the in-place path prices a batched run of documents, build of a new shape
  included; a rectangle as the causal document of as many pairs). Single documents are
  batched calls of one, so per-document calls are this kernel's groups of one. A windowed
  group runs on the window kernel's flash op, priced as varlen documents of its pairs;
* ``varlen`` (CUDA fp16/bf16 with PyTorch's flash varlen op): each tile a document of the
  varlen call, :meth:`KernelCosts.varlen`, as the in-place path prices its varlen documents
  (a windowed square as the causal document of as many pairs);
* ``math``: the dense masked product of the block, :meth:`KernelCosts.masked`, refused past
  a memory bound.

Ties go to the earlier of :data:`BLOCK_KERNELS`. The choice is made once per block and head
shape and cached on the block, which is built once per micro-batch: every layer, head chunk,
the backward and the recomputation reuse it. So a tile group's new shape is built once for
all the layers of the micro-batch, and each layer's call is charged its share of the build
(``layers``, :meth:`KernelCosts.for_layers`). It depends on the block and the table alone, and
the table is one for every rank of ``costs_group`` (measured on its first rank and
broadcast, :func:`~megatron.usp.packed_documents.agreed_costs`), so ranks that compute the same
block (Ulysses and TP peers) choose the same kernel. At U = R = 1 the same table cuts the
documents into in-place segments (:mod:`megatron.usp.packed_documents`). Nothing here
communicates, apart from that one broadcast per process and head shape.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.usp import flash_varlen
from megatron.usp.backend_names import DOCUMENT_KERNEL_NAMES
from megatron.usp.document_kernels import (
    DocumentBlock,
    DocumentKernel,
    MathDocumentKernel,
    TileDocumentKernel,
    VarlenDocumentKernel,
    document_kernel_problem,
)
from megatron.usp.kernels import AttentionKernel
from megatron.usp.packed_documents import (
    KernelCosts,
    costs_for_shape,
    equivalent_length,
    tile_shape,
)

Tensor = torch.Tensor

BLOCK_KERNELS = ("tiles", "varlen", "math")


# --------------------------------------------------------------------------- the model
def block_candidates(device_type: str, dtype: torch.dtype, has_varlen_op: bool
                     ) -> Tuple[str, ...]:
    """The kernels that can run a block of q on this device and dtype."""
    low = dtype in (torch.float16, torch.bfloat16)
    if device_type == "cuda" and low and has_varlen_op:
        return BLOCK_KERNELS
    return ("tiles", "math")


def block_costs(block: DocumentBlock, costs: KernelCosts, candidates: Sequence[str]
                ) -> Dict[str, float]:
    """Modelled seconds (forward + backward) of each candidate kernel on ``block`` (module
    docstring). Reads the table's sightings, changes nothing."""
    out: Dict[str, float] = {}
    if "tiles" in candidates:
        out["tiles"] = sum(_group_cost(g, costs) for g in block.groups)
    if "varlen" in candidates:
        out["varlen"] = sum(costs.varlen(_tile_length(t)) for row in block.tiles for t in row)
    if "math" in candidates:
        out["math"] = costs.masked(block.batch * block.sq * block.sk)
    return out


def _group_cost(group, costs: KernelCosts) -> float:
    """A tile group's call: batched, or, windowed, the window kernel's flash op on ``n``
    equal sequences, priced as varlen documents of the tiles' visible pairs."""
    if group.window is None:
        return costs.tile_call(group.q.length, group.k.length, group.causal, group.q.n)
    return group.q.n * costs.varlen(equivalent_length(group.pairs // group.q.n))


def _tile_length(tile) -> int:
    """A tile as a document of the varlen call: its length, or, for a rectangle or a windowed
    square, the causal document of as many visible pairs."""
    if tile.causal and tile.window is None:
        return tile.q_len
    return equivalent_length(tile.pairs)


def cheapest(estimates: Dict[str, float]) -> str:
    """The kernel of least modelled cost; ties to the earlier of :data:`BLOCK_KERNELS`."""
    return min(estimates, key=lambda name: (estimates[name], BLOCK_KERNELS.index(name)))


def choose_block_kernel(block: DocumentBlock, costs: KernelCosts, candidates: Sequence[str]
                        ) -> str:
    """The cheapest kernel for ``block``; records its tile-group shapes in ``costs`` (built
    when ``tiles`` runs them), as the in-place path records its batched runs."""
    name = cheapest(block_costs(block, costs, candidates))
    for g in block.groups:
        costs.sighted(g.q.length, g.q.n, built=name == "tiles",
                      shape=tile_shape(g.q.length, g.k.length, g.causal, g.q.n))
    return name


# --------------------------------------------------------------------------- auto
class AutoDocumentKernel(DocumentKernel):
    """The cheapest kernel per block (module docstring).

    Args:
        kernel: the run's local :class:`AttentionKernel` (``tiles``'s calls, and the table's
            timings).
        costs_group: gloo group of the ranks that read the same micro-batch, over which the
            cost table is agreed (None: this process measures its own).
        layers: the calls that reuse one choice per micro-batch (the model's layers on this
            rank that share the micro-batch's blocks; 1 for one attention call).
    """

    name = "auto"

    def __init__(self, kernel: AttentionKernel,
                 costs_group: Optional[dist.ProcessGroup] = None, layers: int = 1) -> None:
        self.kernel = kernel
        self.costs_group = costs_group
        self.layers = layers
        self.kernels: Dict[str, DocumentKernel] = {
            "tiles": TileDocumentKernel(kernel), "varlen": VarlenDocumentKernel(),
            "math": MathDocumentKernel()}

    def costs(self, q: Tensor, k: Tensor, causal: bool) -> KernelCosts:
        """The cost table of q [b, h, s, d] / k [b, hk, s, d] (shared with the in-place path)."""
        return costs_for_shape(self.kernel, q.device, q.dtype, q.shape[1], k.shape[1],
                               q.shape[-1], causal, self.costs_group).for_layers(self.layers)

    def choose(self, q: Tensor, k: Tensor, block: DocumentBlock) -> DocumentKernel:
        """The kernel for ``block`` (chosen once per block and head shape, cached on it)."""
        key = ("auto", q.device.type, q.dtype, q.shape[1], k.shape[1], q.shape[-1],
               self.kernel.name)
        if key not in block._cache:
            candidates = block_candidates(q.device.type, q.dtype, flash_varlen.available())
            block._cache[key] = choose_block_kernel(block, self.costs(q, k, block.causal),
                                                    candidates)
        return self.kernels[block._cache[key]]  # type: ignore[index]

    def forward(self, q, k, v, block, scale):
        return self.choose(q, k, block).forward(q, k, v, block, scale)

    def backward(self, dout, q, k, v, out, lse, block, scale):
        return self.choose(q, k, block).backward(dout, q, k, v, out, lse, block, scale)


def get_document_kernel(name, kernel: AttentionKernel,
                        costs_group: Optional[dist.ProcessGroup] = None, layers: int = 1
                        ) -> DocumentKernel:
    """The document kernel for ``--document-attention-kernel name`` over local ``kernel``
    (a :class:`DocumentKernel` is returned as it is); ``costs_group`` and ``layers`` as for
    :class:`AutoDocumentKernel`."""
    if isinstance(name, DocumentKernel):
        return name
    if name not in DOCUMENT_KERNEL_NAMES:
        raise ValueError(document_kernel_problem(name, "cpu", torch.float32))
    if name == "auto":
        return AutoDocumentKernel(kernel, costs_group, layers)
    return {"math": MathDocumentKernel, "varlen": VarlenDocumentKernel,
            "tiles": lambda: TileDocumentKernel(kernel)}[name]()
