"""``rankwatch analyze`` over production-shaped traces in the rankwatch trace format.

The traces are simulated jobs (tests/tracegen.py): data x pipeline parallel, 32 to 128 ranks,
microbatches and P2P per stage, a DP all-reduce per stage.  Each fault is checked against the
same trace generated without it.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

import tracegen
from rankwatch.agent.analyze.engine import analyze
from rankwatch.agent.analyze.readers import read_paths
from rankwatch.agent.analyze.rank_steps import step_matrix
from rankwatch.agent.analyze.table import TraceError
from rankwatch.agent.analyze.trace_format import read_trace
from rankwatch.agent.detect.consequence import consequences
from rankwatch.agent.detect.workload import workload_imbalance


def _run(tmp_path, name: str, **kw) -> tuple[dict, float]:
    """The analysis of a generated job, and its wall time per step."""
    path = tracegen.write(tracegen.Job(**kw), str(tmp_path / f"{name}.parquet"))
    t = read_trace(path)
    sm = step_matrix(t)
    wall = float(np.nanmax(sm.end) - np.nanmin(sm.start)) / len(sm.steps)
    return analyze(t), wall


def _named(r: dict) -> list[tuple[str, int, str | None]]:
    return [(i["kind"], i["rank"], i["detail"].get("cause")) for i in r["incidents"]]


def test_formats_read_alike(tmp_path):
    job = tracegen.Job(dp=2, pp=2, steps=5)
    tables = [read_trace(tracegen.write(job, str(tmp_path / f"t{ext}")))
              for ext in (".jsonl", ".jsonl.gz", ".csv", ".parquet")]
    ref = tables[0]
    for t in tables[1:]:
        assert len(t) == len(ref)
        np.testing.assert_array_equal(t.rank, ref.rank)
        np.testing.assert_allclose(t.start, ref.start)
        assert [t.names[i] for i in t.op] == [ref.names[i] for i in ref.op]
        np.testing.assert_array_equal(t.column("peer"), ref.column("peer"))


def test_unknown_columns_are_ignored(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"rank": 0, "step": 1, "op": "fwd", "kind": "compute", "start": 0.5,
                             "duration": 0.1, "colour": "blue", "pp": 1}) + "\n")
    t = read_trace(p)
    assert len(t) == 1 and t.column("pp").tolist() == [1] and t.column("tp") is None


_ROW = {"rank": 0, "step": 1, "op": "fwd", "kind": "compute", "start": 0.5, "duration": 0.1}


@pytest.mark.parametrize("change, row, field, why", [
    ({"rank": "zero"}, 3, "rank", "not a number"),
    ({"kind": "lunch"}, 3, "kind", "not one of"),
    ({"duration": -0.5}, 3, "duration", "out of range"),
    ({"rank": 1 << 30}, 3, "rank", "out of range"),
    ({"pp": -7}, 3, "pp", "out of range"),
    ({"start": None}, 3, "start", "missing"),
])
def test_a_bad_row_is_named(tmp_path, change, row, field, why):
    rows = [_ROW, _ROW, {**_ROW, **change}, _ROW]
    p = tmp_path / "bad.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert (e.value.row, e.value.column) == (row, field)
    assert why in str(e.value) and str(p) in str(e.value)


def test_bad_files_are_named(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(_ROW) + "\n" + '{"rank": 0, "step":\n')
    csv = tmp_path / "t.csv"
    csv.write_text("rank,step,op,kind,start,duration\n0,1,fwd,compute,0.1,0.2\n1,two,fwd,compute,0.1,0.2\n")
    short = tmp_path / "short.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"rank": [0], "step": [1], "op": ["f"], "kind": ["compute"], "start": [0.0]}), short)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    (tmp_path / "x.txt").write_text("rank,step\n")
    cases = {broken: (2, None, "not JSON"), csv: (3, "step", "not a number"),
             short: (None, None, "no column 'duration'"), empty: (None, None, "no operations"),
             tmp_path / "x.txt": (None, None, "not a trace file"), tmp_path / "gone.jsonl": (None, None, "no such")}
    for path, (row, field, why) in cases.items():
        with pytest.raises(TraceError) as e:
            read_paths([str(path)])
        assert (e.value.row, e.value.column) == (row, field), e.value
        assert why in str(e.value)


def test_the_cli_refuses_with_the_row_and_exits_2(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(_ROW) + "\n" + json.dumps({**_ROW, "kind": "<script>"}) + "\n")
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli.app", "analyze", str(p), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and not out.stdout
    assert f"{p}:2: kind:" in out.stderr and "Traceback" not in out.stderr


def test_one_slow_rank_is_named_with_its_cost(tmp_path):
    """128 ranks (dp 32 x pp 4): rank 77 computes 30 % slower from step 20.  It alone is the
    straggler (its pipeline neighbour, late at its all-reduce because it waits for rank 77,
    is dismissed by the replay), and the replay's speed-up without it is within 10 % of the
    step time measured on the same job generated without the fault."""
    r, slow = _run(tmp_path, "slow", dp=32, pp=4, slow_rank=77, slow_from=20)
    _, clean = _run(tmp_path, "clean", dp=32, pp=4)
    assert _named(r) == [("straggler", 77, "compute")]
    assert r["incidents"][0]["step"] >= 20
    top = r["whatif"][0]
    assert (top["kind"], top["what"]) == ("rank", 77)
    measured = slow / clean
    assert abs(top["speedup"] - measured) <= 0.10 * (measured - 1) + 0.01 * measured, (top, measured)
    assert r["replay"]["ok"] and r["replay"]["error"] <= 0.05
    assert r["workload_imbalance"] is None
    assert {d["rank"] for d in r["dismissed"]} <= {76, 78, 79} and all(d["consequence_of"] == 77 for d in r["dismissed"])


def test_a_slow_loader_is_named_data(tmp_path):
    r, _ = _run(tmp_path, "loader", dp=8, pp=4, slow_loader=8, loader_extra=0.03)
    assert _named(r) == [("straggler", 8, "data")]
    assert r["whatif"][0]["what"] in (8, "dataloader_next")
    assert r["replay"]["error"] <= 0.05


def test_a_heavy_last_stage_is_imbalance_not_a_straggler(tmp_path):
    r, _ = _run(tmp_path, "heavy", dp=16, pp=4, last_stage=1.6)
    assert r["incidents"] == []
    p = r["pipeline"]
    assert p["heaviest_stage"] == 3
    assert 1.5 <= p["imbalance"] <= 1.75, p
    assert r["whatif"][0]["kind"] == "stage" and r["whatif"][0]["what"] == 3
    assert r["replay"]["error"] <= 0.05


def test_random_workload_imbalance_is_its_own_finding(tmp_path):
    r, _ = _run(tmp_path, "imbalance", dp=32, pp=2, imbalance=0.2, seed=3)
    assert r["incidents"] == []
    w = r["workload_imbalance"]
    assert w is not None and w["share"] >= 0.05 and w["most_often_slowest"] <= 0.5
    assert r["replay"]["error"] <= 0.05


def test_a_clean_job_has_no_finding(tmp_path):
    r, _ = _run(tmp_path, "clean", dp=16, pp=2, seed=7)
    assert r["incidents"] == [] and r["dismissed"] == [] and r["workload_imbalance"] is None
    assert r["whatif"][0]["speedup"] < 1.03
    assert r["replay"]["error"] <= 0.05


def test_a_rank_that_stops_is_the_hang(tmp_path):
    """Rank 6 never issues its last all-reduce: the others issued it (their rows of it are
    the recording's last) and its group is one member short."""
    cols = tracegen.generate(tracegen.Job(dp=4, pp=2, steps=40))
    keep = [not (r == 6 and s == 39 and op in ("all_reduce", "optimizer_step"))
            for r, s, op in zip(cols["rank"], cols["step"], cols["op"])]
    rows = [dict(zip(cols, vals)) for vals, k in zip(zip(*cols.values()), keep) if k]
    p = tmp_path / "hang.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in rows))
    r = analyze(read_trace(p))
    hangs = [i for i in r["incidents"] if i["kind"] == "hang"]
    assert [h["rank"] for h in hangs] == [6]
    assert hangs[0]["detail"]["collective"]["group"] == "dp_stage0"


def test_the_json_holds_the_contract(tmp_path):
    path = tracegen.write(tracegen.Job(dp=4, pp=2, steps=30, slow_rank=3), str(tmp_path / "j.jsonl.gz"))
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli.app", "analyze", path, "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout)
    assert {"incidents", "pipeline", "bottleneck", "workload_imbalance", "whatif", "ranks", "steps"} <= set(r)
    assert (r["ranks"], r["steps"]) == (8, 30)
    for inc in r["incidents"]:
        assert {"kind", "node", "rank", "step", "detected_at", "detail"} <= set(inc)
    assert all(w["kind"] in ("rank", "stage", "op") and w["speedup"] > 0 for w in r["whatif"])
    assert r["bottleneck"]["kind"] in ("input", "communication", "compute")


