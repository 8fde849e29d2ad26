"""The data pipeline: JSONL -> indexed dataset -> GPT samples -> micro-batches -> CP shards.

Stages, each with one entry point:

1. :func:`preprocess_jsonl` tokenizes JSONL documents into megatron-core's indexed format
   (``PREFIX.bin`` token ids, ``PREFIX.idx`` lengths/offsets) through
   ``IndexedDatasetBuilder``; ``tools/preprocess_data.py`` is its command line.
2. :func:`validate_data_config` checks every input before anything is built and raises
   :class:`DataConfigError` naming the flag or file at fault.
3. :func:`build_gpt_datasets` builds megatron-core ``GPTDataset`` splits (or
   ``MockGPTDataset``) through ``BlendedMegatronDatasetBuilder``.
4. :func:`build_data_iterator` yields full-sequence micro-batches with Megatron's pretraining
   sampler semantics.
5. :func:`shard_batch_for_cp` keeps the tokens of one context-parallel rank, using the
   layout of :mod:`megatron.usp.token_layout` (the single source of truth for which global
   positions a rank holds).

Batch layout (names used throughout)::

    tokens       [b, s] int64   input ids
    labels       [b, s] int64   tokens shifted left by one (next-token targets)
    loss_mask    [b, s] float32 1.0 where the label counts in the loss
    position_ids [b, s] int64   global positions 0..s-1 (never reset: see below)
    attention_mask None         attention is causal by construction; no [s, s] mask

After :func:`shard_batch_for_cp` every ``[b, s]`` tensor is ``[b, s/CP]``: chunk ``c`` then
chunk ``2*CP-1-c`` of ``2*CP`` (``c = u + U*r``), and ``position_ids`` hold exactly those
global positions, which is what megatron-core's ``RotaryEmbedding`` selects on that rank.

Packed documents: ``--reset-position-ids`` and ``--reset-attention-mask`` are refused.
megatron-core's ``RotaryEmbedding`` ignores ``position_ids`` (it rotates by global
position) and USP attention has no per-document mask, so attention would cross document
boundaries while the flags claim it does not. ``--eod-mask-loss`` works.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import math
import multiprocessing as mp
import os
import re
import struct
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

import numpy as np
import torch

from megatron.usp.token_layout import check_seq_divisible, shard_for_cp_rank

logger = logging.getLogger(__name__)

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""Batch entries with a sequence dimension (dim 1); the ones CP sharding cuts."""

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_VERSION = 1
_IDX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, #sequences, #documents
_IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}


class DataConfigError(ValueError):
    """Bad data input found at start-up. The message names the flag or file, and a fix."""


class PreprocessError(ValueError):
    """A JSONL line that cannot be turned into a document. Names the file and line."""


@dataclass
class DataConfig:
    """Data flags of GPT pretraining (Megatron-LM names).

    Attributes:
        data_path: ``--data-path``: prefixes of ``.bin/.idx`` pairs, optionally weighted:
            ``["prefix"]`` or ``["w1", "prefix1", "w2", "prefix2", ...]``; an entry holding
            spaces is split, so ``["0.3 a 0.7 b"]`` also works.
        split: ``--split``: train/valid/test weights, e.g. ``"969,30,1"``.
        mock_data: ``--mock-data``: synthetic tokens from ``MockGPTDataset``, no files.
        seq_length: ``--seq-length``: tokens per sample; divisible by ``2*U*R``.
        seed: ``--seed``: drives the document and sample shuffles.
        reset_position_ids: ``--reset-position-ids``: refused (see module docstring).
        reset_attention_mask: ``--reset-attention-mask``: refused (see module docstring).
        eod_mask_loss: ``--eod-mask-loss``: no loss on predicting from an EOD token.
        num_workers: ``--num-workers``: DataLoader worker processes per rank.
        data_cache_path: ``--data-cache-path``: where megatron-core caches its sample
            indices; ``None`` keeps megatron-core's default, ``PREFIX/cache/`` (a folder
            named like each prefix, beside its ``.bin``).
        micro_batch_size: ``--micro-batch-size``.
        global_batch_size: ``--global-batch-size``; ``None`` means micro x DP.
    """

    data_path: Optional[List[str]] = None
    split: str = "969,30,1"
    mock_data: bool = False
    seq_length: int = 1024
    seed: int = 1234
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    num_workers: int = 2
    data_cache_path: Optional[str] = None
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None


# =========================================================================== preprocessing
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
        from megatron.training.tokenizer import build_tokenizer

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
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

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
    from megatron.core.datasets.indexed_dataset import DType

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


