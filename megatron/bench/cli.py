"""Command-line pieces shared by the benchmark tools: lengths, splits, head chunks, and their
errors."""

from __future__ import annotations

from typing import List, Optional, Tuple

from megatron.errors import UsageError


class BenchConfigError(UsageError, ValueError):
    """Bad benchmark input; the message names the flag and a valid value."""


def parse_seq_len(text: str, flag: str = "--seq-lens") -> int:
    """``"32k"`` -> 32768, ``"1m"`` -> 1048576, ``"4096"`` -> 4096 (k = 1024)."""
    t = text.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit() or int(digits) <= 0:
        raise BenchConfigError(f"{flag}: cannot read {text!r}; write lengths like 32k, 1m or "
                               f"131072")
    return int(digits) * mult


def parse_seq_lens(text: str, flag: str = "--seq-lens") -> List[int]:
    """Comma-separated lengths."""
    return [parse_seq_len(s, flag) for s in text.split(",") if s.strip()]


def parse_splits(text: str, flag: str = "--splits") -> List[Tuple[int, int]]:
    """``"2x1,1x2"`` -> [(2, 1), (1, 2)] (Ulysses degree x Ring degree)."""
    out = []
    for item in filter(None, (p.strip().lower() for p in text.split(","))):
        parts = item.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise BenchConfigError(f"{flag}: cannot read {item!r}; write U x R pairs like "
                                   f"2x1,1x2")
        out.append((int(parts[0]), int(parts[1])))
    return out


def parse_overlap_chunks(text: str, flag: str = "--overlap-chunks") -> List[Optional[int]]:
    """``"auto,1,2"`` -> [None, 1, 2] (None: USP's auto rule), without repeats."""
    values: List[Optional[int]] = []
    for item in (t.strip().lower() for t in text.split(",")):
        if item == "auto":
            value = None
        elif item.isdigit() and int(item) >= 1:
            value = int(item)
        else:
            raise BenchConfigError(f"{flag} {text!r}: each value is 'auto' or a positive "
                                   f"integer; try {flag} auto,1,2")
        if value not in values:
            values.append(value)
    return values


def seq_label(s: int) -> str:
    """32768 -> "32K"; lengths that are not whole K stay numbers."""
    return f"{s // 1024}K" if s % 1024 == 0 else str(s)
