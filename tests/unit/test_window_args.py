"""``--window-size`` and ``--window-attn-skip-freq``: Megatron-LM's spellings reach
megatron-core's ``TransformerConfig`` fields, and every bad value is refused at start-up in
one line naming the flag and a valid value."""

from __future__ import annotations

import pytest

from megatron.training.cli.arguments import ArgumentsError, parse_args, validate_args
from tests.helpers import tiny_gpt_flags

BASE = tiny_gpt_flags(llama=False, num_layers=4, num_attention_heads=8, train_iters=10,
                      lr="1e-3", mock_data=True, vocab_size=1000)


def _valid(extra):
    return validate_args(parse_args(BASE + extra), 4, cuda_available=False)


@pytest.mark.parametrize("spelling", ["16", "(16,0)", "(16, 0)", "16,0"])
def test_window_size_spellings(spelling):
    config = _valid(["--window-size", spelling])
    assert config.window_size == (16, 0) and config.window_attn_skip_freq is None


@pytest.mark.parametrize("freq,want", [("2", 2), ("[1,1,0,1]", [1, 1, 0, 1]),
                                       ("([1]*3+[0]*1)", [1, 1, 1, 0]),
                                       ("[1,0]*2", [1, 0, 1, 0])])
def test_skip_frequency_int_or_list(freq, want):
    config = _valid(["--window-size", "16", "--window-attn-skip-freq", freq])
    assert config.window_attn_skip_freq == want


def test_no_window_is_full_attention():
    config = _valid([])
    assert config.window_size is None and config.window_attn_skip_freq is None


@pytest.mark.parametrize("extra,needle", [
    (["--window-size", "(16,4)"], "--window-size (16,4): the right side must be 0"),
    (["--window-size", "0"], "--window-size 0: the window must be at least 1"),
    (["--window-size", "-3"], "--window-size -3: the window must be at least 1"),
    (["--window-size", "big"], "--window-size 'big' is not a window"),
    (["--window-attn-skip-freq", "2"], "has no effect without --window-size"),
    (["--window-size", "16", "--window-attn-skip-freq", "0"], "must be >= 1"),
    (["--window-size", "16", "--window-attn-skip-freq", "[1,0]"], "a list of 4 zeros and ones"),
    (["--window-size", "16", "--window-attn-skip-freq", "[1,2,0,1]"], "e.g. "),
    (["--window-size", "16", "--window-attn-skip-freq", "__import__('os')"], "e.g. "),
    (["--window-size", "16", "--window-attn-skip-freq", "[1]*5"], "a list of 4 zeros and ones"),
])
def test_bad_window_flags_are_refused_in_one_line(extra, needle):
    with pytest.raises(ArgumentsError) as err:
        _valid(extra)
    message = str(err.value)
    assert needle in message and "\n" not in message
    assert any(valid in message for valid in ("e.g. --window", "pass --window-size",
                                              "add --window-size"))


def test_transformer_config_carries_the_window():
    from megatron.training.model.build import (  # megatron-core on first use
        transformer_config_from_args,
    )

    config = _valid(["--window-size", "(16,0)", "--window-attn-skip-freq", "[1,1,0,1]"])
    tc = transformer_config_from_args(config)
    assert tc.window_size == (16, 0) and tc.window_attn_skip_freq == [1, 1, 0, 1]
