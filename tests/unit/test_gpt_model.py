"""RoPE from position_ids (megatron/training/model/gpt_model.py) against megatron-core's own table.

``rotary_freqs_from_positions`` must give, bit for bit, the rows of megatron-core's
``RotaryEmbedding.get_emb`` table at the given positions: for the default token order (the table for
``0..S-1`` sliced as megatron-core's ``get_pos_emb_on_this_cp_rank`` slices it, chunks ``c``
and ``2CP-1-c`` of ``2CP``, restated here because megatron-core's function pins memory and
calls ``.cuda()``), for reset positions, interleaved or not, with a rotary percent, an
interpolation factor and Llama-3 scaling.
"""

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron.training.model.gpt_model import rotary_freqs_from_positions
from megatron.usp import token_order
from megatron.usp.document_mask import segment_ids_from_tokens
from tests.helpers import document_offsets


def _megatron_cp_slice(table, cp_rank, cp):
    """get_pos_emb_on_this_cp_rank(table, 0, group): chunks c and 2CP-1-c of 2CP."""
    chunks = table.view(2 * cp, -1, *table.shape[1:])
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]])


def _megatron_table(rope, seq):
    """megatron-core's get_emb table [S, 1, 1, d] (computed on inv_freq's device)."""
    freqs = rope.get_freqs_non_repeated(seq)
    if not rope.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


ROPES = [dict(kv_channels=16, rotary_percent=1.0),
         dict(kv_channels=16, rotary_percent=0.5, rotary_interleaved=True),
         dict(kv_channels=32, rotary_percent=1.0, seq_len_interpolation_factor=4.0),
         dict(kv_channels=32, rotary_percent=1.0, rope_scaling=True, rotary_base=500000)]


@pytest.mark.parametrize("kwargs", ROPES)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_default_token_order_is_bit_identical_to_megatron_core(kwargs, cp):
    rope = RotaryEmbedding(use_cpu_initialization=True, **kwargs)
    seq = 64
    table = _megatron_table(rope, seq)
    for c in range(cp):
        want = _megatron_cp_slice(table, c, cp)
        pos = torch.tensor(token_order.positions_for_cp_rank(seq, c, cp)).repeat(2, 1)   # [b, s]
        got = rotary_freqs_from_positions(rope, pos)                                 # [s, b, 1, d]
        assert got.shape == (seq // cp, 2, 1, table.shape[-1])
        assert torch.equal(got, want.expand(-1, 2, -1, -1))


@pytest.mark.parametrize("kwargs", ROPES[:2])
def test_reset_positions_take_the_rows_of_their_positions(kwargs):
    rope = RotaryEmbedding(use_cpu_initialization=True, **kwargs)
    tokens = torch.tensor([[3, 4, 0, 5, 6, 7, 0, 8], [0, 1, 2, 3, 4, 5, 6, 0]])
    pos = document_offsets(segment_ids_from_tokens(tokens, 0))
    table = _megatron_table(rope, 8)[:, 0, 0]                       # [S, d]
    got = rotary_freqs_from_positions(rope, pos)
    for b in range(2):
        assert torch.equal(got[:, b, 0], table[pos[b]])
    assert not torch.equal(got[:, 0], got[:, 1])                    # per sample
