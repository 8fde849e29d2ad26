"""The shared test helpers (tests/helpers.py) do what their docstrings say."""

import torch

from megatron.training.cli.arguments import parse_args, validate_args
from tests.helpers import flag_list, free_port, rel_err, tiny_gpt_flags


def test_flag_list_switches_values_and_omissions():
    assert flag_list({"hidden_size": 64, "swiglu": True, "bf16": None, "fp16": False,
                      "hierarchical_sizes": [2, 2]}) == [
        "--hidden-size", "64", "--swiglu", "--hierarchical-sizes", "2", "2"]


def test_tiny_gpt_flags_overrides_in_place_and_drops():
    plain = tiny_gpt_flags(llama=False)
    assert plain == ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                     "--seq-length", "64"]
    flags = tiny_gpt_flags(hidden_size=128, num_query_groups=None, group_query_attention=None,
                           lr="1e-3")
    assert flags[:4] == ["--num-layers", "2", "--hidden-size", "128"]
    assert "--num-query-groups" not in flags and "--group-query-attention" not in flags
    assert flags[-2:] == ["--lr", "1e-3"] and "--swiglu" in flags


def test_the_tiny_model_flags_parse_and_validate():
    args = validate_args(parse_args(tiny_gpt_flags(mock_data=True, vocab_size=255, lr="1e-3",
                                                   train_iters=1, device="cpu")),
                         1, cuda_available=False).args
    assert (args.num_layers, args.hidden_size, args.num_query_groups, args.swiglu) == \
        (2, 64, 2, True)


def test_rel_err_and_its_floor():
    want = torch.tensor([3.0, 4.0])
    assert abs(rel_err(want + torch.tensor([0.3, 0.4]), want) - 0.1) < 1e-7
    assert rel_err(torch.ones(2), torch.zeros(2), floor=1e-30) > 1e29


def test_free_port_is_a_port():
    assert 0 < free_port() < 65536
