"""megatron.layers.norms: what megatron-core's WrappedTorchNorm computes, plus the SP marking.

Equality: the same random float64 input, weights and output gradient through our norm and
through ``WrappedTorchNorm`` (``torch.nn.RMSNorm`` / ``LayerNorm``); outputs, input gradients
and weight gradients must be bit-identical (both call the same ``torch.nn.functional``
kernel), for several shapes and epsilons. Marking: every parameter carries
``sequence_parallel = config.sequence_parallel``, the attribute megatron-core's
``finalize_model_grads`` selects the TP all-reduce by. Specs: the layer spec's four norm
slots and the block spec's final norm are ours; the block spec holds this pipeline stage's
layers.
"""

from __future__ import annotations

import pytest
import torch

from megatron.layers.norms import LayerNorm, RMSNorm, norm_class

NORMS = {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}


def _config(normalization="RMSNorm", sequence_parallel=False, **extra):
    from megatron.core.transformer.transformer_config import (
        TransformerConfig,  # megatron-core on first use
    )

    return TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, normalization=normalization,
        params_dtype=torch.float64, tensor_model_parallel_size=2 if sequence_parallel else 1,
        sequence_parallel=sequence_parallel, **extra)


def _randomise(module, gen):
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64))


def _run(module, x, dy):
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("normalization", sorted(NORMS))
@pytest.mark.parametrize("shape,eps", [((16, 2, 32), 1e-5), ((5, 32), 1e-6), ((3, 1, 2, 32), 0.1)])
def test_equals_wrapped_torch_norm(normalization, shape, eps):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm  # megatron-core on first use

    config = _config(normalization)
    gen = torch.Generator().manual_seed(7)
    ours = NORMS[normalization](config, hidden_size=32, eps=eps)
    theirs = WrappedTorchNorm(config, hidden_size=32, eps=eps).double()
    # Same parameters, same names, same initial values (ones / zeros).
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=0, atol=0)
    _randomise(theirs, gen)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 0.5
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    y, dx, dw = _run(ours, x, dy)
    y_ref, dx_ref, dw_ref = _run(theirs, x, dy)
    assert y.dtype == torch.float64 and y.shape == x.shape
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    assert dw.keys() == dw_ref.keys()
    for name in dw:
        torch.testing.assert_close(dw[name], dw_ref[name], rtol=0, atol=0)


@pytest.mark.parametrize("normalization", sorted(NORMS))
def test_output_is_normalised(normalization):
    """Independent of torch's module: RMS 1 (RMSNorm) or mean 0 / variance 1 (LayerNorm)."""
    norm = NORMS[normalization](_config(normalization), hidden_size=32, eps=0.0)
    x = torch.randn(64, 32, dtype=torch.float64) * 5 + 2
    y = norm(x)
    if normalization == "RMSNorm":
        torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(64, dtype=torch.float64))
        torch.testing.assert_close(y * x.pow(2).mean(-1, keepdim=True).sqrt(), x)
    else:
        torch.testing.assert_close(y.mean(-1), torch.zeros(64, dtype=torch.float64))
        torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(64, dtype=torch.float64))


@pytest.mark.parametrize("normalization", sorted(NORMS))
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parameters_carry_the_sequence_parallel_mark(normalization, sequence_parallel):
    config = _config(normalization, sequence_parallel)
    norm = NORMS[normalization](config, hidden_size=32, eps=1e-5)
    names = [n for n, _ in norm.named_parameters()]
    assert names == (["weight"] if normalization == "RMSNorm" else ["weight", "bias"])
    for param in norm.parameters():
        assert param.sequence_parallel is sequence_parallel
        assert param.dtype == torch.float64 and param.shape == (32,)
    # The mark survives the dtype / device moves the training loop makes (Float16Module).
    norm.bfloat16()
    assert all(p.sequence_parallel is sequence_parallel for p in norm.parameters())
    assert f"sequence_parallel={sequence_parallel}" in repr(norm)


