"""USP attention on gloo ranks equals single-device attention on the whole sequence.

Every rank draws the same full-sequence float64 q, k, v and output gradient (same seed),
keeps its TP heads (megatron's split: heads over TP first, one KV head per rank when KV heads
< TP) and its tokens (``token_order.shard_for_cp_rank``), runs USP attention forward and backward,
and compares its out, dq, dk, dv with the matching token slice of a float64 reference computed
with plain autograd ops on the whole sequence of its TP heads (independent of
megatron.usp.kernels). Every rank checks its own slice, so together the ranks check the whole
gathered result.

Tolerance: 1e-10 absolute and relative (float64; the orders of summation differ, ~1e-15).

Communication is counted too: no all-to-all when U = 1 and no ring exchange when R = 1; else
exactly two all-to-alls each way and R-1 (forward) + R-1 (backward) K/V exchanges plus R
dK/dV accumulator exchanges (R-1 in the accumulator dtype, the last in the input dtype), with K/V messages
sized by the KV head count (never Q's); all of it per head chunk when the default
``overlap_chunks`` pipelines (``tests/distributed/test_usp_overlap.py`` covers chunking).

Layouts (U x R, TP): 1x2, 2x1 (world 2); 2x2, 4x1, 1x4, TP2 x U2 (world 4); 4x2, 2x4
(world 8). Per layout: causal and not; MHA, GQA, MQA and KV heads < U where the layout allows;
batch 2; head dims 64 and 128; the default kernel (PyTorch's CPU kernel) and ``math``; one case
through the megatron-core module ``USPAttention``. One process launch per world size.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from megatron.usp import token_order
from megatron.usp.attention import resolve_overlap_chunks, usp_attention
from megatron.usp.kernels import AttentionBackendUnavailable, get_kernel
from megatron.usp.parallel_dims import ParallelDims
from megatron.usp.parallel_state import destroy_usp_parallel, initialize_usp_parallel
from megatron.usp.ring_attention import (
    ring_accum_dtype,
    ring_attention_backward,
    ring_attention_forward,
)
from megatron.usp.ring_comm import RingComm
from megatron.usp.ulysses import kv_replication
from tests.gpu.test_usp_attention_gpu import assert_passed, load_check_tool
from tests.helpers import attention_config

TOL = dict(atol=1e-10, rtol=1e-10)
NUM_HEADS = 8
LAYOUTS = {  # world size -> [(U, R, TP)]
    2: [(1, 2, 1), (2, 1, 1)],
    4: [(2, 2, 1), (4, 1, 1), (1, 4, 1), (2, 1, 2)],
    8: [(4, 2, 1), (2, 4, 1)],
}


def reference_attention(q, k, v, causal):
    """Whole-sequence attention on [S, b, h, d] / [S, b, hk, d], plain autograd ops."""
    seq, _, h, d = q.shape
    g = h // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)
    if causal:
        mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", torch.softmax(scores, dim=-1), v)


def kv_head_choices(ulysses: int, tp: int):
    """Total KV head counts valid for the layout (megatron: < TP means one per TP rank)."""
    out = []
    for hk in (NUM_HEADS, 4, 2, 1):
        per_tp = max(1, hk // tp)
        if per_tp % ulysses == 0 or ulysses % per_tp == 0:
            out.append(hk)
    return out


def cases_for(ulysses: int, ring: int, tp: int):
    cases = []
    combos = itertools.product((True, False), kv_head_choices(ulysses, tp))
    for i, (causal, hk) in enumerate(combos):
        cases.append(dict(
            causal=causal,
            num_kv_heads=hk,
            head_dim=(64, 128)[i % 2],
            backend="math" if i == 1 else "auto",
            via_module=(i == 0),
        ))
    return cases


def tp_heads(x, tp_rank, tp, total_heads):
    """Megatron's TP split of a head dim [S, b, H, d] (one head per rank when H < TP)."""
    if total_heads >= tp:
        per = total_heads // tp
        return x[:, :, tp_rank * per:(tp_rank + 1) * per]
    idx = tp_rank // (tp // total_heads)
    return x[:, :, idx:idx + 1]


