"""Per-file checksums of a checkpoint: written at save, verified at load.

A checkpoint directory holds ``checksums.json``::

    {"version": 2, "algorithm": "xxh3_128", "chunk_bytes": 67108864,
     "files": {"__0_0.distcp": {"bytes": 488688, "xxh3_128": "5f0c..."}, ...}}

covering every other file in the directory. XXH3-128 (the ``xxhash`` package) hashes at
~8-9 GB/s per core in memory (BLAKE2b from the standard library: 0.47 GB/s, too slow for a
12 GB checkpoint), so the cost is reading the bytes back. megatron-core's writer leaves a
few large files per rank (the 0.85B model: two of ~6 GB), so hashing file by file would use
two cores; instead each file is cut into ``chunk_bytes`` pieces, the pieces are hashed by a
thread pool (``xxhash`` releases the GIL), and a file's digest is the XXH3-128 of its
pieces' digests in order (a two-level tree: the same bytes always give the same digest, and
a change anywhere changes it). At save and load alike the files are spread over the ranks
(:func:`files_of_rank`), so each rank reads about 1/world of the checkpoint, mostly the
files it wrote itself (still in its page cache).

A version-1 manifest (one streaming XXH3-128 over the whole file, before the chunked
scheme) is still verified.

A file whose bytes changed without changing its size loads silently otherwise: PyTorch's
``.metadata`` holds offsets and lengths, not checksums.
"""

from __future__ import annotations

import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, List, Optional

import xxhash

from megatron.errors import UsageError

MANIFEST = "checksums.json"
ALGORITHM = "xxh3_128"
VERSION = 2
CHUNK_BYTES = 64 << 20
"""Piece of a file hashed by one thread (version 2)."""
_READ = 16 << 20


class ChecksumMismatch(UsageError, ValueError):
    """A file's bytes differ from what the manifest recorded at save."""


def _hash_range(path: str, start: int, length: Optional[int]) -> bytes:
    """XXH3-128 digest of ``length`` bytes of ``path`` from ``start`` (None: to the end).

    The bytes are hashed straight from a read-only memory map (the page cache, for files
    just written): no copy into a buffer, which made hashing 2-5x faster than ``readinto``
    on our CPU machine; a file that cannot be mapped is read instead."""
    size = os.path.getsize(path)
    end = size if length is None else start + length
    if end > size:
        raise OSError(f"{path} ended {end - size} bytes early while being hashed")
    if end == start:
        return xxhash.xxh3_128(b"").digest()
    with open(path, "rb", buffering=0) as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            mapped = None
        if mapped is not None:
            with mapped:
                if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
                    mapped.madvise(mmap.MADV_SEQUENTIAL)
                view = memoryview(mapped)
                piece = view[start:end]
                try:
                    return xxhash.xxh3_128(piece).digest()
                finally:
                    piece.release()
                    view.release()
        h = xxhash.xxh3_128()
        buf = bytearray(min(_READ, end - start))
        f.seek(start)
        left = end - start
        while left > 0:
            n = f.readinto(memoryview(buf)[:min(len(buf), left)])
            if not n:
                raise OSError(f"{path} ended {left} bytes early while being hashed")
            h.update(memoryview(buf)[:n])
            left -= n
        return h.digest()


