"""One micro-batch through the model: CP sharding, ``get_batch``, the loss, the forward step.

Shapes at this boundary (names as in :mod:`megatron.training.data.loader`)::

    data iterator      tokens/labels/loss_mask/position_ids  [b, s]      full sequence, the
                       same micro-batch on every rank of a CP group (and of a TP group)
    get_batch          the same keys                          [b, s/CP]   this CP rank's
                       chunks c and 2CP-1-c (c = u + U*r), moved to the device
    GPTModel(labels)   per-token loss                         [b, s/CP]   float32

After :func:`shard_batch_for_cp` every ``[b, s]`` tensor is ``[b, s/CP]``: chunk ``c`` then
chunk ``2*CP-1-c`` of ``2*CP`` (``c = u + U*r``), and ``position_ids`` hold exactly those
global positions, which is what megatron-core's ``RotaryEmbedding`` selects on that rank.
The token order is :mod:`megatron.usp.token_order`'s (the single source of truth for which global
positions a rank holds).

Packed documents (:mod:`megatron.training.data.documents`): with ``--reset-attention-mask`` the
batch carries ``segment_ids`` and the micro-batch's ``chunk_assignment``; every key is
sharded through that assignment (tokens, labels, loss mask, position ids, segment ids alike),
and :func:`get_batch` adds ``packed_seq_params``: a
:class:`~megatron.usp.core_attention.DocumentParams` with this ring rank's document ring plan,
built from the full-sequence segment ids (the same plan on every rank of the ring). With
documents (either reset flag) every pipeline stage reads the batch: the middle stages need the
positions for RoPE and the plan for attention.

The loss function returns megatron-core's three-value form ``(loss_sum, num_tokens,
{"lm loss": [loss_sum, num_tokens], "attention pairs": [P]})``, ``P`` the (query, key) pairs
the micro-batch's core attention computes (:func:`attention_pairs`: the sum of ``n^2/2`` over
its documents, ``S^2/2`` per dense sequence), for the MFU of the work done with ``calculate_per_token_loss=True``: the schedule
back-propagates the *sum* over this rank's loss tokens and adds up the token counts; the
optimizer step divides the gradients by the global count (``training.guarded_optimizer_step``,
in place of ``finalize_model_grads``), and the training loop divides the summed losses the
same way. Hence the reported loss is the mean over every
loss-masked token of the global batch, for every parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import xxhash

from megatron.shapes import layer_mean_pairs
from megatron.training.data.config import DataConfigError
from megatron.training.data.errors import BatchMismatchError
from megatron.usp.document_kernels import pinned_to_device
from megatron.usp.document_ring import build_document_ring_plan, effective_window
from megatron.usp.token_order import shard_for_cp_rank

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "segment_ids")
"""Batch entries with a sequence dimension (dim 1); the ones CP sharding cuts."""


def shard_batch_for_cp(batch: Dict, cp_rank: int, cp_size: int) -> Dict:
    """Keep the tokens context-parallel rank ``cp_rank`` holds, on the sequence dim (1).

    ``[b, s]`` -> ``[b, s/cp_size]`` for each of :data:`SEQUENCE_KEYS`, through
    :func:`megatron.usp.token_order.shard_for_cp_rank` with the batch's chunk assignment
    ``batch["chunk_assignment"]`` (None or absent: chunks ``c`` and ``2*cp_size-1-c`` of
    ``2*cp_size``); other entries are passed through; ``attention_mask`` must be None.
    Returns a new dict; ``cp_size == 1`` returns the tensors unchanged.
    """
    if batch.get("attention_mask") is not None:
        raise ValueError("shard_batch_for_cp expects attention_mask None (attention is causal)")
    assignment = batch.get("chunk_assignment")
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        if key in batch and batch[key] is not None:
            try:
                out[key] = shard_for_cp_rank(batch[key], 1, cp_rank, cp_size, assignment)
            except ValueError as exc:
                raise DataConfigError(f"{key}: {exc}; see --seq-length") from None
    return out


def batch_fingerprint(full: Dict) -> int:
    """A 63-bit hash of what a micro-batch's ranks must agree on: the token ids, the segment
    ids and the chunk assignment (the rest, labels, loss mask and positions, follow from
    them). XXH3-64 of the host bytes: about 1 ms per MiB of tokens."""
    h = xxhash.xxh3_64()
    for key in ("tokens", "segment_ids"):
        if full.get(key) is not None:
            h.update(full[key].detach().cpu().contiguous().numpy().tobytes())
        h.update(key.encode())
    assignment = full.get("chunk_assignment")
    if assignment is not None:
        h.update(repr((assignment.ulysses_size, assignment.ring_chunks)).encode())
    return h.intdigest() >> 1   # fits an int64


def mismatch_message(count: int, hashes: List[int], ranks: List[int]) -> str:
    """One line naming which ranks of a group hold which batch."""
    by_hash: Dict[int, List[int]] = {}
    for h, rank in zip(hashes, ranks):
        by_hash.setdefault(h, []).append(rank)
    groups = sorted(by_hash.values(), key=lambda g: (-len(g), g))
    parts = [f"rank(s) {', '.join(map(str, g))}" for g in groups]
    return (f"micro-batch {count}: the TP and context-parallel ranks {ranks} must read the same "
            f"micro-batch, but {' hold one, '.join(parts)} hold another (hashes of token ids, "
            f"segment ids and chunk assignment differ); their data loaders must see the same "
            f"samples in the same order (same --seed, --data-path, data-parallel rank)")


class BatchAgreement:
    """Every ``interval``-th micro-batch the ranks of ``group`` (the TP x CP ranks that read
    the same micro-batch, a gloo group: :attr:`~megatron.usp.parallel_state.USPGroups.same_batch`)
    compare :func:`batch_fingerprint`: one all-gather of one int64 per rank on the host.
    A mismatch raises :class:`BatchMismatchError` on every rank of the group."""

    def __init__(self, group: dist.ProcessGroup, interval: int) -> None:
        self.group, self.interval, self.count = group, interval, 0
        self.ranks = dist.get_process_group_ranks(group)

    def check(self, full: Dict) -> None:
        self.count += 1
        if self.interval < 1 or (self.count - 1) % self.interval:
            return
        mine = torch.tensor([batch_fingerprint(full)], dtype=torch.int64)
        found = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(found, mine, group=self.group)
        hashes = [int(t) for t in found]
        if len(set(hashes)) > 1:
            raise BatchMismatchError(mismatch_message(self.count, hashes, self.ranks),
                                     primary=dist.get_rank() == self.ranks[0])


@dataclass(frozen=True)
class BatchContext:
    """What a forward step needs to know about this rank's place in the grid."""

    cp_rank: int
    cp_size: int
    device: torch.device
    first_stage: bool
    last_stage: bool
    ring_rank: int = 0
    ring_size: int = 1
    documents: bool = False     # --reset-position-ids / --reset-attention-mask
    agreement: Optional[BatchAgreement] = None   # --batch-agreement-interval
    # --window-size's left window when some layer uses it: the micro-batch's windowed document
    # plan is built here with the batch, not by the first window layer's forward.
    window: Optional[int] = None
    window_share: float = 0.0   # the share of the model's layers that use ``window``


