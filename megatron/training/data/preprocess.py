"""JSONL documents -> megatron-core indexed datasets (``PREFIX.bin`` / ``PREFIX.idx``).

:func:`preprocess_jsonl` tokenizes each JSON key of each line into one document of the
dataset ``output_prefix_for_key(output_prefix, key)`` through megatron-core's
``IndexedDatasetBuilder`` (``PREFIX.bin`` token ids, ``PREFIX.idx`` lengths/offsets);
``tools/preprocess_data.py`` is its command line. :func:`iter_jsonl_texts` yields the same
documents untokenized (``tools/train_tokenizer.py``). A bad line raises
:class:`PreprocessError` naming ``file:line`` (or is skipped and counted on request); the
output is written under temporary names and appears only when the run completes.
"""

from __future__ import annotations

import collections
import itertools
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

import numpy as np

from megatron.errors import UsageError


class PreprocessError(UsageError, ValueError):
    """A JSONL line that cannot be turned into a document. Names the file and line."""


@dataclass
class PreprocessSummary:
    """What :func:`preprocess_jsonl` wrote and skipped; nothing is dropped uncounted.

    ``skipped_bad_json``: lines that are not UTF-8, not JSON or not a JSON object.
    ``skipped_missing_key``: objects lacking a ``--json-keys`` key or holding a non-string
    there (the whole line is skipped so the per-key datasets stay aligned).
    ``skipped_empty``: blank texts, per key. ``blank_lines``: empty lines, ignored.
    """

    output_prefixes: Dict[str, str]
    lines: int = 0
    blank_lines: int = 0
    skipped_bad_json: int = 0
    skipped_missing_key: int = 0
    skipped_empty: Dict[str, int] = field(default_factory=dict)
    documents_written: Dict[str, int] = field(default_factory=dict)
    tokens_written: Dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def summary_line(self) -> str:
        keys = list(self.output_prefixes)
        written = ", ".join(f"{k}: {self.documents_written[k]}" for k in keys)
        tokens = ", ".join(f"{k}: {self.tokens_written[k]}" for k in keys)
        empty = ", ".join(f"{k}: {self.skipped_empty[k]}" for k in keys)
        return (
            f"documents written ({written}); skipped: {self.skipped_bad_json} bad JSON, "
            f"{self.skipped_missing_key} missing key, empty ({empty}); tokens written "
            f"({tokens}); {self.lines} lines read ({self.blank_lines} blank) in "
            f"{self.seconds:.1f}s"
        )


@dataclass(frozen=True)
class TokenizerSpec:
    """How to rebuild a tokenizer in a worker process (tokenizers are not picklable)."""

    tokenizer_type: str
    tokenizer_model: Optional[str]
    vocab_size: Optional[int] = None

    def build(self):
        from megatron.training.data.tokenizer import build_tokenizer  # torch-free --help

        return build_tokenizer(self.tokenizer_type, self.tokenizer_model, self.vocab_size)


_BAD_JSON, _MISSING_KEY, _BLANK, _OK = "bad JSON", "missing key", "blank", "ok"


class _LineEncoder:
    """Turns one raw JSONL line into token ids per JSON key (EOD appended if asked)."""

    def __init__(self, spec: TokenizerSpec, json_keys: Sequence[str], append_eod: bool):
        self.tokenizer = spec.build()
        self.json_keys = list(json_keys)
        self.append_eod = append_eod

    def __call__(self, item: Tuple[int, int, bytes]):
        """``(file index, line number, raw line)`` -> ``(file, line, kind, detail, ids, nbytes)``.

        ``ids`` has one list per key; an empty list is an empty document.
        """
        fidx, lineno, raw = item
        kind, detail, texts = _parse_line(raw, self.json_keys)
        if kind != _OK:
            return fidx, lineno, kind, detail, None, len(raw)
        ids = []
        for text in texts:
            toks = self.tokenizer.tokenize(text) if text.strip() else []
            if toks and self.append_eod:
                toks.append(self.tokenizer.eod)
            ids.append(toks)
        return fidx, lineno, kind, None, ids, len(raw)


def _parse_line(raw: bytes, json_keys: Sequence[str]) -> Tuple[str, Optional[str], List[str]]:
    """Classify a raw line: ``(kind, detail for a message, texts per key)``."""
    if not raw.strip():
        return _BLANK, None, []
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return _BAD_JSON, f"not UTF-8 ({exc.reason} at byte {exc.start})", []
    except json.JSONDecodeError as exc:
        return _BAD_JSON, f"invalid JSON ({exc.msg} at column {exc.colno})", []
    if not isinstance(obj, dict):
        return _BAD_JSON, f"expected a JSON object, got {type(obj).__name__}", []
    texts = []
    for key in json_keys:
        if key not in obj:
            have = ", ".join(sorted(obj)[:8]) or "none"
            return _MISSING_KEY, f"no key {key!r} (keys: {have}); see --json-keys", []
        if not isinstance(obj[key], str):
            return _MISSING_KEY, f"key {key!r} holds {type(obj[key]).__name__}, not a string", []
        texts.append(obj[key])
    return _OK, None, texts


