"""tools/compare_loss.py: per-step and max divergence, the PNG, and the exit status."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "compare_loss.py")


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("compare_loss", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _write(path, losses, layout=None, valid=None, extra=()):
    with open(path, "w") as f:
        if layout:
            f.write(json.dumps({"kind": "run", "layout": layout, "world_size": 4}) + "\n")
        for it, loss in losses.items():
            f.write(json.dumps({"kind": "train", "iteration": it, "lm_loss": loss,
                                "grad_norm": 1.0}) + "\n")
        for it, loss in (valid or {}).items():
            f.write(json.dumps({"kind": "valid", "iteration": it, "lm_loss": loss}) + "\n")
        for line in extra:
            f.write(line + "\n")
    return str(path)


def _curve(n=20, scale=1.0):
    return {i: (9.0 - 0.1 * i) * scale for i in range(1, n + 1)}


def test_identical_runs_pass_and_draw(tool, tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", _curve(), layout="TP1 U1 R1 DP4 PP1")
    b = _write(tmp_path / "b.jsonl", _curve(), layout="TP1 U2 R2 DP1 PP1")
    png = tmp_path / "out" / "curves.png"
    assert tool.main([a, b, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "TP1 U2 R2 DP1 PP1" in out and "max relative divergence: 0.000e+00" in out
    assert "OK: the curves agree" in out and str(png) in out
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10_000


def test_divergence_past_tolerance_fails_naming_the_step(tool, tmp_path, capsys):
    ref = _curve()
    bad = dict(ref)
    bad[13] = ref[13] * (1 + 3e-5)
    a = _write(tmp_path / "a.jsonl", ref)
    b = _write(tmp_path / "b.jsonl", bad)
    c = _write(tmp_path / "c.jsonl", {k: v * (1 + 2e-7) for k, v in ref.items()})
    assert tool.main([a, c, b, "--labels", "dp", "ok", "bad"]) == 1
    out = capsys.readouterr().out
    assert "max relative divergence: 3.000e-05 (bad at iteration 13)" in out
    assert "FAIL: divergence 3.000e-05 exceeds --tolerance 1e-05" in out
    assert tool.main([a, b, "--tolerance", "1e-4"]) == 0


def test_per_step_table(tool, tmp_path):
    ref = _curve(5)
    other = {k: v * (1 + 1e-6 * k) for k, v in ref.items()}
    cmp = tool.compare([tool.load_series(_write(tmp_path / "a.jsonl", ref), label="a"),
                        tool.load_series(_write(tmp_path / "b.jsonl", other), label="b")])
    assert cmp.iterations == [1, 2, 3, 4, 5]
    for k in ref:
        assert cmp.divergence["b"][k] == pytest.approx(1e-6 * k, rel=1e-6)
    assert cmp.max_divergence()[1:] == ("b", 5)
    table = tool.format_table(cmp).splitlines()
    assert len(table) == 6 and table[0].split()[0] == "iteration"
    assert len(tool.format_table(cmp, every=2).splitlines()) == 4  # 1, 3, 5 and the header


def test_nan_loss_is_a_failure(tool, tmp_path, capsys):
    bad = _curve()
    bad[7] = float("nan")
    a = _write(tmp_path / "a.jsonl", _curve())
    b = _write(tmp_path / "b.jsonl", bad)
    assert tool.main([a, b]) == 1
    assert "inf" in capsys.readouterr().out
    assert tool.relative_divergence(math.nan, 1.0) == math.inf
    assert tool.relative_divergence(0.0, 0.0) == 0.0


def test_last_record_of_an_iteration_wins(tool, tmp_path):
    """A resumed run appends: iterations 6..10 again after a crash at 8."""
    ref = _curve(10)
    lines = [json.dumps({"kind": "train", "iteration": i, "lm_loss": 99.0}) for i in (6, 7, 8)]
    lines += [json.dumps({"kind": "train", "iteration": i, "lm_loss": ref[i]})
              for i in range(6, 11)]
    path = _write(tmp_path / "resumed.jsonl", {i: ref[i] for i in range(1, 9)}, extra=lines)
    assert tool.load_series(path).values == ref


def test_missing_iterations_fail_unless_allowed(tool, tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", _curve(20))
    b = _write(tmp_path / "b.jsonl", _curve(12))
    assert tool.main([a, b]) == 1
    assert "lacks iterations [13, 14" in capsys.readouterr().out
    assert tool.main([a, b, "--allow-missing"]) == 0


def test_validation_records(tool, tmp_path):
    a = _write(tmp_path / "a.jsonl", _curve(), valid={10: 8.0, 20: 7.0})
    b = _write(tmp_path / "b.jsonl", _curve(), valid={10: 8.0, 20: 7.5})
    assert tool.main([a, b, "--kind", "valid"]) == 1
    assert tool.main([a, b, "--kind", "valid", "--tolerance", "0.1"]) == 0


def test_unreadable_input_exits_2(tool, tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", _curve())
    assert tool.main([a, str(tmp_path / "nope.jsonl")]) == 2
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"kind": "train", "iteration": 1, "lm_loss": 9.0}\n{not json\n')
    assert tool.main([a, str(broken)]) == 2
    assert "broken.jsonl:2: not JSON" in capsys.readouterr().err
    empty = _write(tmp_path / "empty.jsonl", {}, layout="TP1 U1 R1 DP1 PP1")
    assert tool.main([a, empty]) == 2
    assert tool.main([a]) == 2
    assert tool.main([a, a, "--labels", "only-one"]) == 2
    disjoint = _write(tmp_path / "late.jsonl", {100: 1.0})
    assert tool.main([a, disjoint]) == 2


def test_command_line(tmp_path):
    a = _write(tmp_path / "a.jsonl", _curve(), layout="TP1 U1 R1 DP4 PP1")
    b = _write(tmp_path / "b.jsonl", {k: v * 1.01 for k, v in _curve().items()})
    png = tmp_path / "cli.png"
    proc = subprocess.run([sys.executable, TOOL, a, b, "--png", str(png)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "FAIL" in proc.stdout and png.exists()
    proc = subprocess.run([sys.executable, TOOL, "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "--tolerance" in proc.stdout
