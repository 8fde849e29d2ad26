"""Run the GPU tier in chunks that fit a time budget and write a dated record of it.

``tools/run_gpu_tests.py`` is the command line; this module holds the parts (planning,
running one chunk, the record) so that the unit tests exercise them on the CPU.

A chunk is one ``pytest`` process given a list of test ids; it runs under a timeout equal
to the budget, so a hang costs one chunk, not the whole call. Each test's duration is
estimated from the newest earlier record in the output folder (a default for tests never
run), and tests are packed in collection order, a file kept whole when it fits.

The record (``gpu_tests_<UTC date-time>_<host>.json`` and ``.md``) holds the date, host,
GPU names, Python / torch / CUDA versions, the commit, the command, each chunk's exit
status and wall time, and each test's outcome and duration.

This module is also the ``pytest`` plugin that reports each test to the runner: with
``-p tests.gpu_runner`` and ``GPU_RUNNER_REPORT`` naming a file, each test appends one
JSON line (node id, outcome, seconds, short message).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
REPORT_ENV = "GPU_RUNNER_REPORT"
RECORD_PREFIX = "gpu_tests_"
NOT_RUN = "not run"


# ------------------------------------------------------------------ pytest plugin
_phases: Dict[str, Dict[str, object]] = {}


def pytest_runtest_logstart(nodeid, location):
    path = os.environ.get(REPORT_ENV)
    if path:
        _append(path, {"nodeid": nodeid, "outcome": "started"})


def pytest_runtest_logreport(report):
    """Fold setup / call / teardown into one line per test, written at teardown."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    entry = _phases.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed",
                                               "duration_s": 0.0, "message": ""})
    entry["duration_s"] = round(float(entry["duration_s"]) + report.duration, 3)
    if report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        longrepr = report.longrepr
        entry["message"] = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)[:300]
    elif report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        crash = getattr(report.longrepr, "reprcrash", None)     # "file:line: message"
        text = crash.message if crash is not None else str(report.longrepr).strip()
        entry["message"] = " ".join(text.split())[:300]
    if report.when == "teardown":
        _append(path, _phases.pop(report.nodeid))


def _append(path: str, entry: Dict[str, object]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


# ------------------------------------------------------------------ planning
def collect(paths: Sequence[str], pytest_args: Sequence[str] = ()) -> List[str]:
    """The node ids ``pytest --collect-only`` finds under ``paths``."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *pytest_args, *paths],
                         cwd=REPO, capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    if out.returncode not in (0, 5) or (not ids and out.returncode != 5):
        raise RuntimeError(f"collecting {list(paths)} failed:\n{out.stdout[-2000:]}"
                           f"{out.stderr[-2000:]}")
    return ids


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def plan_chunks(nodeids: Sequence[str], estimates: Dict[str, float], budget_s: float,
                default_s: float) -> List[List[str]]:
    """Pack ``nodeids`` (kept in order) into chunks whose estimated seconds fit ``budget_s``.

    A file's tests stay in one chunk when their sum fits; a file that does not fit is cut
    between tests; a test estimated over the budget gets a chunk of its own.
    """
    cost = {n: estimates.get(n, default_s) for n in nodeids}
    files: Dict[str, List[str]] = {}
    for n in nodeids:
        files.setdefault(_file_of(n), []).append(n)
    chunks: List[List[str]] = []
    used = budget_s + 1.0          # no open chunk yet
    for tests in files.values():
        whole = sum(cost[n] for n in tests)
        if whole <= budget_s and used + whole > budget_s:
            chunks.append([])
            used = 0.0
        for n in tests:
            if used + cost[n] > budget_s:
                chunks.append([])
                used = 0.0
            chunks[-1].append(n)
            used += cost[n]
    return chunks


def load_estimates(out_dir: Path) -> Dict[str, float]:
    """Each test's duration in the newest record under ``out_dir`` that ran it."""
    estimates: Dict[str, float] = {}
    for path in sorted(out_dir.glob(RECORD_PREFIX + "*.json")):      # oldest first
        try:
            tests = json.loads(path.read_text()).get("tests", [])
        except (OSError, ValueError):
            continue
        for t in tests:
            if t.get("outcome") in ("passed", "failed") and t.get("duration_s") is not None:
                estimates[t["nodeid"]] = float(t["duration_s"])
    return estimates


# ------------------------------------------------------------------ running
@dataclass
class ChunkResult:
    index: int
    nodeids: List[str]
    returncode: Optional[int]          # None: killed at the budget
    wall_s: float
    tests: List[Dict[str, object]] = field(default_factory=list)


def run_chunk(index: int, nodeids: Sequence[str], budget_s: float, report_dir: Path,
              pytest_args: Sequence[str] = ()) -> ChunkResult:
    """One ``pytest`` process over ``nodeids``, stopped after ``budget_s`` seconds; every
    id gets an outcome (``not run`` for those a timeout or a crash left unreported)."""
    report = report_dir / f"chunk_{index}.jsonl"
    report.unlink(missing_ok=True)
    env = dict(os.environ, **{REPORT_ENV: str(report)})
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
           "tests.gpu_runner", *pytest_args, *nodeids]
    start = time.monotonic()
    try:
        code: Optional[int] = subprocess.run(cmd, cwd=REPO, env=env,
                                             timeout=budget_s).returncode
    except subprocess.TimeoutExpired:
        code = None
    wall = round(time.monotonic() - start, 1)
    return ChunkResult(index, list(nodeids), code, wall,
                       outcomes(nodeids, _read_lines(report), timed_out=code is None,
                                budget_s=budget_s))


