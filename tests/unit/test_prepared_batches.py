"""The training iterator prepares the next micro-batch ahead (``PreparedBatches``).

* the prepared micro-batches are the ones :func:`prepare_batch` makes of the same full
  batches, in the same order, whether prepared ahead or on demand;
* ``prepare_next`` reads one micro-batch at most, nothing on a rank that reads no batches,
  and the end of the data is raised where a micro-batch is asked for;
* ``next()`` still gives the full micro-batches (custom forward steps);
* a training run prepares the next step's first micro-batch on every step but the last,
  and its losses are those of the same run whose forward step reads the batches itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.training.data.batch import (
    BatchContext,
    PreparedBatches,
    get_batch,
    prepare_batch,
)
from tests.helpers import tiny_gpt_flags

CPU = torch.device("cpu")


def _batches(n, seq=16, b=1, seed=0):
    """Full micro-batches with documents: tokens, labels, loss mask, positions, segments."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=2, replace=False))
        lengths = np.diff(np.concatenate(([0], cuts, [seq])))
        seg = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))[None].repeat(b, 1)
        pos = torch.cat([torch.arange(int(n_)) for n_ in lengths])[None].repeat(b, 1)
        tokens = torch.randint(0, 100, (b, seq), generator=torch.Generator().manual_seed(i))
        out.append({"tokens": tokens, "labels": tokens.roll(-1, 1),
                    "loss_mask": torch.ones(b, seq), "position_ids": pos,
                    "segment_ids": seg.long(), "attention_mask": None})
    return out


def _ctx(**kw):
    base = dict(cp_rank=0, cp_size=1, device=CPU, first_stage=True, last_stage=True,
                documents=True)
    base.update(kw)
    return BatchContext(**base)


def _same(a, b):
    for key in ("tokens", "labels", "loss_mask", "position_ids", "segment_ids"):
        assert torch.equal(a[key], b[key]), key
    assert a["attention_pairs"] == b["attention_pairs"]
    pa, pb = a["packed_seq_params"].plan, b["packed_seq_params"].plan
    assert pa.seq_len == pb.seq_len
    assert [x is None for x in pa.blocks] == [x is None for x in pb.blocks]


class _Counting:
    def __init__(self, items):
        self.items, self.reads = list(items), 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.reads == len(self.items):
            raise StopIteration
        self.reads += 1
        return self.items[self.reads - 1]


@pytest.mark.parametrize("ahead", [(), (0,), (0, 2), (0, 1, 2, 3)])
def test_prepared_ahead_or_not_the_micro_batches_are_the_same(ahead):
    full = _batches(4)
    ctx = _ctx()
    it = PreparedBatches(_Counting(full), ctx)
    for i in range(4):
        if i in ahead:
            it.prepare_next()
            assert it.source.reads == i + 1        # read now, before it is asked for
        _same(get_batch(it, ctx), prepare_batch(full[i], ctx))
        assert it.source.reads == i + 1


def test_prepare_next_reads_one_micro_batch_at_most():
    ctx = _ctx()
    it = PreparedBatches(_Counting(_batches(3)), ctx)
    it.prepare_next()
    it.prepare_next()
    assert it.source.reads == 1
    get_batch(it, ctx)
    get_batch(it, ctx)
    assert it.source.reads == 2


def test_the_end_of_the_data_is_raised_where_a_micro_batch_is_asked_for():
    ctx = _ctx()
    it = PreparedBatches(_Counting(_batches(1)), ctx)
    get_batch(it, ctx)
    it.prepare_next()                                   # the end: no error here
    with pytest.raises(StopIteration):
        get_batch(it, ctx)
    with pytest.raises(StopIteration):
        next(it)


def test_a_rank_that_reads_no_batches_prepares_nothing():
    ctx = _ctx(first_stage=False, last_stage=False, documents=False)
    it = PreparedBatches(_Counting(_batches(2)), ctx)
    it.prepare_next()
    assert it.source.reads == 0
    assert all(v is None for v in get_batch(it, ctx).values())


def test_next_gives_the_full_micro_batches_prepared_or_not():
    full = _batches(3)
    it = PreparedBatches(_Counting(full), _ctx())
    it.prepare_next()
    assert next(it) is full[0]
    assert next(it) is full[1]
    it.prepare_next()
    assert next(it) is full[2]


def test_another_context_reads_its_own_micro_batch():
    full = _batches(2)
    ctx = _ctx()
    it = PreparedBatches(_Counting(full), ctx)
    it.prepare_next()
    other = _ctx(window=4)
    _same(get_batch(it, other), prepare_batch(full[0], other))


# --------------------------------------------------------------------------- in training
ITERS = 3
RUN = tiny_gpt_flags(llama=False, num_attention_heads=8, train_iters=ITERS, lr="1e-3",
                     mock_data=True, vocab_size=1000, num_workers=0, eval_iters=0,
                     global_batch_size=2, micro_batch_size=1, seq_length=64,
                     max_position_embeddings=64) + [
    "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--device", "cpu",
    "--log-interval", "1", "--seed", "1234"]


def _train(rank, world_size, out):
    import megatron.training.data.batch as batch_mod
    from megatron.training.cli.arguments import parse_args
    from megatron.training.loop import pretrain

    events = []
    real_prepare, real_get = batch_mod.PreparedBatches.prepare_next, batch_mod.get_batch

    def prepare(self):
        events.append("prepare")
        real_prepare(self)

    def get(data_iterator, ctx):
        events.append("get")
        return real_get(data_iterator, ctx)

    class Raw:                   # the batches as a custom forward step reads them
        def __init__(self, source):
            self.source = source

        def __next__(self):
            return next(self.source)

    def own_reads(ctx, data_iterator, model):
        return batch_mod.forward_step(ctx, Raw(data_iterator), model)

    batch_mod.PreparedBatches.prepare_next, batch_mod.get_batch = prepare, get
    try:
        ahead = pretrain(parse_args(RUN)).losses
        run_events, events[:] = list(events), []
        itself = pretrain(parse_args(RUN), forward_step_func=own_reads).losses
    finally:
        batch_mod.PreparedBatches.prepare_next, batch_mod.get_batch = real_prepare, real_get
    assert run_events == ["get", "get", "prepare"] * (ITERS - 1) + ["get", "get"], run_events
    assert ahead == itself and len(ahead) == ITERS, (ahead, itself)


def test_training_prepares_the_next_step_and_keeps_its_losses(dist_run):
    dist_run(_train, 1, None, timeout=240)
