"""The command-line surface is frozen: every option of ``pretrain_gpt.py`` and
``tools/bench_e2e.py`` (option strings, dest, action, default, choices, nargs, type,
required) equals the checked-in snapshot ``tests/data/cli_surface.json``.

A flag that changes by accident fails here. To change the surface on purpose, change the
parser, regenerate the snapshot and commit both::

    python -m tests.unit.test_cli_surface --update
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

SNAPSHOT = Path(__file__).parents[1] / "data" / "cli_surface.json"
ROOT = str(Path(__file__).parents[2])


def _pretrain_parser() -> argparse.ArgumentParser:
    from megatron.training.cli.arguments import build_parser  # two build_parser functions here

    return build_parser()


def _bench_e2e_parser() -> argparse.ArgumentParser:
    from megatron.bench.e2e.cli import build_parser  # two build_parser functions here

    return build_parser()


PARSERS: Dict[str, Callable[[], argparse.ArgumentParser]] = {
    "pretrain_gpt.py": _pretrain_parser,
    "tools/bench_e2e.py": _bench_e2e_parser,
}


def _plain(value: Any) -> Any:
    """``value`` as JSON: scalars as they are, sequences and mappings' keys as lists,
    anything else (a callable, an enum) by its name or repr."""
    if isinstance(value, str) and value.startswith(ROOT):
        return "<repo>" + value[len(ROOT):]       # a path in this checkout, wherever it is
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return [_plain(v) for v in value]
    if isinstance(value, (list, tuple, set, frozenset, range)):
        items = [_plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    return getattr(value, "__name__", repr(value))


def option_surface(action: argparse.Action) -> Dict[str, Any]:
    """What a user of one option depends on (the help text is left out: it may change)."""
    return {
        "options": list(action.option_strings),
        "dest": action.dest,
        "action": type(action).__name__,
        "default": _plain(action.default),
        "choices": _plain(action.choices),
        "nargs": _plain(action.nargs),
        "type": _plain(action.type),
        "required": action.required,
    }


def surface(parser: argparse.ArgumentParser) -> List[Dict[str, Any]]:
    """Every option but ``--help``, in the parser's order."""
    return [option_surface(a) for a in parser._actions
            if not isinstance(a, argparse._HelpAction)]


def current() -> Dict[str, List[Dict[str, Any]]]:
    return {name: surface(build()) for name, build in PARSERS.items()}


def differences(want: List[Dict[str, Any]], got: List[Dict[str, Any]]) -> List[str]:
    """One line per option removed, added or changed (keyed by its first option string)."""
    key = lambda o: (o["options"] or [o["dest"]])[0]  # noqa: E731
    old, new = {key(o): o for o in want}, {key(o): o for o in got}
    lines = [f"removed {k}" for k in old if k not in new]
    lines += [f"added {k}" for k in new if k not in old]
    for k in old.keys() & new.keys():
        for field in old[k]:
            if old[k][field] != new[k].get(field):
                lines.append(f"{k}: {field} {old[k][field]!r} -> {new[k].get(field)!r}")
    if not lines and [key(o) for o in want] != [key(o) for o in got]:
        lines.append("the options' order changed (it orders --help)")
    return sorted(lines)


def test_snapshot_names_every_parser():
    assert sorted(json.loads(SNAPSHOT.read_text())) == sorted(PARSERS)


def test_the_command_line_surface_is_unchanged():
    frozen = json.loads(SNAPSHOT.read_text())
    problems = []
    for name, options in current().items():
        problems += [f"{name} {line}" for line in differences(frozen.get(name, []), options)]
    assert not problems, (
        "the command line changed:\n  " + "\n  ".join(problems) +
        "\nIf this is deliberate: python -m tests.unit.test_cli_surface --update, and commit "
        "tests/data/cli_surface.json with the change.")


def test_differences_name_what_changed():
    a = {"options": ["--x"], "dest": "x", "action": "_StoreAction", "default": 1,
         "choices": None, "nargs": None, "type": "int", "required": False}
    b = dict(a, default=2)
    c = dict(a, options=["--y"], dest="y")
    assert differences([a], [a]) == []
    assert differences([a], [b]) == ["--x: default 1 -> 2"]
    assert differences([a], [c]) == ["added --y", "removed --x"]
    assert differences([a, c], [c, a]) == ["the options' order changed (it orders --help)"]


def dumps(snapshot: Dict[str, List[Dict[str, Any]]]) -> str:
    """The snapshot as JSON with one option per line, so that a change diffs as one line."""
    parts = []
    for name, options in snapshot.items():
        rows = ",\n".join("  " + json.dumps(o) for o in options)
        parts.append(f"{json.dumps(name)}: [\n{rows}\n]")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true",
                        help=f"write the current surface to {SNAPSHOT}")
    args = parser.parse_args(argv)
    now = current()
    if args.update:
        SNAPSHOT.write_text(dumps(now))
        print(f"wrote {SNAPSHOT} ({sum(map(len, now.values()))} options)")
        return 0
    frozen = json.loads(SNAPSHOT.read_text())
    lines = [f"{n} {line}" for n in now for line in differences(frozen.get(n, []), now[n])]
    print("\n".join(lines) or "unchanged")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
