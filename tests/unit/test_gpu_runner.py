"""The GPU-tier runner's planning, outcomes and record (tests/gpu_runner.py), on the CPU."""

from __future__ import annotations

import datetime as dt
import json
import textwrap

import pytest

from tests import gpu_runner as gr


def test_files_stay_whole_when_they_fit_and_are_cut_when_not():
    ids = ["a.py::t1", "a.py::t2", "b.py::t1", "b.py::t2", "b.py::t3", "c.py::t1"]
    est = {"a.py::t1": 100, "a.py::t2": 100, "b.py::t1": 300, "b.py::t2": 300,
           "b.py::t3": 300, "c.py::t1": 50}
    # b.py (900 s) cannot stay whole, so it fills a.py's chunk, then is cut between tests
    assert gr.plan_chunks(ids, est, budget_s=540, default_s=60) == [
        ["a.py::t1", "a.py::t2", "b.py::t1"], ["b.py::t2"], ["b.py::t3", "c.py::t1"]]
    # a file that fits stays whole: it opens a new chunk instead of being cut
    assert gr.plan_chunks(["a.py::t1", "b.py::t1", "b.py::t2"],
                          {"a.py::t1": 300, "b.py::t1": 200, "b.py::t2": 200}, 540, 60) == [
        ["a.py::t1"], ["b.py::t1", "b.py::t2"]]


def test_a_test_over_the_budget_runs_alone_and_unknown_tests_take_the_default():
    ids = ["a.py::long", "a.py::x", "b.py::y", "b.py::z"]
    assert gr.plan_chunks(ids, {"a.py::long": 900}, budget_s=100, default_s=40) == [
        ["a.py::long"], ["a.py::x"], ["b.py::y", "b.py::z"]]
    assert gr.plan_chunks([], {}, 100, 40) == []


def test_outcomes_name_the_stopped_test_and_those_never_run():
    lines = [{"nodeid": "a", "outcome": "started"},
             {"nodeid": "a", "outcome": "passed", "duration_s": 1.5, "message": ""},
             {"nodeid": "b", "outcome": "started"}]
    got = gr.outcomes(["a", "b", "c"], lines, timed_out=True, budget_s=540)
    assert [t["outcome"] for t in got] == ["passed", "timeout", gr.NOT_RUN]
    assert "540 s" in got[1]["message"]
    crashed = gr.outcomes(["a", "b"], lines, timed_out=False, budget_s=540)
    assert crashed[1]["outcome"] == "crashed"


def _record(tests):
    chunk = gr.ChunkResult(1, [t["nodeid"] for t in tests], 1, 12.5, tests)
    env = {"host": "gpu-node/1", "python": "3.11.9", "torch": "2.13.0", "cuda": "12.8",
           "gpus": ["NVIDIA H200", "NVIDIA H200"]}
    when = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    return gr.build_record([chunk], env, {"commit": "abc123", "dirty": False},
                           ["tools/run_gpu_tests.py", "--out", "x"], 540.0, when)


def test_the_record_holds_versions_and_every_outcome(tmp_path):
    tests = [{"nodeid": "tests/gpu/test_a.py::t[x]", "outcome": "passed", "duration_s": 3.25,
              "message": ""},
             {"nodeid": "tests/gpu/test_a.py::u", "outcome": "failed", "duration_s": 1.0,
              "message": "AssertionError: 0.3 | 0.1"}]
    record = _record(tests)
    path = gr.write_record(record, tmp_path / "records")
    assert path.name == "gpu_tests_2030-01-02T030405Z_gpu-node-1.json"
    saved = json.loads(path.read_text())
    assert saved["date"] == "2030-01-02T03:04:05+00:00"
    assert (saved["host"], saved["gpus"], saved["torch"], saved["cuda"], saved["commit"]) == \
        ("gpu-node/1", ["NVIDIA H200"] * 2, "2.13.0", "12.8", "abc123")
    assert saved["summary"] == {"passed": 1, "failed": 1}
    assert saved["chunks"] == [{"index": 1, "tests": 2, "returncode": 1, "wall_s": 12.5}]
    assert saved["tests"] == tests
    page = path.with_suffix(".md").read_text()
    assert "| GPUs | NVIDIA H200, NVIDIA H200 |" in page
    assert "| `tests/gpu/test_a.py::t[x]` | passed | 3.2 |" in page
    assert "0.3 \\| 0.1" in page                     # a '|' in a message keeps the table
    # the next plan takes its estimates from this record
    assert gr.load_estimates(tmp_path / "records") == {
        "tests/gpu/test_a.py::t[x]": 3.25, "tests/gpu/test_a.py::u": 1.0}


@pytest.mark.slow
def test_a_chunk_reports_each_test_and_stops_at_its_budget(tmp_path):
    (tmp_path / "test_fake.py").write_text(textwrap.dedent("""
        import time
        import pytest

        def test_ok():
            pass

        def test_bad():
            assert 1 == 2

        @pytest.mark.skip(reason="no GPU here")
        def test_skipped():
            pass

        def test_hangs():
            time.sleep(60)

        def test_after():
            pass
    """))
    ids = [f"{tmp_path}/test_fake.py::{n}"
           for n in ("test_ok", "test_bad", "test_skipped", "test_hangs", "test_after")]
    result = gr.run_chunk(1, ids, budget_s=15, report_dir=tmp_path)
    assert result.returncode is None and result.wall_s >= 15
    got = {t["nodeid"].rsplit("::", 1)[1]: t for t in result.tests}
    assert [got[n]["outcome"] for n in ("test_ok", "test_bad", "test_skipped", "test_hangs",
                                        "test_after")] == [
        "passed", "failed", "skipped", "timeout", gr.NOT_RUN]
    assert "assert 1 == 2" in got["test_bad"]["message"]
    assert "no GPU here" in got["test_skipped"]["message"]
