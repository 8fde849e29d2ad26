"""Sliding-window flags, Megatron-LM's names, and their start-up check (no torch: ``--help``).

``--window-size W`` (or Megatron-LM's tuple ``"(W,0)"``) sets megatron-core's
``window_size = (W, 0)``: a query at position i attends to keys i - W .. i.
``--window-attn-skip-freq`` sets its ``window_attn_skip_freq``: an int N makes every N-th layer
a full-attention layer (layers with ``layer_number % N != 0`` are windowed), a list such as
``[1,1,0,1]`` (or Megatron-LM's ``([1]*3+[0]*1)``) marks each layer (1: window). Without it every layer is windowed. megatron-core's
``is_layer_window_attention`` decides per layer (:func:`megatron.usp.core_attention.layer_window`).
"""

from __future__ import annotations

import ast
import re
from typing import List, Optional, Tuple, Union

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
    """``"4096"`` or ``"(4096,0)"`` -> (4096, 0); raises ArgumentsError naming the flag."""
    match = re.fullmatch(r"\s*\(?\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\)?\s*", str(text))
    if match is None:
        raise ArgumentsError(f"--window-size {text!r} is not a window; pass the keys before "
                             f"each query, e.g. --window-size 4096 (or \"(4096,0)\")")
    left, right = int(match.group(1)), int(match.group(2) or 0)
    if right != 0:
        raise ArgumentsError(f"--window-size {text}: the right side must be 0 (attention is "
                             f"causal); pass --window-size {left if left > 0 else 4096}")
    if left <= 0:
        raise ArgumentsError(f"--window-size {text}: the window must be at least 1 key, e.g. "
                             f"--window-size 4096 (drop the flag for full attention)")
    return left, 0


def _list_expression(node):
    """The value of an int, a list of ints, or ``+`` / ``*`` of them (Megatron-LM's
    ``([1]*3+[0]*1)*3``); ValueError for anything else (nothing is executed)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_list_expression(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expression(node.left), _list_expression(node.right)
        if isinstance(node.op, ast.Add) and type(left) is type(right):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(right, int) and not isinstance(left, int):
            return left * right
    raise ValueError("not an int or a list expression")


def parse_skip_freq(text: str, num_layers: int) -> SkipFreq:
    """``"2"`` -> 2; ``"[1,1,0,1]"`` or Megatron-LM's ``"([1]*3+[0]*1)"`` -> a list of one
    0 / 1 per layer."""
    try:
        value = _list_expression(ast.parse(str(text).strip(), mode="eval").body)
    except (ValueError, SyntaxError, RecursionError):
        value = None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ArgumentsError(f"--window-attn-skip-freq {text} must be >= 1, e.g. "
                                 f"--window-attn-skip-freq 2 (every second layer full)")
        return value
    if isinstance(value, (list, tuple)) and all(v in (0, 1) for v in value) \
            and len(value) == num_layers:
        return [int(v) for v in value]
    example = ",".join(["1"] * (num_layers - 1) + ["0"]) if num_layers > 1 else "1"
    raise ArgumentsError(f"--window-attn-skip-freq {text} is neither an int >= 1 nor a list "
                         f"of {num_layers} zeros and ones (one per layer, 1: window), e.g. "
                         f"--window-attn-skip-freq [{example}]")


def window_from_args(args) -> Tuple[Optional[Tuple[int, int]], Optional[SkipFreq]]:
    """(window_size, window_attn_skip_freq) for megatron-core's ``TransformerConfig``."""
    if args.window_size is None:
        if args.window_attn_skip_freq is not None:
            raise ArgumentsError(f"--window-attn-skip-freq {args.window_attn_skip_freq} has no "
                                 f"effect without --window-size; add --window-size 4096 or "
                                 f"drop it")
        return None, None
    window = parse_window_size(args.window_size)
    if args.window_attn_skip_freq is None:
        return window, None
    return window, parse_skip_freq(args.window_attn_skip_freq, args.num_layers)


__all__ = ["add_window_args", "parse_window_size", "parse_skip_freq", "window_from_args"]
