"""Layout planner: formulas against hand derivations and brute force, the paper's
qualitative results, the rules, bad input, calibration files and the contract the
training script uses. Pure Python; no process group."""

import json
import math
import re
from dataclasses import replace

import pytest

from megatron.planner import (
    HARDWARE_PRESETS,
    Assumptions,
    Layout,
    PlannerError,
    Workload,
    apply_calibration,
    check_model,
    choose_layout,
    estimate,
    get_hardware,
    load_calibration,
    load_model,
    plan_layouts,
    rules,
    with_overrides,
)
from megatron.planner import cost_model as cm
from megatron.planner.capabilities import FULL_MEGATRON, installed_capabilities
from megatron.planner.cost_model import AttentionWorkload, estimate_attention
from megatron.planner.explain import format_table
from megatron.planner.hardware import bottleneck_level, peers_per_level
from megatron.planner.plan import result_to_json
from megatron.planner.search import rank_attention_layouts
from megatron.planner.validate import MEASUREMENTS_SCHEMA, validate_measurements
from megatron.shapes import PRESETS, ModelShape, window_pairs
from megatron.usp.parallel_dims import ParallelDims

M = PRESETS
SP_ONLY = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
           "data_parallel_size": 1}


# ============================================================================ models


def test_preset_parameter_counts_match_the_model_cards():
    assert M["llama2-7b"].total_params() == pytest.approx(6.738e9, rel=2e-3)
    assert M["llama3-8b"].total_params() == pytest.approx(8.030e9, rel=2e-3)
    assert M["llama2-70b"].total_params() == pytest.approx(68.98e9, rel=2e-3)
    # 16 x (10.49M attention + 34.6M MLP) + 2 x 65.5M embeddings.
    assert M["llama-0.85b"].total_params() == pytest.approx(0.8527e9, rel=2e-3)


def test_shape_defaults_are_megatrons():
    m = ModelShape(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=50304,
                   swiglu=False)
    assert m.num_query_groups == 16 and m.ffn_hidden_size == 4096
    assert m.params_per_layer() == 12 * 1024 * 1024 + 2 * 1024


def test_load_model_from_json_and_yaml(tmp_path):
    fields = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=512, vocab_size=1000, swiglu=True)
    j = tmp_path / "tiny.json"
    j.write_text(json.dumps(fields))
    y = tmp_path / "tiny.yaml"
    y.write_text("\n".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}"
                           for k, v in fields.items()))
    for path in (j, y):
        m = load_model(str(path))
        assert (m.name, m.num_query_groups, m.swiglu) == ("tiny", 2, True)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(fields, n_layer=3)))
    with pytest.raises(PlannerError, match="unknown field.*n_layer"):
        load_model(str(bad))
    with pytest.raises(PlannerError, match="presets: .*llama2-7b"):
        load_model("no-such-model")
    with pytest.raises(PlannerError, match="not divisible by num_attention_heads"):
        check_model(ModelShape(name="x", num_layers=2, hidden_size=100, num_attention_heads=3,
                               num_query_groups=3, ffn_hidden_size=10, vocab_size=10))


# ============================================================================ hardware


def test_presets_are_labelled_with_their_provenance():
    for name in ("h100", "h200", "a100", "a800", "l20"):
        hw = HARDWARE_PRESETS[name]
        assert all(v.startswith("datasheet") for v in hw.sources.values()), name
        assert any(name.upper() in line for line in hw.describe()), name
    measured = HARDWARE_PRESETS["h200-measured"]
    for key in ("matmul_tflops", "attention_tflops", "intra_node", "hbm_gbps"):
        assert measured.sources[key].startswith("measured (2xH200")
    assert measured.sources["inter_node"].startswith("datasheet")
    assert measured.matmul_tflops == 780.0
    # NCCL all-to-all algbw 509 GB/s over 2 GPUs is a bus bandwidth of 509/2.
    assert measured.intra_node[0].all_to_all_gbps == pytest.approx(254.5)


def test_attention_rate_interpolates_in_log_sequence_and_clamps():
    hw = HARDWARE_PRESETS["h200-measured"]
    assert hw.attention_rate_tflops(32768) == 557.0
    assert hw.attention_rate_tflops(1024) == 519.0     # clamped below the table
    assert hw.attention_rate_tflops(10**7) == 544.0    # clamped above
    mid = hw.attention_rate_tflops(math.sqrt(8192 * 32768))  # halfway in log
    assert mid == pytest.approx((519.0 + 557.0) / 2)


@pytest.mark.parametrize("world,tp,u,r,gpn", [(16, 2, 4, 2, 8), (16, 1, 8, 2, 8),
                                              (32, 2, 2, 4, 8), (8, 1, 2, 4, 8), (8, 1, 8, 1, 4)])
