"""Passkey retrieval: a 5-digit key hidden at a chosen depth of filler text.

A prompt of exactly ``length`` tokens is built from separately tokenised pieces::

    intro | filler[:before] | needle ("The pass key is 12345. Remember it. ...") |
    filler[:after] | question ("What is the pass key? The pass key is")

with ``before = round(depth * (before + after))``: depth 0 puts the needle right after the
intro, depth 1 right before the question. The answer is the tokens of ``" 12345"``.

Scoring is greedy decoding computed in one forward pass: greedy decoding writes the answer's
n tokens exactly when each answer token is the arg-max of the logits that follow the prompt
and the answer's earlier tokens, so ``prompt + answer`` is run once and the arg-max read at the
n positions (causal attention: no position sees a later one). The greedy tokens up to the
first wrong one are what greedy decoding would have written.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, List, Sequence

import torch

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant "
         "text. Find it and memorize it. I will quiz you about it.")
FILLER = (" The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
          "back again.")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"

Encode = Callable[[str], List[int]]


@dataclass(frozen=True)
class PasskeyPrompt:
    """``ids``: the prompt (``length`` tokens); ``answer``: the key's tokens; ``needle_at``:
    index of the needle's first token in ``ids``."""

    ids: List[int]
    answer: List[int]
    needle_at: int
    key: str


def fixed_tokens(encode: Encode, key: str = "12345") -> int:
    """Tokens of a prompt without filler: the shortest ``length`` a prompt can have."""
    return sum(len(encode(text.format(key=key))) for text in (INTRO, NEEDLE, QUESTION))


def _filler(encode: Encode, n: int) -> List[int]:
    unit = encode(FILLER)
    return (unit * (n // len(unit) + 1))[:n]


def build_prompt(encode: Encode, length: int, depth: float, key: str) -> PasskeyPrompt:
    """The prompt of ``length`` tokens with ``key`` at ``depth`` in [0, 1] (module docstring).
    Raises ``ValueError`` when ``length`` is shorter than :func:`fixed_tokens`."""
    intro, needle, question = (encode(t.format(key=key)) for t in (INTRO, NEEDLE, QUESTION))
    fill = length - len(intro) - len(needle) - len(question)
    if fill < 0:
        raise ValueError(f"a passkey prompt needs at least {length - fill} tokens, not {length}")
    before = round(depth * fill)
    filler = _filler(encode, fill)
    ids = intro + filler[:before] + needle + filler[before:] + question
    return PasskeyPrompt(ids, encode(ANSWER.format(key=key)), len(intro) + before, key)


def random_keys(n: int, seed: int) -> List[str]:
    """``n`` 5-digit keys (10000-99999), the same for the same seed."""
    rng = random.Random(seed)
    return [str(rng.randint(10000, 99999)) for _ in range(n)]


def greedy_answer(logits: torch.Tensor, prompt: PasskeyPrompt) -> List[int]:
    """Greedy decoding's first tokens from ``logits [len(ids) + len(answer), V]`` of
    ``ids + answer``: the arg-max after the prompt and each answer token, up to and
    including the first one that differs from the answer."""
    start = len(prompt.ids) - 1
    picked = logits[start:start + len(prompt.answer)].argmax(-1).tolist()
    for i, (got, want) in enumerate(zip(picked, prompt.answer)):
        if got != want:
            return picked[:i + 1]
    return picked


@dataclass(frozen=True)
class PasskeyCell:
    """Accuracy at one (length, depth) over ``len(answers)`` keys."""

    length: int
    depth: float
    correct: int
    answers: List[str]

    @property
    def accuracy(self) -> float:
        return self.correct / len(self.answers)


def evaluate_passkey(logits_fn: Callable[[List[int]], torch.Tensor], encode: Encode,
                     decode: Callable[[List[int]], str], lengths: Sequence[int],
                     depths: Sequence[float], trials: int, seed: int,
                     progress: Callable[[str], None] = lambda line: None) -> List[PasskeyCell]:
    """One :class:`PasskeyCell` per (length, depth); ``logits_fn(ids) -> [len(ids), V]``.
    The same ``trials`` keys are used in every cell; ``progress`` gets a line per cell."""
    keys = random_keys(trials, seed)
    cells = []
    for length in lengths:
        for depth in depths:
            answers, correct = [], 0
            for key in keys:
                prompt = build_prompt(encode, length, depth, key)
                got = greedy_answer(logits_fn(prompt.ids + prompt.answer), prompt)
                correct += got == prompt.answer
                answers.append(decode(got))
            cells.append(PasskeyCell(length, depth, correct, answers))
            progress(f"passkey length {length} depth {depth:g}: {correct}/{trials}")
    return cells
