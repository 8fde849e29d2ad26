"""``training.allocate_adam_state``: Adam's state made when the optimizer is built trains
bitwise like the state Adam makes at its first step, is updated in place (the memory held
from the first step on is the memory of every later one), and is placed and typed as
PyTorch places it; optimizers it must leave alone keep no new state; ``build_optimizer``
gives it to the plain and the distributed optimizer before ``pretrain``'s first step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megatron.training.cli.arguments import parse_args
from megatron.training.loop import allocate_adam_state
from tests.harness import run_on_ranks
from tests.helpers import tiny_gpt_flags


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g))
            for shape in ((7, 5), (5,), (3, 4, 2))]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * (step + 1) for p in params]


KINDS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=False),
    "adamw_two_groups": lambda ps: torch.optim.AdamW(
        [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], lr=1e-2, fused=True),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_allocated_state_trains_bitwise_like_lazy_state(kind):
    eager_params, lazy_params = _params(0), _params(0)
    eager, lazy = KINDS[kind](eager_params), KINDS[kind](lazy_params)
    assert allocate_adam_state(SimpleNamespace(optimizer=eager)) == 1
    held = {}
    for p in eager_params:
        state = eager.state[p]
        assert float(state["step"]) == 0.0
        assert all(float(state[k].abs().sum()) == 0.0 for k in state if k != "step")
        assert state["exp_avg"].shape == p.shape and state["exp_avg"].dtype == p.dtype
        held[p] = {k: v.data_ptr() for k, v in state.items()}
    for step in range(3):
        for opt, params in ((eager, eager_params), (lazy, lazy_params)):
            for p, g in zip(params, _grads(params, step)):
                p.grad = g
            opt.step()
    for pe, pl in zip(eager_params, lazy_params):
        assert torch.equal(pe, pl)
        se, sl = eager.state[pe], lazy.state[pl]
        assert se.keys() == sl.keys()
        for key in sl:
            assert se[key].dtype == sl[key].dtype and se[key].device == sl[key].device, key
            assert torch.equal(se[key], sl[key]), key
        # Updated in place: the tensors made at build time are the ones in use.
        assert {k: v.data_ptr() for k, v in se.items()} == held[pe]


def test_left_alone_where_state_exists_or_the_optimizer_is_no_adam():
    stepped_params = _params(1)
    stepped = torch.optim.AdamW(stepped_params, lr=1e-2)
    for p, g in zip(stepped_params, _grads(stepped_params, 0)):
        p.grad = g
    stepped.step()
    before = {p: {k: v.clone() for k, v in stepped.state[p].items()} for p in stepped_params}
    sgd = torch.optim.SGD(_params(2), lr=1e-2, momentum=0.9)
    fresh = torch.optim.AdamW(_params(3), lr=1e-2)
    chained = SimpleNamespace(chained_optimizers=[
        SimpleNamespace(optimizer=stepped), SimpleNamespace(optimizer=sgd),
        SimpleNamespace(optimizer=None), SimpleNamespace(optimizer=fresh)])
    assert allocate_adam_state(chained) == 1
    assert len(fresh.state) == 3 and not sgd.state
    for p in stepped_params:
        assert all(torch.equal(stepped.state[p][k], v) for k, v in before[p].items())


# A 2-layer model trained one step by ``pretrain``: what ``build_optimizer`` hands the loop.
PRETRAIN_ARGS = tiny_gpt_flags(
    group_query_attention=None, num_query_groups=None, mock_data=True, vocab_size=255,
    global_batch_size=1, micro_batch_size=1, train_iters=1, lr="1e-3", eval_iters=0,
    num_workers=0, device="cpu")


def _built_state(rank, world_size, out_path):
    from megatron.training import loop as training  # megatron-core on first use

    seen = []
    build = training.build_optimizer

    def recording_build(args, model):
        optimizer = build(args, model)
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = sub.optimizer
            params = [p for g in inner.param_groups for p in g["params"]]
            seen.append({
                "params": len(params),
                "with_state": sum(1 for p in params if inner.state[p]),
                "zero": all(float(inner.state[p]["exp_avg"].abs().sum()) == 0.0
                            and float(inner.state[p]["step"]) == 0.0
                            for p in params if inner.state[p])})
        return optimizer

    training.build_optimizer = recording_build
    try:
        results = {}
        for name, extra in (("plain", []), ("distributed", ["--use-distributed-optimizer"])):
            seen.clear()
            result = training.pretrain(parse_args(PRETRAIN_ARGS + extra))
            results[name] = {"seen": list(seen), "iteration": result.iteration}
    finally:
        training.build_optimizer = build
    with open(out_path, "w") as f:
        json.dump(results, f)


def test_build_optimizer_gives_the_state_before_the_first_step(tmp_path):
    out = tmp_path / "state.json"
    run_on_ranks(_built_state, 1, str(out), timeout=300)
    got = json.loads(out.read_text())
    for name in ("plain", "distributed"):
        assert got[name]["iteration"] == 1, got
        assert got[name]["seen"], got
        for sub in got[name]["seen"]:
            assert sub["params"] > 0 and sub["with_state"] == sub["params"] and sub["zero"], got