def _threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def hash_files(root: str, names: Iterable[str], chunk_bytes: Optional[int] = CHUNK_BYTES
               ) -> Dict[str, Dict[str, object]]:
    """{name: {"bytes": size, ALGORITHM: digest}} for ``names`` under ``root``; the pieces
    of all files go through one thread pool. ``chunk_bytes=None``: the version-1 digest."""
    names = sorted(names)
    sizes = {n: os.path.getsize(os.path.join(root, n)) for n in names}
    tasks = []   # (name, start, length)
    for n in names:
        if chunk_bytes is None:
            tasks.append((n, 0, None))
        else:
            pieces = max(1, -(-sizes[n] // chunk_bytes))
            tasks += [(n, i * chunk_bytes, min(chunk_bytes, sizes[n] - i * chunk_bytes))
                      for i in range(pieces)]
    with ThreadPoolExecutor(_threads()) as pool:
        digests = list(pool.map(lambda t: _hash_range(os.path.join(root, t[0]), t[1], t[2]),
                                tasks))
    pieces: Dict[str, List[bytes]] = {n: [] for n in names}
    for (name, _, _), d in zip(tasks, digests):   # tasks are in file, then piece order
        pieces[name].append(d)
    return {n: {"bytes": sizes[n],
                ALGORITHM: pieces[n][0].hex() if chunk_bytes is None
                else xxhash.xxh3_128(b"".join(pieces[n])).hexdigest()}
            for n in names}


def checkpoint_files(root: str) -> List[str]:
    """Every file of a checkpoint directory the manifest covers (all but itself), relative."""
    out = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def files_of_rank(names: List[str], rank: int, world: int) -> List[str]:
    """The share of ``names`` that ``rank`` hashes.

    megatron-core's writer names rank r's data files ``__r_<n>.distcp``; those go to rank r
    (when it exists), the rest round-robin by sorted position, so every file has exactly
    one rank and the split needs no communication.
    """
    mine, rest = [], []
    for name in names:
        owner = _writer_rank(name)
        if owner is not None and owner < world:
            if owner == rank:
                mine.append(name)
        else:
            rest.append(name)
    return mine + [n for i, n in enumerate(rest) if i % world == rank]


def _writer_rank(name: str) -> Optional[int]:
    if not (name.startswith("__") and name.endswith(".distcp")):
        return None
    head = name[2:].split("_", 1)[0]
    return int(head) if head.isdigit() else None


class Manifest(dict):
    """``{name: {"bytes": ..., ALGORITHM: ...}}`` as read from ``checksums.json``, with the
    piece size its digests were made with (``None``: a version-1 manifest)."""

    chunk_bytes: Optional[int] = CHUNK_BYTES


def write_manifest(root: str, entries: Dict[str, Dict[str, object]],
                   chunk_bytes: int = CHUNK_BYTES) -> None:
    """Write ``root/checksums.json`` (fsynced) for ``entries`` (digests of
    :func:`hash_files` with ``chunk_bytes``), which must cover every file."""
    missing = sorted(set(checkpoint_files(root)) - set(entries))
    if missing:
        raise ValueError(f"checksums of {root} lack {missing}")
    path = os.path.join(root, MANIFEST)
    with open(path, "w") as f:
        json.dump({"version": VERSION, "algorithm": ALGORITHM, "chunk_bytes": chunk_bytes,
                   "files": entries}, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(root: str) -> Optional[Manifest]:
    """The manifest's files, or None for a checkpoint saved without one (before checksums);
    ChecksumMismatch when it is unreadable."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("algorithm") != ALGORITHM:
            raise ValueError(f"algorithm {data.get('algorithm')!r}")
        version = data.get("version")
        if version not in (1, 2):
            raise ValueError(f"version {version!r}; this installation reads 1 and 2")
        manifest = Manifest(data["files"])
        manifest.chunk_bytes = None if version == 1 else int(data["chunk_bytes"])
        if manifest.chunk_bytes is not None and manifest.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes {manifest.chunk_bytes}")
        return manifest
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ChecksumMismatch(f"{MANIFEST} is unreadable ({exc})") from None


def verify_files(root: str, manifest: Dict[str, Dict[str, object]], names: List[str]
                 ) -> Optional[str]:
    """The first of ``names`` whose size or checksum differs from ``manifest``, described
    in one sentence naming the file; None when all match."""
    sizes = {}
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        sizes[name] = os.path.getsize(path)
        if sizes[name] != manifest[name]["bytes"]:
            return f"{name} holds {sizes[name]} bytes, {manifest[name]['bytes']} were saved"
    got = hash_files(root, names, getattr(manifest, "chunk_bytes", CHUNK_BYTES))
    for name in sorted(names):
        if got[name][ALGORITHM] != manifest[name][ALGORITHM]:
            return (f"{name} does not match its checksum ({ALGORITHM} "
                    f"{got[name][ALGORITHM]}, {manifest[name][ALGORITHM]} at save): its "
                    f"bytes changed after the save")
    return None
