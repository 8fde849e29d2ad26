"""The user's documentation stays runnable: README.md, docs/*.md and benchmarks/README.md.

* Every relative link points to a file or folder that exists.
* Every command in a fenced code block (and every inline code span that starts with
  ``python``, ``torchrun``, ``bash`` or ``sbatch``, after any ``NAME=value``) that names a script or module names one
  that exists.
* Each ``--flag`` given to ``pretrain_gpt.py``, a ``tools/*.py`` script or a ``python -m``
  module is an option of that program's parser; flags inside ``--extra-args`` are checked
  against ``pretrain_gpt.py``'s. The parsers are built without running the programs: each
  runs until it asks argparse to parse, and the parser is read there (one subprocess for
  all of them).

The benchmark recipes (``benchmarks/*.sh``) are checked the same way.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md",
               *(ROOT / "docs").glob("*.md")])
RECIPES = sorted((ROOT / "benchmarks").glob("*.sh"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`((?:[A-Z_]+=\S+ )*(?:python3?|torchrun|bash|sbatch) [^`]+)`")
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
LAUNCHERS = {"python", "python3", "torchrun", "bash", "sh", "sbatch"}
SCRIPT_SUFFIXES = (".py", ".sh", ".sbatch")
# Programs whose flags are checked: pretrain_gpt.py, tools/*.py and project modules.
CHECKED = re.compile(r"^(pretrain_gpt\.py|tools/[\w]+\.py|megatron(\.\w+)+|tests(\.\w+)+)$")


@dataclass(frozen=True)
class Command:
    source: str       # file:line, for messages
    program: str      # a script path relative to the root, or a dotted module
    flags: Tuple[str, ...]
    extra_flags: Tuple[str, ...]   # flags inside --extra-args="..."


def _relative_links(path: Path) -> Iterator[Tuple[int, str]]:
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    for lineno, line in enumerate(text.splitlines(), 1):
        for target in LINK.findall(line):
            if not re.match(r"^[a-z]+:", target) and not target.startswith("#"):
                yield lineno, target.split("#", 1)[0]


def _command_lines(path: Path) -> Iterator[Tuple[int, str]]:
    """(line number, one logical shell line) from fenced blocks and inline spans."""
    text = path.read_text()
    if path.suffix == ".sh":
        blocks = [(1, text)]
    else:
        blocks = [(text[:m.start(2)].count("\n") + 1, m.group(2))
                  for m in FENCE.finditer(text) if m.group(1) in SHELL_LANGS]
        blocks += [(text[:m.start()].count("\n") + 1, m.group(1)) for m in INLINE.finditer(text)]
    for first, block in blocks:
        joined = re.sub(r"\\\n", " ", block)
        for offset, line in enumerate(joined.splitlines()):
            yield first + offset, line


def _tokens(line: str) -> List[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return []


def _parse(source: str, tokens: List[str]) -> Optional[Command]:
    """The program a command runs and the flags it passes, or None for other commands."""
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        tokens = tokens[1:]
    if not tokens or tokens[0] not in LAUNCHERS:
        return None
    rest = tokens[1:]
    if tokens[0].startswith("python") and rest[:1] == ["-m"] and len(rest) > 1:
        program, args = rest[1], rest[2:]
    else:
        index = next((i for i, t in enumerate(rest) if t.endswith(SCRIPT_SUFFIXES)), None)
        if index is None:
            return None
        program, args = rest[index], rest[index + 1:]
    flags, extra = [], []
    for arg in args:
        if arg.startswith("--extra-args"):
            value = arg.split("=", 1)[1] if "=" in arg else ""
            extra += [t.split("=", 1)[0] for t in value.split() if t.startswith("--")]
            flags.append("--extra-args")
        elif arg.startswith("--"):
            flags.append(arg.split("=", 1)[0])
    return Command(source, program, tuple(flags), tuple(extra))


def _commands() -> List[Command]:
    found = []
    for path in DOCS + RECIPES:
        for lineno, line in _command_lines(path):
            for part in re.split(r"&&|;|\|\|?", line):
                cmd = _parse(f"{path.relative_to(ROOT)}:{lineno}", _tokens(part))
                if cmd is not None:
                    found.append(cmd)
    return found


def _program_exists(program: str) -> bool:
    if program.endswith(SCRIPT_SUFFIXES):
        return (ROOT / program).is_file()
    if program.split(".")[0] not in ("megatron", "tests", "tools"):
        return importlib.util.find_spec(program) is not None   # e.g. python -m pytest
    as_path = ROOT / program.replace(".", "/")
    return as_path.with_suffix(".py").is_file() or (as_path / "__init__.py").is_file()


_GRAB = r"""
import argparse, json, runpy, sys
class Grabbed(BaseException):
    pass
