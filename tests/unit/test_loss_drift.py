"""The drift test (megatron/training/observe/loss_drift.py and tools/compare_loss.py --noise-pair).

Synthetic curves: a decaying loss, and runs that differ from it per step by noise of 1 %
(white; 0.6 % autocorrelated) plus, for the drifting run, a constant offset of 0.5 %: less
than the per-step noise, so no single step shows it and the largest per-step difference of
a run without offset is larger than the offset. The drift test must catch the offset and pass the
run without it, for several seeds; the edge cases (short curves, missing steps, NaN, a
bit-identical pair) must give errors that say what is wrong.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import re
import sys

import pytest

from megatron.training.observe import loss_drift as ld

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "compare_loss.py")
STEPS = 500
NOISE = 0.01
OFFSET = 0.005


def _reference(steps=STEPS):
    return {t: 4.0 + 5.0 * math.exp(-t / 80.0) for t in range(1, steps + 1)}


def _run(ref, rng, offset=0.0, noise=NOISE, phi=0.0):
    """ref * (1 + offset + e_t), e_t AR(1) with coefficient phi and stationary std noise."""
    out, e = {}, 0.0
    innovation = noise * math.sqrt(1.0 - phi * phi)
    for t, value in ref.items():
        e = phi * e + rng.gauss(0.0, innovation)
        out[t] = value * (1.0 + offset + e)
    return out


def _report(rng, offset, noise, phi):
    ref = _reference()
    pair = _run(ref, rng, noise=noise, phi=phi)
    runs = {name: _run(ref, rng, off, noise, phi)
            for name, off in (("no offset", 0.0), ("offset", offset),
                              ("negative offset", -offset))}
    return ld.drift_report(runs, ref, [("ref", ref, "ref2", pair)]), runs, ref


# White noise of twice the offset; autocorrelated noise (each step keeps half of the last
# step's error, as a run that is ahead stays ahead) of 1.2 times it. Over 1000 seeds of
# each (not run here): the offset is caught every time, a run without it is flagged 0.7 %.
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("noise,phi", [(NOISE, 0.0), (0.006, 0.5)])
def test_offset_buried_under_larger_noise_is_caught(seed, noise, phi):
    report, runs, ref = _report(random.Random(seed), OFFSET, noise, phi)
    verdicts = {v.stats.label: v for v in report.verdicts}
    assert report.window == ld.Window(251, 500)
    assert not verdicts["no offset"].drifts, verdicts["no offset"].message()
    assert verdicts["offset"].drifts and verdicts["offset"].mean_outside
    assert verdicts["negative offset"].drifts
    st = verdicts["offset"].stats
    assert abs(st.mean - OFFSET) < 4 * st.se_mean and 0 < st.se_mean < OFFSET / 3
    msg = verdicts["offset"].message()
    assert msg.startswith("offset drifts from the reference over iterations 251-500")
    assert re.search(r"higher by 0\.\d{3}% on average; its mean signed difference \+0\.\d{3}% "
                     r"is outside \+-0\.\d{3}%", msg), msg
    assert "lower by" in verdicts["negative offset"].message()
    # The offset is buried: a run without it has single steps further off than the offset,
    # so the largest per-step difference cannot tell the two apart.
    worst_clean = max(abs(runs["no offset"][t] / ref[t] - 1) for t in ref)
    assert worst_clean > 3 * OFFSET


def test_statistics_of_a_known_series():
    ref = {t: 2.0 for t in range(1, 41)}
    run = {t: 2.0 * (1.01 if t % 4 else 0.99) for t in ref}    # 3 of 4 steps +1 %, one -1 %
    st = ld.drift_stats(run, ref, ld.Window(1, 40), "run", blocks=10)
    assert st.steps == 40
    assert st.mean == pytest.approx(0.005)
    assert st.above == pytest.approx(0.75)
    assert st.se_mean == pytest.approx(0.0) and st.se_above == pytest.approx(0.0, abs=1e-12)
    ties = ld.drift_stats(ref, ref, ld.Window(1, 40))
    assert ties.mean == 0.0 and ties.above == 0.5          # a tie counts one half
    band = ld.noise_band([ld.drift_stats(run, ref, ld.Window(1, 40), "p")], z=3.0)
    assert band.mean == pytest.approx(0.005) and band.above == pytest.approx(0.25)
    # the widest of several pairs
    wide = {t: 2.0 * (1.03 if t % 2 else 0.99) for t in ref}
    band2 = ld.noise_band([ld.drift_stats(run, ref, ld.Window(1, 40), "p"),
                           ld.drift_stats(wide, ref, ld.Window(1, 40), "q")])
    assert band2.mean == pytest.approx(0.01)


def test_percent_format():
    assert ld.percent(0.00419) == "+0.419%" and ld.percent(0.00419, signed=False) == "0.419%"
    assert ld.percent(-2.1e-8) == "-2.10e-06%" and ld.percent(0.0) == "+0.000%"


def test_windows():
    assert ld.default_window(range(1, 201)) == ld.Window(101, 200)
    assert ld.default_window([5, 6, 7]) == ld.Window(4, 7)
    its = list(range(1, 101))
    assert ld.parse_window("half", its) == ld.Window(51, 100)
    assert ld.parse_window("20:60", its) == ld.Window(20, 60)
    assert ld.parse_window("20:", its) == ld.Window(20, 100)
    assert ld.parse_window(":30", its) == ld.Window(1, 30)
    for bad, words in (("20", "START:END"), ("a:b", "integers"), ("60:20", "before")):
        with pytest.raises(ld.DriftError, match=words):
            ld.parse_window(bad, its)


def test_edge_cases_give_clear_errors():
    ref = _reference(60)
    rng = random.Random(0)
    run = _run(ref, rng)
    with pytest.raises(ld.DriftError, match="10 common step.*needs at least 20"):
        ld.drift_stats(run, ref, ld.Window(51, 60), "U2")
    gaps = {t: v for t, v in run.items() if t not in (40, 41, 42)}
    with pytest.raises(ld.BrokenRunError, match=r"U2 lacks 3 step\(s\).*\[40, 41, 42\]"):
        ld.drift_stats(gaps, ref, ld.Window(21, 60), "U2")
    assert ld.drift_stats(gaps, ref, ld.Window(21, 60), "U2", allow_missing=True).steps == 37
    nan = dict(run)
    nan[45] = math.nan
    with pytest.raises(ld.BrokenRunError, match="U2 has a non-finite loss.*iteration 45"):
        ld.drift_stats(nan, ref, ld.Window(21, 60), "U2")
    nan[10] = math.nan          # outside the window: not the drift test's business
    del nan[45]
    nan[45] = run[45]
    assert ld.drift_stats(nan, ref, ld.Window(21, 60), "U2").steps == 40
    zero = dict(ref)
    zero[30] = 0.0
    with pytest.raises(ld.DriftError, match="loss 0 at iteration 30"):
        ld.drift_stats(run, zero, ld.Window(21, 60), "U2", "DP2")
    same = ld.drift_stats(ref, ref, ld.Window(21, 60), "DP vs DP")
    with pytest.raises(ld.DriftError, match="bit-identical.*measures no noise"):
        ld.noise_band([same])
    with pytest.raises(ld.DriftError, match="at least one"):
        ld.noise_band([])
    with pytest.raises(ld.DriftError, match="--drift-z"):
        ld.noise_band([ld.drift_stats(run, ref, ld.Window(21, 60))], z=-1.0)
    assert ld.signed_relative_difference(math.inf, 1.0) != ld.signed_relative_difference(
        math.inf, 1.0)           # NaN for plotting
    assert ld.signed_relative_difference(1.1, -1.0) == pytest.approx(2.1)


# --------------------------------------------------------------------------- the tool
@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("compare_loss_drift", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _write(path, losses, layout):
    with open(path, "w") as f:
        f.write(json.dumps({"kind": "run", "layout": layout}) + "\n")
        for it, loss in losses.items():
            f.write(json.dumps({"kind": "train", "iteration": it, "lm_loss": loss}) + "\n")
    return str(path)


@pytest.fixture()
def curves(tmp_path):
    rng = random.Random(1)
    ref = _reference()
    return {"ref": _write(tmp_path / "dp2.jsonl", ref, "TP1 U1 R1 DP2 PP1"),
            "pair": _write(tmp_path / "dp1_accum.jsonl", _run(ref, rng), "TP1 U1 R1 DP1 PP1"),
            "u2": _write(tmp_path / "u2.jsonl", _run(ref, rng), "TP1 U2 R1 DP1 PP1"),
            "r2": _write(tmp_path / "r2.jsonl", _run(ref, rng, OFFSET), "TP1 U1 R2 DP1 PP1"),
            "dir": tmp_path}


def test_tool_fails_naming_the_drifting_layout(tool, curves, capsys):
    png = curves["dir"] / "drift.png"
    code = tool.main([curves["ref"], curves["u2"], curves["r2"], "--labels", "DP2", "U2", "R2",
                      "--noise-pair", curves["ref"], curves["pair"], "--png", str(png),
                      "--print-every", "100", "--summary-json",
                      str(curves["dir"] / "summary.json")])
    out = capsys.readouterr().out
    assert code == 1, out
    with open(curves["dir"] / "summary.json") as f:
        summary = json.load(f)
    assert summary["exit_status"] == 1 and summary["drift"]["window"] == [251, 500]
    assert [(r["label"], r["drifts"]) for r in summary["drift"]["runs"]] == [
        ("U2", False), ("R2", True)]
    assert summary["drift"]["pairs"][0]["label"] == "dp2 vs dp1_accum"
    assert summary["drift"]["band"]["mean"] > 0 and not summary["max_divergence"]["enforced"]
    assert "FAIL: R2 drifts from the reference over iterations 251-500" in out
    assert "ok: U2: within the noise band" in out
    assert "noise band from dp2 vs dp1_accum" in out and "[reference pair]" in out
    assert "not enforced: the drift test decides" in out   # bf16-sized noise, no tolerance
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 30_000                   # three panels
    # Within the band, the tool passes; an explicit --tolerance is enforced as well.
    assert tool.main([curves["ref"], curves["u2"], "--noise-pair", curves["ref"],
                      curves["pair"]]) == 0
    assert "OK: no layout drifts outside the noise band" in capsys.readouterr().out
    assert tool.main([curves["ref"], curves["u2"], "--noise-pair", curves["ref"],
                      curves["pair"], "--tolerance", "1e-3"]) == 1
    assert "exceeds --tolerance" in capsys.readouterr().out


def test_tool_window_and_errors(tool, curves, capsys):
    args = [curves["ref"], curves["r2"], "--noise-pair", curves["ref"], curves["pair"]]
    assert tool.main(args + ["--drift-window", "1:15"]) == 2
    assert "needs at least 20" in capsys.readouterr().err
    assert tool.main(args + ["--drift-window", "x"]) == 2
    assert tool.main([curves["ref"], curves["r2"], "--noise-pair", curves["ref"],
                      curves["ref"]]) == 2
    assert "bit-identical" in capsys.readouterr().err
    assert tool.main(args + ["--noise-pair", curves["ref"], str(curves["dir"] / "no.jsonl")]
                     ) == 2
    nan = _reference()
    nan[300] = math.nan
    bad = _write(curves["dir"] / "nan.jsonl", nan, "TP1 U1 R2 DP1 PP1")
    assert tool.main([curves["ref"], bad, "--noise-pair", curves["ref"], curves["pair"]]) == 1
    assert "non-finite loss (nan) at iteration 300" in capsys.readouterr().out
    # Without a pair the statistics are printed, not judged; the tolerance decides.
    assert tool.main([curves["ref"], curves["r2"], "--tolerance", "1"]) == 0
    out = capsys.readouterr().out
    assert "no --noise-pair: drift statistics only" in out and "OK: the curves agree" in out