@pytest.mark.parametrize("normalization", sorted(NORMS))
def test_zero_centered_gamma_applies_weight_plus_one(normalization):
    plain = NORMS[normalization](_config(normalization), hidden_size=32, eps=1e-5)
    centred = NORMS[normalization](
        _config(normalization, layernorm_zero_centered_gamma=True), hidden_size=32, eps=1e-5)
    assert torch.count_nonzero(centred.weight) == 0
    gen = torch.Generator().manual_seed(3)
    _randomise(plain, gen)
    with torch.no_grad():
        centred.weight.copy_(plain.weight - 1)
        if normalization == "LayerNorm":
            centred.bias.copy_(plain.bias)
    x = torch.randn(8, 32, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(centred(x), plain(x), rtol=1e-15, atol=1e-15)


def test_norm_class_names_the_flag():
    assert norm_class("RMSNorm") is RMSNorm and norm_class("LayerNorm") is LayerNorm
    with pytest.raises(ValueError, match="--normalization 'L2Norm'.*RMSNorm"):
        norm_class("L2Norm")


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_layer_spec_uses_our_norms(qk_layernorm):
    from megatron.core.transformer.identity_op import IdentityOp  # megatron-core on first use

    from megatron.layers.fused_kernels import op_impl  # megatron-core on first use
    from megatron.training.model.layer_specs import (  # megatron-core on first use
        LayerSpecOptions,
        get_usp_gpt_layer_spec,
    )

    def norm_module(slot):
        return slot.module if hasattr(slot, "module") else slot

    for normalization, cls in NORMS.items():
        spec = get_usp_gpt_layer_spec(
            LayerSpecOptions(attention_backend="math", fused_kernels="compile"),
            qk_layernorm=qk_layernorm, normalization=normalization)
        assert norm_module(spec.submodules.input_layernorm) is cls
        assert spec.submodules.input_layernorm.params == {
            "impl": op_impl("compile", "rms_norm")}
        assert norm_module(spec.submodules.pre_mlp_layernorm) is cls
        attn = spec.submodules.self_attention.submodules
        assert norm_module(attn.q_layernorm) is (cls if qk_layernorm else IdentityOp)
        assert norm_module(attn.k_layernorm) is (cls if qk_layernorm else IdentityOp)
    with pytest.raises(ValueError, match="--normalization 'ScaleNorm'"):
        get_usp_gpt_layer_spec(normalization="ScaleNorm")


@pytest.mark.parametrize("lean", [False, True])
def test_usp_norms_take_the_residual_gradient_from_the_bias_dropout_add(lean):
    """With the ``usp`` RMSNorm the input and pre-MLP norms (or the linear layers they moved
    into) add their residual's gradient, handed over by the layer's bias-dropout-add slots;
    the q / k norms, LayerNorm and the other kernels keep megatron-core's slots."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    from megatron.layers.residual import residual_bda
    from megatron.training.model.layer_specs import (  # megatron-core on first use
        LayerSpecOptions,
        get_usp_gpt_layer_spec,
    )

    spec = get_usp_gpt_layer_spec(LayerSpecOptions(attention_backend="math", fused_kernels="usp",
                                                   lean_norms=lean), qk_layernorm=True)
    layer = spec.submodules
    attn = layer.self_attention.submodules
    stream = ([attn.linear_qkv, layer.mlp.submodules.linear_fc1] if lean
              else [layer.input_layernorm, layer.pre_mlp_layernorm])
    assert all(slot.params["residual_grad"] is True for slot in stream)
    assert "residual_grad" not in attn.q_layernorm.params
    assert layer.self_attn_bda is residual_bda and layer.mlp_bda is residual_bda
    for kernels, normalization in (("torch", "RMSNorm"), ("usp", "LayerNorm")):
        other = get_usp_gpt_layer_spec(
            LayerSpecOptions(attention_backend="math", fused_kernels=kernels, lean_norms=lean),
            normalization=normalization).submodules
        assert other.self_attn_bda is get_bias_dropout_add
        assert other.mlp_bda is get_bias_dropout_add
        slots = ([other.self_attention.submodules.linear_qkv] if lean
                 else [other.input_layernorm])
        assert all("residual_grad" not in slot.params for slot in slots)


def test_block_spec_holds_this_stage_layers_and_our_final_norm():
    from megatron.training.model.layer_specs import (  # megatron-core on first use
        LayerSpecOptions,
        get_usp_gpt_block_spec,
    )
    from megatron.usp.core_attention import USPAttention  # megatron-core on first use

    config = _config("LayerNorm", qk_layernorm=True, pipeline_model_parallel_size=2,
                     pipeline_dtype=torch.float64)
    for pp_rank in (0, 1):
        block = get_usp_gpt_block_spec(config, pp_rank=pp_rank,
                                       options=LayerSpecOptions(attention_backend="torch"))
        assert block.layer_norm.module is LayerNorm
        assert len(block.layer_specs) == 2  # 4 layers over 2 stages
        layer = block.layer_specs[0]
        assert layer.submodules.input_layernorm.module is LayerNorm
        attn = layer.submodules.self_attention.submodules
        assert attn.q_layernorm.module is LayerNorm and attn.k_layernorm.module is LayerNorm
        assert attn.core_attention.module is USPAttention
        assert attn.core_attention.params["attention_backend"] == "torch"
    assert len(get_usp_gpt_block_spec(_config(), pp_rank=0).layer_specs) == 4
    assert get_usp_gpt_block_spec(_config(), pp_rank=0).layer_norm.module is RMSNorm
