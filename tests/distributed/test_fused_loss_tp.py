"""The fused output-layer loss under tensor parallelism (TP=2, gloo), with and without
Megatron sequence parallelism, against the single-process float64 reference.

Every rank builds the same float64 hidden states ``h [s, b, H]``, output weight ``W [V, H]``,
labels (both ends of the vocabulary and both sides of the TP boundary V/2, so each rank owns
some targets and not others) and a loss probe, and computes the reference on the whole
problem: ``F.cross_entropy(h @ W^T)`` with autograd. TP rank ``t`` then runs
:func:`fused_linear_cross_entropy` on its vocabulary rows ``W[t*V/2:(t+1)*V/2]`` and on
``h`` (sequence parallel: its rows ``h[t*s/2:(t+1)*s/2]``), back-propagates the same probe,
and compares: the loss ``[b, s]`` (identical on both ranks), the gradient of its ``h``
input (full, or its sequence shard after the reduce-scatter) and the gradient of the whole
``W`` (the shards all-gathered). Float64, so 1e-12 (observed ~1e-15). Chunks of 1, 3 (a
partial last chunk of 20 tokens), 10, and more than the sequence.

Also against megatron-core's own TP path, ``copy_to_tensor_model_parallel_region``, the
matmul and ``vocab_parallel_cross_entropy`` on the full logits: that path casts the logits
to float32, so the agreement there is float32 rounding (1e-6 relative; ~1e-7 observed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.training.cli.arguments import padded_vocab_size, parse_args, validate_args
from megatron.training.cpu_shims import apply_cpu_shims
from megatron.usp.parallel_dims import ParallelDims
from tests.helpers import tiny_gpt_flags

SEQ, BATCH, HIDDEN, VOCAB = 10, 2, 16, 48
CHUNKS = (1, 3, 10, 64)
TOL = dict(atol=1e-12, rtol=1e-12)
FLOAT32_TOL = dict(atol=1e-6, rtol=1e-6)


def _problem():
    gen = torch.Generator().manual_seed(2024)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) * 0.5
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[1, 2:6] = torch.tensor([0, VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1])
    probe = torch.randn(BATCH, SEQ, generator=gen, dtype=torch.float64)
    return hidden, weight, labels, probe


def _reference(hidden, weight, labels, probe):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logits = torch.einsum("sbh,vh->bsv", h, w)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                           reduction="none").view(BATCH, SEQ)
    (loss * probe).sum().backward()
    return loss.detach(), h.grad, w.grad


def _gather_rows(shard, group):
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _check_fused(tp_rank, tp, sequence_parallel, chunk_tokens, problem, ref, weighted=False):
    from megatron.training.model.fused_loss import (
        fused_linear_cross_entropy,  # megatron-core on first use
    )

    hidden, weight, labels, probe = problem
    rows = VOCAB // tp.size()
    w = weight[tp_rank * rows:(tp_rank + 1) * rows].clone().requires_grad_(True)
    if sequence_parallel:
        seq_rows = SEQ // tp.size()
        h_ref_grad = ref[1][tp_rank * seq_rows:(tp_rank + 1) * seq_rows]
        h = hidden[tp_rank * seq_rows:(tp_rank + 1) * seq_rows].clone().requires_grad_(True)
    else:
        h_ref_grad = ref[1]
        h = hidden.clone().requires_grad_(True)
    # With loss_weights = the probe the gradients come from the forward (fused_loss module).
    loss = fused_linear_cross_entropy(h, w, labels, chunk_tokens=chunk_tokens, tp_group=tp,
                                      sequence_parallel=sequence_parallel,
                                      loss_weights=probe if weighted else None)
    (loss * probe).sum().backward()
    what = f"sp={sequence_parallel} chunk={chunk_tokens} weighted={weighted}"
    torch.testing.assert_close(loss.detach(), ref[0], **TOL, msg=f"loss {what}")
    torch.testing.assert_close(h.grad, h_ref_grad, **TOL, msg=f"grad h {what}")
    torch.testing.assert_close(_gather_rows(w.grad, tp), ref[2], **TOL,
                               msg=f"grad W {what}")


def _check_megatron_path(tp_rank, tp, problem, ref):
    from megatron.core.tensor_parallel import (
        vocab_parallel_cross_entropy,  # megatron-core on first use
    )
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,  # megatron-core on first use
    )

    from megatron.training.model.fused_loss import (
        fused_linear_cross_entropy,  # megatron-core on first use
    )

    hidden, weight, labels, probe = problem
    rows = VOCAB // tp.size()
    shard = weight[tp_rank * rows:(tp_rank + 1) * rows]
    results = []
    for path in ("megatron", "fused"):
        h = hidden.clone().requires_grad_(True)
        w = shard.clone().requires_grad_(True)
        if path == "megatron":
            logits = torch.matmul(copy_to_tensor_model_parallel_region(h, group=tp), w.t())
            loss = vocab_parallel_cross_entropy(logits, labels.t().contiguous()).t()
        else:
            loss = fused_linear_cross_entropy(h, w, labels, chunk_tokens=3, tp_group=tp)
        (loss * probe).sum().backward()
        results.append((loss.detach(), h.grad, _gather_rows(w.grad, tp)))
    assert results[0][0].dtype == torch.float32   # megatron's float32 cast, see the module
    for name, megatron, fused, exact in zip(("loss", "grad h", "grad W"), *results, ref):
        megatron = megatron.double()
        err = (fused - megatron).abs().max().item()
        torch.testing.assert_close(fused, megatron, **FLOAT32_TOL, msg=f"{name}: {err:.2e}")
        # megatron's float32 error is real (so this comparison is not vacuous) and ours is not
        assert (fused - exact).abs().max() < 1e-12 < (megatron - exact).abs().max(), name


def _tp2_checks(rank, world_size):
    from megatron.usp.parallel_state import initialize_usp_parallel  # megatron-core on first use

    apply_cpu_shims()  # megatron-core's sequence all-gather allocates on the CUDA device
    groups = initialize_usp_parallel(ParallelDims(dist.get_world_size(), tp=2))
    tp_rank = dist.get_rank(groups.tp)
    problem = _problem()
    ref = _reference(*problem)
    for sequence_parallel in (False, True):
        for chunk_tokens in CHUNKS:
            _check_fused(tp_rank, groups.tp, sequence_parallel, chunk_tokens, problem, ref)
        _check_fused(tp_rank, groups.tp, sequence_parallel, 3, problem, ref, weighted=True)
    _check_megatron_path(tp_rank, groups.tp, problem, ref)


def test_tp2_with_and_without_sequence_parallel(dist_run):
    dist_run(_tp2_checks, 2, timeout=240)


MODEL_ARGS = tiny_gpt_flags(
    hidden_size=32, group_query_attention=None, num_query_groups=None, seq_length=16,
    max_position_embeddings=None, train_iters=1, lr="1e-3", mock_data=True, vocab_size=60,
    device="cpu", tensor_model_parallel_size=2, sequence_parallel=True)


def _build(config, groups):
    from megatron.core.tensor_parallel import (
        model_parallel_cuda_manual_seed,  # megatron-core on first use
    )

    from megatron.training.model.build import (  # megatron-core on first use
        build_gpt_model,
        transformer_config_from_args,
    )

    config = config.with_padded_vocab(padded_vocab_size(config.args.vocab_size, 32, 2))  # 64
    model_parallel_cuda_manual_seed(7)
    return build_gpt_model(config, transformer_config_from_args(config), groups)


def _model_checks(rank, world_size):
    """build_gpt_model: the flag selects FusedLossGPTModel, the default is USPGPTModel
    (GPTModel with RoPE from position_ids, megatron/training/model/gpt_model.py);
    with the same weights (TP2, sequence parallel, tied embeddings) the losses and every
    parameter gradient agree with GPTModel's to float32 rounding, and calls without labels
    are GPTModel's own (bit-equal logits); given float8 GEMMs, the loss runs its output
    layer through them."""
    from megatron.core.models.gpt.gpt_model import GPTModel  # megatron-core on first use

    from megatron.training.model.fused_loss_model import (
        FusedLossGPTModel,  # megatron-core on first use
    )
    from megatron.training.model.gpt_model import USPGPTModel  # megatron-core on first use
    from megatron.usp.parallel_state import initialize_usp_parallel  # megatron-core on first use

    apply_cpu_shims()
    groups = initialize_usp_parallel(ParallelDims(dist.get_world_size(), tp=2))
    plain = _build(validate_args(parse_args(MODEL_ARGS), 2, cuda_available=False), groups)
    fused_args = validate_args(parse_args(MODEL_ARGS + ["--fused-linear-cross-entropy",
                                                        "--linear-cross-entropy-chunk-tokens",
                                                        "5"]), 2, cuda_available=False)
    fused = _build(fused_args, groups)
    assert type(plain) is USPGPTModel and type(fused) is FusedLossGPTModel
    assert isinstance(fused, USPGPTModel) and isinstance(plain, GPTModel)
    assert fused.loss_chunk_tokens == 5 and fused.share_embeddings_and_output_weights
    fused.load_state_dict(plain.state_dict())

    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 60, (2, 16), generator=gen)
    labels = torch.randint(0, 60, (2, 16), generator=gen)
    labels[0, :4] = torch.tensor([0, 31, 32, 59])
    positions = torch.arange(16).unsqueeze(0).expand(2, 16).contiguous()
    probe = torch.rand(2, 16, generator=gen)
    losses, grads = [], []
    for model in (plain, fused):
        loss = model(tokens, positions, None, labels=labels)
        (loss * probe).sum().backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert losses[0].shape == losses[1].shape == (2, 16)
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=1e-6)
    assert grads[0].keys() == grads[1].keys() and "output_layer.weight" not in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5,
                                   msg=lambda m, n=name: f"grad {n}: {m}")
    with torch.no_grad():
        logits = [model(tokens, positions, None) for model in (plain, fused)]
    assert logits[0].shape == (2, 16, 32)                       # [b, s, V/tp]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)

    # --fp8-output-layer: the model hands its float8 GEMMs to the loss (emulated here)
    from megatron.layers.float8_gemms import Float8Gemms  # torchao on first use
    from megatron.layers.float8_options import Float8Options

    assert fused.output_float8_shape() == tuple(reversed(fused._output_weight().shape))
    fused.run_output_in_float8(Float8Gemms(Float8Options(linears="all", emulate=True)))
    loss8 = fused(tokens, positions, None, labels=labels).detach()
    noise = (loss8.double() - losses[1].double()).pow(2).sum()
    sqnr = float(10 * torch.log10(losses[1].double().pow(2).sum() / noise))
    assert 20.0 < sqnr < 60.0, sqnr             # rounded to float8, and only that


def test_model_subclass_matches_gpt_model(dist_run):
    dist_run(_model_checks, 2, timeout=240)