# =========================================================================== index checks
@dataclass
class IndexedDatasetInfo:
    """What the ``.idx`` of one prefix says, checked against its ``.bin``.

    ``max_token_id`` / ``tokens_scanned`` come from :func:`scan_token_ids`;
    ``eod_endings`` counts, of ``eod_checked`` non-empty documents, those whose last
    token is the tokenizer's EOD.
    """

    prefix: str
    dtype: type
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray
    bin_bytes: int
    max_token_id: int = -1
    min_token_id: int = 0
    tokens_scanned: int = 0
    eod_checked: int = 0
    eod_endings: int = 0

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    @property
    def empty_documents(self) -> int:
        return int((self.sequence_lengths == 0).sum())


def _check_prefix_files(prefix: str, flag: str) -> Tuple[str, str]:
    """The ``.idx`` and ``.bin`` paths of ``prefix``; a DataConfigError if either is missing."""
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            raise DataConfigError(
                f"{flag} {prefix}: give the prefix without '{ext}', i.e. {flag} {prefix[:-4]}"
            )
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
    if missing:
        hint = ""
        import glob

        near = sorted(glob.glob(glob.escape(prefix) + "_*_document.idx"))
        if near:
            hint = f"; did you mean {flag} {near[0][:-4]} (tools/preprocess_data.py adds _KEY_document)?"
        raise DataConfigError(
            f"{flag} {prefix}: missing {' and '.join(missing)}; a dataset is a .bin/.idx pair "
            f"written by tools/preprocess_data.py{hint}"
        )
    return idx_path, bin_path


def inspect_indexed_dataset(prefix: str, flag: str = "--data-path") -> IndexedDatasetInfo:
    """Read and check the header and sizes of ``prefix.idx`` / ``prefix.bin``.

    Checks: both files exist; the ``.idx`` magic, version (1) and dtype code; its size is
    exactly header + 12 bytes per sequence + 8 per document entry (a truncated or
    foreign ``.idx`` fails); document indices start at 0 and end at the sequence count;
    the ``.bin`` size equals the token count times the dtype size (a truncated ``.bin``,
    or one from another run, fails). Reads only the ``.idx``.
    """
    idx_path, bin_path = _check_prefix_files(prefix, flag)
    idx_bytes = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_IDX_HEADER_BYTES)
    if len(head) < _IDX_HEADER_BYTES or head[:9] != _IDX_MAGIC:
        raise DataConfigError(
            f"{idx_path}: not a megatron indexed-dataset index (bad magic {head[:9]!r}); "
            f"re-create it with tools/preprocess_data.py"
        )
    (version,) = struct.unpack("<Q", head[9:17])
    code = head[17]
    n_seq, n_doc = struct.unpack("<QQ", head[18:34])
    if version != _IDX_VERSION:
        raise DataConfigError(f"{idx_path}: index version {version}, expected {_IDX_VERSION}")
    if code not in _IDX_DTYPES:
        raise DataConfigError(f"{idx_path}: unknown token dtype code {code}")
    dtype = _IDX_DTYPES[code]
    expect = _IDX_HEADER_BYTES + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if idx_bytes not in (expect, expect + n_seq):  # + n_seq: multimodal mode bytes
        raise DataConfigError(
            f"{idx_path}: {idx_bytes} bytes but its header ({n_seq} sequences, {n_doc - 1} "
            f"documents) needs {expect}: the file is truncated or corrupt; re-run "
            f"tools/preprocess_data.py"
        )
    mm = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(mm, dtype=np.int32, count=n_seq, offset=_IDX_HEADER_BYTES)
    pointers = np.frombuffer(mm, dtype=np.int64, count=n_seq,
                             offset=_IDX_HEADER_BYTES + 4 * n_seq)
    doc_idx = np.frombuffer(mm, dtype=np.int64, count=n_doc,
                            offset=_IDX_HEADER_BYTES + 12 * n_seq)
    if n_doc < 1 or doc_idx[0] != 0 or doc_idx[-1] != n_seq:
        raise DataConfigError(
            f"{idx_path}: document index does not span the {n_seq} sequences; the file is "
            f"corrupt; re-run tools/preprocess_data.py"
        )
    info = IndexedDatasetInfo(prefix, dtype, lengths, pointers, doc_idx,
                              os.path.getsize(bin_path))
    itemsize = np.dtype(dtype).itemsize
    need = info.num_tokens * itemsize
    if n_seq and (pointers[0] != 0 or pointers[-1] + int(lengths[-1]) * itemsize != need):
        raise DataConfigError(f"{idx_path}: sequence offsets disagree with the lengths: corrupt")
    if info.bin_bytes != need:
        what = "truncated" if info.bin_bytes < need else "longer than its index says"
        raise DataConfigError(
            f"{bin_path}: {info.bin_bytes} bytes but {idx_path} describes {info.num_tokens} "
            f"tokens of {itemsize} bytes = {need}: the .bin is {what} (or the two files come "
            f"from different runs); re-run tools/preprocess_data.py"
        )
    return info


