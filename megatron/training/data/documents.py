"""Packed documents in the data loader: segment ids and the chunk assignment of each micro-batch.

Megatron-LM's flags, Megatron-LM's meaning:

* ``--reset-position-ids``: positions restart after each EOD token (megatron-core's
  ``GPTDataset`` computes them; the RoPE follows them, :mod:`megatron.training.model.gpt_model`).
* ``--reset-attention-mask``: a token attends only to its own document (EOD-delimited; the EOD
  closes its document). The batch carries ``segment_ids [b, s]``
  (:func:`megatron.usp.document_mask.segment_ids_from_tokens`) instead of a dense mask, and a
  ``chunk_assignment`` chosen here to balance the causal work over the ring ranks with few
  documents cut between them (:func:`megatron.usp.load_balance.balance_chunks`, from the segment
  ids; ``--chunk-assignment zigzag`` keeps the
  zigzag token order). Every sequence key of the batch is then sharded through that one
  assignment (:func:`megatron.training.data.batch.shard_batch_for_cp`).
* ``--eod-mask-loss``: loss mask 0 on EOD tokens (megatron-core's dataset).

:class:`DocumentBatching` is the DataLoader's ``collate_fn`` (it runs in the loader's worker
processes, off the training step's critical path). Documents are never padded and no token is
dropped: a document of one token, of odd length, or longer than the sequence (it continues in
the next sample, as a new segment there) is just a segment of that length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from megatron.training.cli.document_args import (  # noqa: F401  (re-exported)
    CHUNK_ASSIGNMENTS,
    add_document_args,
    document_flags_problem,
)
from megatron.training.data.loader import collate_samples
from megatron.usp.document_mask import segment_ids_from_tokens
from megatron.usp.load_balance import balance_chunks


@dataclass(frozen=True)
class DocumentBatching:
    """``collate_fn`` adding ``segment_ids`` and ``chunk_assignment`` to each micro-batch.

    Attributes:
        eod: the tokenizer's EOD id.
        ulysses, ring: U and R (the assignment balances the R ring ranks).
        balance: ``--chunk-assignment``: ``auto`` (balanced chunks, zigzag when not better) or
            ``zigzag``.
    """

    eod: int
    ulysses: int
    ring: int
    balance: str = "auto"

    def __call__(self, samples: Sequence[Dict]) -> Dict[str, Optional[object]]:
        batch = collate_samples(samples)
        seg = segment_ids_from_tokens(batch["tokens"], self.eod)          # [b, s] int32
        batch["segment_ids"] = seg
        batch["chunk_assignment"] = None
        if self.balance == "auto" and self.ring > 1:
            choice = balance_chunks(seg.numpy(), self.ulysses, self.ring)
            if not choice.is_zigzag:
                batch["chunk_assignment"] = choice.assignment
        return batch


def documents_enabled(reset_attention_mask: bool, reset_position_ids: bool) -> bool:
    """Whether the batches carry document information every pipeline stage must read
    (``--reset-attention-mask`` or ``--reset-position-ids``)."""
    return bool(reset_attention_mask or reset_position_ids)