def iter_jsonl_texts(
    paths: Sequence[str],
    json_keys: Sequence[str] = ("text",),
    skip_bad_lines: bool = False,
    warn: Optional[Callable[[str], None]] = None,
    counts: Optional[Dict[str, int]] = None,
) -> Iterator[str]:
    """The texts of JSONL documents (each key of each line, in order), untokenized.

    Same line rules as :func:`preprocess_jsonl`: a bad line raises
    :class:`PreprocessError` naming ``file:line`` unless ``skip_bad_lines``; blank lines
    and blank texts are skipped. ``counts`` (if given) receives ``documents``,
    ``bad_lines``, ``blank_lines`` and ``empty``.
    """
    counts = counts if counts is not None else {}
    for k in ("documents", "bad_lines", "blank_lines", "empty"):
        counts.setdefault(k, 0)
    for fidx, lineno, raw in _read_lines(paths):
        kind, detail, texts = _parse_line(raw, json_keys)
        if kind == _BLANK:
            counts["blank_lines"] += 1
            continue
        if kind != _OK:
            where = f"{paths[fidx]}:{lineno}"
            if not skip_bad_lines:
                raise PreprocessError(f"{where}: {detail}; fix the line or pass --skip-bad-lines")
            counts["bad_lines"] += 1
            if warn is not None:
                warn(f"skipping {where}: {detail}")
            continue
        for text in texts:
            if text.strip():
                counts["documents"] += 1
                yield text
            else:
                counts["empty"] += 1


_WORKER_ENCODER: Optional[_LineEncoder] = None


def _init_worker(spec: TokenizerSpec, json_keys: Sequence[str], append_eod: bool) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = _LineEncoder(spec, json_keys, append_eod)


def _encode_in_worker(item):
    return _WORKER_ENCODER(item)


def _read_lines(paths: Sequence[str]) -> Iterator[Tuple[int, int, bytes]]:
    """``(file index, 1-based line number, raw bytes)`` for every line of every file."""
    for fidx, path in enumerate(paths):
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                yield fidx, lineno, raw


class _AtomicIndexedWriter:
    """``IndexedDatasetBuilder`` writing to temporary names, renamed into place on commit.

    A failed or interrupted run leaves no ``.bin/.idx`` pair behind that looks complete.
    """

    def __init__(self, prefix: str, dtype) -> None:
        from megatron.core.datasets.indexed_dataset import (  # megatron-core on first use
            IndexedDatasetBuilder,  # torch-free --help
        )

        self.prefix = prefix
        self.dtype = dtype
        tag = f".tmp-{os.getpid()}"
        self.tmp_bin, self.tmp_idx = prefix + ".bin" + tag, prefix + ".idx" + tag
        self.builder = IndexedDatasetBuilder(self.tmp_bin, dtype=dtype)
        self.documents = 0
        self.tokens = 0

    def add(self, ids: List[int]) -> None:
        self.builder.add_document(np.asarray(ids, dtype=self.dtype), [len(ids)])
        self.documents += 1
        self.tokens += len(ids)

    def commit(self) -> None:
        self.builder.finalize(self.tmp_idx)
        os.replace(self.tmp_bin, self.prefix + ".bin")
        os.replace(self.tmp_idx, self.prefix + ".idx")

    def abort(self) -> None:
        try:
            self.builder.data_file.close()
        except Exception:  # noqa: BLE001 - best effort while already failing
            pass
        for path in (self.tmp_bin, self.tmp_idx):
            if os.path.exists(path):
                os.remove(path)


