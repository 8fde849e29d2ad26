"""The data loader on a real USP grid (4 gloo ranks on the CPU).

For U x R in {1x2 (DP 2), 2x2 (DP 1)}: every rank builds the datasets (megatron-core's
rank-0-first index build behind barriers), iterates its DP slice, and checks that

* its full micro-batches are exactly Megatron's DP slice of each global batch;
* every rank of its CP group got the same full micro-batch;
* the CP shards gathered over the CP group rebuild the micro-batch (nothing lost or
  duplicated), and its shard's position_ids are the token order's global positions;
* megatron-core's RotaryEmbedding on the CP group gives this rank the rotary rows of
  exactly those positions (RoPE sees the right global positions);
* the CP rank is u + U*r, as the token order assumes;
* an iterator resumed from consumed samples continues the same stream.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.training.cpu_shims import apply_cpu_shims
from megatron.training.data import corpus as corpus_mod
from megatron.training.data.batch import shard_batch_for_cp
from megatron.training.data.config import DataConfig, validate_data_config
from megatron.training.data.loader import build_data_iterator, build_gpt_datasets
from megatron.training.data.tokenizer import build_tokenizer
from megatron.usp.parallel_dims import ParallelDims
from megatron.usp.token_order import positions_for_cp_rank, unshard_from_cp_ranks

SMALL_BYTES = 200_000
SMALL_VOCAB = 1000
SEQ = 96  # divisible by 2*CP for CP 2 and 4
MICRO = 2
STEPS = 3


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "default-corpus-cache"
    return corpus_mod.ensure_default_corpus(str(cache), SMALL_BYTES, SMALL_VOCAB)


def _all_gather(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _check_grid(u, r, data_prefix, tokenizer_model, cache):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding,  # megatron-core on first use
    )

    from megatron.usp.parallel_state import (  # megatron-core on first use
        destroy_usp_parallel,
        initialize_usp_parallel,
    )

    groups = initialize_usp_parallel(ParallelDims(dist.get_world_size(), ulysses=u, ring=r))
    try:
        cp = u * r
        assert groups.cp_rank == groups.ulysses_rank + u * groups.ring_rank
        dp_rank, dp_size = dist.get_rank(groups.dp), dist.get_world_size(groups.dp)
        tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model)
        cfg = DataConfig(data_path=[data_prefix], split="90,5,5", seq_length=SEQ, seed=11,
                         data_cache_path=cache, micro_batch_size=MICRO,
                         global_batch_size=MICRO * dp_size, num_workers=0)
        validate_data_config(cfg, tok, cp)
        n = MICRO * dp_size * (STEPS + 2)
        train, _, _ = build_gpt_datasets(cfg, tok, [n, 4, 4])
        it = build_data_iterator(train, MICRO, dp_rank, dp_size, 0, num_workers=0)
        rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True,
                               cp_group=groups.cp)
        full_emb = rope.get_emb(SEQ)[:, 0, 0, :]  # [s, d] before CP slicing
        local_emb = rope(SEQ)[:, 0, 0, :]  # [s/cp, d], sliced for this CP rank
        batches = []
        for step in range(STEPS):
            batch = next(it)
            batches.append(batch)
            first = step * MICRO * dp_size + dp_rank * MICRO
            want = torch.stack([train[i]["tokens"] for i in range(first, first + MICRO)])
            assert torch.equal(batch["tokens"], want)
            for peer in _all_gather(batch["tokens"], groups.cp):
                assert torch.equal(peer, batch["tokens"])
            shard = shard_batch_for_cp(batch, groups.cp_rank, cp)
            assert shard["tokens"].shape == (MICRO, SEQ // cp)
            pos = positions_for_cp_rank(SEQ, groups.cp_rank, cp)
            assert shard["position_ids"][0].tolist() == pos
            assert torch.equal(local_emb, full_emb[shard["position_ids"][0].to(full_emb.device)])
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                gathered = _all_gather(shard[key], groups.cp)
                assert torch.equal(unshard_from_cp_ranks(gathered, 1), batch[key])
        resumed = build_data_iterator(train, MICRO, dp_rank, dp_size,
                                      consumed_samples=2 * MICRO * dp_size, num_workers=0)
        assert torch.equal(next(resumed)["tokens"], batches[2]["tokens"])
        # different DP ranks read different samples
        firsts = _all_gather(batches[0]["tokens"], groups.dp)
        assert len({tuple(t.flatten().tolist()) for t in firsts}) == dp_size
    finally:
        destroy_usp_parallel()


def _loader_on_grids(rank, world_size, data_prefix, tokenizer_model, cache):
    apply_cpu_shims()
    _check_grid(1, 2, data_prefix, tokenizer_model, cache + "/u1r2")
    _check_grid(2, 2, data_prefix, tokenizer_model, cache + "/u2r2")


def test_data_loader_on_usp_grids(dist_run, small_corpus, tmp_path):
    dist_run(_loader_on_grids, 4, small_corpus.data_prefix, small_corpus.tokenizer_model,
             str(tmp_path), timeout=240)