def _module(groups, case, tp):
    from megatron.core.transformer.enums import AttnMaskType  # megatron-core on first use

    from megatron.usp.core_attention import USPAttention  # megatron-core on first use

    config = attention_config(NUM_HEADS, case["head_dim"], case["num_kv_heads"], groups.dims,
                              tensor_model_parallel_size=tp)
    if case["num_kv_heads"] < tp:          # what megatron's Attention hands core attention
        config.num_query_groups = tp
    mask = AttnMaskType.causal if case["causal"] else AttnMaskType.no_mask
    return USPAttention(config=config, layer_number=1, attn_mask_type=mask,
                        attention_type="self", cp_comm_type=None, softmax_scale=None,
                        pg_collection=groups.pg_collection,
                        attention_backend=case["backend"])


class CommCounter:
    """Records the all-to-alls and ring exchanges issued inside the ``with`` block."""

    def __enter__(self):
        self.a2a, self.p2p = [], []
        self._orig = (dist.all_to_all_single, dist.batch_isend_irecv)

        def a2a(out, inp, *args, **kwargs):
            self.a2a.append(inp.numel())
            return self._orig[0](out, inp, *args, **kwargs)

        def p2p(ops):
            self.p2p.append([(op.op.__name__, op.tensor.numel(), op.tensor.dtype) for op in ops])
            return self._orig[1](ops)

        dist.all_to_all_single, dist.batch_isend_irecv = a2a, p2p
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, dist.batch_isend_irecv = self._orig


