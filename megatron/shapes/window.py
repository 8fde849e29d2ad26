"""Sliding-window attention of a model: megatron-core's two fields, their spellings, their
check, and which layers they window.

* ``window_size``: the left window ``W`` (megatron-core's ``window_size = (W, 0)``: a query at
  position ``i`` sees the keys ``i - W .. i``); None: full attention.
* ``window_attn_skip_freq``: None windows every layer; an int ``N`` the layers with
  ``layer_number % N != 0`` (one full layer after every ``N - 1`` window layers); a list one
  0 / 1 per layer (1: window).

:func:`is_window_layer` is megatron-core's ``is_layer_window_attention``
(``megatron.core.transformer.utils``, which the attention asks at run time) written once for
the readers that must not import torch: the shape, the FLOP count, the planner, the
checkpoint converter; ``tests/unit/test_shapes.py`` holds the two to the same answers. The
parsers take the command line's spellings (``--window-size 4096`` or ``"(4096,0)"``,
``--window-attn-skip-freq 4``, ``[1,1,0,1]`` or Megatron-LM's ``([1]*3+[0]*1)``) and, with
the checks, say what is wrong in one line naming the flag or the field (``label``: a flag
``--window-size`` reads ``--window-size 4096``, a field ``window_size`` reads
``window_size=4096``) and a valid value; they raise ``ValueError``, which each reader turns
into its own error.

Standard library only, like the rest of :mod:`megatron.shapes`.
"""

from __future__ import annotations

import ast
import re
from typing import List, Optional, Sequence, Tuple, Union

SkipFreq = Union[int, Sequence[int]]

WINDOW_FLAG = "--window-size"
SKIP_FREQ_FLAG = "--window-attn-skip-freq"


def _named(label: str, value) -> str:
    """``--flag value`` for a flag, ``field=value`` for a field."""
    return f"{label} {value}" if label.startswith("--") else f"{label}={value}"


# --------------------------------------------------------------------------- the rule
def is_window_layer(window_size: Optional[int], skip_freq: Optional[SkipFreq],
                    layer_number: int) -> bool:
    """Whether layer ``layer_number`` (1-based, counted over the whole model) has the window:
    megatron-core's ``is_layer_window_attention`` for a left window (None: no window)."""
    if not window_size:
        return False
    if skip_freq is None:
        return True
    if isinstance(skip_freq, int):
        return layer_number % skip_freq != 0
    return bool(skip_freq[layer_number - 1])


def window_marks(window_size: Optional[int], skip_freq: Optional[SkipFreq],
                 num_layers: int) -> Tuple[int, ...]:
    """One mark per layer, first layer first: 1 for a window layer, 0 for a full one."""
    return tuple(int(is_window_layer(window_size, skip_freq, n))
                 for n in range(1, num_layers + 1))


def effective_window(window: Optional[int], seq_len: int) -> Optional[int]:
    """``window``, or None when it reaches the whole sequence of ``seq_len`` tokens (a window
    of ``seq_len - 1`` or more is full causal attention, and runs as such)."""
    return None if window is None or window >= seq_len - 1 else int(window)


# --------------------------------------------------------------------------- the checks
def window_size_problem(left, label: str = "window_size",
                        shown: Optional[str] = None) -> Optional[str]:
    """What is wrong with a left window ``left`` (an int >= 1), or None."""
    shown = left if shown is None else shown
    if isinstance(left, bool) or not isinstance(left, int):
        return (f"{_named(label, repr(shown))} is not a window; pass the keys before each "
                f"query, e.g. {_named(label, 4096)}")
    if left < 1:
        return (f"{_named(label, shown)}: the window must be at least 1 key, e.g. "
                f"{_named(label, 4096)} (without a window: full attention)")
    return None


def skip_freq_problem(value, num_layers: int, label: str = "window_attn_skip_freq",
                      shown: Optional[str] = None) -> Optional[str]:
    """What is wrong with a pattern ``value`` for ``num_layers`` layers (an int >= 1, or one
    0 / 1 per layer), or None."""
    shown = value if shown is None else shown
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            return (f"{_named(label, shown)} must be >= 1, e.g. {_named(label, 2)} (every "
                    f"second layer full)")
        return None
    if isinstance(value, (list, tuple)) and len(value) == num_layers and all(
            type(v) is int and v in (0, 1) for v in value):
        return None
    example = ",".join(["1"] * (num_layers - 1) + ["0"]) if num_layers > 1 else "1"
    return (f"{_named(label, shown)} is neither an int >= 1 nor a list of {num_layers} zeros "
            f"and ones (one per layer, 1: window), e.g. {_named(label, f'[{example}]')}")


def window_problems(window_size, skip_freq, num_layers: int,
                    labels: Tuple[str, str] = ("window_size", "window_attn_skip_freq")
                    ) -> List[str]:
    """What is wrong with the two fields together, one message per problem (empty: fine)."""
    size_label, freq_label = labels
    if window_size is None:
        if skip_freq is None:
            return []
        return [f"{_named(freq_label, skip_freq)} has no effect without {size_label}; add "
                f"{_named(size_label, 4096)} or drop it"]
    out = [p for p in (window_size_problem(window_size, size_label),) if p]
    if skip_freq is not None:
        out += [p for p in (skip_freq_problem(skip_freq, num_layers, freq_label),) if p]
    return out


# --------------------------------------------------------------------------- the spellings
def parse_window_size(text, label: str = WINDOW_FLAG) -> Tuple[int, int]:
    """``"4096"``, ``"(4096,0)"`` or ``"4096,0"`` -> (4096, 0); ValueError naming ``label``."""
    match = re.fullmatch(r"\s*\(?\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\)?\s*", str(text))
    if match is None:
        raise ValueError(window_size_problem(str(text), label))
    left, right = int(match.group(1)), int(match.group(2) or 0)
    if right != 0:
        raise ValueError(f"{_named(label, text)}: the right side must be 0 (attention is "
                         f"causal); pass {_named(label, left if left > 0 else 4096)}")
    problem = window_size_problem(left, label, shown=text)
    if problem:
        raise ValueError(problem)
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


def parse_skip_freq(text, num_layers: int, label: str = SKIP_FREQ_FLAG) -> Union[int, List[int]]:
    """``"2"`` -> 2; ``"[1,1,0,1]"`` or Megatron-LM's ``"([1]*3+[0]*1)"`` -> a list of one
    0 / 1 per layer; ValueError naming ``label``."""
    try:
        value = _list_expression(ast.parse(str(text).strip(), mode="eval").body)
    except (ValueError, SyntaxError, RecursionError):
        value = None
    problem = skip_freq_problem(value, num_layers, label, shown=text)
    if problem:
        raise ValueError(problem)
    return value if isinstance(value, int) else [int(v) for v in value]


def skip_freq_text(skip_freq: SkipFreq) -> str:
    """The pattern as its flag takes it: ``4`` or ``[1,1,0,1]`` (no spaces)."""
    if isinstance(skip_freq, int):
        return str(skip_freq)
    return "[" + ",".join(str(int(v)) for v in skip_freq) + "]"


def window_flags(window_size: Optional[int], skip_freq: Optional[SkipFreq]) -> List[str]:
    """``--window-size W`` and, when not every layer has it, ``--window-attn-skip-freq``
    (nothing without a window)."""
    if window_size is None:
        return []
    flags = [WINDOW_FLAG, str(window_size)]
    if skip_freq is not None:
        flags += [SKIP_FREQ_FLAG, skip_freq_text(skip_freq)]
    return flags
