"""Sliding-window flags, Megatron-LM's names, and their start-up check (no torch: ``--help``).

``--window-size W`` (or Megatron-LM's tuple ``"(W,0)"``) sets megatron-core's
``window_size = (W, 0)``: a query at position i attends to keys i - W .. i.
``--window-attn-skip-freq`` sets its ``window_attn_skip_freq``: an int N makes every N-th layer
a full-attention layer (layers with ``layer_number % N != 0`` are windowed), a list such as
``[1,1,0,1]`` (or Megatron-LM's ``([1]*3+[0]*1)``) marks each layer (1: window). Without it every layer is windowed. megatron-core's
``is_layer_window_attention`` decides per layer (:func:`megatron.usp.core_attention.layer_window`).
The spellings and their checks are :mod:`megatron.shapes.window`'s, shared with the model
files of the planner; the model shape carries the window too.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import megatron.shapes.window as shape_window
from megatron.shapes.window import SKIP_FREQ_FLAG, WINDOW_FLAG
from megatron.training.cli.errors import ArgumentsError

SkipFreq = Union[int, List[int]]


def add_window_args(group) -> None:
    """The sliding-window flags (the model group)."""
    group.add_argument("--window-size", default=None,
                       help="sliding-window attention: a query sees itself and the W keys "
                            "before it; W or Megatron-LM's \"(W,0)\"")
    group.add_argument("--window-attn-skip-freq", default=None,
                       help="with --window-size: N makes every N-th layer full attention "
                            "(layer %% N != 0 is windowed), or one 0/1 per layer (1: window "
                            "layer) as [1,1,0,1] or Megatron-LM's ([1]*3+[0]*1); default "
                            "every layer windowed")


def parse_window_size(text: str) -> Tuple[int, int]:
    """``"4096"`` or ``"(4096,0)"`` -> (4096, 0); raises ArgumentsError naming the flag
    (:func:`megatron.shapes.window.parse_window_size`)."""
    try:
        return shape_window.parse_window_size(text, WINDOW_FLAG)
    except ValueError as exc:
        raise ArgumentsError(str(exc)) from None


def parse_skip_freq(text: str, num_layers: int) -> SkipFreq:
    """``"2"`` -> 2; ``"[1,1,0,1]"`` or Megatron-LM's ``"([1]*3+[0]*1)"`` -> a list of one
    0 / 1 per layer (:func:`megatron.shapes.window.parse_skip_freq`)."""
    try:
        return shape_window.parse_skip_freq(text, num_layers, SKIP_FREQ_FLAG)
    except ValueError as exc:
        raise ArgumentsError(str(exc)) from None


def window_from_args(args) -> Tuple[Optional[Tuple[int, int]], Optional[SkipFreq]]:
    """(window_size, window_attn_skip_freq) for megatron-core's ``TransformerConfig``."""
    if args.window_size is None:
        problems = shape_window.window_problems(None, args.window_attn_skip_freq,
                                                args.num_layers, (WINDOW_FLAG, SKIP_FREQ_FLAG))
        if problems:
            raise ArgumentsError(problems[0])
        return None, None
    window = parse_window_size(args.window_size)
    if args.window_attn_skip_freq is None:
        return window, None
    return window, parse_skip_freq(args.window_attn_skip_freq, args.num_layers)


__all__ = ["add_window_args", "parse_window_size", "parse_skip_freq", "window_from_args"]