def scan_token_ids(
    info: IndexedDatasetInfo, eod: Optional[int] = None, window: int = 1 << 16,
    windows: int = 64, eod_docs: int = 256,
) -> IndexedDatasetInfo:
    """Find the largest token id in (a sample of) the ``.bin``; count EOD document endings.

    Datasets of at most ``window * windows`` tokens (4M by default) are scanned whole;
    larger ones in ``windows`` evenly spaced windows of ``window`` tokens, which bounds the
    read at a few MB while still covering the whole file. With ``eod`` given, the last
    token of the first ``eod_docs`` non-empty documents is compared with it.
    """
    total = info.num_tokens
    if total == 0:
        return info
    data = np.memmap(info.prefix + ".bin", mode="r", dtype=info.dtype, shape=(total,))
    if total <= window * windows:
        starts = range(0, total, window)
    else:
        starts = [int(i * (total - window) / (windows - 1)) for i in range(windows)]
    top, bottom, seen = -1, 0, 0
    for s in starts:
        chunk = data[s:s + window]
        top, bottom = max(top, int(chunk.max())), min(bottom, int(chunk.min()))
        seen += len(chunk)
    info.max_token_id, info.min_token_id, info.tokens_scanned = top, bottom, seen
    if eod is not None:
        itemsize = np.dtype(info.dtype).itemsize
        nonempty = np.flatnonzero(info.sequence_lengths[: eod_docs * 4] > 0)[:eod_docs]
        last = (info.sequence_pointers[nonempty] // itemsize
                + info.sequence_lengths[nonempty] - 1)
        info.eod_checked = len(nonempty)
        info.eod_endings = int((data[last] == eod).sum()) if len(nonempty) else 0
    del data
    return info


# =========================================================================== validation
@dataclass
class DataReport:
    """What :func:`validate_data_config` found: per-prefix facts and non-fatal warnings."""

    prefixes: List[str] = field(default_factory=list)
    weights: Optional[List[float]] = None
    datasets: List[IndexedDatasetInfo] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """``--data-path`` -> (prefixes, weights or None), Megatron's "[w1] p1 [w2] p2" format."""
    items = [tok for entry in data_path for tok in str(entry).split()]
    if not items:
        raise DataConfigError("--data-path is empty; pass one or more dataset prefixes")

    def as_weight(s: str) -> Optional[float]:
        try:
            return float(s)
        except ValueError:
            return None

    numeric = [as_weight(s) is not None for s in items]
    if len(items) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2]):
        weights = [as_weight(s) for s in items[0::2]]
        bad = [w for w in weights if not (w > 0 and math.isfinite(w))]
        if bad:
            raise DataConfigError(
                f"--data-path weights must be positive numbers; got {bad[0]} in {items}"
            )
        return items[1::2], weights
    if any(numeric):
        raise DataConfigError(
            f"--data-path {' '.join(items)}: expected either prefixes only, or 'weight prefix' "
            f"pairs, e.g. --data-path 0.7 /data/a_text_document 0.3 /data/b_text_document"
        )
    return items, None


def parse_split(split: str) -> List[float]:
    """``--split`` "969,30,1" -> normalised [train, valid, test] weights."""
    parts = [p for p in re.split(r"[,/]", str(split).strip()) if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 or not math.isfinite(v) for v in values):
        raise DataConfigError(
            f"--split {split!r}: expected up to three non-negative train,valid,test weights, "
            f"e.g. --split 969,30,1"
        )
    values += [0.0] * (3 - len(values))
    if values[0] <= 0:
        raise DataConfigError(f"--split {split!r}: the train weight must be > 0; e.g. 969,30,1")
    total = sum(values)
    return [v / total for v in values]