def options(parser):
    # a subcommand's flags (convert_hf.py export --hf-config) live on its own parser
    out = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= options(sub)
    return out
def grab(self, args=None, namespace=None):
    raise Grabbed(sorted(options(self)))
argparse.ArgumentParser.parse_known_args = grab
found = {}
for program in json.loads(sys.argv[1]):
    sys.argv = [program, "--help"]
    try:
        if program.endswith(".py"):
            runpy.run_path(program, run_name="__main__")
        else:
            runpy.run_module(program, run_name="__main__", alter_sys=True)
        found[program] = None
    except Grabbed as got:
        found[program] = got.args[0]
    except BaseException as exc:
        found[program] = "error: %r" % (exc,)
print(json.dumps(found))
"""


def _parser_options(programs: List[str]) -> Dict[str, object]:
    """Each program's option strings, read where it asks argparse to parse."""
    out = subprocess.run([sys.executable, "-c", _GRAB, json.dumps(programs)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                              "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_relative_link_resolves():
    broken = [f"{path.relative_to(ROOT)}:{lineno}: {target}"
              for path in DOCS for lineno, target in _relative_links(path)
              if target and not (path.parent / target).exists()]
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_commands_name_existing_scripts():
    commands = _commands()
    assert len(commands) > 20, "the command scan found too little: is the parsing broken?"
    missing = [f"{c.source}: {c.program}" for c in commands if not _program_exists(c.program)]
    assert not missing, "commands name missing scripts:\n" + "\n".join(missing)


def test_command_flags_exist_in_their_parsers():
    commands = [c for c in _commands() if CHECKED.match(c.program) and _program_exists(c.program)]
    programs = sorted({c.program for c in commands} | {"pretrain_gpt.py"})
    options = _parser_options(programs)
    unreadable = {p: o for p, o in options.items() if not isinstance(o, list)}
    assert not unreadable, f"parsers not reached: {unreadable}"
    unknown = []
    for c in commands:
        unknown += [f"{c.source}: {c.program} {f}" for f in c.flags if f not in options[c.program]]
        unknown += [f"{c.source}: pretrain_gpt.py {f} (in --extra-args)"
                    for f in c.extra_flags if f not in options["pretrain_gpt.py"]]
    assert not unknown, "flags that the parser does not have:\n" + "\n".join(unknown)


def test_the_scan_reads_commands_as_written():
    line = ('PYTORCH_CUDA_ALLOC_CONF=x python tools/bench_e2e.py --seq-lens 512k '
            '--extra-args="--recompute-keep-core-attn --mlp-tile-tokens 16384"  # note --not-a-flag')
    cmd = _parse("t", _tokens(line))
    assert cmd == Command("t", "tools/bench_e2e.py", ("--seq-lens", "--extra-args"),
                          ("--recompute-keep-core-attn", "--mlp-tile-tokens"))
    assert _parse("t", _tokens("torchrun --nproc-per-node 2 tools/x.py --a=1")).flags == ("--a",)
    assert _parse("t", _tokens("python -m megatron.bench.depth A.json --full-layers 16")).program \
        == "megatron.bench.depth"
    assert _parse("t", _tokens("git log")) is None
