"""Per-layer cost model of one training step under a TP x Ulysses x Ring x DP x PP layout.

Everything here is a pure function of integers and floats: the model shape
(:class:`~megatron.shapes.ModelShape`), the layout (:class:`Layout`), the workload
(:class:`Workload`) and the hardware (:class:`HardwareSpec`). It follows the accounting of the USP paper
(Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach for Long Context
Generative AI", the communication/memory comparison of SP-Ulysses, SP-Ring, TP, TP-sp
and ZeRO), made exact for this code base's layout and megatron-core's training step.

Notation (per micro-batch):

    b  micro-batch size       s  sequence length (global)     h  hidden size
    a  attention heads        g  KV groups                    d = h/a head dim
    f  MLP width              V  vocabulary                   L  layers
    t  TP size                U  Ulysses degree               R  Ring degree
    C = U*R (CP size)         D  DP size                      p  PP size
    m  micro-batches per step per DP rank
    n = b*s/C                 tokens a context-parallel rank holds
    kv_t = max(1, g/t)        KV heads per TP rank (replicated over TP when g < t)
    kv_u = kv_t if kv_t % U == 0 else U
                              KV heads entering the Ulysses all-to-all: when there are
                              fewer KV heads than U they are replicated up to U so that
                              every Ulysses rank receives the KV head its queries use

Sliding window (the model's ``window_size`` ``W`` on the layers its
``window_attn_skip_freq`` marks, :mod:`megatron.shapes.window`): a window layer computes the
pairs inside its window (:func:`attention_flops_fwd`) and its ring moves only the window's
halo (:func:`window_halo`), as ``megatron/usp/document_ring.py`` runs it; a window of
``s - 1`` or more is a full layer. A stage sums its full and window layers.

Packed documents (the workload's ``documents``: a ``--docs`` mix or a run's document lengths;
:mod:`.documents`): a layer computes its documents' pairs
(:func:`~megatron.shapes.document_pairs`, with a window :func:`~megatron.shapes.window_pairs`),
the mean over representative packed samples, on the
busiest ring rank of the data loader's chunk assignment (``1 + spread`` of the mean). Its
kernels run at the rate table's value for the pair-weighted mean document length
(``sum n^3 / sum n^2``), capped at ``s/R`` (and ``2*window`` on a window layer): the
assumption is that a document ring's kernels are as fast as one dense causal kernel of that
length. Its ring moves, like a window layer's, only the keys some query sees
(:class:`Halo` of the busiest ring rank: the K/V tokens the assignment makes it send and
receive, :func:`megatron.usp.load_balance.ring_rank_kv_tokens`; on a window layer the
smaller of that and the window's halo). The model FLOPs are the training loop's count of the
same documents.

All byte counts are per GPU. Times are per GPU and combine as described in
:func:`estimate`. Assumptions that are choices rather than facts (dtypes of buffers,
which communication overlaps which compute) live in :class:`Assumptions`.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.planner.documents import (
    Documents,
    as_documents,
    document_ring,
    kernel_tokens,
    layer_pairs,
    mean_shape_pairs,
    plan_samples,
    sample_lengths,
)
from megatron.planner.errors import PlannerError
from megatron.planner.hardware import (
    HardwareSpec,
    LinkLevel,
    bottleneck_level,
    peers_per_level,
)
from megatron.planner.models import check_model
from megatron.shapes import (
    ModelShape,
    attention_shape,
    causal_pairs,
    shape_pairs,
    training_flops,
    window_pairs,
)
from megatron.shapes.window import effective_window
from megatron.usp.parallel_dims import ParallelDims

GIB = float(2**30)
RECOMPUTE_CHOICES = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)


# ============================================================================ inputs


@dataclass(frozen=True)
class Layout:
    """A parallel layout (:class:`~megatron.usp.parallel_dims.ParallelDims`: TP, U, R, PP and
    the world, DP derived) plus what the planner also chooses: the ZeRO stage and the
    activation recompute."""

    dims: ParallelDims
    zero_stage: int = 1
    recompute: str = "none"

    def __post_init__(self) -> None:
        if self.zero_stage not in ZERO_STAGES:
            raise PlannerError(f"--zero-stage {self.zero_stage!r} must be one of {ZERO_STAGES}")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise PlannerError(
                f"--recompute {self.recompute!r} must be one of {RECOMPUTE_CHOICES}")

    @classmethod
    def of(cls, tp: int, ulysses: int, ring: int, dp: int, pp: int, zero_stage: int = 1,
           recompute: str = "none") -> "Layout":
        """From the five degrees (the world is their product)."""
        for key, v in (("tp", tp), ("ulysses", ulysses), ("ring", ring), ("dp", dp), ("pp", pp)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlannerError(f"layout {key}={v!r} must be an integer >= 1")
        dims = ParallelDims(tp * ulysses * ring * dp * pp, tp=tp, ulysses=ulysses, ring=ring,
                            pp=pp)
        return cls(dims, zero_stage, recompute)

    tp = property(lambda self: self.dims.tp)
    ulysses = property(lambda self: self.dims.ulysses)
    ring = property(lambda self: self.dims.ring)
    dp = property(lambda self: self.dims.dp)
    pp = property(lambda self: self.dims.pp)
    cp = property(lambda self: self.dims.cp)
    world_size = property(lambda self: self.dims.world_size)

    @property
    def sharding_group_size(self) -> int:
        """ZeRO shards over the data-parallel x context-parallel group (megatron's
        ``dp_cp`` group): CP ranks hold the same weights, so they share optimizer work."""
        return self.dp * self.cp

    def short(self) -> str:
        return (f"TP{self.tp} U{self.ulysses} R{self.ring} DP{self.dp} PP{self.pp} "
                f"ZeRO-{self.zero_stage} {self.recompute}")


@dataclass(frozen=True)
class Workload:
    """What is trained where: model, sequence, batch and the cluster's shape."""

    model: ModelShape
    seq_length: int
    world_size: int
    gpus_per_node: int
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    # packed documents (:mod:`.documents`); a mix's name (``--docs MIX``) is taken as its
    # Documents
    documents: Optional[Documents] = None

    def __post_init__(self) -> None:
        check_model(self.model)
        object.__setattr__(self, "documents", as_documents(self.documents))
        for key, flag in (("seq_length", "--seq-length"), ("world_size", "--gpus"),
                          ("gpus_per_node", "--gpus-per-node"),
                          ("micro_batch_size", "--micro-batch-size")):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlannerError(f"{flag} {v!r} must be an integer >= 1")
        if self.global_batch_size is not None and (
                not isinstance(self.global_batch_size, int) or self.global_batch_size < 1):
            raise PlannerError(f"--global-batch-size {self.global_batch_size!r} must be >= 1")

    def global_batch(self, layout: Layout, assumptions: "Assumptions") -> int:
        """The given global batch, or (when none is given) one micro-batch per DP rank,
        ``assumptions.micro_batches_per_pp_stage * PP`` of them when PP > 1."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        per_rank = assumptions.micro_batches_per_pp_stage * layout.pp if layout.pp > 1 else 1
        return self.micro_batch_size * layout.dp * per_rank

    def num_micro_batches(self, layout: Layout, assumptions: "Assumptions") -> int:
        return self.global_batch(layout, assumptions) // (self.micro_batch_size * layout.dp)


@dataclass(frozen=True)
class Assumptions:
    """Choices the model makes about the training step (megatron-core defaults).

    Attributes:
        param_bytes: bf16 weights.
        main_grad_bytes: megatron accumulates bf16 gradients into an fp32 buffer (the
            ``--bf16`` default, as in Megatron-LM; 2 with ``--grad-reduce-in-bf16``).
        optimizer_bytes: fp32 master weights + Adam m + v.
        grad_reduce_bytes: gradients are reduced in fp32 (the main-grad buffer; 2 with
            ``--grad-reduce-in-bf16``).
        param_gather_bytes: the distributed optimizer all-gathers bf16 weights.
        act_bytes: bf16 activations.
        ring_dkv_bytes: dK/dV travel round a ring of R > 2 as fp32 accumulators (a ring of
            two keeps the activation dtype, :func:`ring_acc_bytes`).
        tp_sequence_parallel: TP runs with megatron's sequence parallelism (norms and
            residuals sharded over TP, all-gather/reduce-scatter instead of all-reduce).
        a2a_calls_per_pass: all-to-alls per layer per pass (megatron/usp/ulysses.py: one
            for q, k, v together, one for the output).
        attention_bwd_factor: flash-attention backward FLOPs / forward FLOPs.
        micro_batches_per_pp_stage: micro-batches per PP stage when no global batch is
            given (1F1B's bubble is (p-1)/m; 4 per stage keeps it under 20%).
        memory_fragmentation: fraction of GPU memory lost to the caching allocator.
        memory_reserve_gib: CUDA context, NCCL and library workspaces.
        selective_recompute_modules: what ``selective`` recomputes (``mlp``, and the norms
            with ``layernorm``).
        loss_chunk_tokens: the loss the plan runs: ``--fused-linear-cross-entropy`` over
            chunks of this many tokens (the plan's flags say so, :func:`logits_bytes`); None:
            megatron-core's vocab-parallel cross-entropy over the full logits.
    """

    param_bytes: int = 2
    main_grad_bytes: int = 4
    optimizer_bytes: int = 12
    grad_reduce_bytes: int = 4
    param_gather_bytes: int = 2
    act_bytes: int = 2
    ring_dkv_bytes: int = 4
    tp_sequence_parallel: bool = True
    a2a_calls_per_pass: int = 2
    attention_bwd_factor: float = 2.5
    micro_batches_per_pp_stage: int = 4
    memory_fragmentation: float = 0.05
    memory_reserve_gib: float = 1.5
    # megatron-core's recompute_modules of "selective"; the search sets what the training
    # script can run here (megatron/planner/capabilities.py).
    selective_recompute_modules: Tuple[str, ...] = ("layernorm", "mlp")
    loss_chunk_tokens: Optional[int] = 8192

    def __post_init__(self) -> None:
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 1:
            raise PlannerError(f"--linear-cross-entropy-chunk-tokens {self.loss_chunk_tokens} "
                               f"must be >= 1 (e.g. 8192), or plan the unfused loss with "
                               f"--plain-cross-entropy")


DEFAULT_ASSUMPTIONS = Assumptions()


# ============================================================================ shapes


@dataclass(frozen=True)
class RankShapes:
    """Per-rank sizes of one layout (see the module docstring for the names)."""

    n: float        # tokens per CP rank per micro-batch: b*s/C
    n_sp: float     # tokens in the sequence-parallel region: n/t with TP-sp, else n
    kv_t: int       # KV heads per TP rank
    kv_u: int       # KV heads entering the all-to-all (replicated up to U if fewer)
    layers: int     # layers per pipeline stage


def rank_shapes(model: ModelShape, layout: Layout, b: int, s: int, a: Assumptions) -> RankShapes:
    n = b * s / layout.cp
    return RankShapes(
        n=n,
        n_sp=n / layout.tp if a.tp_sequence_parallel else n,
        kv_t=layout.dims.kv_heads_per_tp_rank(model.num_query_groups),
        kv_u=layout.dims.kv_heads_into_all_to_all(model.num_query_groups),
        layers=model.num_layers // layout.pp,
    )


# ============================================================================ FLOPs


def layer_matmul_flops_fwd(model: ModelShape, layout: Layout, sh: RankShapes) -> Tuple[float, float]:
    """Forward GEMM FLOPs of one layer on one rank: ``(attention projections, MLP)``.

    * QKV: ``2 * n * h * (h/t + 2*kv_t*d)`` (a GEMM is 2 FLOPs per multiply-add);
    * output projection: ``2 * n * h * h/t``;
    * MLP: ``2 * n * h * f/t`` per matrix, 3 matrices for SwiGLU, 2 for GELU.

    TP splits the weights, CP the tokens, so each rank does ``1/(t*C)`` of the work
    (plus the KV projection replicated over TP when ``g < t``).
    """
    h, d, t = model.hidden_size, model.head_dim, layout.tp
    qkv = 2 * sh.n * h * (h / t + 2 * sh.kv_t * d)
    proj = 2 * sh.n * h * h / t
    mlp = 2 * sh.n * h * model.ffn_hidden_size / t * (3 if model.swiglu else 2)
    return qkv + proj, mlp


def attention_flops_fwd(model: ModelShape, layout: Layout, b: int, s: int,
                        window: Optional[int] = None, pairs: Optional[float] = None) -> float:
    """Forward FLOPs of causal core attention for one layer on one rank.

    ``Q K^T`` and ``P V`` are ``2 * b * a * s^2 * d`` FLOPs each for the full square;
    causal masking keeps half: ``2 * b * s^2 * h`` per layer, ``4*h`` per (query, key)
    pair of :func:`~megatron.shapes.causal_pairs`. A window layer computes the pairs inside
    its left ``window`` (:func:`~megatron.shapes.window_pairs`, the FLOP count's). Heads split
    over ``t*U`` and the zigzag ring splits the sequence over ``R`` with equal work per rank,
    so a rank does ``1/(t*C)`` of it. Backward is ``attention_bwd_factor`` (2.5) times this.
    ``pairs`` (packed documents): the pairs per sequence instead.
    """
    if pairs is None:
        pairs = causal_pairs(s) if window is None else window_pairs([s], window)
    return 4.0 * b * pairs * model.hidden_size / (layout.tp * layout.cp)


def attention_kernel_tokens(s: int, ring: int, window: Optional[int] = None) -> float:
    """The kernel length whose table rate a layer's attention runs at: ``s/R`` tokens, or for
    a window layer at most ``2*window`` (a causal kernel of ``2W`` tokens has as many keys per
    query on average as a window of ``W``)."""
    tokens = s / ring
    return tokens if window is None else min(tokens, 2.0 * window)


def logits_flops_fwd(model: ModelShape, layout: Layout, sh: RankShapes) -> float:
    """Output layer on the last stage: ``2 * n * h * V/t``."""
    return 2 * sh.n * model.hidden_size * model.vocab_size / layout.tp


# ============================================================================ memory-bound work


def layer_elementwise_bytes_fwd(model: ModelShape, layout: Layout, sh: RankShapes,
                                a: Assumptions) -> float:
    """HBM bytes read+written by one layer's memory-bound kernels outside USP attention
    (see :func:`usp_attention_elementwise_bytes_fwd` for those), forward, one rank.

    Per token of the sequence-parallel region (``n_sp`` tokens), bf16:
      * two RMSNorms, each reading and writing ``h``: ``8h``;
      * two residual adds, each reading ``2h`` and writing ``h``: ``12h``.
    Per token of the CP rank (``n`` tokens), on the TP rank's slice:
      * RoPE on q and k, read + write: ``4 * (h/t + kv_t*d)``;
      * SwiGLU reads gate and up and writes one (``6f/t``); GELU reads and writes (``4f/t``).
    Backward is taken as twice this (it reads the saved input and the incoming grad and
    writes the outgoing grad).
    """
    h, d, t, ab = model.hidden_size, model.head_dim, layout.tp, a.act_bytes
    per_sp_token = (8 * h + 12 * h) * ab / 2
    per_token = 4 * (h / t + sh.kv_t * d) * ab / 2
    per_token += (6 if model.swiglu else 4) * model.ffn_hidden_size / t * ab / 2
    return per_sp_token * sh.n_sp + per_token * sh.n


def usp_attention_elementwise_bytes_fwd(model: ModelShape, layout: Layout, sh: RankShapes,
                                        a: Assumptions, merges: Optional[float] = None) -> float:
    """HBM bytes of USP attention's own memory-bound work, forward, one rank, per token
    of the CP rank (``n`` tokens):

      * Ulysses (U > 1): q, k, v, o each packed before and unpacked after the
        all-to-all (megatron/usp/ulysses.py: one copy per direction), read + write:
        ``8 * (2h/t + 2*kv_u*d)`` (bf16);
      * Ring (R > 1): ``merges`` (default ``R-1``; a window layer's
        :meth:`Halo.blocks_received`) out/lse merges into an fp32 accumulator, ~10 bytes per
        output element per merge: ``10 * (R-1) * h/t``.
    """
    h, d, t, ab = model.hidden_size, model.head_dim, layout.tp, a.act_bytes
    per_token = 0.0
    if layout.ulysses > 1:
        per_token += 8 * (2 * h / t + 2 * sh.kv_u * d) * ab / 2
    if layout.ring > 1:
        per_token += 10 * (layout.ring - 1 if merges is None else merges) * h / t
    return per_token * sh.n


def ring_merge_bytes_bwd(model: ModelShape, layout: Layout, sh: RankShapes,
                         halo: Optional["Halo"] = None) -> float:
    """Ring backward: ``R-1`` accumulations of dq (fp32, read+write 8 bytes per element)
    and of dk, dv into fp32 accumulators: ``8 * (R-1) * n * (h/t + 2*kv_u*d)``; a window
    layer accumulates dq over the blocks it received and dk, dv over the shares of the
    blocks it sent (:class:`Halo`)."""
    if layout.ring == 1:
        return 0.0
    dq, dkv = model.hidden_size / layout.tp, 2 * sh.kv_u * model.head_dim
    if halo is None:
        return 8 * (layout.ring - 1) * sh.n * (dq + dkv)
    return 8 * sh.n * (halo.blocks_received * dq + halo.blocks_sent * dkv)


def loss_elementwise_bytes(model: ModelShape, layout: Layout, sh: RankShapes) -> float:
    """Vocab-parallel cross entropy, forward + backward: reads bf16 logits and writes the
    fp32 softmax (6 B), then reads it back and writes bf16 grads (6 B): ``12 * n * V/t``."""
    return 12 * sh.n * model.vocab_size / layout.tp


def optimizer_step_bytes(local_params: float) -> float:
    """Adam on the local shard: reads fp32 param, m, v, grad (16 B), writes param, m, v
    (12 B) and the bf16 copy (2 B): 30 bytes per parameter."""
    return 30.0 * local_params


# ============================================================================ communication volumes


def ulysses_a2a_bytes(model: ModelShape, layout: Layout, sh: RankShapes, a: Assumptions) -> float:
    """Bytes one rank sends to other Ulysses ranks in one pass of one layer.

    Forward moves q, k, v (sequence-sharded -> head-sharded) and o (back): per rank the
    local tensors hold ``n * (h/t)`` elements for q and o and ``n * kv_u * d`` for k and
    v, of which ``(U-1)/U`` leave the rank:

        ``(U-1)/U * n * (2*h/t + 2*kv_u*d) * 2 bytes``

    i.e. the paper's ``(2 + 2*g/a) * b*s*h/(t*C)`` elements scaled by ``(U-1)/U`` (GQA
    shrinks the k, v terms by ``g/a``; replication when ``kv_t < U`` grows them back by
    ``U/kv_t``). Backward moves dO, dQ, dK, dV: the same volume.
    """
    U = layout.ulysses
    if U == 1:
        return 0.0
    h, d = model.hidden_size, model.head_dim
    return (U - 1) / U * sh.n * (2 * h / layout.tp + 2 * sh.kv_u * d) * a.act_bytes


def ring_step_bytes(model: ModelShape, layout: Layout, sh: RankShapes,
                    a: Assumptions) -> Tuple[float, float]:
    """Bytes one rank sends to its ring neighbour per ring step: ``(forward, backward)``.

    After the all-to-all a ring rank holds ``b*s/R`` tokens of ``kv_u/U`` KV heads, i.e.
    ``n * kv_u * d`` elements per K or V (megatron/usp/ring_attention.py packs K and V
    in one buffer). Forward passes K and V on: ``2 * n*kv_u*d * 2`` bytes per step,
    ``R-1`` steps. Backward passes K, V again plus the travelling dK, dV accumulator
    (:func:`ring_acc_bytes` each): ``n*kv_u*d * (2*2 + 2*acc)`` per step for
    ``R-1`` steps, and one more hop of the accumulator alone
    (:func:`ring_last_hop_bytes`) to bring it home.
    """
    if layout.ring == 1:
        return 0.0, 0.0
    kv_elems = sh.n * sh.kv_u * model.head_dim
    return 2 * kv_elems * a.act_bytes, kv_elems * (2 * a.act_bytes + 2 * ring_acc_bytes(layout, a))


def ring_acc_bytes(layout: Layout, a: Assumptions) -> int:
    """Bytes per element of the ring's accumulators (megatron.usp.ring_attention's
    ``ring_accum_dtype``): the activation dtype for R = 2 (every sum has two terms), else
    ``ring_dkv_bytes`` (fp32)."""
    return a.act_bytes if layout.ring <= 2 else a.ring_dkv_bytes


def ring_last_hop_bytes(model: ModelShape, layout: Layout, sh: RankShapes, a: Assumptions) -> float:
    """The R-th hop of the dK/dV accumulator after the last backward step: ``2 * n*kv_u*d``
    elements. The sum is final by then, so megatron/usp/ring_attention.py casts it to the
    activation dtype before sending (``act_bytes``, not ``ring_dkv_bytes``); nothing is left
    to overlap it with."""
    if layout.ring == 1:
        return 0.0
    return 2 * sh.n * sh.kv_u * model.head_dim * a.act_bytes


@dataclass(frozen=True)
class Halo:
    """What one forward of a window layer moves round the ring, on the ring rank that moves
    the most (:func:`window_halo`): ``sent`` and ``received`` sequence positions whose K/V
    leave and reach it, out of the ``s/R`` positions a ring rank holds (``ring_tokens``). The
    backward sends the same K/V again and returns the received positions' dK/dV."""

    sent: int
    received: int
    ring_tokens: float

    @property
    def blocks_sent(self) -> float:
        """``sent`` in ring blocks (the full ring sends ``R-1``)."""
        return self.sent / self.ring_tokens

    @property
    def blocks_received(self) -> float:
        return self.received / self.ring_tokens


@functools.lru_cache(maxsize=4096)
def window_halo(s: int, ring: int, window: int) -> Halo:
    """The halo of a window layer without documents in the zigzag order (the plan of
    ``megatron/usp/document_ring.py``, counted on chunks instead of positions).

    Ring rank ``r`` holds the chunks ``r`` and ``2R-1-r`` of ``c = s/(2R)`` positions. A key at
    position ``p`` of chunk ``k`` reaches ring rank ``r`` iff ``r``'s first query at or after
    ``p`` (the start of its first chunk ``m > k``) is at most ``window`` after ``p``: chunk
    ``k`` sends ``r`` its last ``min(c, max(0, window - (m-k-1)*c))`` positions. With
    ``window <= c`` that is each rank's ``window`` last positions to the rank holding the next
    chunk: ``n*window`` sent, ``n = 1`` on ring ranks 0 and R-1, 2 on the others
    (docs/sliding_window.md). Returns the largest ``sent`` and ``received`` over the ranks.
    """
    c = s / (2 * ring)
    chunks = [(r, 2 * ring - 1 - r) for r in range(ring)]
    sent, received = [0.0] * ring, [0.0] * ring
    for r in range(ring):
        for j in range(ring):
            if j == r:
                continue
            for k in chunks[j]:
                later = [m for m in chunks[r] if m > k]
                if not later:
                    continue
                gap = (min(later) - k - 1) * c
                need = min(c, max(0.0, window - gap))
                sent[j] += need
                received[r] += need
    return Halo(int(max(sent)), int(max(received)), s / ring)


def halo_bytes(model: ModelShape, layout: Layout, sh: RankShapes, a: Assumptions,
               halo: Halo) -> Tuple[float, float]:
    """``(K/V sent, dK/dV returned)`` bytes of one window-layer pass on one rank: a position
    costs what it costs in a ring block (:func:`ring_step_bytes`' forward, ``2*b*(kv_u/U)*d``
    elements), so ``sent`` positions cost ``blocks_sent`` forward ring steps; the backward
    returns the dK/dV of the ``received`` positions in the activation dtype."""
    step_f = 2 * sh.n * sh.kv_u * model.head_dim * a.act_bytes
    return halo.blocks_sent * step_f, halo.blocks_received * step_f


@dataclass(frozen=True)
class DocumentLayer:
    """A layer over packed documents (module docstring): ``pairs`` per sequence, the kernel
    length of its rate, the busiest ring rank's ``halo`` and the assignment's work ``spread``."""

    pairs: float
    kernel_tokens: float
    halo: Halo
    spread: float


def document_layers(w: "Workload", layout: Layout, window: Optional[int]
                    ) -> Tuple[Optional[DocumentLayer], Optional[DocumentLayer]]:
    """``(full layer, window layer)`` of ``w``'s documents under ``layout`` (the window layer
    None without a window); ``(None, None)`` without documents."""
    if w.documents is None:
        return None, None
    s, R = w.seq_length, layout.ring
    rows = sample_lengths(w.documents, s, plan_samples(w.micro_batch_size))
    ring = document_ring(w.documents, s, w.micro_batch_size, layout.ulysses, R)
    halo = Halo(int(round(ring.sent)), int(round(ring.received)), s / R)
    tokens = kernel_tokens(rows)
    full = DocumentLayer(layer_pairs(rows), tokens, halo, ring.spread)
    if window is None:
        return full, None
    wh = window_halo(s, R, window)
    return full, DocumentLayer(layer_pairs(rows, window), tokens,
                               Halo(min(halo.sent, wh.sent), min(halo.received, wh.received),
                                    s / R), ring.spread)


def tp_collective_bytes(model: ModelShape, layout: Layout, sh: RankShapes, a: Assumptions) -> float:
    """Bytes one rank moves in ONE TP collective of a layer.

    With sequence parallelism a layer does, per pass, 2 all-gathers (before QKV and
    fc1) and 2 reduce-scatters (after the output projection and fc2) over the ``n * h``
    activation: ``(t-1)/t * n * h * 2`` bytes each. Without it, 2 all-reduces per pass
    of twice that. Both give ``4 * (t-1)/t * n*h*2`` bytes per pass (the paper: TP and
    TP-sp cost the same communication). Returns the all-gather-sized unit; callers count
    4 units per pass.
    """
    t = layout.tp
    if t == 1:
        return 0.0
    return (t - 1) / t * sh.n * model.hidden_size * a.act_bytes


def pp_send_bytes(model: ModelShape, sh: RankShapes, a: Assumptions) -> float:
    """Activation (or its gradient) sent between two pipeline stages per micro-batch:
    ``n_sp * h * 2`` bytes (sharded over TP with sequence parallelism)."""
    return sh.n_sp * model.hidden_size * a.act_bytes


@dataclass(frozen=True)
class DPTraffic:
    """Per-rank ZeRO/DP traffic of one step.

    ``grad_bytes`` happen ``grad_times`` times (overlapping backward passes) and
    ``param_bytes`` happen ``param_times`` times (overlapping forward passes)."""

    grad_bytes: float
    grad_times: int
    param_bytes: float
    param_times: int

    @property
    def total(self) -> float:
        return self.grad_bytes * self.grad_times + self.param_bytes * self.param_times


def dp_traffic(zero_stage: int, local_params: float, group: int, m: int, a: Assumptions) -> DPTraffic:
    """Gradient and parameter traffic over the ``dp_cp`` group of ``N`` ranks, per step.

    With ``P`` parameters per rank (its TP shard on its PP stage) and ``k = (N-1)/N``:

    * ZeRO-0 (DDP): one all-reduce of fp32 grads, ``2k * P * 4`` bytes.
    * ZeRO-1 (megatron's distributed optimizer): reduce-scatter fp32 grads ``k*P*4``,
      then all-gather bf16 weights ``k*P*2``: 6 bytes/param against DDP's 8.
    * ZeRO-2: gradients are sharded, so they are reduce-scattered after every
      micro-batch: ``m * k*P*4``, weights gathered once ``k*P*2``.
    * ZeRO-3: weights gathered for forward and again for backward, grads
      reduce-scattered, every micro-batch: ``m * k*P*(2+2+4)``.
    """
    if group <= 1:
        return DPTraffic(0.0, 0, 0.0, 0)
    k = (group - 1) / group
    g, w = a.grad_reduce_bytes, a.param_gather_bytes
    if zero_stage == 0:
        return DPTraffic(2 * k * local_params * g, 1, 0.0, 0)
    if zero_stage == 1:
        return DPTraffic(k * local_params * g, 1, k * local_params * w, 1)
    if zero_stage == 2:
        return DPTraffic(k * local_params * g, m, k * local_params * w, 1)
    return DPTraffic(k * local_params * (g + w), m, k * local_params * w, m)


# ============================================================================ memory


def stage_params(model: ModelShape, layout: Layout, first: bool, last: bool) -> float:
    """Parameters one rank holds on a PP stage: its TP shard of the layer matrices
    (norm weights are replicated over TP), plus the embedding on the first stage and the
    output layer (untied) on the last, both vocab-sharded over TP."""
    L = model.num_layers // layout.pp
    per_layer = (model.attention_params_per_layer() + model.mlp_params_per_layer()) / layout.tp
    per_layer += model.norm_params_per_layer()
    params = L * per_layer
    if first:
        params += model.embedding_params() / layout.tp
    if last:
        params += model.output_params() / layout.tp + model.hidden_size
        if not model.untied_embeddings and not first:
            params += model.embedding_params() / layout.tp  # tied copy on the last stage
    return params


@dataclass(frozen=True)
class ModelStateBytes:
    params: float
    grads: float
    optimizer: float
    gathered: float  # ZeRO-3 weights gathered for the current + prefetched layer


def model_state_bytes(zero_stage: int, local_params: float, layer_params: float,
                      group: int, a: Assumptions) -> ModelStateBytes:
    """Bytes of weights, gradients and optimizer states on one rank (the ZeRO paper's
    accounting with megatron's dtypes: 2 + 4 + 12 = 18 bytes/param unsharded):

    * ZeRO-0: ``2P + 4P + 12P``;
    * ZeRO-1: ``2P + 4P + 12P/N``;
    * ZeRO-2: ``2P + 4P/N + 12P/N`` (+ one layer's fp32 grads being reduced);
    * ZeRO-3: ``(2 + 4 + 12)P/N`` + two layers of gathered bf16 weights (current and
      prefetched).
    """
    N = max(1, group)
    P = local_params
    pb, gb, ob = a.param_bytes, a.main_grad_bytes, a.optimizer_bytes
    if zero_stage == 0 or N == 1:
        return ModelStateBytes(pb * P, gb * P, ob * P, 0.0)
    if zero_stage == 1:
        return ModelStateBytes(pb * P, gb * P, ob * P / N, 0.0)
    if zero_stage == 2:
        return ModelStateBytes(pb * P, gb * P / N + gb * layer_params, ob * P / N, 0.0)
    return ModelStateBytes(pb * P / N, gb * P / N, ob * P / N, 2 * pb * layer_params)


def layer_activation_bytes(model: ModelShape, layout: Layout, sh: RankShapes, recompute: str,
                           a: Assumptions) -> float:
    """Activations one layer keeps for backward, per micro-batch, on one rank.

    Saved tensors of a megatron-core GPT layer with flash/cuDNN attention (bf16; no
    dropout; TP-sp region has ``n_sp`` tokens):

    * ``none``:
        - input norm input, QKV GEMM input, pre-MLP norm input, fc1 input:
          ``4 * n_sp*h``;
        - q (``n*h/t``), k and v (``n*kv_u*d`` each, as held after the all-to-all),
          attention output o (``n*h/t``), and when U > 1 the output projection's input
          (o after the reverse all-to-all, another ``n*h/t``);
        - fp32 softmax statistics: ``n*a/t`` floats;
        - fc1 output (``2f/t`` per token for SwiGLU, ``f/t`` for GELU) and fc2 input
          (``f/t``).
    * ``selective`` (megatron-core ``recompute_modules=["layernorm", "mlp"]``): the
      norm outputs and everything inside the MLP are recomputed; kept are the two norm
      inputs, the attention tensors above and the output projection's input. With
      ``["mlp"]`` only (``a.selective_recompute_modules``; no TransformerEngine) the two
      norm outputs are kept too (``4 * n_sp*h`` as without recompute).
    * ``full`` (``recompute_granularity="full"``, uniform, 1 layer per checkpoint): only
      the layer input ``n_sp*h``.
    """
    h, d, t, ab = model.hidden_size, model.head_dim, layout.tp, a.act_bytes
    sp = sh.n_sp * h
    if recompute == "full":
        return sp * ab
    attn = sh.n * (2 * h / t + 2 * sh.kv_u * d)  # q, o, k, v
    if layout.ulysses > 1:
        attn += sh.n * h / t
    lse = sh.n * model.num_attention_heads / t * 4
    if recompute == "selective":
        norm_io = 2 if "layernorm" in a.selective_recompute_modules else 4
        return (norm_io * sp + attn) * ab + lse
    f = model.ffn_hidden_size / t
    mlp = sh.n * ((2 * f if model.swiglu else f) + f)
    return (4 * sp + attn + mlp) * ab + lse


def layer_transient_bytes(model: ModelShape, layout: Layout, sh: RankShapes, recompute: str,
                          a: Assumptions) -> float:
    """Peak extra memory while one layer runs backward, one rank.

    The gradients of that layer's activations (as large as its ``none`` activations),
    the activations recomputed for it (``none`` minus what was kept), the attention
    backward's fp32 dq accumulator (``4*n*h/t``) and the all-to-all staging buffers
    (a second copy of q, k, v: ``n*(h/t + 2*kv_u*d)*2``).
    """
    full = layer_activation_bytes(model, layout, sh, "none", a)
    kept = layer_activation_bytes(model, layout, sh, recompute, a)
    h, d, t = model.hidden_size, model.head_dim, layout.tp
    attn_ws = 4 * sh.n * h / t
    if layout.ulysses > 1:
        attn_ws += sh.n * (h / t + 2 * sh.kv_u * d) * a.act_bytes
    return full + (full - kept) + attn_ws


def logits_bytes(model: ModelShape, layout: Layout, sh: RankShapes,
                 a: Optional[Assumptions] = None) -> Tuple[float, float]:
    """Last stage: ``(kept, transient)`` bytes of the output layer and the loss.

    * megatron-core's vocab-parallel cross entropy (``a.loss_chunk_tokens`` None) keeps the
      fp32 softmax (``4*n*V/t``); at the loss the bf16 logits and the fp32 gradient exist
      too (``6*n*V/t``);
    * ``--fused-linear-cross-entropy`` (megatron/training/model/fused_loss.py, gradients computed
      in the forward) keeps the final norm's output and its gradient (``2 * 2*n*h``), a
      float32 log-sum-exp per token and the float32 output-weight gradient
      (``4*V/t*h``); one chunk's logits are transient (``c*V/t * (2 + 4 + 4)``, ``c`` the
      chunk's tokens).
    """
    a = DEFAULT_ASSUMPTIONS if a is None else a
    vocab = model.vocab_size / layout.tp
    if a.loss_chunk_tokens is None:
        elems = sh.n * vocab
        return 4 * elems, 6 * elems
    h = model.hidden_size
    kept = 2 * sh.n * h * a.act_bytes + 4 * sh.n + 4 * vocab * h
    return kept, min(a.loss_chunk_tokens, sh.n) * vocab * 10


# ============================================================================ times


def a2a_time(bytes_sent: float, per_level: List[Tuple[LinkLevel, int]], group: int,
             calls: int) -> float:
    """All-to-all time: a rank's peers are spread over link levels; each level carries
    ``bytes_sent * peers_at_level / (group-1)`` of the traffic, levels run in parallel,
    the slowest sets the time; plus ``calls`` latencies of the outermost level."""
    if group <= 1 or bytes_sent <= 0:
        return 0.0
    t = max(bytes_sent * peers / (group - 1) / (lvl.all_to_all_gbps * 1e9)
            for lvl, peers in per_level)
    return t + calls * per_level[-1][0].latency_us * 1e-6


def ring_pass_time(compute_s: float, step_bytes: float, steps: int, level: Optional[LinkLevel]) -> float:
    """A ring pass of ``steps`` (= R) compute steps overlapped with ``steps-1`` sends.

    Step ``i`` computes on the KV block it holds while the next block is in flight, so
    the pass takes the first block's compute plus ``R-1`` times the slower of a step's
    compute and its send (``latency + bytes / p2p bandwidth``). Exposed ring
    communication is this minus ``compute_s``.
    """
    if steps <= 1 or level is None:
        return compute_s
    per_step = compute_s / steps
    send = level.latency_us * 1e-6 + step_bytes / (level.p2p_gbps * 1e9)
    return per_step + (steps - 1) * max(per_step, send)


def collective_time(bytes_moved: float, level: Optional[LinkLevel], calls: int) -> float:
    """``calls`` ring collectives moving ``bytes_moved`` in total over ``level``."""
    if level is None or bytes_moved <= 0:
        return 0.0
    return calls * level.latency_us * 1e-6 + bytes_moved / (level.collective_gbps * 1e9)


def halo_pass_time(compute_s: float, send_bytes: float, level: Optional[LinkLevel]) -> float:
    """A window layer's pass: its halo's K/V travel while the local block, nearly all of the
    pass's compute, runs (each transfer is started before the block ahead of it computes), so
    the pass takes the longer of the compute and ``latency + bytes / p2p bandwidth``."""
    if level is None or send_bytes <= 0:
        return compute_s
    return max(compute_s, level.latency_us * 1e-6 + send_bytes / (level.p2p_gbps * 1e9))


def p2p_time(bytes_sent: float, level: Optional[LinkLevel]) -> float:
    if level is None or bytes_sent <= 0:
        return 0.0
    return level.latency_us * 1e-6 + bytes_sent / (level.p2p_gbps * 1e9)


def pipeline_time(stage_time: float, m: int, pp: int) -> Tuple[float, float]:
    """1F1B: ``(m + p - 1)`` slots of the slowest stage's micro-batch time; the bubble
    is the ``(p - 1)`` extra slots. Returns ``(total, bubble)``."""
    return (m + pp - 1) * stage_time, (pp - 1) * stage_time


# ============================================================================ estimate


@dataclass
class TimeBreakdown:
    """Seconds per step on the slowest rank, by cause. ``total`` is the step time;
    the other fields show where it goes (``*_total`` includes hidden time)."""

    matmul: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    tp_comm: float = 0.0
    a2a: float = 0.0
    ring_exposed: float = 0.0
    ring_total: float = 0.0
    pp_p2p: float = 0.0
    pp_bubble: float = 0.0
    dp_exposed: float = 0.0
    dp_total: float = 0.0
    optimizer: float = 0.0
    total: float = 0.0


@dataclass
class MemoryBreakdown:
    """GiB on the most loaded rank (the PP stage that needs the most)."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    zero3_gathered: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    transient: float = 0.0
    total: float = 0.0

    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer + self.zero3_gathered


@dataclass
class Estimate:
    """The cost model's prediction for one layout."""

    layout: Layout
    time: TimeBreakdown
    memory: MemoryBreakdown
    usable_memory_gib: float
    global_batch: int
    num_micro_batches: int
    tokens_per_step: int
    model_flops_per_step: float
    peak_tflops: float
    links: Dict[str, str] = field(default_factory=dict)       # axis -> link level name
    link_levels: Dict[str, int] = field(default_factory=dict)  # axis -> level index (0 fastest)
    volumes: Dict[str, float] = field(default_factory=dict)    # bytes per step per rank
    kv_replication: float = 1.0
    flops_count: str = "dense causal"   # or "documents": the training metrics' words

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_memory_gib

    @property
    def step_time_s(self) -> float:
        return self.time.total

    @property
    def time_per_token(self) -> float:
        return self.time.total / self.tokens_per_step

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.time.total / self.layout.world_size

    @property
    def mfu(self) -> float:
        """Model FLOPs (3x forward GEMMs + 3x forward causal attention, the pairs inside the
        window on window layers, the documents' pairs with packed documents, no recompute:
        the training loop's count) per second per GPU
        over the datasheet peak."""
        return self.model_flops_per_step / self.time.total / self.layout.world_size / (
            self.peak_tflops * 1e12)

    def to_dict(self) -> Dict[str, object]:
        return {
            "layout": asdict(self.layout),
            "fits": self.fits,
            "step_time_s": self.time.total,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "memory_gib": self.memory.total,
            "usable_memory_gib": self.usable_memory_gib,
            "global_batch": self.global_batch,
            "num_micro_batches": self.num_micro_batches,
            "time_breakdown_s": asdict(self.time),
            "memory_breakdown_gib": asdict(self.memory),
            "links": dict(self.links),
            "volumes_gb_per_step": {k: v / 1e9 for k, v in self.volumes.items()},
            "kv_replication": self.kv_replication,
            "flops_count": self.flops_count,
        }


@dataclass
class _Group:
    stride: int
    size: int


def _groups(layout: Layout) -> Dict[str, _Group]:
    """Stride and size of each axis's groups in the grid order TP -> U -> R -> DP -> PP."""
    t, U, R, D = layout.tp, layout.ulysses, layout.ring, layout.dp
    return {
        "tp": _Group(1, t),
        "ulysses": _Group(t, U),
        "ring": _Group(t * U, R),
        "dp_cp": _Group(t, U * R * D),
        "pp": _Group(t * U * R * D, layout.pp),
    }


@dataclass
class AttentionTimes:
    """USP attention of one layer, one micro-batch, one rank: seconds.

    ``kernel`` is the attention kernels' compute, ``wall`` adds the exposed ring
    sends; ``a2a`` and ``elementwise`` are the all-to-alls and the pack/merge copies;
    ``fwd``/``bwd`` are the wall times of the forward pass and of the backward pass
    (including a recomputed forward under full recompute)."""

    kernel: float
    wall: float
    a2a: float
    elementwise: float
    fwd: float
    bwd: float


def usp_attention_times(model: ModelShape, layout: Layout, sh: RankShapes, hw: HardwareSpec,
                        links: Dict[str, object], a: Assumptions, b: int, s: int,
                        backward: bool = True, recompute_forward: bool = False,
                        window: Optional[int] = None,
                        docs: Optional[DocumentLayer] = None) -> AttentionTimes:
    """Core attention under U x R: all-to-alls, ring passes, kernels, copies.

    * Kernels: forward ``A`` (:func:`attention_flops_fwd`), backward ``2.5A``, at the
      table rate for kernels of ``s/R`` tokens (:func:`attention_kernel_tokens`; the table's
      rate counts forward+backward as 3.5x forward; the same rate is used for each pass).
      With R > 1 each pass runs as a ring (:func:`ring_pass_time`); backward also sends the
      dK/dV accumulator home (:func:`ring_last_hop_bytes`), exposed.
    * A window layer (``window``: the left window; one of ``s - 1`` or more is a full layer)
      computes its window's pairs and its ring moves the halo (:func:`window_halo`,
      :func:`halo_bytes`) while the local block computes (:func:`halo_pass_time`); the
      backward returns the halo's dK/dV, exposed.
    * A layer over packed documents (``docs``) computes its documents' pairs on the busiest
      ring rank (``1 + spread`` of the mean), at the rate of ``docs.kernel_tokens`` capped as
      above, and moves its halo as a window layer does.
    * All-to-all (U > 1): :func:`ulysses_a2a_bytes` per pass, never overlapped.
    * Copies: :func:`usp_attention_elementwise_bytes_fwd` forward, twice that plus
      :func:`ring_merge_bytes_bwd` backward, at the HBM rate.
    """
    window = effective_window(window, s)
    kernel = attention_kernel_tokens(s, layout.ring, window)
    if docs is None:
        att = attention_flops_fwd(model, layout, b, s, window)
        halo = window_halo(s, layout.ring, window) if window is not None else None
    else:
        att = attention_flops_fwd(model, layout, b, s, window, docs.pairs) * (1 + docs.spread)
        kernel = min(kernel, docs.kernel_tokens)
        halo = docs.halo
    rate = hw.attention_rate_tflops(kernel) * 1e12
    t_f, t_b = att / rate, a.attention_bwd_factor * att / rate
    ring = links["ring"]
    if halo is None:
        step_f, step_b = ring_step_bytes(model, layout, sh, a)
        wall_f = ring_pass_time(t_f, step_f, layout.ring, ring)
    else:
        halo_kv, halo_dkv = halo_bytes(model, layout, sh, a, halo)
        wall_f = halo_pass_time(t_f, halo_kv, ring)
    a2a = a2a_time(ulysses_a2a_bytes(model, layout, sh, a), links["ulysses_levels"],
                   layout.ulysses, a.a2a_calls_per_pass)
    hbm = hw.hbm_gbps * 1e9
    merges = None if halo is None else halo.blocks_received
    ew_f = usp_attention_elementwise_bytes_fwd(model, layout, sh, a, merges) / hbm
    fwd = wall_f + a2a + ew_f
    if not backward:
        return AttentionTimes(t_f, wall_f, a2a, ew_f, fwd, 0.0)
    if halo is None:
        wall_b = ring_pass_time(t_b, step_b, layout.ring, ring)
        wall_b += p2p_time(ring_last_hop_bytes(model, layout, sh, a), ring)
    else:
        wall_b = halo_pass_time(t_b, halo_kv, ring) + p2p_time(halo_dkv, ring)
    ew_b = 2 * ew_f + ring_merge_bytes_bwd(model, layout, sh, halo) / hbm
    bwd = wall_b + a2a + ew_b + (fwd if recompute_forward else 0.0)
    passes_f = 2 if recompute_forward else 1
    return AttentionTimes(
        kernel=passes_f * t_f + t_b,
        wall=passes_f * wall_f + wall_b,
        a2a=(passes_f + 1) * a2a,
        elementwise=passes_f * ew_f + ew_b,
        fwd=fwd,
        bwd=bwd,
    )


@dataclass
class _LayerTimes:
    """One layer, one micro-batch, one rank: seconds by cause."""

    matmul: float
    attention: float
    elementwise: float
    tp: float
    a2a: float
    ring_exposed: float
    ring_total: float
    fwd: float   # wall time of the forward pass (for overlap windows)
    bwd: float   # wall time of backward incl. recompute


def _layer_times(w: Workload, layout: Layout, hw: HardwareSpec, sh: RankShapes,
                 a: Assumptions, links: Dict[str, object],
                 window: Optional[int] = None,
                 docs: Optional[DocumentLayer] = None) -> _LayerTimes:
    """Forward, backward and recompute of one layer (a window layer with ``window``).

    * GEMMs: forward ``F``, backward ``2F``; full recompute adds ``F``, selective adds
      the MLP's forward.
    * Attention: :func:`usp_attention_times` (full recompute repeats its forward).
    * TP: 4 collectives per pass, exposed (no TP comm overlap is modelled).
    * Other memory-bound kernels: :func:`layer_elementwise_bytes_fwd` forward, twice that
      in backward (plus the forward again under full recompute), at the HBM rate.
    """
    model, b, s = w.model, w.micro_batch_size, w.seq_length
    mm_attn, mm_mlp = layer_matmul_flops_fwd(model, layout, sh)
    mm_rate = hw.matmul_tflops * 1e12
    full = layout.recompute == "full"
    recompute_mm = (mm_attn + mm_mlp) if full else (mm_mlp if layout.recompute == "selective" else 0.0)
    t_mm_f = (mm_attn + mm_mlp) / mm_rate
    t_mm_b = (2 * (mm_attn + mm_mlp) + recompute_mm) / mm_rate

    att = usp_attention_times(model, layout, sh, hw, links, a, b, s, True, full, window, docs)
    passes_f = 2 if full else 1
    t_tp_pass = collective_time(4 * tp_collective_bytes(model, layout, sh, a), links["tp"], 4)

    hbm = hw.hbm_gbps * 1e9
    t_ew_f = layer_elementwise_bytes_fwd(model, layout, sh, a) / hbm
    t_ew_b = (2 + (1 if full else 0)) * t_ew_f

    fwd = t_mm_f + att.fwd + t_tp_pass + t_ew_f
    bwd = t_mm_b + att.bwd + passes_f * t_tp_pass + t_ew_b
    return _LayerTimes(
        matmul=t_mm_f + t_mm_b,
        attention=att.kernel,
        elementwise=t_ew_f + t_ew_b + att.elementwise,
        tp=(1 + passes_f) * t_tp_pass,
        a2a=att.a2a,
        ring_exposed=att.wall - att.kernel,
        ring_total=att.wall,
        fwd=fwd,
        bwd=bwd,
    )


def _sum_layers(parts: Sequence[Tuple[int, _LayerTimes]]) -> _LayerTimes:
    """The field-wise sum of ``count`` layers of each kind."""
    return _LayerTimes(**{f.name: sum(n * getattr(lt, f.name) for n, lt in parts)
                          for f in fields(_LayerTimes)})


def stage_window_layers(model: ModelShape, layout: Layout) -> List[int]:
    """Window layers on each pipeline stage (stage ``i`` holds the layers ``i*L/p + 1`` to
    ``(i+1)*L/p``, megatron's global layer numbers, which the window's rule reads)."""
    marks, per = model.window_marks(), model.num_layers // layout.pp
    return [sum(marks[i * per:(i + 1) * per]) for i in range(layout.pp)]


def _resolve_links(gpus_per_node: int, layout: Layout, hw: HardwareSpec) -> Dict[str, object]:
    g = _groups(layout)
    out: Dict[str, object] = {}
    for axis in ("tp", "ring", "dp_cp", "pp"):
        out[axis] = bottleneck_level(hw, gpus_per_node, g[axis].stride, g[axis].size)
    out["ulysses_levels"] = peers_per_level(hw, gpus_per_node, g["ulysses"].stride,
                                            g["ulysses"].size)
    out["ulysses"] = out["ulysses_levels"][-1][0] if out["ulysses_levels"] else None
    return out


def _level_index(hw: HardwareSpec, level: Optional[LinkLevel]) -> int:
    """0 for the innermost intra-node level ... len(intra) for inter-node; -1 for none."""
    if level is None:
        return -1
    for i, lvl in enumerate(hw.intra_node):
        if lvl is level:
            return i
    return len(hw.intra_node)


def _link_names_and_levels(hw: HardwareSpec, links: Dict[str, object]
                           ) -> Tuple[Dict[str, str], Dict[str, int]]:
    axes = ("tp", "ulysses", "ring", "dp_cp", "pp")
    names = {ax: (links[ax].name if links[ax] is not None else "-") for ax in axes}
    return names, {ax: _level_index(hw, links[ax]) for ax in axes}


def check_workload_fits_layout(w: Workload, layout: Layout) -> None:
    if layout.world_size != w.world_size:
        raise PlannerError(
            f"layout {layout.short()} uses {layout.world_size} GPUs but --gpus is {w.world_size}")
    if w.model.num_layers % layout.pp:
        raise PlannerError(
            f"--pipeline-model-parallel-size {layout.pp} does not divide num_layers "
            f"{w.model.num_layers}")


def estimate(w: Workload, layout: Layout, hw: HardwareSpec,
             a: Assumptions = DEFAULT_ASSUMPTIONS) -> Estimate:
    """Predict step time and peak memory of ``layout`` for workload ``w`` on ``hw``.

    Step time (slowest rank):

        stage  = sum over its layers of (fwd + bwd)         [see _layer_times]
                 + output layer and loss on the last stage
                 + 2 pipeline sends per micro-batch when p > 1
        step   = (m + p - 1) * max(stage)                   [1F1B, bubble (p-1)*stage]
                 + exposed ZeRO/DP traffic
                 + optimizer step (HBM-bound)

    DP traffic overlaps compute: gradient traffic with a micro-batch's backward (once
    for ZeRO-0/1, every micro-batch for ZeRO-2/3), weight gathers with its forward
    (once after the optimizer for ZeRO-1/2, every micro-batch for ZeRO-3); only the
    excess over that window is exposed. Contention between overlapped traffic and
    compute, and between axes sharing a link, is not modelled.

    Memory (most loaded stage): model states (:func:`model_state_bytes`), activations
    of ``min(p - stage, m)`` in-flight micro-batches (1F1B), the last stage's logits,
    and the larger of the layer-backward and loss transients.
    """
    check_workload_fits_layout(w, layout)
    sh = rank_shapes(w.model, layout, w.micro_batch_size, w.seq_length, a)
    links = _resolve_links(w.gpus_per_node, layout, hw)
    m = w.num_micro_batches(layout, a)
    gbs = w.global_batch(layout, a)
    window = effective_window(w.model.window_size, w.seq_length)
    docs = document_layers(w, layout, window)
    full = _layer_times(w, layout, hw, sh, a, links, None, docs[0])
    windowed = full if window is None else _layer_times(w, layout, hw, sh, a, links, window,
                                                        docs[1])
    per_stage = stage_window_layers(w.model, layout) if window is not None else [0] * layout.pp
    stages = [_sum_layers(((sh.layers - n, full), (n, windowed))) for n in per_stage]
    traffic = dp_traffic(layout.zero_stage, _heaviest_stage_params(w.model, layout),
                         layout.sharding_group_size, m, a)
    time, slowest = _step_time(w, layout, hw, sh, a, links, stages, traffic, m)
    names, levels = _link_names_and_levels(hw, links)
    return Estimate(
        layout=layout,
        time=time,
        memory=_memory(w, layout, sh, a, m),
        usable_memory_gib=hw.gpu_memory_gib * (1 - a.memory_fragmentation) - a.memory_reserve_gib,
        global_batch=gbs,
        num_micro_batches=m,
        tokens_per_step=gbs * w.seq_length,
        # the training loop's count: every sequence's pairs (its documents' with --docs),
        # the mean over the layers
        model_flops_per_step=training_flops(w.model, gbs * w.seq_length,
                                            gbs * sequence_pairs(w)),
        flops_count="dense causal" if w.documents is None else "documents",
        peak_tflops=hw.peak_tflops,
        links=names,
        link_levels=levels,
        volumes=_volumes(w, layout, sh, a, m, traffic, window, per_stage[slowest], docs),
        kv_replication=sh.kv_u / sh.kv_t if sh.kv_u > sh.kv_t else 1.0,
    )


def sequence_pairs(w: Workload) -> float:
    """Attention pairs per sequence of the FLOP count, the mean over the model's layers: the
    training loop's :func:`~megatron.shapes.shape_pairs` of a dense sequence, or of the packed
    samples' documents (the mean over the samples) with ``w.documents``."""
    if w.documents is None:
        return shape_pairs(w.model, [w.seq_length])
    return mean_shape_pairs(w.model, sample_lengths(w.documents, w.seq_length,
                                                    plan_samples(w.micro_batch_size)))


def _heaviest_stage_params(model: ModelShape, layout: Layout) -> float:
    """Parameters per rank on the pipeline stage that holds the most."""
    single = layout.pp == 1
    return max(stage_params(model, layout, True, single), stage_params(model, layout, single, True))


def _step_time(w: Workload, layout: Layout, hw: HardwareSpec, sh: RankShapes, a: Assumptions,
               links: Dict[str, object], stages: Sequence[_LayerTimes], traffic: DPTraffic,
               m: int) -> Tuple[TimeBreakdown, int]:
    """The step-time composition of :func:`estimate`, and the slowest stage: ``stages``
    holds each pipeline stage's layers summed (their full and window layers)."""
    model = w.model
    hbm = hw.hbm_gbps * 1e9
    # Output layer (GEMM fwd + 2x bwd) and loss, last stage only.
    t_logits = 3 * logits_flops_fwd(model, layout, sh) / (hw.matmul_tflops * 1e12)
    t_loss = loss_elementwise_bytes(model, layout, sh) / hbm
    t_pp = 2 * p2p_time(pp_send_bytes(model, sh, a), links["pp"]) if layout.pp > 1 else 0.0
    last = len(stages) - 1
    times = [st.fwd + st.bwd + t_pp + (t_logits + t_loss if i == last else 0.0)
             for i, st in enumerate(stages)]
    # Ties go to the last stage (with the same layers it is the slowest: it has the loss).
    slowest = max(range(len(stages)), key=lambda i: (times[i], i))
    lt, stage = stages[slowest], times[slowest]
    head = slowest == last
    pipe_total, bubble = pipeline_time(stage, m, layout.pp)

    t_grad = collective_time(traffic.grad_bytes, links["dp_cp"], 1)
    t_param = collective_time(traffic.param_bytes, links["dp_cp"], 1)
    dp_exposed = (traffic.grad_times * max(0.0, t_grad - lt.bwd)
                  + traffic.param_times * max(0.0, t_param - lt.fwd))

    n = layout.sharding_group_size
    local = _heaviest_stage_params(model, layout)
    shard = local / n if (layout.zero_stage >= 1 and n > 1) else local
    t_opt = optimizer_step_bytes(shard) / hbm
    return TimeBreakdown(
        matmul=m * (lt.matmul + (t_logits if head else 0.0)),
        attention=m * lt.attention,
        elementwise=m * (lt.elementwise + (t_loss if head else 0.0)),
        tp_comm=m * lt.tp,
        a2a=m * lt.a2a,
        ring_exposed=m * lt.ring_exposed,
        ring_total=m * lt.ring_total,
        pp_p2p=m * t_pp,
        pp_bubble=bubble,
        dp_exposed=dp_exposed,
        dp_total=traffic.grad_times * t_grad + traffic.param_times * t_param,
        optimizer=t_opt,
        total=pipe_total + dp_exposed + t_opt,
    ), slowest


def _ring_bytes_per_layer(model: ModelShape, layout: Layout, sh: RankShapes, a: Assumptions,
                          s: int, window: Optional[int],
                          docs: Optional[DocumentLayer] = None) -> float:
    """Ring bytes one rank sends for one layer and micro-batch (full recompute repeats the
    forward): whole blocks round the ring, or a window layer's or a document layer's halo."""
    passes_f = 2 if layout.recompute == "full" else 1
    if docs is not None:
        if layout.ring == 1:
            return 0.0
        kv, dkv = halo_bytes(model, layout, sh, a, docs.halo)
        return (passes_f + 1) * kv + dkv
    if window is None:
        ring_f, ring_b = ring_step_bytes(model, layout, sh, a)
        return (max(0, layout.ring - 1) * (passes_f * ring_f + ring_b)
                + ring_last_hop_bytes(model, layout, sh, a))
    if layout.ring == 1:
        return 0.0
    kv, dkv = halo_bytes(model, layout, sh, a, window_halo(s, layout.ring, window))
    return (passes_f + 1) * kv + dkv


def _volumes(w: Workload, layout: Layout, sh: RankShapes, a: Assumptions, m: int,
             traffic: DPTraffic, window: Optional[int] = None, n_window: int = 0,
             docs: Tuple[Optional[DocumentLayer], Optional[DocumentLayer]] = (None, None)
             ) -> Dict[str, float]:
    """Bytes one rank sends per step, by axis (full recompute repeats forward traffic), on
    the slowest stage (``n_window`` of its layers with the left ``window``)."""
    model, s = w.model, w.seq_length
    full = layout.recompute == "full"
    per_layer = m * sh.layers
    ring = ((sh.layers - n_window) * _ring_bytes_per_layer(model, layout, sh, a, s, None, docs[0])
            + n_window * _ring_bytes_per_layer(model, layout, sh, a, s, window, docs[1]))
    passes = 3 if full else 2
    return {
        "ulysses_a2a": per_layer * passes * ulysses_a2a_bytes(model, layout, sh, a),
        "ring_p2p": m * ring,
        "tp": per_layer * passes * 4 * tp_collective_bytes(model, layout, sh, a),
        "dp_zero": traffic.total,
        "pp": m * 2 * pp_send_bytes(model, sh, a) if layout.pp > 1 else 0.0,
    }


def _memory(w: Workload, layout: Layout, sh: RankShapes, a: Assumptions, m: int) -> MemoryBreakdown:
    """Peak memory of the most loaded stage (see :func:`estimate`)."""
    model = w.model
    layer_params = (model.attention_params_per_layer() + model.mlp_params_per_layer()) / layout.tp
    kept = layer_activation_bytes(model, layout, sh, layout.recompute, a)
    transient = layer_transient_bytes(model, layout, sh, layout.recompute, a)
    embed_out = sh.n_sp * model.hidden_size * a.act_bytes
    N = layout.sharding_group_size
    best: Optional[MemoryBreakdown] = None
    stages = [(True, layout.pp == 1)] + ([(False, True)] if layout.pp > 1 else [])
    for first, last in stages:
        states = model_state_bytes(layout.zero_stage, stage_params(model, layout, first, last),
                                   layer_params, N, a)
        inflight = min(layout.pp, m) if first else 1
        acts = inflight * (sh.layers * kept + (embed_out if first else 0.0))
        logit_kept, logit_tr = logits_bytes(model, layout, sh, a) if last else (0.0, 0.0)
        mem = MemoryBreakdown(
            params=states.params / GIB,
            grads=states.grads / GIB,
            optimizer=states.optimizer / GIB,
            zero3_gathered=states.gathered / GIB,
            activations=acts / GIB,
            logits=logit_kept / GIB,
            transient=max(transient, logit_tr) / GIB,
        )
        mem.total = (mem.model_states() + mem.activations + mem.logits + mem.transient)
        if best is None or mem.total > best.total:
            best = mem
    assert best is not None
    return best


# ============================================================================ attention only


@dataclass(frozen=True)
class AttentionWorkload:
    """One USP attention call over ``world_size`` GPUs (all of them in U x R), as
    ``tools/bench_attention.py`` and yunchang's benchmark time it.

    Attributes:
        heads, kv_heads, head_dim: query heads, KV heads, head size.
        seq_length: global tokens; batch: sequences.
        backward: time forward + backward (else forward only).
    """

    heads: int
    kv_heads: int
    head_dim: int
    seq_length: int
    world_size: int
    gpus_per_node: int
    batch: int = 1
    backward: bool = True

    def model(self) -> ModelShape:
        """The attention as a one-layer model (no MLP, no vocabulary)."""
        return attention_shape(self.heads, self.kv_heads, self.head_dim)


@dataclass
class AttentionEstimate:
    """Predicted time of one attention call (forward, + backward when asked)."""

    layout: Layout
    times: AttentionTimes
    tokens: int
    links: Dict[str, str] = field(default_factory=dict)
    link_levels: Dict[str, int] = field(default_factory=dict)

    @property
    def step_time_s(self) -> float:
        return self.times.fwd + self.times.bwd

    @property
    def time_per_token(self) -> float:
        return self.step_time_s / self.tokens


def estimate_attention(aw: AttentionWorkload, ulysses: int, ring: int, hw: HardwareSpec,
                       a: Assumptions = DEFAULT_ASSUMPTIONS) -> AttentionEstimate:
    """:func:`usp_attention_times` for one call of ``aw`` under Ulysses x Ring."""
    if ulysses * ring != aw.world_size:
        raise PlannerError(f"Ulysses {ulysses} x Ring {ring} != {aw.world_size} GPUs")
    model = aw.model()
    layout = Layout.of(1, ulysses, ring, 1, 1)
    sh = rank_shapes(model, layout, aw.batch, aw.seq_length, a)
    links = _resolve_links(aw.gpus_per_node, layout, hw)
    times = usp_attention_times(model, layout, sh, hw, links, a, aw.batch, aw.seq_length,
                                aw.backward)
    names, levels = _link_names_and_levels(hw, links)
    return AttentionEstimate(layout, times, aw.batch * aw.seq_length, names, levels)