def _check_cache_dir(cfg: DataConfig, prefixes: Sequence[str]) -> None:
    """The folder(s) megatron-core will write its sample indices to must be writable."""
    if cfg.data_cache_path is not None:
        try:
            os.makedirs(cfg.data_cache_path, exist_ok=True)
        except OSError as exc:
            raise DataConfigError(f"--data-cache-path {cfg.data_cache_path}: {exc}") from None
        targets = [cfg.data_cache_path]
    else:
        targets = sorted({os.path.dirname(os.path.abspath(p)) for p in prefixes})
    for target in targets:
        if not os.access(target, os.W_OK):
            raise DataConfigError(
                f"--data-cache-path: the sample-index cache would be written under {target}, "
                f"which is not writable; pass --data-cache-path DIR with a writable DIR"
            )


def _validate_scalars(cfg: DataConfig, tokenizer, cp_size: int) -> None:
    if cfg.reset_position_ids or cfg.reset_attention_mask:
        flag = "--reset-position-ids" if cfg.reset_position_ids else "--reset-attention-mask"
        raise DataConfigError(
            f"{flag} is not supported with USP: megatron-core's RotaryEmbedding rotates by "
            f"global position (it ignores position_ids) and USP attention has no per-document "
            f"mask, so attention would still cross EOD boundaries. Drop {flag}; documents are "
            f"packed with causal attention across them (Megatron's default). --eod-mask-loss "
            f"is supported"
        )
    if not isinstance(cfg.seq_length, int) or cfg.seq_length < 1:
        raise DataConfigError(f"--seq-length {cfg.seq_length!r} must be a positive integer")
    try:
        check_seq_divisible(cfg.seq_length, cp_size, "--seq-length")
    except ValueError as exc:
        raise DataConfigError(str(exc)) from None
    if cfg.micro_batch_size < 1:
        raise DataConfigError(f"--micro-batch-size {cfg.micro_batch_size} must be >= 1")
    gbs = cfg.global_batch_size
    if gbs is not None and (gbs < cfg.micro_batch_size or gbs % cfg.micro_batch_size):
        raise DataConfigError(
            f"--global-batch-size {gbs} must be a multiple of --micro-batch-size "
            f"{cfg.micro_batch_size} (times the data-parallel size)"
        )
    if cfg.num_workers < 0:
        raise DataConfigError(f"--num-workers {cfg.num_workers} must be >= 0 (0: load in-line)")
    eod, vocab = tokenizer.eod, tokenizer.vocab_size
    if eod is None or not 0 <= int(eod) < vocab:
        raise DataConfigError(
            f"the tokenizer's EOD id {eod} is outside its vocabulary of {vocab}; check "
            f"--tokenizer-model"
        )


def _check_dataset(info: IndexedDatasetInfo, tokenizer, report: DataReport) -> None:
    bin_path = info.prefix + ".bin"
    if info.num_tokens == 0:
        raise DataConfigError(
            f"{bin_path}: the dataset has no tokens ({info.num_documents} documents, all "
            f"empty); re-create it from non-empty text with tools/preprocess_data.py"
        )
    scan_token_ids(info, eod=tokenizer.eod)
    vocab = tokenizer.vocab_size
    if info.min_token_id < 0:
        raise DataConfigError(f"{bin_path} holds a negative token id: corrupt; re-create it")
    if info.max_token_id >= vocab:
        raise DataConfigError(
            f"{bin_path} holds token id {info.max_token_id}, but the tokenizer "
            f"({getattr(tokenizer, 'path', None) or type(tokenizer).__name__}) has {vocab} ids: "
            f"the dataset was made with another tokenizer. Pass the --tokenizer-model used by "
            f"tools/preprocess_data.py, or re-run it with this one"
        )
    if info.empty_documents:
        report.warnings.append(
            f"{bin_path}: {info.empty_documents} of {info.num_documents} documents are empty "
            f"(they contribute no tokens)"
        )
    if info.eod_checked and info.eod_endings == 0:
        report.warnings.append(
            f"{bin_path}: none of the first {info.eod_checked} documents ends with the "
            f"tokenizer's EOD id {tokenizer.eod}: it was preprocessed with --no-append-eod or "
            f"with a different tokenizer"
        )


