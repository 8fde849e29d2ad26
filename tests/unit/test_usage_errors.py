"""Errors a user causes share one base, :class:`megatron.errors.UsageError`, and
``pretrain_gpt.py`` reports any of them in one line with the error's exit status."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

from megatron.errors import UsageError
from megatron.training.checkpoint.faults import CheckpointSaveError

REPO = Path(__file__).resolve().parents[2]

# Errors that are not the user's to fix: a diverging run, a peer rank or a checkpoint writer
# process that died or stopped answering are reported in one line, not blamed on input.
NOT_USAGE = {"NonFiniteLossError", "WriterDiedError", "WriterStuckError", "PeerLostError",
             "RingTimeoutError"}
# The subsystems' input errors, by name (the walk below must find each of them).
EXPECTED = {"ArgumentsError", "DataConfigError", "TokenizerError", "PreprocessError",
            "ChecksumMismatch", "CheckpointError", "CheckpointSaveError", "PlannerError",
            "USPConfigError", "AttentionBackendUnavailable", "FusedKernelsUnavailable",
            "BenchConfigError", "DriftError", "BrokenRunError", "InputError",
            "Float8Unavailable"}


def _load_path(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _project_modules():
    for path in sorted((REPO / "megatron").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[1] == "bench" and parts[-1] != "cli":
            continue  # the benchmarks' errors live in bench.cli; the rest imports their peers
        yield importlib.import_module(".".join(p for p in parts if p != "__init__"))
    yield _load_path("compare_loss_tool", REPO / "tools" / "compare_loss.py")


def _error_classes():
    """Every exception class the project defines (not imported from elsewhere)."""
    found = {}
    for module in _project_modules():
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__):
                found[name] = obj
    return found


def test_every_user_error_class_derives_from_usage_error():
    classes = _error_classes()
    assert EXPECTED <= set(classes), EXPECTED - set(classes)
    for name, cls in classes.items():
        if name in NOT_USAGE or cls is UsageError:
            continue
        assert issubclass(cls, UsageError), f"{cls.__module__}.{name} is not a UsageError"
        # The historical builtin base stays, so `except ValueError / RuntimeError` still works.
        assert issubclass(cls, (ValueError, RuntimeError)), name


def _pretrain_gpt():
    sys.modules.pop("pretrain_gpt_script", None)   # a fresh copy for each monkeypatching
    return _load_path("pretrain_gpt_script", REPO / "pretrain_gpt.py")


def _raise_from_pretrain(monkeypatch, exc):
    import megatron.training.loop as loop  # megatron-core on first use

    def fail(args):
        raise exc

    monkeypatch.setattr(loop, "pretrain", fail)
    script = _pretrain_gpt()
    # Valid flags, so the error comes from "inside the run", not from the preflight checks.
    monkeypatch.setattr(script, "preflight", lambda args: None)
    monkeypatch.setattr("megatron.training.process_guard.start_guard", lambda: None)
    monkeypatch.setattr("megatron.training.observe.console.install_console_filters",
                        lambda rank: None)
    return script


@pytest.mark.parametrize("name", sorted(EXPECTED - {"CheckpointSaveError"}))
def test_startup_reports_any_subsystems_usage_error_in_one_line(name, monkeypatch, capsys):
    cls = _error_classes()[name]
    exc = cls.__new__(cls)
    Exception.__init__(exc, f"--some-flag is wrong ({name}); pass --some-flag 1")
    monkeypatch.setenv("RANK", "0")
    script = _raise_from_pretrain(monkeypatch, exc)
    assert script.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pretrain_gpt.py: error: --some-flag is wrong ({name}); pass --some-flag 1"]


def test_a_failed_save_keeps_exit_status_1(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    script = _raise_from_pretrain(monkeypatch, CheckpointSaveError("--save /x: no room"))
    assert script.main([]) == 1
    assert capsys.readouterr().err.strip() == "pretrain_gpt.py: error: --save /x: no room"


def test_usage_error_imports_nothing_of_the_project():
    before = set(sys.modules)
    importlib.reload(importlib.import_module("megatron.errors"))
    assert not {m for m in set(sys.modules) - before if m.startswith("megatron.")}