def _requested(reported: str, nodeids: Sequence[str]) -> str:
    """The id as the runner asked for it: pytest reports ids relative to its rootdir."""
    if reported in nodeids:
        return reported
    return next((n for n in nodeids if n.endswith("/" + reported)), reported)


def _read_lines(path: Path) -> List[Dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def outcomes(nodeids: Sequence[str], lines: Iterable[Dict[str, object]], timed_out: bool,
             budget_s: float) -> List[Dict[str, object]]:
    """One entry per id in ``nodeids`` from the plugin's lines: the test that had started
    when the chunk was stopped is ``timeout``, those never started ``not run``."""
    done: Dict[str, Dict[str, object]] = {}
    started = set()
    for line in lines:
        n = _requested(str(line["nodeid"]), nodeids)
        if line["outcome"] == "started":
            started.add(n)
        else:
            done[n] = dict(line, nodeid=n)
    result = []
    for n in nodeids:
        if n in done:
            result.append(done[n])
        elif n in started:
            why = f"stopped at the chunk's budget of {budget_s:.0f} s" if timed_out else \
                "the pytest process ended during this test"
            result.append({"nodeid": n, "outcome": "timeout" if timed_out else "crashed",
                           "duration_s": None, "message": why})
        else:
            result.append({"nodeid": n, "outcome": NOT_RUN, "duration_s": None,
                           "message": "an earlier test in its chunk stopped the chunk"})
    return result


# ------------------------------------------------------------------ the record
def environment() -> Dict[str, object]:
    """Host, GPUs and versions, asked of a child process (CUDA stays uninitialised here,
    so this process holds no GPU memory while the chunks run)."""
    probe = ("import json, sys, torch\n"
             "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
             "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__,"
             " 'cuda': torch.version.cuda,"
             " 'gpus': [torch.cuda.get_device_name(i) for i in range(n)]}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    info: Dict[str, object] = {"host": platform.node()}
    try:
        info.update(json.loads(out.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        info["probe_error"] = out.stderr[-500:]
    return info


def commit() -> Dict[str, object]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def build_record(chunks: Sequence[ChunkResult], env: Dict[str, object],
                 source: Dict[str, object], command: Sequence[str], budget_s: float,
                 when: Optional[_dt.datetime] = None) -> Dict[str, object]:
    when = when or _dt.datetime.now(_dt.timezone.utc)
    tests = [t for c in chunks for t in c.tests]
    summary: Dict[str, int] = {}
    for t in tests:
        summary[str(t["outcome"])] = summary.get(str(t["outcome"]), 0) + 1
    return {
        "date": when.isoformat(timespec="seconds"),
        **env, **source,
        "command": list(command),
        "budget_s": budget_s,
        "summary": summary,
        "chunks": [{"index": c.index, "tests": len(c.nodeids), "returncode": c.returncode,
                    "wall_s": c.wall_s} for c in chunks],
        "tests": tests,
    }


def markdown(record: Dict[str, object]) -> str:
    """The record as a page: a header of versions, then one table row per test."""
    gpus = ", ".join(record.get("gpus") or []) or "none"
    commit_text = f"{record.get('commit')}{' (uncommitted changes)' if record.get('dirty') else ''}"
    lines = [
        f"# GPU tests, {record['date']}",
        "",
        "| | |", "| --- | --- |",
        f"| host | {record.get('host')} |",
        f"| GPUs | {gpus} |",
        f"| Python / torch / CUDA | {record.get('python')} / {record.get('torch')} / "
        f"{record.get('cuda')} |",
        f"| commit | {commit_text} |",
        f"| command | `{' '.join(record['command'])}` |",
        f"| outcome | {', '.join(f'{v} {k}' for k, v in sorted(record['summary'].items()))} |",
        "",
        "| test | outcome | seconds | note |", "| --- | --- | ---: | --- |",
    ]
    for t in record["tests"]:
        secs = "" if t.get("duration_s") is None else f"{t['duration_s']:.1f}"
        note = str(t.get("message") or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{t['nodeid']}` | {t['outcome']} | {secs} | {note} |")
    return "\n".join(lines) + "\n"


def write_record(record: Dict[str, object], out_dir: Path) -> Path:
    """``<out_dir>/gpu_tests_<date>_<host>.json`` and the ``.md`` beside it; returns the
    JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = str(record["date"]).replace(":", "").replace("+0000", "Z")
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in str(record.get("host")))
    base = out_dir / f"{RECORD_PREFIX}{stamp}_{host}"
    base.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    base.with_suffix(".md").write_text(markdown(record))
    return base.with_suffix(".json")