def _document_params(full: Dict, ctx: BatchContext):
    """This ring rank's :class:`DocumentParams` for a full micro-batch, or None."""
    if full.get("segment_ids") is None:
        return None
    from megatron.usp.core_attention import DocumentParams  # megatron-core on first use

    plan = build_document_ring_plan(full["segment_ids"].numpy(), ctx.ring_rank, ctx.ring_size,
                                    full.get("chunk_assignment"), causal=True,
                                    device=ctx.device)
    if ctx.window is not None:
        plan.with_window(effective_window(ctx.window, plan.seq_len))     # cached on the plan
    return DocumentParams.for_plan(plan)


def reads_batches(ctx: BatchContext) -> bool:
    """Whether this rank reads micro-batches: the first and last pipeline stages, and every
    stage when the batches carry documents (their positions and plan)."""
    return ctx.first_stage or ctx.last_stage or ctx.documents


def prepare_batch(full: Dict, ctx: BatchContext) -> Dict[str, Optional[torch.Tensor]]:
    """A full micro-batch ``[b, s]`` cut to this CP rank's tokens, queued to ``ctx.device``
    through pinned memory, with its document plan and attention pairs (:func:`get_batch`)."""
    local = shard_batch_for_cp(full, ctx.cp_rank, ctx.cp_size)   # [b, s/CP]
    out = {key: (pinned_to_device(local[key], device=ctx.device) if local.get(key) is not None
                 else None) for key in SEQUENCE_KEYS}
    out["packed_seq_params"] = _document_params(full, ctx)
    out["attention_pairs"] = attention_pairs(full, ctx.documents, ctx.window, ctx.window_share)
    return out


def get_batch(data_iterator, ctx: BatchContext) -> Dict[str, Optional[torch.Tensor]]:
    """Next micro-batch, cut to this CP rank's tokens and moved to ``ctx.device``.

    Middle pipeline stages read nothing (their input comes from the previous stage) and
    get ``None`` for every key, unless the batches carry documents (module docstring); the
    first stage needs tokens and positions, the last labels and the loss mask, and both read
    the full micro-batch, which ``ctx.agreement`` compares across the TP x CP group.
    ``packed_seq_params`` is the document mask (None without one). From a
    :class:`PreparedBatches` it is the micro-batch that iterator prepared ahead, if any.
    """
    if not reads_batches(ctx):
        return {key: None for key in SEQUENCE_KEYS + ("packed_seq_params",)}
    prepared = None
    if isinstance(data_iterator, PreparedBatches) and data_iterator.ctx == ctx:
        full, prepared = data_iterator.next_prepared()
    else:
        full = next(data_iterator)
    if ctx.agreement is not None:     # where the micro-batch is used, prepared ahead or not
        ctx.agreement.check(full)
    return prepared if prepared is not None else prepare_batch(full, ctx)


