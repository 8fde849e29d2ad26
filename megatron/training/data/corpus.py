"""The built-in default corpus: English prose from the Python standard library.

No machine here can download a data set or a tokenizer, yet a first run should train on
real language. Every Python installation ships a few MB of it: the Language Reference
topics of ``pydoc_data`` and the docstrings and comment paragraphs of the standard library's
modules. :func:`ensure_default_corpus` turns them, at first use, into

* ``corpus.jsonl``: one ``{"text": ...}`` document per line (a pydoc topic, or one module's
  docstrings and comments in source order),
* ``tokenizer.model``: a BPE SentencePiece model trained on it (vocabulary 8000),
* ``corpus_text_document.bin/.idx``: the documents tokenized, EOD appended,

exactly what ``tools/train_tokenizer.py`` and ``tools/preprocess_data.py`` produce from
``corpus.jsonl`` (same code path). Sources are read with :mod:`ast` and never imported.

Caching: the files live in ``<cache_dir>/default-corpus/<key>/`` where ``key`` hashes the
build recipe version, the parameters, the Python version and the list (path, size) of the
source files. ``STAMP.json`` records the SHA-256 of every file and is checked on each use,
so a damaged cache is rebuilt. Several processes starting at once serialise on a file lock;
the first builds into a temporary directory renamed into place, the others then find it.
A rebuild on the same Python installation is byte-identical.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

RECIPE_VERSION = 1
DEFAULT_VOCAB_SIZE = 8000
DEFAULT_MAX_BYTES = 8 << 20  # caps the text; the standard library gives ~2.5 MB
SP_NUM_THREADS = 2  # recorded in the .model: fixed so the file is the same on every machine
JSON_KEY = "text"

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
              "_bundled"}
_MIN_COMMENT_CHARS = 80
_MIN_DOC_PARAGRAPH_CHARS = 20


@dataclass(frozen=True)
class DefaultCorpus:
    """Paths of a built default corpus, for ``--data-path`` and ``--tokenizer-model``."""

    root: str
    data_prefix: str
    tokenizer_model: str
    corpus_jsonl: str
    num_documents: int
    num_tokens: int
    text_bytes: int
    vocab_size: int


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "megatron-usp")


# --------------------------------------------------------------------------- extraction
def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_sources(root: Optional[str] = None) -> List[str]:
    """The standard library's ``.py`` files (tests and installed packages excluded), sorted."""
    root = root or stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in _SKIP_DIRS and not d.startswith("config-"))
        out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return sorted(out, key=lambda p: os.path.relpath(p, root))


def _prose_ratio(text: str) -> float:
    return sum(c.isalpha() or c == " " for c in text) / max(1, len(text))


def _docstring_paragraphs(doc: str) -> Iterator[str]:
    """Prose paragraphs of a docstring, re-wrapped; doctest and code-like blocks dropped."""
    for block in re.split(r"\n\s*\n", doc):
        lines = [ln.strip() for ln in block.strip().split("\n")]
        if not lines or any(ln.startswith((">>>", "...")) for ln in lines):
            continue
        text = " ".join(ln for ln in lines if ln)
        if len(text) >= _MIN_DOC_PARAGRAPH_CHARS and _prose_ratio(text) >= 0.75:
            yield text


def _comment_paragraphs(source: str) -> Iterator[Tuple[int, str]]:
    """``(line, text)`` of runs of whole-line ``#`` comments that read as prose."""
    run: List[str] = []
    start = 0
    for lineno, line in enumerate(source.split("\n") + [""], start=1):
        s = line.strip()
        if s.startswith("#") and not s.startswith("#!"):
            if not run:
                start = lineno
            run.append(s.lstrip("#").strip())
            continue
        if run:
            text = " ".join(x for x in run if x)
            if len(text) >= _MIN_COMMENT_CHARS and _prose_ratio(text) >= 0.85:
                yield start, text
            run = []


