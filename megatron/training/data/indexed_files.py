"""Reading and checking megatron-core indexed datasets (``PREFIX.idx`` / ``PREFIX.bin``).

:func:`inspect_indexed_dataset` parses an ``.idx`` itself (magic, version, dtype, sequence
lengths and offsets, document index) and checks it against the size of its ``.bin``;
:func:`scan_token_ids` reads (a sample of) the ``.bin`` for its token-id range and EOD
endings. Both only read; a missing, truncated or foreign file raises
:class:`~megatron.training.data.errors.DataConfigError` naming the file and the fix.
"""

from __future__ import annotations

import glob
import os
import struct
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from megatron.training.data.errors import DataConfigError

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_VERSION = 1
_IDX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, #sequences, #documents
_IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}


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


def check_prefix_files(prefix: str, flag: str) -> Tuple[str, str]:
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
    idx_path, bin_path = check_prefix_files(prefix, flag)
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


__all__ = ["IndexedDatasetInfo", "inspect_indexed_dataset", "scan_token_ids"]