def test_consequence_needs_a_culprit_that_gains():
    assert consequences([4, 5], {4: 1.0002, 5: 1.14}) == {4: 5}
    assert consequences([4, 5], {4: 1.0002, 5: 1.005}) == {}          # nobody's removal gains: keep both
    assert consequences([4, 5], {4: 1.05, 5: 1.14}) == {}             # both gain: two stragglers
    assert consequences([4, 5], {5: 1.14}) == {}                      # 4 was not replayed


def test_workload_imbalance_needs_the_slowest_to_move():
    rng = np.random.default_rng(0)
    own = 0.1 + 0.02 * rng.random((8, 40))
    ranks, roles, step = np.arange(8), np.zeros(8, int), np.full(40, 0.12)
    assert workload_imbalance(own, roles, ranks, step) is not None
    own[3] += 0.05                                                     # always rank 3: a straggler's business
    assert workload_imbalance(own, roles, ranks, step) is None


def test_clock_origins_that_differ_per_step_and_gaps_between_steps(tmp_path):
    """The trace format lets each step have its own clock origin, and steps need not be
    contiguous: a step is then measured and replayed from its own first start."""
    rng = np.random.default_rng(1)
    rows = []
    for step in range(0, 80, 2):
        t0 = float(rng.uniform(-1000, 1000))
        for r in range(4):
            t = t0 + float(rng.uniform(0, 0.001))
            slow = 1.5 if r == 2 and step > 20 else 1.0
            for op, kind, d in (("load", "data", 0.002), ("fwd", "compute", 0.01 * slow),
                                ("bwd", "compute", 0.02 * slow), ("opt", "optimizer", 0.003)):
                d *= float(rng.uniform(0.98, 1.02))
                rows.append({"rank": r, "step": step, "op": op, "kind": kind, "start": t, "duration": d})
                t += d
    p = tmp_path / "origins.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in rows))
    r = analyze(read_trace(p))
    assert _named(r) == [("straggler", 2, "compute")]
    assert 0.04 < r["step_seconds"] < 0.06                       # a step, not a jump of the clock
    assert (r["whatif"][0]["kind"], r["whatif"][0]["what"]) == ("rank", 2)
    assert 1.25 < r["whatif"][0]["speedup"] < 1.35                # 0.05 s against 0.035 s at its peers'