def validate_data_config(cfg: DataConfig, tokenizer, cp_size: int) -> DataReport:
    """Check every data input before any dataset is built; raise :class:`DataConfigError`.

    Checked, in order: the refused packing flags; ``--seq-length`` positive and divisible
    by ``2*cp_size`` (``cp_size = U*R``); batch sizes; the tokenizer's EOD; ``--mock-data``
    versus ``--data-path``; ``--split``; the ``--data-path`` format and weights; for each
    prefix, :func:`inspect_indexed_dataset` (files present, ``.idx`` header and size,
    ``.bin`` size) and :func:`scan_token_ids` (largest token id below the tokenizer's
    vocabulary size; the whole ``.bin`` up to 4M tokens, 64 windows of 64K tokens beyond);
    a dataset with no tokens is an error, empty documents and missing EODs are warnings
    in the returned report; finally that the index cache directory is writable.
    """
    _validate_scalars(cfg, tokenizer, cp_size)
    report = DataReport()
    if cfg.mock_data:
        if cfg.data_path:
            raise DataConfigError(
                "--mock-data and --data-path exclude one another; drop one of them"
            )
        return report
    if not cfg.data_path:
        raise DataConfigError(
            "no data: pass --data-path PREFIX (a .bin/.idx pair from tools/preprocess_data.py), "
            "--mock-data, or neither flag to train on the built-in default corpus"
        )
    parse_split(cfg.split)
    report.prefixes, report.weights = parse_data_path(cfg.data_path)
    for prefix in report.prefixes:
        info = inspect_indexed_dataset(prefix, "--data-path")
        _check_dataset(info, tokenizer, report)
        report.datasets.append(info)
    _check_cache_dir(cfg, report.prefixes)
    for msg in report.warnings:
        logger.warning(msg)
    return report


# =========================================================================== datasets
def _check_split_tokens(
    prefixes: Sequence[str], split: str, sizes: Sequence[Optional[int]]
) -> None:
    """Each split that will be sampled must own tokens, or megatron-core loops forever.

    Mirrors megatron-core's document ranges: split ``i`` of a prefix with ``n`` documents
    is ``[round(lo_i * n), round(hi_i * n))``.
    """
    weights = parse_split(split)
    bounds = np.concatenate([[0.0], np.cumsum(weights)])
    names = ("train", "valid", "test")
    for prefix in prefixes:
        info = inspect_indexed_dataset(prefix, "--data-path")
        n = info.num_sequences
        for i, name in enumerate(names):
            if weights[i] == 0 or sizes[i] is None:
                continue
            beg, end = int(round(bounds[i] * n)), int(round(bounds[i + 1] * n))
            tokens = int(info.sequence_lengths[beg:end].sum(dtype=np.int64))
            if tokens == 0:
                raise DataConfigError(
                    f"--split {split}: the {name} split of {prefix} gets documents "
                    f"[{beg}, {end}) of {n}, which hold no tokens. Give {name} a larger share "
                    f"(e.g. --split 90,5,5), set its weight to 0, or use more documents"
                )


def build_gpt_datasets(
    cfg: DataConfig,
    tokenizer,
    train_valid_test_num_samples: Sequence[Optional[int]],
    is_built_on_rank: Optional[Callable[[], bool]] = None,
):
    """Build (train, valid, test) ``GPTDataset`` splits; a split of weight 0 is ``None``.

    Uses ``BlendedMegatronDatasetBuilder`` with ``GPTDatasetConfig`` (``MockGPTDataset``
    when ``cfg.mock_data``); a weighted ``--data-path`` gives ``BlendedDataset`` splits.
    Samples are ``seq_length`` tokens (plus one for the shifted labels), documents packed
    back to back; no ``[s, s]`` attention mask is built (at 128K it would be 64 GiB).

    Must be called on every rank (megatron-core builds the index cache on global rank 0
    behind a barrier). ``is_built_on_rank`` defaults to every rank: each rank of a CP
    group (and of a TP group) reads the same samples itself, no broadcast.

    Call :func:`validate_data_config` first; this also refuses splits that would be
    sampled but own no tokens.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    sizes = list(train_valid_test_num_samples)
    if len(sizes) != 3:
        raise ValueError("train_valid_test_num_samples must have three entries")
    blend = None
    if not cfg.mock_data:
        prefixes, weights = parse_data_path(cfg.data_path or [])
        _check_split_tokens(prefixes, cfg.split, sizes)
        blend = (prefixes, weights)
    config = GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.seq_length,
        blend=blend,
        split=None if cfg.mock_data else cfg.split,
        path_to_cache=cfg.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    cls = MockGPTDataset if cfg.mock_data else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        cls, sizes, is_built_on_rank or (lambda: True), config
    )
    with _process_group_for_single_process_build():
        train, valid, test = builder.build()
    return train, valid, test


@contextlib.contextmanager
def _process_group_for_single_process_build():
    """Outside a distributed job, run the build inside a one-process gloo group.

    megatron-core 0.16.1's ``BlendedDataset._build_indices`` calls
    ``torch.distributed.get_rank()`` without checking that a process group exists, so a
    weighted blend cannot be built by a single-process tool (a benchmark, a notebook).
    The group lives only for the build; inside a distributed job nothing is created.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="usp-data-pg-") as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