def module_document(path: str) -> str:
    """One module's docstrings and comment paragraphs, in source order, as one document.

    The file is parsed with :mod:`ast`, never imported. Returns "" for a file that does
    not parse or holds no prose.
    """
    with open(path, "rb") as f:
        raw = f.read()
    try:
        tree = ast.parse(raw)
        source = raw.decode("utf-8")
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return ""
    pieces: List[Tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and node.body:
                line = node.body[0].lineno
                pieces.extend((line, p) for p in _docstring_paragraphs(doc))
    pieces.extend(_comment_paragraphs(source))
    pieces.sort(key=lambda lp: lp[0])
    return "\n\n".join(p for _, p in pieces)


def pydoc_topic_documents() -> Iterator[str]:
    """The Language Reference topics shipped in ``pydoc_data/topics.py``, sorted by name."""
    path = os.path.join(stdlib_dir(), "pydoc_data", "topics.py")
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "topics":
            topics: Dict[str, str] = ast.literal_eval(node.value)
            for name in sorted(topics):
                paragraphs = [" ".join(x.strip() for x in block.split("\n") if x.strip())
                              for block in re.split(r"\n\s*\n", topics[name])]
                text = "\n\n".join(p for p in paragraphs if p)
                if text:
                    yield text


def iter_corpus_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[str]:
    """Corpus documents in a fixed order, at most ``max_bytes`` of UTF-8 text in all.

    Pydoc topics first, then modules by path. Paragraphs seen before (licence headers,
    repeated boilerplate) are dropped. Stops before the document that would pass the cap.
    """
    seen = set()
    total = 0

    def fresh(text: str) -> str:
        keep = []
        for p in text.split("\n\n"):
            h = hashlib.sha1(p.encode("utf-8")).digest()
            if h not in seen:
                seen.add(h)
                keep.append(p)
        return "\n\n".join(keep)

    def sources() -> Iterator[str]:
        yield from pydoc_topic_documents()
        for path in stdlib_sources():
            yield module_document(path)

    for doc in sources():
        doc = fresh(doc)
        if not doc:
            continue
        size = len(doc.encode("utf-8"))
        if total + size > max_bytes:
            return
        total += size
        yield doc


# --------------------------------------------------------------------------- build
def corpus_key(max_bytes: int, vocab_size: int) -> str:
    """Cache key: recipe, parameters, Python version and the source files' (path, size)."""
    root = stdlib_dir()
    h = hashlib.sha256()
    h.update(json.dumps({"recipe": RECIPE_VERSION, "max_bytes": max_bytes,
                         "vocab_size": vocab_size, "python": sys.version}).encode())
    topics = os.path.join(root, "pydoc_data", "topics.py")
    for path in [topics] + stdlib_sources(root):
        if os.path.isfile(path):
            h.update(f"{os.path.relpath(path, root)}\0{os.path.getsize(path)}\n".encode())
    return h.hexdigest()[:20]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_ARTIFACTS = ("corpus.jsonl", "tokenizer.model", "corpus_text_document.bin",
              "corpus_text_document.idx")


def build_corpus_files(out_dir: str, max_bytes: int, vocab_size: int) -> Dict:
    """Write the corpus, tokenizer and indexed dataset into ``out_dir``; return the stamp.

    Steps, timed in the stamp: extract documents; write ``corpus.jsonl``; train the
    tokenizer (:func:`megatron.training.data.tokenizer.train_sentencepiece` on each document's
    non-blank lines); tokenize with :func:`megatron.training.data.preprocess.preprocess_jsonl`.
    """
    from megatron.training.data.preprocess import (  # torch-free module
        TokenizerSpec,
        preprocess_jsonl,
    )
    from megatron.training.data.tokenizer import (  # torch-free module
        train_sentencepiece,
        training_sentences,
    )

    os.makedirs(out_dir, exist_ok=True)
    times = {}
    t = time.perf_counter()
    docs = list(iter_corpus_documents(max_bytes))
    times["extract_s"] = time.perf_counter() - t
    if not docs:
        raise RuntimeError(f"no prose found in the standard library at {stdlib_dir()}")
    jsonl = os.path.join(out_dir, "corpus.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({JSON_KEY: doc}, ensure_ascii=False) + "\n")

    t = time.perf_counter()
    model = train_sentencepiece(
        (s for doc in docs for s in training_sentences(doc)), vocab_size,
        num_threads=SP_NUM_THREADS,
    )
    model_path = os.path.join(out_dir, "tokenizer.model")
    with open(model_path, "wb") as f:
        f.write(model)
    times["tokenizer_s"] = time.perf_counter() - t

    t = time.perf_counter()
    summary = preprocess_jsonl(
        [jsonl], os.path.join(out_dir, "corpus"),
        TokenizerSpec("SentencePieceTokenizer", model_path), json_keys=[JSON_KEY],
        append_eod=True, workers=1,
    )
    times["preprocess_s"] = time.perf_counter() - t
    return {
        "recipe": RECIPE_VERSION,
        "python": sys.version,
        "max_bytes": max_bytes,
        "vocab_size": vocab_size,
        "num_documents": summary.documents_written[JSON_KEY],
        "num_tokens": summary.tokens_written[JSON_KEY],
        "text_bytes": sum(len(d.encode("utf-8")) for d in docs),
        "sha256": {name: _sha256(os.path.join(out_dir, name)) for name in _ARTIFACTS},
        "times": {k: round(v, 3) for k, v in times.items()},
    }


def _read_stamp(root: str) -> Optional[Dict]:
    """The stamp of a complete, undamaged build in ``root``, or None."""
    try:
        with open(os.path.join(root, "STAMP.json"), encoding="utf-8") as f:
            stamp = json.load(f)
        for name, digest in stamp["sha256"].items():
            if _sha256(os.path.join(root, name)) != digest:
                return None
        return stamp
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _corpus_from(root: str, stamp: Dict) -> DefaultCorpus:
    return DefaultCorpus(
        root=root,
        data_prefix=os.path.join(root, "corpus_text_document"),
        tokenizer_model=os.path.join(root, "tokenizer.model"),
        corpus_jsonl=os.path.join(root, "corpus.jsonl"),
        num_documents=stamp["num_documents"],
        num_tokens=stamp["num_tokens"],
        text_bytes=stamp["text_bytes"],
        vocab_size=stamp["vocab_size"],
    )


def ensure_default_corpus(
    cache_dir: Optional[str] = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> DefaultCorpus:
    """Return the default corpus, building it first if it is not cached yet.

    Safe to call from every rank at once: builders serialise on
    ``<cache_dir>/default-corpus/<key>.lock`` (``fcntl.flock``); the files are written
    into a temporary directory and renamed into place, so no process sees a partial
    corpus. Takes ~10 s to build on 2 cores for the full ~2.5 MB, milliseconds when cached
    (the SHA-256 of the ~5 MB of files is checked each time).

    Args:
        cache_dir: parent folder of the cache (default ``~/.cache/megatron-usp``).
        max_bytes: cap on the text; tests use a few hundred KB.
        vocab_size: SentencePiece vocabulary size.
    """
    base = os.path.join(cache_dir or default_cache_dir(), "default-corpus")
    try:
        os.makedirs(base, exist_ok=True)
    except OSError as exc:
        raise OSError(
            f"cannot create the default-corpus cache {base} ({exc}); give a writable cache "
            f"folder (tools/build_default_corpus.py --cache-dir DIR, or the training flag "
            f"that sets it)"
        ) from None
    key = corpus_key(max_bytes, vocab_size)
    root = os.path.join(base, key)
    stamp = _read_stamp(root)
    if stamp is not None:
        return _corpus_from(root, stamp)
    with open(os.path.join(base, key + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            stamp = _read_stamp(root)  # another process may have built it meanwhile
            if stamp is None:
                stamp = _build_into(root, base, max_bytes, vocab_size)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return _corpus_from(root, stamp)


def _build_into(root: str, base: str, max_bytes: int, vocab_size: int) -> Dict:
    tmp = tempfile.mkdtemp(prefix=".build-", dir=base)
    try:
        stamp = build_corpus_files(tmp, max_bytes, vocab_size)
        with open(os.path.join(tmp, "STAMP.json"), "w", encoding="utf-8") as f:
            json.dump(stamp, f, indent=1, sort_keys=True)
        os.chmod(tmp, 0o755)
        if os.path.exists(root):  # damaged earlier build
            shutil.rmtree(root)
        os.rename(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return stamp