def check_communication(comm, groups, q_l, k_l, chunks=1):
    """Exactly the collectives and message sizes the docstrings state; none for size-1 axes.

    With ``chunks`` = G head chunks every message is 1/G of the unchunked one and there are G
    times as many, so the total volume does not depend on G. The ring's dK/dV accumulator
    travels R-1 hops in the accumulator dtype (float32/float64 for R > 2, the inputs' own for
    R = 2: ``ring_accum_dtype``) and the last one in the inputs' dtype.
    """
    ulysses, ring = groups.dims.ulysses, groups.dims.ring
    s, b, h, d = q_l.shape
    hk_sent = max(k_l.shape[2], ulysses)          # KV heads after replication (hk < U)
    if ulysses == 1:
        assert comm.a2a == []
    else:   # forward: Q,K,V in one, output back; backward: dOut in, then dQ/dK/dV back in
        # one (no ring) or dQ and dK/dV in two (ring: dK/dV wait for the last hop); per chunk
        qkv, out = s * b * (h + 2 * hk_sent) * d, s * b * h * d
        grads = [qkv] if ring == 1 else [out, qkv - out]
        expected = [qkv, out, out] + grads
        assert sorted(comm.a2a) == sorted([m // chunks for m in expected] * chunks), comm.a2a
        assert sum(comm.a2a) == 2 * (qkv + out)
    if ring == 1:
        assert comm.p2p == []
        return
    kv = 2 * b * (hk_sent // ulysses) * (ulysses * s) * d // chunks
    acc = ring_accum_dtype(q_l.dtype, ring)

    def msg(dtype):
        return [("isend", kv, dtype), ("irecv", kv, dtype)]

    expected = ([msg(q_l.dtype)] * (2 * (ring - 1))      # K/V, forward and backward
                + [msg(acc)] * (ring - 1)                # dK/dV accumulating
                + [msg(q_l.dtype)])                      # dK/dV delivered home
    as_key = [tuple(m) for m in comm.p2p]          # dtypes compare by equality only
    assert Counter(as_key) == Counter(tuple(m) for m in expected * chunks), comm.p2p


def run_case(groups, tp, tp_rank, case, seq_len, batch=2):
    causal, hk, d = case["causal"], case["num_kv_heads"], case["head_dim"]
    gen = torch.Generator().manual_seed(1234 + 7 * hk + d + int(causal))

    def rand(h):
        return torch.randn(seq_len, batch, h, d, generator=gen, dtype=torch.float64)

    q, k, v, dout = rand(NUM_HEADS), rand(hk), rand(hk), rand(NUM_HEADS)

    # Attention is separable over heads: the reference for this TP rank is whole-sequence
    # attention over this rank's heads (when KV heads < TP the shared KV head's gradient is
    # this rank's share; megatron's QKV projection sums the shares).
    q, dout = tp_heads(q, tp_rank, tp, NUM_HEADS), tp_heads(dout, tp_rank, tp, NUM_HEADS)
    k, v = tp_heads(k, tp_rank, tp, hk), tp_heads(v, tp_rank, tp, hk)
    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref = reference_attention(q_ref, k_ref, v_ref, causal)
    out_ref.backward(dout)

    cp_rank, cp = groups.cp_rank, groups.dims.cp

    def mine(x):   # this rank's tokens
        return token_order.shard_for_cp_rank(x, 0, cp_rank, cp)

    q_l, k_l, v_l = (mine(t).clone().requires_grad_() for t in (q, k, v))
    with CommCounter() as comm:
        if case["via_module"]:
            module = _module(groups, case, tp)
            out_l = module(q_l, k_l, v_l, None).view(q_l.shape)
        else:
            out_l = usp_attention(q_l, k_l, v_l, ulysses_group=groups.ulysses,
                                  ring_group=groups.ring, causal=causal, backend=case["backend"])
        out_l.backward(mine(dout))
    chunks = resolve_overlap_chunks(q_l.shape[2], k_l.shape[2], groups.dims.ulysses,
                                    groups.dims.ring)
    check_communication(comm, groups, q_l, k_l, chunks)

    for name, got, want in (
        ("out", out_l, mine(out_ref.detach())),
        ("dq", q_l.grad, mine(q_ref.grad)),
        ("dk", k_l.grad, mine(k_ref.grad)),
        ("dv", v_l.grad, mine(v_ref.grad)),
    ):
        assert got.shape == want.shape, (name, got.shape, want.shape)
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _all_layouts(rank, world_size, layouts):
    for ulysses, ring, tp in layouts:
        groups = initialize_usp_parallel(
            ParallelDims(dist.get_world_size(), tp=tp, ulysses=ulysses, ring=ring))
        tp_rank = torch.distributed.get_rank(groups.tp)
        cp = ulysses * ring
        seq_len = max(32, 2 * cp * 4)
        for case in cases_for(ulysses, ring, tp):
            try:
                run_case(groups, tp, tp_rank, case, seq_len)
            except AssertionError as exc:
                raise AssertionError(f"U={ulysses} R={ring} TP={tp} {case}: {exc}") from None
        destroy_usp_parallel()


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_usp_attention_matches_single_device(dist_run, world_size):
    dist_run(_all_layouts, world_size, LAYOUTS[world_size], timeout=300)


def _narrow_accumulators_bitwise(rank, world_size):
    """R = 2, bf16: input-dtype accumulators give the bits float32 accumulators give."""
    groups = initialize_usp_parallel(ParallelDims(dist.get_world_size(), ring=2))
    comm, kernel = RingComm(groups.ring), get_kernel("auto")
    assert ring_accum_dtype(torch.bfloat16, 2) == torch.bfloat16
    assert ring_accum_dtype(torch.bfloat16, 3) == torch.float32
    gen = torch.Generator().manual_seed(99 + rank)
    b, hq, hk, s2, d = 2, 4, 2, 24, 16

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(torch.bfloat16)

    q, kv, dout = rand(b, hq, s2, d), rand(2, b, hk, s2, d), rand(b, hq, s2, d)
    for causal in (True, False):
        runs = {}
        for name, acc in (("narrow", None), ("wide", torch.float32)):
            out, lse = ring_attention_forward(q, kv, comm, kernel, causal, 0.25, acc_dtype=acc)
            grads = ring_attention_backward(dout, q, kv, out, lse, comm, kernel, causal, 0.25,
                                            acc_dtype=acc)
            runs[name] = (out, lse, grads.dq, *grads.dkv())
        for field, a, w in zip(("out", "lse", "dq", "dk", "dv"), runs["narrow"], runs["wide"]):
            assert a.dtype == w.dtype, (field, a.dtype, w.dtype)
            assert torch.equal(a, w), f"causal={causal} {field}: {(a.float() - w.float()).abs().max()}"
    destroy_usp_parallel()


def test_ring_of_two_accumulates_in_input_dtype_bit_for_bit(dist_run):
    """The R = 2 memory saving (``ring_accum_dtype``) changes no bit of out, lse, dq, dk, dv."""
    dist_run(_narrow_accumulators_bitwise, 2, timeout=120)


def test_case_matrix_covers_the_issue():
    """The matrix above includes every required feature at least once."""
    seen = set()
    for layouts in LAYOUTS.values():
        for ulysses, ring, tp in layouts:
            for case in cases_for(ulysses, ring, tp):
                kv_per_tp = max(1, case["num_kv_heads"] // tp)
                kind = ("mha" if case["num_kv_heads"] == NUM_HEADS else
                        "mqa" if case["num_kv_heads"] == 1 else "gqa")
                seen.update({kind, ("causal", case["causal"]), ("d", case["head_dim"]),
                             case["backend"]})
                if kv_per_tp < ulysses:
                    seen.add("kv<U")
                if tp > 1:
                    seen.add("tp")
                if case["via_module"]:
                    seen.add("module")
    assert {"mha", "gqa", "mqa", "kv<U", "tp", "module", "math", "auto", ("causal", True),
            ("causal", False), ("d", 64), ("d", 128)} <= seen
    assert {(u, r) for ls in LAYOUTS.values() for u, r, tp in ls if tp == 1} == {
        (1, 2), (2, 1), (2, 2), (4, 1), (1, 4), (4, 2), (2, 4)}


# --------------------------------------------------------------------------- bad input
def _config(**overrides):
    return attention_config(4, 16, **{"params_dtype": torch.float32, **overrides})


def _build(config, **kwargs):
    from megatron.core.transformer.enums import AttnMaskType  # megatron-core on first use

    from megatron.usp.core_attention import USPAttention  # megatron-core on first use

    params = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                  attention_type="self", cp_comm_type=None, softmax_scale=None,
                  pg_collection=None)
    params.update(kwargs)
    return USPAttention(**params)


def test_dropout_is_rejected_with_the_flag():
    with pytest.raises(ValueError, match="--attention-dropout 0.1.*--attention-dropout 0.0"):
        _build(_config(attention_dropout=0.1))


def test_unknown_and_missing_backends():
    with pytest.raises(ValueError, match="--attention-backend 'fast'"):
        _build(_config(), attention_backend="fast")
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(AttentionBackendUnavailable, match="pip install flash-attn"):
            _build(_config(), attention_backend="flash-attn")


def test_unsupported_masks_and_inputs():
    from megatron.core.packed_seq_params import PackedSeqParams  # megatron-core on first use
    from megatron.core.transformer.enums import AttnMaskType  # megatron-core on first use

    with pytest.raises(NotImplementedError, match="causal or no_mask"):
        _build(_config(), attn_mask_type=AttnMaskType.padding)
    module = _build(_config())
    q = torch.zeros(8, 1, 4, 16)
    with pytest.raises(NotImplementedError, match="packed"):
        module(q, q, q, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))


def test_single_rank_module_without_groups_is_plain_attention():
    module = _build(_config(params_dtype=torch.float64))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 2, 4, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    out = module(q, k, v, None)
    assert out.shape == (16, 2, 64)
    torch.testing.assert_close(out.view(16, 2, 4, 16), reference_attention(q, k, v, True), **TOL)


def test_kv_heads_and_ulysses_must_divide():
    assert kv_replication(8, 2) == 1 and kv_replication(1, 4) == 4 and kv_replication(2, 8) == 4
    with pytest.raises(ValueError, match="--ulysses-degree"):
        kv_replication(3, 2)
    with pytest.raises(ValueError, match="--ulysses-degree"):
        kv_replication(2, 3)


# --------------------------------------------------------------------------- GPU check tool
def _check_tool_cpu(rank, world_size):
    tool = load_check_tool()
    cfg = tool.CheckConfig(seq_lens=(256,), heads=((8, 8), (8, 2)), head_dim=64,
                           timing_iters=1)
    results = tool.run_checks(cfg, torch.device("cpu"))
    assert [(r.ulysses, r.ring) for r in results[::2]] == [(1, 2), (2, 1)]
    report = json.loads(json.dumps(tool.summary(cfg, results, torch.device("cpu"))))
    assert report["environment"]["world_size"] == 2 and len(report["cases"]) == 4
    for case in report["cases"]:
        assert case["reference_out_err_vs_fp64"] < 1e-5     # the fp32 reference is trustworthy
        for name in ("out", "dq", "dk", "dv"):
            assert 0 < case["errors"][name]["kernel_rel_l2"] < 2e-2   # bf16-sized, non-zero
    assert_passed(results)
    # Several --overlap-chunks values, one reference; MQA x U2 cannot take 2 chunks (skipped).
    cfg = tool.CheckConfig(seq_lens=(256,), heads=((8, 8), (8, 1)), head_dim=64,
                           layouts=((2, 1),), overlap_chunks=(1, 2), timing_iters=0)
    results = tool.run_checks(cfg, torch.device("cpu"))
    assert [(r.kv_heads, r.overlap_chunks, r.resolved_chunks) for r in results] == [
        (8, 1, 1), (8, 2, 2), (1, 1, 1)]
    assert_passed(results)


def test_attention_check_tool_cpu_smoke(dist_run):
    """tools/gpu_attention_check.py's functions on 2 gloo CPU ranks, bf16, S = 256."""
    dist_run(_check_tool_cpu, 2, timeout=240)


def test_attention_check_tool_arguments():
    tool = load_check_tool()
    args = tool.parse_args(["--out", "x.json", "--device", "cpu", "--seq-lens", "128",
                            "--heads", "8/2", "--layouts", "2x1", "--dtype", "bf16"])
    cfg = tool.config_from_args(args)
    assert cfg.seq_lens == (128,) and cfg.heads == ((8, 2),) and cfg.layouts == ((2, 1),)
    assert cfg.causal and cfg.max_ratio == 2.0 and cfg.overlap_chunks == (None,)
    args = tool.parse_args(["--out", "x.json", "--overlap-chunks", "1", "auto", "4"])
    assert tool.config_from_args(args).overlap_chunks == (1, None, 4)
    for bad in (["--heads", "8/3"], ["--layouts", "2by1"], ["--dtype", "fp8"],
                ["--overlap-chunks", "0"], ["--overlap-chunks", "two"]):
        with pytest.raises(SystemExit):
            tool.parse_args(["--out", "x.json", *bad])


def test_layer_spec_swaps_only_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,  # megatron-core on first use
    )
    from megatron.core.transformer.spec_utils import ModuleSpec  # megatron-core on first use

    from megatron.training.model.layer_specs import (  # megatron-core on first use
        LayerSpecOptions,
        get_usp_gpt_layer_spec,
    )
    from megatron.usp.core_attention import USPAttention  # megatron-core on first use

    spec = get_usp_gpt_layer_spec(LayerSpecOptions(attention_backend="math"), qk_layernorm=True)
    upstream = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    core = spec.submodules.self_attention.submodules.core_attention
    assert isinstance(core, ModuleSpec) and core.module is USPAttention
    assert core.params["attention_backend"] == "math"
    assert core.params.get("overlap_chunks") is None      # auto unless a flag sets it
    mine = spec.submodules.self_attention.submodules
    theirs = upstream.submodules.self_attention.submodules
    for field in ("linear_qkv", "linear_proj"):
        assert getattr(mine, field) == getattr(theirs, field), field
    # Norms are ours (megatron/layers/norms.py): same math, and they support --sequence-parallel.
    from megatron.layers.norms import RMSNorm  # megatron-core on first use

    assert mine.q_layernorm.module is RMSNorm and mine.k_layernorm.module is RMSNorm
    assert spec.submodules.mlp == upstream.submodules.mlp    # fused_swiglu off: upstream's
    from megatron.layers.self_attention import USPSelfAttention  # megatron-core on first use

    assert spec.submodules.self_attention.module is USPSelfAttention
    assert spec.submodules.self_attention.params["rope_impl"] == "torch"
    with pytest.raises(ValueError, match="--attention-backend 'cudnn'"):
        get_usp_gpt_layer_spec(LayerSpecOptions(attention_backend="cudnn"))
    with pytest.raises(ValueError, match="--normalization"):
        get_usp_gpt_layer_spec(normalization="ScaleNorm")