# =========================================================================== iteration
class PretrainingSampler:
    """Megatron's pretraining batch sampler: each DP rank's slice of each global batch.

    Sample indices ``consumed, consumed+1, ...`` are cut into groups of
    ``micro_batch_size * dp_size``; DP rank ``d`` takes positions
    ``[d*micro, (d+1)*micro)`` of each group. A trailing partial group is dropped. Resuming
    from ``consumed_samples`` continues exactly where an uninterrupted run would be.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size {micro_batch_size} must be >= 1")
        if total_samples <= 0:
            raise DataConfigError("the dataset has no samples; check --data-path and --split")
        if consumed_samples >= total_samples:
            raise DataConfigError(
                f"consumed samples {consumed_samples} (from the checkpoint) are past the "
                f"dataset's {total_samples} samples: the dataset was built for a shorter run; "
                f"rebuild it with the new --train-iters/--train-samples"
            )
        self.total = total_samples
        self.consumed = consumed_samples
        self.micro = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.micro * self.dp_size)

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro * self.dp_size
        first = self.consumed + self.dp_rank * self.micro
        for k in range(len(self)):
            start = first + k * step
            yield list(range(start, start + self.micro))


def collate_samples(samples: Sequence[Dict]) -> Dict[str, Optional[torch.Tensor]]:
    """Stack per-sample ``[s]`` tensors to ``[b, s]``; ``attention_mask`` is None."""
    batch: Dict[str, Optional[torch.Tensor]] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if isinstance(values[0], torch.Tensor):
            batch[key] = torch.stack(values)
        else:  # e.g. BlendedDataset's numpy "dataset_id"
            batch[key] = torch.as_tensor(np.asarray(values))
    batch["attention_mask"] = None
    return batch


def build_data_iterator(
    dataset,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    consumed_samples: int = 0,
    num_workers: int = 2,
) -> Optional[Iterator[Dict[str, Optional[torch.Tensor]]]]:
    """An iterator over this DP rank's full-sequence micro-batches (None for no dataset).

    Each ``next()`` gives a dict of ``[micro_batch_size, seq_length]`` tensors (see the
    module docstring for the keys). DP slicing follows :class:`PretrainingSampler`; the
    order is deterministic (megatron-core's shuffle is seeded) and independent of
    ``num_workers``. Every rank of one CP group (and TP group) has the same DP rank, so
    gets the same full micro-batch and keeps its part with :func:`shard_batch_for_cp`.
    Iteration ends after the last complete global batch.
    """
    if dataset is None:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_samples,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
    )
    return iter(loader)


# =========================================================================== CP sharding
def shard_batch_for_cp(batch: Dict, cp_rank: int, cp_size: int) -> Dict:
    """Keep the tokens context-parallel rank ``cp_rank`` holds, on the sequence dim (1).

    ``[b, s]`` -> ``[b, s/cp_size]`` for each of :data:`SEQUENCE_KEYS`, through
    :func:`megatron.usp.token_layout.shard_for_cp_rank` (chunks ``c`` and ``2*cp_size-1-c`` of
    ``2*cp_size``); other entries are passed through; ``attention_mask`` must be None.
    Returns a new dict; ``cp_size == 1`` returns the tensors unchanged.
    """
    if batch.get("attention_mask") is not None:
        raise ValueError("shard_batch_for_cp expects attention_mask None (attention is causal)")
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        if key in batch and batch[key] is not None:
            try:
                out[key] = shard_for_cp_rank(batch[key], 1, cp_rank, cp_size)
            except ValueError as exc:
                raise DataConfigError(f"{key}: {exc}; see --seq-length") from None
    return out


__all__ = [
    "DataConfig", "DataConfigError", "DataReport", "IndexedDatasetInfo", "PreprocessError",
    "PreprocessSummary", "PretrainingSampler", "SEQUENCE_KEYS", "TokenizerSpec",
    "build_data_iterator", "build_gpt_datasets", "collate_samples", "inspect_indexed_dataset",
    "output_prefix_for_key", "parse_data_path", "parse_split", "preprocess_jsonl",
    "scan_token_ids", "shard_batch_for_cp", "validate_data_config",
]