class _Progress:
    """A progress bar on ``stream``: bytes done of the input total, documents/s, MB/s."""

    def __init__(self, total_bytes: int, stream: Optional[TextIO], log_interval: int) -> None:
        self.total = max(1, total_bytes)
        self.stream = stream
        self.interval = max(1, log_interval)
        self.start = time.perf_counter()
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self._next = self.interval
        self._last: Tuple[int, int] = (-1, -1)

    def update(self, docs: int, done_bytes: int, final: bool = False) -> None:
        if self.stream is None or (docs < self._next and not final):
            return
        if final and self._last == (docs, done_bytes):  # the bar already shows the end
            if self.tty:
                self.stream.write("\n")
            return
        self._next = docs + self.interval
        self._last = (docs, done_bytes)
        secs = max(time.perf_counter() - self.start, 1e-9)
        frac = min(1.0, done_bytes / self.total)
        bar = "#" * int(frac * 30) + "-" * (30 - int(frac * 30))
        line = (f"[{bar}] {100 * frac:5.1f}%  {docs:,} docs  {docs / secs:,.0f} docs/s  "
                f"{done_bytes / secs / 1e6:.2f} MB/s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def output_prefix_for_key(output_prefix: str, key: str) -> str:
    """Megatron-LM's naming: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def preprocess_jsonl(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer: TokenizerSpec,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int = 1,
    skip_bad_lines: bool = False,
    log_interval: int = 10000,
    progress: Optional[TextIO] = None,
    warn: Optional[Callable[[str], None]] = None,
    max_warnings: int = 20,
) -> PreprocessSummary:
    """Tokenize JSONL documents into one indexed dataset per JSON key.

    Each non-blank line of each input is a JSON object; ``obj[key]`` (a string) is one
    document of the dataset ``output_prefix_for_key(output_prefix, key)``, written as one
    sequence of token ids (``tokenizer.eod`` appended when ``append_eod``) with the
    smallest integer dtype that holds the vocabulary (uint16 below 65500 ids, else int32).
    Output order is input order whatever ``workers`` is, so the files are reproducible.

    Bad lines (not UTF-8, not JSON, not an object, a key missing or not a string) raise
    :class:`PreprocessError` naming ``file:line``, unless ``skip_bad_lines``: then each is
    reported through ``warn`` (the first ``max_warnings``) and counted. Blank lines are
    counted and ignored. Empty documents (blank text) are skipped and counted per key.
    Nothing is written unless the run completes.

    Args:
        workers: tokenizer processes (``multiprocessing.Pool``); 1 runs in this process.
        progress: stream for the progress bar (None: no bar).
    """
    t0 = time.perf_counter()
    keys = list(json_keys)
    if not keys:
        raise PreprocessError("--json-keys is empty; pass e.g. --json-keys text")
    for path in inputs:
        if not os.path.isfile(path):
            raise PreprocessError(f"--input {path}: no such file")
    from megatron.core.datasets.indexed_dataset import DType  # torch-free --help

    encoder = _LineEncoder(tokenizer, keys, append_eod)
    dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    prefixes = {k: output_prefix_for_key(output_prefix, k) for k in keys}
    summary = PreprocessSummary(
        output_prefixes=prefixes,
        skipped_empty={k: 0 for k in keys},
        documents_written={k: 0 for k in keys},
        tokens_written={k: 0 for k in keys},
    )
    writers = {k: _AtomicIndexedWriter(prefixes[k], dtype) for k in keys}
    bar = _Progress(sum(os.path.getsize(p) for p in inputs), progress, log_interval)
    warned = 0
    done_bytes = 0
    try:
        for fidx, lineno, kind, detail, ids, nbytes in _encoded_lines(
            inputs, encoder, tokenizer, workers
        ):
            summary.lines += 1
            done_bytes += nbytes
            if kind == _BLANK:
                summary.blank_lines += 1
                continue
            if kind != _OK:
                where = f"{inputs[fidx]}:{lineno}"
                if not skip_bad_lines:
                    raise PreprocessError(
                        f"{where}: {detail}; fix the line or pass --skip-bad-lines to skip "
                        f"such lines (they are counted in the summary)"
                    )
                if kind == _BAD_JSON:
                    summary.skipped_bad_json += 1
                else:
                    summary.skipped_missing_key += 1
                warned += 1
                if warn is not None and warned <= max_warnings:
                    more = " (further bad lines are only counted)" if warned == max_warnings else ""
                    warn(f"skipping {where}: {detail}{more}")
                continue
            for key, toks in zip(keys, ids):
                if not toks:
                    summary.skipped_empty[key] += 1
                    continue
                writers[key].add(toks)
            bar.update(max(w.documents for w in writers.values()), done_bytes)
        for key, w in writers.items():
            w.commit()
            summary.documents_written[key] = w.documents
            summary.tokens_written[key] = w.tokens
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    bar.update(max(summary.documents_written.values()), done_bytes, final=True)
    summary.seconds = time.perf_counter() - t0
    return summary


def _encoded_lines(inputs, encoder: _LineEncoder, spec: TokenizerSpec, workers: int):
    """Encoded lines in input order, from ``workers`` processes (or this one)."""
    lines = _read_lines(inputs)
    if workers <= 1:
        yield from map(encoder, lines)
        return
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    initargs = (spec, encoder.json_keys, encoder.append_eod)
    # Pool.imap would read the whole input ahead into memory; keep two blocks in flight.
    block_lines = 256 * workers
    with ctx.Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        pending: Deque = collections.deque()
        while True:
            block = list(itertools.islice(lines, block_lines))
            if block:
                pending.append(pool.map_async(_encode_in_worker, block, chunksize=32))
            if pending and (len(pending) > 1 or not block):
                yield from pending.popleft().get()
            if not block and not pending:
                return


__all__ = [
    "PreprocessError", "PreprocessSummary", "TokenizerSpec", "iter_jsonl_texts",
    "output_prefix_for_key", "preprocess_jsonl",
]