def test_link_levels_of_groups_match_the_grid(world, tp, u, r, gpn):
    """peers_per_level's arithmetic against the real rank groups of ParallelDims."""
    hw = HARDWARE_PRESETS["l20"]  # pair (2), socket (4), node, inter-node
    dims = ParallelDims(world, tp=tp, ulysses=u, ring=r)
    strides = {"tp": (1, tp), "ulysses": (tp, u), "ring": (tp * u, r)}
    domains = [2, 4, gpn]
    for axis, (stride, size) in strides.items():
        for group in dims.rank_groups((axis,)):
            me = group[0]
            counted = {lvl.name: n for lvl, n in peers_per_level(hw, gpn, stride, size)}
            expected = {}
            inside = 1
            for lvl, dom in zip(hw.intra_node, domains):
                reach = sum(1 for x in group if x // dom == me // dom)
                if reach > inside:
                    expected[lvl.name] = reach - inside
                    inside = reach
            if len(group) > inside:
                expected[hw.inter_node.name] = len(group) - inside
            assert counted == expected, (axis, group)


def test_bottleneck_level_is_the_slowest_link_a_group_crosses():
    hw = HARDWARE_PRESETS["h100"]
    assert bottleneck_level(hw, 8, 1, 8) is hw.intra_node[0]       # TP 8 in a node
    assert bottleneck_level(hw, 8, 8, 2) is hw.inter_node          # ring over 2 nodes
    assert bottleneck_level(hw, 8, 4, 4) is hw.inter_node          # 16 ranks span 2 nodes
    assert bottleneck_level(hw, 8, 1, 1) is None


def _write(path, doc):
    path.write_text(json.dumps(doc))
    return str(path)


def test_partial_calibration_files_merge_with_provenance(tmp_path):
    links = _write(tmp_path / "links.json", {
        "schema": "megatron-usp-calibration/1", "source": "bench_links",
        "links": {"intra_node": {"all_to_all_gbps": 200.0, "p2p_gbps": 250.0,
                                 "latency_us": 12.0, "group_size": 2}},
        "matmul_tflops": 700.0})
    attn = _write(tmp_path / "attn.json", {
        "schema": "megatron-usp-calibration/1", "source": "bench_attention",
        "attention_tflops": {"8192": 500.0, "32768": 550.0}, "matmul_tflops": 760.0})
    cal = load_calibration([links, attn])
    assert cal.matmul_tflops == 760.0          # later file wins
    assert cal.attention_tflops == {8192: 500.0, 32768: 550.0}
    assert cal.intra_node.p2p_gbps == 250.0 and cal.inter_node is None
    assert "links.json" in cal.sources["intra_node"]
    assert "attn.json" in cal.sources["attention_tflops"]
    hw = apply_calibration(get_hardware("h200"), cal)
    assert hw.matmul_tflops == 760.0 and hw.attention_rate_tflops(32768) == 550.0
    lvl = hw.intra_node[0]
    assert (lvl.all_to_all_gbps, lvl.p2p_gbps, lvl.collective_gbps) == (200.0, 250.0, 250.0)
    assert hw.inter_node == get_hardware("h200").inter_node   # not measured: kept
    assert hw.sources["inter_node"].startswith("datasheet")
    assert any("attn.json" in line for line in hw.describe())


@pytest.mark.parametrize("doc,match", [
    ({"schema": "other/1"}, "schema"),
    ({"schema": "megatron-usp-calibration/1", "matmul": 1.0}, "unknown field.*matmul"),
    ({"schema": "megatron-usp-calibration/1", "matmul_tflops": -3}, "matmul_tflops"),
    ({"schema": "megatron-usp-calibration/1", "links": {"intra_node": {"p2p": 1}}},
     r"links.intra_node has unknown"),
    ({"schema": "megatron-usp-calibration/1", "attention_tflops": {"long": 3.0}},
     "not a sequence length"),
])
def test_bad_calibration_names_the_field(tmp_path, doc, match):
    with pytest.raises(PlannerError, match=match):
        load_calibration(_write(tmp_path / "c.json", doc))


def test_command_line_overrides_flatten_the_node_and_are_labelled():
    hw = with_overrides(get_hardware("l20"), gpu_memory_gib=40, intra_node_gbps=20,
                        inter_node_gbps=5)
    assert hw.gpu_memory_gib == 40 and len(hw.intra_node) == 1
    assert hw.intra_node[0].p2p_gbps == 20 and hw.inter_node.all_to_all_gbps == 5
    assert hw.sources["intra_node"] == "command line"
    with pytest.raises(PlannerError, match="--inter-node-bw"):
        with_overrides(hw, inter_node_gbps=0)


# ============================================================================ formulas


def _shapes(model, lay, b, s, a=cm.DEFAULT_ASSUMPTIONS):
    return cm.rank_shapes(model, lay, b, s, a)


def _a2a_brute_force(n_tokens, q_heads, kv_heads, d, U):
    """Bytes rank 0 sends in the Ulysses all-to-all of q, k, v and o, counting head by
    head where each one goes: head j of a tensor of H heads goes to rank j // (H/U);
    KV with fewer heads than U is first replicated up to U heads."""
    sent = 0
    for heads in (q_heads, kv_heads, kv_heads, q_heads):
        if heads % U:
            assert U % heads == 0
            heads = U  # replicate: every Ulysses rank gets the head its queries use
        per_rank = heads // U
        sent += sum(1 for j in range(heads) if j // per_rank != 0) * n_tokens * d * 2
    return sent


@pytest.mark.parametrize("name,tp,u,r", [("llama2-7b", 1, 4, 2), ("llama3-8b", 1, 4, 2),
                                        ("llama3-8b", 2, 8, 1), ("llama3-8b", 1, 16, 1),
                                        ("llama-0.85b", 2, 8, 2)])
def test_ulysses_all_to_all_volume_matches_brute_force(name, tp, u, r):
    model = M[name]
    lay = Layout.of(tp, u, r, 1, 1)
    sh = _shapes(model, lay, 2, 32768)
    got = cm.ulysses_a2a_bytes(model, lay, sh, cm.DEFAULT_ASSUMPTIONS)
    n = 2 * 32768 / (u * r)
    kv_t = max(1, model.num_query_groups // tp)
    want = _a2a_brute_force(n, model.num_attention_heads // tp, kv_t, model.head_dim, u)
    assert got == pytest.approx(want)
    # The paper's form: (U-1)/U * (2 + 2*kv/a) * b*s*h/(t*C) elements, for split KV.
    if kv_t % u == 0:
        paper = (u - 1) / u * (2 + 2 * model.kv_ratio) * n * model.hidden_size / tp * 2
        assert got == pytest.approx(paper)


def test_gqa_shrinks_and_replication_grows_the_all_to_all():
    mha = replace(M["llama3-8b"], num_query_groups=32)
    gqa = M["llama3-8b"]  # 8 KV heads
    lay8, lay16 = Layout.of(1, 8, 1, 1, 1), Layout.of(1, 16, 1, 1, 1)
    a = cm.DEFAULT_ASSUMPTIONS
    v_mha = cm.ulysses_a2a_bytes(mha, lay8, _shapes(mha, lay8, 1, 65536), a)
    v_gqa = cm.ulysses_a2a_bytes(gqa, lay8, _shapes(gqa, lay8, 1, 65536), a)
    assert v_gqa / v_mha == pytest.approx((2 + 2 * 8 / 32) / 4)
    sh16 = _shapes(gqa, lay16, 1, 65536)
    assert sh16.kv_u == 16 and sh16.kv_t == 8
    e = estimate(Workload(gqa, 65536, 16, 16), replace(lay16, zero_stage=1), get_hardware("h100"))
    assert e.kv_replication == 2


def test_ring_step_volume_is_the_kv_block_a_ring_rank_holds():
    model = M["llama3-8b"]
    lay = Layout.of(1, 2, 4, 1, 1)
    b, s = 1, 65536
    sh = _shapes(model, lay, b, s)
    fwd, bwd = cm.ring_step_bytes(model, lay, sh, cm.DEFAULT_ASSUMPTIONS)
    # A ring rank holds s/R tokens of 8/2 = 4 KV heads for K and for V, bf16.
    kv_block = (s // 4) * 4 * model.head_dim
    assert fwd == 2 * kv_block * 2
    assert bwd == kv_block * (2 * 2 + 2 * 4)   # K, V again + fp32 dK, dV
    # ... and the accumulator's R-th hop home (megatron/usp/ring_attention.py).
    assert cm.ring_last_hop_bytes(model, lay, sh, cm.DEFAULT_ASSUMPTIONS) == 2 * kv_block * 2  # bf16 last hop
    e = estimate(Workload(model, s, 8, 8), replace(lay, zero_stage=1), get_hardware("h100"))
    assert e.volumes["ring_p2p"] == model.num_layers * (3 * (fwd + bwd) + 2 * kv_block * 2)
    assert cm.ring_step_bytes(model, Layout.of(1, 8, 1, 1, 1), sh, cm.DEFAULT_ASSUMPTIONS) == (0, 0)


def test_flops_causal_attention_is_half_and_gemms_are_two_per_weight():
    model = M["llama2-7b"]
    lay = Layout.of(1, 1, 1, 1, 1)
    s = 4096
    assert cm.attention_flops_fwd(model, lay, 1, s) == 2 * s * s * model.hidden_size
    attn, mlp = cm.layer_matmul_flops_fwd(model, lay, _shapes(model, lay, 1, s))
    assert attn == 2 * s * model.attention_params_per_layer()
    assert mlp == 2 * s * model.mlp_params_per_layer()
    # Split over TP x CP, every rank does an equal share.
    lay8 = Layout.of(2, 2, 2, 1, 1)
    attn8, mlp8 = cm.layer_matmul_flops_fwd(model, lay8, _shapes(model, lay8, 1, s))
    assert 8 * (attn8 + mlp8) == pytest.approx(attn + mlp)
    assert 8 * cm.attention_flops_fwd(model, lay8, 1, s) == 2 * s * s * model.hidden_size


def test_tp_and_tp_with_sequence_parallelism_move_the_same_bytes():
    w = Workload(M["llama2-7b"], 16384, 8, 8)
    lay = Layout.of(8, 1, 1, 1, 1, 0)
    hw = get_hardware("h100")
    with_sp = estimate(w, lay, hw)
    without = estimate(w, lay, hw, Assumptions(tp_sequence_parallel=False))
    assert with_sp.volumes["tp"] == without.volumes["tp"]
    assert with_sp.time.tp_comm == pytest.approx(without.time.tp_comm, rel=1e-6)
    # ... but sequence parallelism shards norms and residuals: fewer activations.
    assert with_sp.memory.activations < without.memory.activations


def test_model_states_per_zero_stage():
    a = cm.DEFAULT_ASSUMPTIONS
    P, layer, N = 1e9, 1e7, 8
    z = {k: cm.model_state_bytes(k, P, layer, N, a) for k in range(4)}
    assert (z[0].params, z[0].grads, z[0].optimizer) == (2e9, 4e9, 12e9)
    assert (z[1].params, z[1].grads, z[1].optimizer) == (2e9, 4e9, 1.5e9)
    assert (z[2].params, z[2].grads, z[2].optimizer) == (2e9, 0.5e9 + 4e7, 1.5e9)
    assert (z[3].params, z[3].grads, z[3].optimizer, z[3].gathered) == (
        0.25e9, 0.5e9, 1.5e9, 4e7)
    assert cm.model_state_bytes(3, P, layer, 1, a).params == 2e9  # nothing to shard over


def test_dp_traffic_per_zero_stage():
    a = cm.DEFAULT_ASSUMPTIONS
    P, N, m = 1e9, 4, 3
    k = 3 / 4
    assert cm.dp_traffic(0, P, N, m, a).total == pytest.approx(2 * k * P * 4)
    assert cm.dp_traffic(1, P, N, m, a).total == pytest.approx(k * P * 6)
    assert cm.dp_traffic(2, P, N, m, a).total == pytest.approx(m * k * P * 4 + k * P * 2)
    assert cm.dp_traffic(3, P, N, m, a).total == pytest.approx(m * k * P * 8)
    assert cm.dp_traffic(1, P, 1, m, a).total == 0


def test_activations_with_and_without_recompute():
    model = M["llama2-7b"]
    h, f = model.hidden_size, model.ffn_hidden_size
    lay = Layout.of(1, 1, 1, 1, 1)
    n = 8192
    sh = _shapes(model, lay, 1, n)
    a = cm.DEFAULT_ASSUMPTIONS
    none = cm.layer_activation_bytes(model, lay, sh, "none", a)
    # 4 GEMM/norm inputs, q k v o, SwiGLU fc1 out (2f) and fc2 in (f), bf16; fp32 lse.
    assert none == (4 * n * h + 4 * n * h + n * 3 * f) * 2 + n * model.num_attention_heads * 4
    sel = cm.layer_activation_bytes(model, lay, sh, "selective", a)
    assert sel == (2 * n * h + 4 * n * h) * 2 + n * model.num_attention_heads * 4
    assert cm.layer_activation_bytes(model, lay, sh, "full", a) == n * h * 2
    # Ulysses keeps the output projection's input as a second copy of o.
    lay_u = Layout.of(1, 2, 1, 1, 1)
    sh_u = _shapes(model, lay_u, 1, 2 * n)
    assert cm.layer_activation_bytes(model, lay_u, sh_u, "none", a) == none + n * h * 2


def test_ring_overlap_hides_sends_shorter_than_a_step():
    lvl = get_hardware("h100").intra_node[0]
    step_send = lvl.latency_us * 1e-6 + 1e9 / (lvl.p2p_gbps * 1e9)
    assert cm.ring_pass_time(4 * step_send * 2, 1e9, 4, lvl) == pytest.approx(4 * step_send * 2)
    assert cm.ring_pass_time(4 * step_send / 2, 1e9, 4, lvl) == pytest.approx(
        step_send / 2 + 3 * step_send)
    assert cm.pipeline_time(2.0, m=8, pp=4) == (22.0, 6.0)   # bubble (p-1)/(m+p-1)


def test_estimate_moves_the_right_way():
    w = Workload(M["llama2-7b"], 65536, 8, 8)
    hw = get_hardware("a100")
    base = estimate(w, Layout.of(1, 8, 1, 1, 1, 1, "none"), hw)
    full = estimate(w, Layout.of(1, 8, 1, 1, 1, 1, "full"), hw)
    z3 = estimate(w, Layout.of(1, 8, 1, 1, 1, 3, "none"), hw)
    tp = estimate(w, Layout.of(8, 1, 1, 1, 1, 0, "none"), hw)
    assert full.time.total > base.time.total and full.memory.activations < base.memory.activations
    assert z3.volumes["dp_zero"] > base.volumes["dp_zero"]
    assert z3.memory.model_states() < base.memory.model_states()
    assert tp.memory.params < base.memory.params and tp.time.tp_comm > 0 == base.time.tp_comm
    # Same tokens per GPU: SP and TP-sp hold the same activations (the paper's A/N).
    assert tp.memory.activations == pytest.approx(
        estimate(w, Layout.of(1, 1, 8, 1, 1, 1, "none"), hw).memory.activations, rel=0.02)


# ============================================================================ windows

MISTRAL = ModelShape(name="mistral-shaped", num_layers=32, hidden_size=4096,
                     num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
                     vocab_size=32000)


def test_a_window_layer_counts_its_pairs_and_sends_its_halo():
    """Attention FLOPs of a window layer are its window's pairs; its ring sends each
    successor the window's last keys (docs/sliding_window.md: n*W*2*b*(hk/U)*d*2 bytes,
    n = 2 on a middle ring rank), not the whole K/V blocks."""
    model, s, W = M["llama3-8b"], 65536, 4096
    lay = Layout.of(1, 2, 4, 1, 1, 1, "none")
    assert cm.attention_flops_fwd(model, lay, 1, s, W) == (
        4 * model.hidden_size * window_pairs([s], W) / 8)
    assert cm.attention_flops_fwd(model, lay, 1, s, s) == cm.attention_flops_fwd(model, lay, 1, s)
    halo = cm.window_halo(s, 4, W)                      # chunks of 8192 >= W
    assert (halo.sent, halo.received) == (2 * W, 2 * W)
    w = Workload(replace(model, window_size=W), s, 8, 8)
    e = estimate(w, lay, get_hardware("h200"))
    kv = 2 * W * 2 * 1 * (8 // 2) * model.head_dim * 2  # K and V, 2 successors, bf16
    assert e.volumes["ring_p2p"] == pytest.approx(model.num_layers * 3 * kv)  # fwd, bwd, dK/dV
    full = estimate(Workload(model, s, 8, 8), lay, get_hardware("h200"))
    assert e.volumes["ring_p2p"] < full.volumes["ring_p2p"] / 5
    assert e.memory.total == full.memory.total          # activations do not shrink
    # A window reaching the whole sequence is full attention.
    whole = estimate(Workload(replace(model, window_size=s - 1), s, 8, 8), lay,
                     get_hardware("h200"))
    assert whole.time.total == full.time.total and whole.volumes == full.volumes


def test_windows_cut_the_mistral_shaped_step_by_the_attention_share():
    """Mistral-7B's shape at 128K on 8 H200s: a window of 4096 on every layer cuts the
    predicted step by about the attention it removes; a hybrid (every second layer full)
    lands in between, on one layout and on each model's best."""
    hw, s = get_hardware("h200"), 131072
    models = [MISTRAL, replace(MISTRAL, window_size=4096, window_attn_skip_freq=2),
              replace(MISTRAL, window_size=4096)]
    lay = Layout.of(1, 4, 2, 1, 1, 1, "full")
    full, hybrid, window = (estimate(Workload(m, s, 8, 8), lay, hw) for m in models)
    assert full.time.total > hybrid.time.total > window.time.total
    saved = full.time.attention - window.time.attention
    assert full.time.total - window.time.total == pytest.approx(saved, rel=0.1)
    assert full.time.attention > 0.7 * full.time.total   # 128K: attention dominates
    assert full.model_flops_per_step > hybrid.model_flops_per_step > window.model_flops_per_step
    best = [plan_layouts(Workload(m, s, 8, 8), hw, top=1).best.estimate.time.total
            for m in models]
    assert best[0] > best[1] > best[2] and best[2] < best[0] / 2


def test_pipeline_stages_count_their_own_window_layers():
    """The same window layers in a different order: with PP = 2 the stage holding both
    full layers sets the pace, so alternating them is faster at the same FLOPs."""
    hw, s = get_hardware("h200"), 65536
    lay = Layout.of(1, 2, 1, 1, 2, 1, "none")
    base = replace(M["llama-0.85b"], num_layers=4)
    runs = {freq: estimate(Workload(replace(base, window_size=1024, window_attn_skip_freq=freq),
                                    s, 4, 8, global_batch_size=8), lay, hw)
            for freq in ((1, 1, 0, 0), (0, 0, 1, 1), (1, 0, 1, 0))}
    assert cm.stage_window_layers(replace(base, window_size=1024,
                                          window_attn_skip_freq=(1, 1, 0, 0)), lay) == [2, 0]
    flops = {e.model_flops_per_step for e in runs.values()}
    assert len(flops) == 1
    assert runs[(1, 0, 1, 0)].time.total < min(runs[(1, 1, 0, 0)].time.total,
                                               runs[(0, 0, 1, 1)].time.total)


def test_model_files_take_the_windows_flag_spellings(tmp_path):
    base = dict(num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=1000)
    j = tmp_path / "w.json"
    j.write_text(json.dumps(dict(base, window_size=[64, 0],
                                 window_attn_skip_freq="([1]*3+[0]*1)*2")))
    y = tmp_path / "w.yaml"
    y.write_text("\n".join(f"{k}: {v}" for k, v in base.items())
                 + '\nwindow_size: "(64,0)"\nwindow_attn_skip_freq: [1, 1, 1, 0, 1, 1, 1, 0]')
    i = tmp_path / "i.json"
    i.write_text(json.dumps(dict(base, window_size=64, window_attn_skip_freq=4)))
    for path in (j, y, i):
        m = load_model(str(path))
        assert m.window_size == 64 and m.window_marks() == (1, 1, 1, 0) * 2, path
    for fields, needle in (
            (dict(window_size=[64, 2]), "window_size=(64,2): the right side must be 0 "
                                        "(attention is causal); pass window_size=64"),
            (dict(window_size=0), "window_size=0: the window must be at least 1"),
            (dict(window_attn_skip_freq=2), "has no effect without window_size"),
            (dict(window_size=64, window_attn_skip_freq="[1,0]"), "a list of 8 zeros and ones"),
            (dict(window_size=64, window_attn_skip_freq=[1, 0]), "a list of 8 zeros and ones")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(dict(base, **fields)))
        with pytest.raises(PlannerError) as err:
            load_model(str(bad))
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


# ============================================================================ rules


def test_every_enumerated_layout_tiles_the_world_and_obeys_the_rules():
    w = Workload(M["llama3-8b"], 65536, 32, 8, global_batch_size=8)
    result = plan_layouts(w, "h100", top=50)
    for e in result.evaluated:
        lay = e.layout
        assert lay.world_size == 32
        assert lay.dims.violations(w.model, w.seq_length, sequence_parallel=True) == []
        assert 8 % lay.dp == 0 and lay.tp <= 8
        assert not (lay.cp > 1 and lay.zero_stage == 0)      # SP always with ZeRO-1/2
    assert result.rejections.counts["sp-with-zero"] > 0
    assert result.rejections.counts["batch"] > 0             # DP 16, 32 exceed the batch
    times = [r.estimate.time_per_token for r in result.ranked]
    for i, t in enumerate(times):   # ranked by time, up to the tie tolerance
        assert all(t <= later * (1 + rules.TIE_TOLERANCE) for later in times[i + 1:])


def test_prefer_dp_when_the_batch_allows():
    w = Workload(M["llama-0.85b"], 4096, 8, 8, global_batch_size=64)
    plan = choose_layout(w.model, 4096, 8, 8, "h100", global_batch_size=64)
    assert (plan.data_parallel_size, plan.context_parallel_size) == (8, 1)
    assert any("prefer DP when the batch allows" in r for r in plan.reasons)
    # A batch of one cannot be split: the sequence is.
    plan1 = choose_layout(w.model, 262144, 8, 8, "h100", global_batch_size=1)
    assert plan1.data_parallel_size == 1 and plan1.context_parallel_size > 1
    assert any("SP always with ZeRO-1/2" in r for r in plan1.reasons)


def test_ulysses_inside_fast_links_and_ring_across_slow_ones():
    plan = choose_layout(M["llama2-7b"], 262144, 16, 8, "h100", fixed=SP_ONLY)
    assert (plan.ulysses_degree, plan.ring_degree) == (8, 2)
    assert any("Ulysses inside the fast links, Ring across slow ones" in r for r in plan.reasons)
    w = Workload(M["llama2-7b"], 262144, 16, 8)
    u16 = estimate(w, Layout.of(1, 16, 1, 1, 1, plan.zero_stage, plan.recompute), get_hardware("h100"))
    assert u16.time.a2a > plan.estimate.time.a2a


def test_ulysses_degree_is_limited_by_heads():
    model = ModelShape(name="eight-heads", num_layers=8, hidden_size=1024, num_attention_heads=8,
                       num_query_groups=8, ffn_hidden_size=4096, vocab_size=32000)
    plan = choose_layout(model, 65536, 16, 16, "h100", fixed=SP_ONLY)
    assert (plan.ulysses_degree, plan.ring_degree) == (8, 2)
    assert any("Ulysses stops at 8" in r and "Ulysses degree limited by heads" in r
               for r in plan.reasons)


def test_tie_breakers_are_cited_when_they_decide():
    w = Workload(M["llama-0.85b"], 262144, 2, 8, global_batch_size=1)
    result = plan_layouts(w, "h200-measured", top=3)
    best = result.best
    assert (best.estimate.layout.ulysses, best.estimate.layout.ring) == (2, 1)
    assert best.decided_by is not None and best.decided_by.id == "ulysses-over-ring"
    assert best.runner_up.layout.ring == 2
    text = format_table(result)
    assert "[tie: ulysses-over-ring]" in text and "Ulysses before Ring when heads allow" in text


# ============================================================================ the paper


# yunchang's benchmark (scripts/run_qkvpack_compare.sh): 8 GPUs, 32 heads of size 32,
# batch 1, 32K tokens per GPU, causal, forward only.
YUNCHANG_BENCH = dict(heads=32, kv_heads=32, head_dim=32, world_size=8, gpus_per_node=8,
                      batch=1, backward=False)


@pytest.mark.parametrize("local_tokens", [16384, 32768])
def test_paper_8xl20_pcie_ulysses2_ring4_is_best(local_tokens):
    """8xL20 over PCIe (yunchang benchmark conclusion 4): the all-to-all stays inside a
    PCIe-switch pair, the ring's sends cross the host and hide under attention."""
    aw = AttentionWorkload(seq_length=8 * local_tokens, **YUNCHANG_BENCH)
    ranked = rank_attention_layouts(aw, "l20")
    best = ranked[0].estimate
    assert (best.layout.ulysses, best.layout.ring) == (2, 4)
    assert best.link_levels["ulysses"] == 0 and best.link_levels["ring"] == 2
    u8 = next(r.estimate for r in ranked if r.estimate.layout.ulysses == 8)
    assert u8.times.a2a > 3 * best.times.a2a      # U=8 all-to-all crosses the sockets


def test_l20_training_long_sequences_keep_ulysses_in_the_switch_pair():
    # The paper's stack shards further (ZeRO-3) than pretrain_gpt.py can here.
    plan = choose_layout(M["llama2-7b"], 262144, 8, 8, "l20", fixed=SP_ONLY,
                         capabilities=FULL_MEGATRON)
    assert (plan.ulysses_degree, plan.ring_degree) == (2, 4)
    assert any("Ulysses inside the fast links, Ring across slow ones" in r for r in plan.reasons)


@pytest.mark.parametrize("local_tokens", [4096, 32768])
@pytest.mark.parametrize("backward", [False, True])
def test_paper_8xa100_nvlink_attention_ulysses8_is_best(local_tokens, backward):
    aw = AttentionWorkload(seq_length=8 * local_tokens, **dict(YUNCHANG_BENCH, backward=backward))
    best = rank_attention_layouts(aw, "a100")[0].estimate
    assert (best.layout.ulysses, best.layout.ring) == (8, 1)


@pytest.mark.parametrize("model", ["gpt-1.2b", "llama2-7b"])
@pytest.mark.parametrize("seq", [32768, 131072])
def test_paper_8xa100_nvlink_training_ulysses8_is_best(model, seq):
    plan = choose_layout(M[model], seq, 8, 8, "a100", fixed=SP_ONLY)
    assert (plan.ulysses_degree, plan.ring_degree) == (8, 1)


def test_paper_llama2_7b_120k_on_a800_sp_only_oom_tp4_u2_r2_fits():
    """Two 8xA800 nodes, Megatron's distributed optimizer (ZeRO-1), no recompute."""
    w = Workload(M["llama2-7b"], 122880, 16, 8)
    hw = get_hardware("a800")
    for u in (1, 2, 4, 8, 16):
        e = estimate(w, Layout.of(1, u, 16 // u, 1, 1, 1, "none"), hw)
        assert not e.fits, e.layout.short()
        assert e.memory.model_states() > e.memory.activations   # the weights bind
    assert estimate(w, Layout.of(4, 2, 2, 1, 1, 1, "none"), hw).fits
    plan = choose_layout(w.model, 122880, 16, 8, hw, fixed={"zero_stage": 1, "recompute": "none"})
    assert plan.tensor_model_parallel_size > 1
    assert any("TP=" in r and "needs" in r for r in plan.reasons)   # why not TP=1


# ============================================================================ bad input


def test_no_layout_fits_names_the_binding_limit_and_what_would_fit():
    with pytest.raises(PlannerError) as err:
        choose_layout(M["llama2-7b"], 1048576, 8, 8, "a800")
    e = err.value
    assert e.binding_limit == "memory"
    assert "Binding limit: activations" in str(e)
    # ZeRO-1 is the most sharding pretrain_gpt.py can do here (no Megatron-FSDP flag).
    assert "with full recompute and ZeRO-1 considered" in str(e)
    assert any(s.startswith("--gpus 16") for s in e.suggestions)
    assert any(s.startswith("--seq-length ") for s in e.suggestions)


def test_no_layout_fits_suggests_dropping_a_fixed_recompute():
    with pytest.raises(PlannerError) as err:
        choose_layout(M["llama-0.85b"], 524288, 2, 8, "h200-measured",
                      fixed={"recompute": "none"})
    assert err.value.suggestions[0].startswith("drop --recompute none")
    # Following the advice gives a plan.
    assert choose_layout(M["llama-0.85b"], 524288, 2, 8, "h200-measured").recompute == "full"


def test_heads_not_divisible_names_heads_and_valid_degrees():
    with pytest.raises(PlannerError) as err:
        choose_layout(M["llama2-7b"], 131072, 12, 12, "h100", fixed={"ulysses_degree": 3})
    assert err.value.binding_limit == "attention heads"
    assert "not divisible by --ulysses-degree 3" in str(err.value)
    assert "[1, 2, 4, 8, 16, 32]" in str(err.value)


def test_sequence_not_divisible_suggests_lengths():
    with pytest.raises(PlannerError) as err:
        choose_layout(M["llama2-7b"], 1002, 4, 4, "h100",
                      fixed={"ulysses_degree": 2, "ring_degree": 2})
    assert err.value.binding_limit == "sequence length"
    assert "try --seq-length 1000 or 1008" in str(err.value)


def test_fixed_degrees_are_checked_at_start_up():
    with pytest.raises(PlannerError, match="does not divide --gpus 8.*one of \\[1, 2, 4, 8\\]"):
        choose_layout(M["llama2-7b"], 8192, 8, 8, "h100", fixed={"ulysses_degree": 3})
    with pytest.raises(PlannerError, match="unknown; known"):
        choose_layout(M["llama2-7b"], 8192, 8, 8, "h100", fixed={"tp": 2})
    with pytest.raises(PlannerError, match="--recompute"):
        choose_layout(M["llama2-7b"], 8192, 8, 8, "h100", fixed={"recompute": "some"})
    with pytest.raises(PlannerError, match="--hardware 'b300'"):
        choose_layout(M["llama2-7b"], 8192, 8, 8, "b300")


# ============================================================================ contract


def test_choose_layout_contract_and_megatron_config():
    plan = choose_layout(M["llama3-8b"], 131072, 16, 8, "h200",
                         fixed={"tensor_model_parallel_size": 2, "ring_degree": None})
    assert plan.tensor_model_parallel_size == 2
    assert (plan.tensor_model_parallel_size * plan.context_parallel_size
            * plan.data_parallel_size * plan.pipeline_model_parallel_size) == 16
    assert plan.predicted_step_time_s == plan.estimate.step_time_s > 0
    assert 0 < plan.memory_gib <= plan.estimate.usable_memory_gib
    assert plan.reasons and plan.reasons[0].startswith(plan.estimate.layout.short())
    cfg = plan.megatron_config()
    assert cfg["sequence_parallel"] is True
    assert cfg["context_parallel_size"] == plan.ulysses_degree * plan.ring_degree
    strategy = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}
    assert cfg["data_parallel_sharding_strategy"] == strategy[plan.zero_stage]
    d = plan.to_dict()
    assert json.loads(json.dumps(d))["ulysses_degree"] == plan.ulysses_degree
    sel = replace(plan, recompute="selective").megatron_config()
    # What pretrain_gpt.py here can run: layernorm recompute needs TransformerEngine.
    assert sel["recompute_modules"] == list(installed_capabilities().selective_recompute_modules)


def test_json_output_is_complete():
    result = plan_layouts(Workload(M["llama-0.85b"], 65536, 8, 8), "h100", top=3)
    doc = json.loads(json.dumps(result_to_json(result)))
    assert len(doc["plans"]) == 3 and doc["plans"][0]["rank"] == 1
    assert doc["hardware"]["sources"]["matmul_tflops"].startswith("datasheet")
    assert "time_breakdown_s" in doc["plans"][0]["prediction"]


# ============================================================================ validation


def _measurements(tmp_path, factor, memory_factor=None):
    w = Workload(M["llama-0.85b"], 131072, 2, 8, global_batch_size=1)
    lay = Layout.of(1, 2, 1, 1, 1, 1, "none")
    e = estimate(w, lay, get_hardware("h200-measured"))
    run = {"name": "0.85b 128K U2", "model": "llama-0.85b", "seq_length": 131072, "gpus": 2,
           "gpus_per_node": 8, "global_batch_size": 1,
           "layout": {"ulysses_degree": 2, "zero_stage": 1, "recompute": "none"},
           "measured_step_time_s": e.step_time_s * factor}
    if memory_factor:
        run["measured_memory_gib"] = e.memory.total * memory_factor
    return _write(tmp_path / "m.json", {"schema": MEASUREMENTS_SCHEMA,
                                        "hardware": "h200-measured", "runs": [run]})


def test_validation_passes_within_tolerance_and_explains_a_gap(tmp_path):
    report = validate_measurements(_measurements(tmp_path, 1.2, 0.9))
    assert report.ok and report.runs[0].time_ratio == pytest.approx(1 / 1.2)
    bad = validate_measurements(_measurements(tmp_path, 1.5))
    assert not bad.ok
    text = bad.format()
    assert "OUTSIDE 25%" in text and "attention" in text and "to explain the gap" in text
    with pytest.raises(PlannerError, match="schema"):
        validate_measurements(_write(tmp_path / "x.json", {"runs": []}))


def test_validation_of_attention_benchmark_runs(tmp_path):
    aw = AttentionWorkload(32, 8, 128, 131072, 2, 8, 1, True)
    pred = estimate_attention(aw, 2, 1, get_hardware("h200-measured")).step_time_s
    run = {"kind": "attention", "name": "U2 128K", "heads": 32, "kv_heads": 8, "head_dim": 128,
           "seq_length": 131072, "gpus": 2, "layout": {"ulysses_degree": 2},
           "measured_step_time_s": pred * 0.9}
    path = _write(tmp_path / "a.json", {"schema": MEASUREMENTS_SCHEMA, "runs": [run]})
    report = validate_measurements(path, "h200-measured")
    assert report.ok and report.runs[0].predicted_memory_gib is None
    assert "attention U2 x R1 fwd+bwd" in report.format()
    run["measured_step_time_s"] = pred * 2
    bad = validate_measurements(_write(tmp_path / "b.json", {"schema": MEASUREMENTS_SCHEMA,
                                                             "runs": [run]}))
    assert not bad.ok and "kernel" in bad.format()
    run["kind"] = "inference"
    with pytest.raises(PlannerError, match="'kind' must be"):
        validate_measurements(_write(tmp_path / "c.json", {"schema": MEASUREMENTS_SCHEMA,
                                                           "runs": [run]}))


def _bench_attention_file(tmp_path, usp_ms):
    """A results file in tools/bench_attention.py's format (megatron/bench)."""
    cases = [{"seq_len": 32768, "method": "single-gpu-kernel", "label": "kernel", "gpus": 1,
              "status": "ok", "fwd_ms": 30.0, "fwd_bwd_ms": 105.0,
              "fwd_bwd_tflops_per_gpu": 550.0},
             {"seq_len": 131072, "method": "single-gpu-kernel", "label": "kernel", "gpus": 1,
              "status": "ok", "fwd_bwd_tflops_per_gpu": 540.0},
             {"seq_len": 131072, "method": "usp", "label": "usp 2x1", "gpus": 2, "ulysses": 2,
              "ring": 1, "status": "ok", "fwd_ms": usp_ms[0], "fwd_bwd_ms": usp_ms[1]},
             {"seq_len": 131072, "method": "usp", "label": "usp 1x2", "gpus": 2, "ulysses": 1,
              "ring": 2, "status": "oom"}]
    doc = {"tool": "bench_attention", "schema_version": 1,
           "metadata": {"world_size": 2, "date_utc": "2026-11-30T10:00:00Z",
                        "device": {"type": "cuda", "name": "NVIDIA H200", "memory_gib": 139.8}},
           "config": {"heads": 32, "kv_heads": 8, "head_dim": 128, "batch": 1, "causal": True},
           "results": cases}
    return _write(tmp_path / "attention.json", doc)


@pytest.mark.parametrize("config,needle", [
    ({"window": 4096}, "--window 4096 (sliding-window attention)"),
    ({"docs": ["lognormal", "fixed:2k"]}, "--docs lognormal,fixed:2k"),
    ({"causal": False}, "without the causal mask"),
])
def test_bench_attention_results_of_another_mask_are_refused(tmp_path, config, needle):
    """A window, packed documents or a full mask time other work than the dense causal
    attention the planner models: neither calibration nor validation takes such a file."""
    path = _bench_attention_file(tmp_path, (1.0, 1.0))
    doc = json.loads(open(path).read())
    doc["config"].update(config)
    path = _write(tmp_path / "masked.json", doc)
    with pytest.raises(PlannerError, match=f"calibration {path}: .*{re.escape(needle)}"):
        load_calibration(path)
    with pytest.raises(PlannerError, match=f"--validate {path}: .*{re.escape(needle)}"):
        validate_measurements(path)


def test_bench_attention_results_calibrate_and_validate(tmp_path):
    path = _bench_attention_file(tmp_path, (1.0, 1.0))
    cal = load_calibration(path)
    assert cal.attention_tflops == {32768: 550.0, 131072: 540.0}
    assert cal.gpu_memory_gib == 139.8 and "NVIDIA H200" in cal.sources["attention_tflops"]
    # Predict the USP case on the file's own kernel rates, then "measure" 10% slower.
    hw = apply_calibration(get_hardware("h200-measured"), cal)
    aw = AttentionWorkload(32, 8, 128, 131072, 2, 2, 1, True)
    fwd = estimate_attention(replace(aw, backward=False), 2, 1, hw).step_time_s
    both = estimate_attention(aw, 2, 1, hw).step_time_s
    report = validate_measurements(_bench_attention_file(tmp_path, (fwd * 1e3 * 1.1,
                                                                    both * 1e3 * 1.1)))
    assert [r.name for r in report.runs] == ["usp 2x1 S=131072 fwd", "usp 2x1 S=131072 fwd+bwd"]
    assert report.ok and all(r.time_ratio == pytest.approx(1 / 1.1) for r in report.runs)
    assert "bench_attention single-gpu-kernel" in report.hardware.sources["attention_tflops"]