class PreparedBatches:
    """The training iterator, able to prepare its next micro-batch ahead of use.

    Between steps the GPU still runs the optimizer while the host reads the next batch,
    cuts it, queues its copies and builds its document plan; when that host work outlasts
    the optimizer (a long packed sequence: several milliseconds of plan building) the GPU
    idles at the start of every step. :meth:`prepare_next`, called by the training loop
    once a step's work is queued and before it waits for the step's loss, does that work
    while the GPU is still busy with the backward; :func:`get_batch` then takes the prepared
    micro-batch. The order of micro-batches is unchanged, and a run that stops leaves at
    most one prepared micro-batch unused (resuming counts consumed samples, not reads). The
    ranks' batch agreement (``--batch-agreement-interval``) is checked where a micro-batch
    is used, so a rank that reads differently is still caught at the same micro-batch.

    ``next()`` gives the full micro-batches as the wrapped iterator does (a custom forward
    step that reads them itself sees no difference: nothing is prepared for it). The end
    of the wrapped iterator is raised where the micro-batch is asked for, not where it is
    prepared.
    """

    def __init__(self, source: Iterator[Dict], ctx: BatchContext) -> None:
        self.source, self.ctx = source, ctx
        self._ready: Optional[Tuple[Dict, Dict]] = None   # (full, prepared)
        self._ended = False

    def __iter__(self) -> "PreparedBatches":
        return self

    def __next__(self) -> Dict:
        if self._ready is not None:
            full, self._ready = self._ready[0], None
            return full
        if self._ended:
            raise StopIteration
        return next(self.source)

    def prepare_next(self) -> None:
        """Read and prepare the next micro-batch now (nothing if one is waiting already, if
        this rank reads no batches, or at the end of the data)."""
        if self._ready is not None or self._ended or not reads_batches(self.ctx):
            return
        try:
            full = next(self.source)
        except StopIteration:
            self._ended = True
            return
        self._ready = (full, prepare_batch(full, self.ctx))

    def next_prepared(self) -> Tuple[Dict, Dict[str, Optional[torch.Tensor]]]:
        """The next micro-batch, full and as :func:`prepare_batch` gives it: prepared ahead,
        or now."""
        if self._ready is not None:
            ready, self._ready = self._ready, None
            return ready
        full = next(self)
        return full, prepare_batch(full, self.ctx)


def attention_pairs(full: Dict[str, torch.Tensor], documents: bool,
                    window: Optional[int] = None, window_share: float = 0.0) -> float:
    """Causal (query, key) pairs of a full micro-batch [b, S], per layer on average: ``n^2/2``
    per document with documents (``segment_ids``), else ``S^2/2`` per sequence (the FLOP
    count's convention, :mod:`megatron.shapes.flops`); on the ``window_share`` of the layers
    that use the left ``window``, the pairs inside it (:func:`~megatron.shapes.window_pairs`);
    the mean over the layers is :func:`~megatron.shapes.layer_mean_pairs`, the planner's too."""
    b, s = full["tokens"].shape
    seg = full.get("segment_ids") if documents else None
    rows = ([[s]] * b if seg is None else
            [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in seg])
    return sum(layer_mean_pairs(lengths, window, window_share) for lengths in rows)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor,
              attention_pairs: Optional[float] = None):
    """Per-token losses [b, s/CP] -> (sum over loss tokens, token count, report).

    Returns megatron-core's three-value loss form (see the module docstring). The report
    ``[loss_sum, num_tokens]`` is float32 and detached; it is summed over micro-batches and
    all-reduced over DP x CP by the training loop, as are the micro-batch's
    ``attention_pairs`` when given (float64: exact to 2^53 pairs).
    """
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = {"lm loss": torch.stack([loss_sum.detach(), mask.sum().detach()])}
    if attention_pairs is not None:
        # on the loss's device through pinned memory: the loop sums the reports after the
        # backward is queued, and a copy from pageable memory would wait for the backward
        report["attention pairs"] = pinned_to_device(
            torch.tensor([attention_pairs], dtype=torch.float64), device=loss_sum.device)
    return loss_sum, num_tokens, report


def forward_step(ctx: BatchContext, data_iterator, model) -> Tuple[torch.Tensor, Callable]:
    """megatron-core forward-step function (bind ``ctx`` with ``functools.partial``).

    Returns the last stage's per-token losses [b, s/CP] (the hidden states [s/CP, b, h]
    on other stages) and the loss function for them.
    """
    batch = get_batch(data_iterator, ctx)
    # loss_mask lets the fused output layer compute its gradients in the forward (the loss
    # function below weighs the per-token losses by exactly this mask); GPTModel ignores it.
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=batch["packed_seq_params"], loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"],
                           attention_pairs=batch.get("attention_pairs"))
