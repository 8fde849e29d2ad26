"""What a benchmark run writes: metadata (device, versions, date, command), JSON, markdown.

Every JSON file the tools write has the same top level::

    {"tool": str, "schema_version": int, "metadata": {...}, "config": {...},
     "results": [ {...}, ... ], ...tool-specific keys}

``metadata`` holds what ``docs/performance.md`` must state next to each number: the device,
the software versions, the date and the exact command, and which code ran: the git commit
and, because a copied checkout's ``.git`` can be older than its files, ``source_digest``, a
hash of the code's files themselves (:func:`source_digest`; ``python -m megatron.bench.report
digest [DIR]`` prints it for a checkout, to match a record to a commit).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

SCHEMA_VERSION = 1


def package_version(name: str) -> Optional[str]:
    """The installed version of distribution ``name``, or None."""
    try:
        return version(name)
    except Exception:  # noqa: BLE001 - any lookup failure means "unknown"
        return None


def _git_commit(repo_dir: Path) -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _git_dirty(repo_dir: Path) -> Optional[bool]:
    """Whether tracked files differ from the commit (the measured code is then not exactly
    ``git_commit``); None outside a git checkout."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                             cwd=repo_dir, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


SOURCE_ROOTS = ("megatron", "tools", "benchmarks", "examples", "pretrain_gpt.py")
SOURCE_SUFFIXES = (".py", ".sh", ".sbatch")


def source_digest(repo_dir: Path) -> Optional[str]:
    """The first 16 hex digits of a SHA-256 over the code's files (the Python and shell files
    under :data:`SOURCE_ROOTS`, by relative path and content, caches skipped): equal for two
    checkouts with the same code whatever their ``.git`` says. None if there is none."""
    root = Path(repo_dir)
    files = []
    for name in SOURCE_ROOTS:
        top = root / name
        found = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        files += [f for f in found if f.is_file() and f.suffix in SOURCE_SUFFIXES
                  and "__pycache__" not in f.parts]
    if not files:
        return None
    digest = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.relative_to(root).as_posix()):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0")
        digest.update(f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def device_description(device: torch.device) -> Dict[str, Any]:
    """Name, count and memory of the accelerator (or the CPU)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "count": torch.cuda.device_count(),
                "memory_gib": round(props.total_memory / (1 << 30), 1),
                "capability": f"{props.major}.{props.minor}"}
    return {"type": "cpu", "name": platform.processor() or platform.machine(),
            "count": os.cpu_count()}


def software_versions() -> Dict[str, Optional[str]]:
    """torch, CUDA, cuDNN, NCCL, megatron-core, Python."""
    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(str(p) for p in v) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": str(cudnn) if cudnn else None, "nccl": nccl,
            "megatron_core": package_version("megatron-core"),
            "python": platform.python_version()}


def run_metadata(argv: Sequence[str], device: Optional[torch.device], world_size: int
                 ) -> Dict[str, Any]:
    """Everything a published number must sit next to (``device=None``: described later)."""
    repo = Path(__file__).resolve().parents[2]
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(shlex.quote(a) for a in argv),
        "world_size": world_size,
        "device": None if device is None else device_description(device),
        "versions": software_versions(),
        "git_commit": _git_commit(repo),
        "git_dirty": _git_dirty(repo),
        "source_digest": source_digest(repo),
        "hostname": platform.node(),
        "python_executable": sys.executable,
    }


def _json_safe(x: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_json(path: str, payload: Dict[str, Any]) -> None:
    """Write ``payload`` atomically (a partial sweep never leaves a truncated file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(_json_safe(payload), indent=2, allow_nan=False) + "\n")
    tmp.replace(target)


def write_summary(path: str, tool: str, fields: Dict[str, Any], argv: Sequence[str],
                  runs_path: str) -> None:
    """The result of a summary step (``python -m megatron.bench.TOOL``, which reads
    ``tools/bench_e2e.py`` outputs and trains nothing) as JSON with its own metadata; the
    device is the runs' (that of ``runs_path``, one of the files it read)."""
    meta = run_metadata(["python", "-m", f"megatron.bench.{tool}", *argv], None, 1)
    with open(runs_path) as f:
        meta["device"] = json.load(f).get("metadata", {}).get("device")
    write_json(path, {"tool": tool, **fields, "metadata": meta})


def write_text(path: str, text: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def fmt(x: Any, digits: int = 1, pct: bool = False) -> str:
    """A table cell: ``n/a`` for missing values, percentages with ``pct``."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if isinstance(x, float):
        return f"{100 * x:.{digits}f}%" if pct else f"{x:.{digits}f}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table of already formatted cells."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def metadata_markdown(meta: Dict[str, Any]) -> str:
    """The header lines of a results table: device, versions, date, command."""
    dev = meta["device"] or {"type": "unknown", "name": "not described yet"}
    ver = meta["versions"]
    dev_line = f"{dev.get('count', '?')} x {dev['name']}" if dev["type"] == "cuda" else (
        f"{dev['type']} ({dev['name']})")
    soft = ", ".join(f"{k} {v}" for k, v in ver.items() if v)
    lines: List[str] = [
        f"- device: {dev_line}, world size {meta['world_size']}",
        f"- software: {soft}",
        f"- date (UTC): {meta['date_utc']}; commit: {meta.get('git_commit') or 'unknown'}"
        f"{' + uncommitted changes' if meta.get('git_dirty') else ''}"
        f"{'; source digest: ' + meta['source_digest'] if meta.get('source_digest') else ''}",
        f"- command: `{meta['command']}`",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m megatron.bench.report digest [DIR]``: print a checkout's source digest."""
    parser = argparse.ArgumentParser(prog="python -m megatron.bench.report",
                                     description="The source digest of a checkout.")
    parser.add_argument("what", choices=["digest"])
    parser.add_argument("dir", nargs="?", default=str(Path(__file__).resolve().parents[2]),
                        help="a checkout (default: this one)")
    args = parser.parse_args(argv)
    digest = source_digest(Path(args.dir))
    if digest is None:
        parser.error(f"DIR {args.dir!r} holds no code files; give a checkout of this project")
    print(digest)


if __name__ == "__main__":
    main()
