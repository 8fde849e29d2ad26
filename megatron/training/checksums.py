"""Per-file checksums of a checkpoint: written at save, verified at load.

A checkpoint directory holds ``checksums.json``::

    {"version": 1, "algorithm": "xxh3_128",
     "files": {"__0_0.distcp": {"bytes": 488688, "xxh3_128": "5f0c..."}, ...}}

covering every other file in the directory. XXH3-128 (the ``xxhash`` package) hashes at
~9 GB/s per core in memory on our CPU machine (BLAKE2b from the standard library: 0.47 GB/s,
too slow for a 12 GB checkpoint), so the cost is the read; files are hashed by a thread
pool (the hash releases the GIL) and, at save and load alike, spread over the ranks (see
:func:`files_of_rank`), so each rank reads about 1/world of the checkpoint, mostly the
files it wrote itself (still in its page cache).

A file whose bytes changed without changing its size loads silently otherwise: PyTorch's
``.metadata`` holds offsets and lengths, not checksums.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, List, Optional

MANIFEST = "checksums.json"
ALGORITHM = "xxh3_128"
VERSION = 1
_CHUNK = 16 << 20


class ChecksumMismatch(ValueError):
    """A file's bytes differ from what the manifest recorded at save."""


def hash_file(path: str) -> str:
    """XXH3-128 of the file's bytes, as 32 hex digits."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def hash_files(root: str, names: Iterable[str]) -> Dict[str, Dict[str, object]]:
    """{name: {"bytes": size, ALGORITHM: digest}} for ``names`` under ``root``."""
    names = sorted(names)
    paths = [os.path.join(root, n) for n in names]
    with ThreadPoolExecutor(_threads()) as pool:
        digests = list(pool.map(hash_file, paths))
    return {n: {"bytes": os.path.getsize(p), ALGORITHM: d}
            for n, p, d in zip(names, paths, digests)}


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


def write_manifest(root: str, entries: Dict[str, Dict[str, object]]) -> None:
    """Write ``root/checksums.json`` (fsynced) for ``entries``, which must cover every file."""
    missing = sorted(set(checkpoint_files(root)) - set(entries))
    if missing:
        raise ValueError(f"checksums of {root} lack {missing}")
    path = os.path.join(root, MANIFEST)
    with open(path, "w") as f:
        json.dump({"version": VERSION, "algorithm": ALGORITHM, "files": entries}, f,
                  indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(root: str) -> Optional[Dict[str, Dict[str, object]]]:
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
        return dict(data["files"])
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
    got = hash_files(root, names)
    for name in sorted(names):
        if got[name][ALGORITHM] != manifest[name][ALGORITHM]:
            return (f"{name} does not match its checksum ({ALGORITHM} "
                    f"{got[name][ALGORITHM]}, {manifest[name][ALGORITHM]} at save): its "
                    f"bytes changed after the save")
    return None
