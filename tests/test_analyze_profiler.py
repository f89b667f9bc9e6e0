"""PyTorch profiler traces for ``rankwatch analyze``: the reader on small Chrome traces written
here (gloo's shape, NCCL's args and kernels, bad files), and a real 2-rank harness job traced
with ``torch.profiler`` (``RANKWATCH_PROFILE_DIR``), one rank slowed."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import torchrun
from rankwatch.agent.analyze import profiler
from rankwatch.agent.analyze.profiler import is_profiler_trace, parse_profiler, read_profiler
from rankwatch.agent.analyze.table import KINDS, NOT_SET, TraceError, concat

PID, MAIN, GLOO = 100, 100, 7
BASE_NS = 1_790_000_000 * 10**9


def ev(name: str, ts: float, dur: float, tid: int = MAIN, cat: str = "cpu_op", **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur,
            "args": {"External id": 1, **args}}


def gloo_step(n: int, t: float, comm: float = 200.0) -> list[dict]:
    """One step shaped like FSDP on gloo: the all-gather runs on gloo's thread while the main
    thread waits inside ``FSDP::pre_forward``."""
    return [
        ev(f"ProfilerStep#{n}", t, 1000, cat="user_annotation"),
        ev("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", t + 10, 40, cat="user_annotation"),
        ev("FSDP::pre_forward", t + 100, 100 + comm + 50, cat="user_annotation"),
        ev("c10d::_allgather_base_", t + 120, 30),           # the launch, nested
        ev("gloo:all_gather", t + 200, comm, tid=GLOO, cat="user_annotation"),
        ev("aten::linear", t + 400 + comm, 100),
        ev("aten::mm", t + 410 + comm, 50),                  # nested: not a row of its own
        ev("Optimizer.step#AdamW.step", t + 600 + comm, 100, cat="user_annotation"),
    ]


def trace(events: list[dict], rank: int | None = 0, base_ns: int | None = BASE_NS, world: int = 2) -> dict:
    doc: dict = {"schemaVersion": 1, "deviceProperties": [], "host_name": "hostA", "displayTimeUnit": "ms"}
    if rank is not None:
        doc["distributedInfo"] = {"backend": "gloo", "rank": rank, "world_size": world, "pg_count": 2, "pg_config": [
            {"pg_name": "0", "pg_desc": "default_pg", "pg_size": world, "ranks": list(range(world))},
            {"pg_name": "1", "pg_desc": "mesh_tp", "pg_size": 1, "ranks": [rank]}]}
    if base_ns is not None:
        doc["baseTimeNanoseconds"] = base_ns
    doc["traceEvents"] = [{"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": {"name": "python"}},
                          *events, {"ph": "i", "name": "marker", "pid": PID, "tid": MAIN, "ts": 0, "s": "t"}]
    return doc


def write(path: Path, doc: dict | str) -> str:
    text = doc if isinstance(doc, str) else json.dumps(doc, indent=1)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


def rows(t) -> list[tuple]:
    return [(int(s), t.names[o], KINDS[k], round(float(a) * 1e6 - (BASE_NS / 1e3 - profiler.ORIGIN_NS / 1e3), 1),
             round(float(d) * 1e6, 1)) for s, o, k, a, d in zip(t.step, t.op, t.kind, t.start, t.duration)]


def test_a_step_is_its_top_level_events_cut_around_the_communication(tmp_path):
    t = read_profiler(write(tmp_path / "w.pt.trace.json", trace(gloo_step(5, 1000.0))))
    assert rows(t) == [
        (5, "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "data", 1010.0, 40.0),
        (5, "FSDP::pre_forward", "compute", 1100.0, 100.0),
        (5, "all_gather", "collective", 1200.0, 200.0),      # gloo's span, from its own thread
        (5, "FSDP::pre_forward", "compute", 1400.0, 50.0),   # the rest of the event around it
        (5, "aten::linear", "compute", 1600.0, 100.0),
        (5, "Optimizer.step#AdamW.step", "optimizer", 1800.0, 100.0),
    ]
    assert set(t.rank) == {0} and t.names[t.node[0]] == "hostA"
    coll = t.kind == KINDS.index("collective")
    assert [t.names[g] for g in t.group[coll]] == ["default_pg"]   # the one group of more than one rank
    assert list(t.group[~coll]) == [NOT_SET] * 5
    ends = t.start + t.duration
    assert (t.start[1:] >= ends[:-1]).all(), "a chain: no row overlaps the next"


def test_ranks_share_one_clock_and_their_collectives_pair(tmp_path):
    # Rank 1's profiler began 5 ms later: its ts are 5 ms smaller for the same moment.
    paths = []
    for rank, shift_us in ((0, 0), (1, 5000)):
        events = gloo_step(3, 1000.0 - shift_us, comm=300 if rank == 0 else 50) + gloo_step(4, 3000.0 - shift_us)
        paths.append(write(tmp_path / f"r{rank}.json", trace(events, rank, base_ns=BASE_NS + shift_us * 1000)))
    t = concat([read_profiler(p) for p in paths])
    assert sorted(set(t.rank.tolist())) == [0, 1] and sorted(set(t.step.tolist())) == [3, 4]
    for step in (3, 4):
        firsts = [t.start[(t.rank == r) & (t.step == step)].min() for r in (0, 1)]
        assert firsts[0] == pytest.approx(firsts[1], abs=1e-7)
    coll = t.kind == KINDS.index("collective")
    pairs = {(int(r), int(s)) for r, s in zip(t.rank[coll], t.column("seq")[coll])}
    assert pairs == {(0, 0), (0, 1), (1, 0), (1, 1)}, "the n-th collective of each rank pairs by seq"
    assert parse_profiler(paths[1]).world_size == 2


def test_nccl_args_name_the_group_seq_bytes_and_peer_and_kernels_are_collected(tmp_path):
    comm = {"Collective name": "allreduce", "Process Group Name": "3", "Process Group Description": "mesh_dp",
            "Seq": 41, "In msg nelems": 1024, "Out msg nelems": 1024, "dtype": "Float", "Group size": 2}
    events = [
        ev("ProfilerStep#7", 0, 1000, cat="user_annotation"),
        ev("nccl:all_reduce", 100, 60, cat="user_annotation"),
        ev("record_param_comms", 105, 50, **comm),
        ev("cudaLaunchKernel", 120, 10, cat="cuda_runtime", correlation=9),
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0, "tid": 7,
         "ts": 150, "dur": 400, "args": {"correlation": 9}},
        ev("nccl:send", 300, 20, cat="user_annotation"),
        ev("record_param_comms", 302, 10, **{"Collective name": "send", "Dst Rank": 1, "Seq": 2,
                                              "Process Group Description": "pp", "In msg nelems": 8,
                                              "dtype": "BFloat16"}),
        ev("aten::mm", 400, 100),
    ]
    tr = parse_profiler(write(tmp_path / "rank0.json.gz", trace(events)))
    t = tr.table
    assert [(t.names[o], KINDS[k]) for o, k in zip(t.op, t.kind)] == [
        ("all_reduce", "collective"), ("send", "p2p"), ("aten::mm", "compute")]
    assert [t.names[g] for g in t.group[:2]] == ["mesh_dp", "pp"]
    assert t.column("seq")[:2].tolist() == [41, 2] and t.column("bytes")[:2].tolist() == [4096, 16]
    assert t.column("peer").tolist() == [NOT_SET, 1, NOT_SET]
    assert tr.kernel_seconds[0] == pytest.approx(400e-6) and np.isnan(tr.kernel_seconds[1:]).all()


def test_gloo_point_to_point_pairs_the_nth_send_with_the_peers_nth_receive(tmp_path):
    # A 2-stage pipeline on gloo: its gloo:send / gloo:recv run on the step's thread, with no args.
    order = {0: ("send", "send", "recv", "recv"), 1: ("recv", "send", "recv", "send")}
    t = concat([read_profiler(write(tmp_path / f"r{rank}.json", trace(
        [ev("ProfilerStep#2", 0, 1000, cat="user_annotation")]
        + [ev(f"gloo:{op}", 100 + 200 * i, 50, cat="user_annotation") for i, op in enumerate(ops)]
        + [ev("c10d::allreduce_", 900, 10)], rank))) for rank, ops in order.items()])
    p2p = t.kind == KINDS.index("p2p")
    got = {(int(r), t.names[o], int(q), int(p)) for r, o, q, p in
           zip(t.rank[p2p], t.op[p2p], t.column("seq")[p2p], t.column("peer")[p2p])}
    assert got == {(0, "send", 0, 1), (0, "send", 1, 1), (0, "recv", 0, 1), (0, "recv", 1, 1),
                   (1, "recv", 0, 0), (1, "send", 0, 0), (1, "recv", 1, 0), (1, "send", 1, 0)}
    # The c10d op is a launch where gloo spans exist: compute, not a second collective.
    assert [KINDS[k] for k in t.kind[t.names.index("c10d::allreduce_") == t.op]] == ["compute"] * 2


def test_without_gloo_or_nccl_spans_the_c10d_ops_are_the_communication(tmp_path):
    t = read_profiler(write(tmp_path / "rank0.json", trace([
        ev("ProfilerStep#1", 0, 1000, cat="user_annotation"), ev("FSDP::all_gather", 100, 300),
        ev("c10d::_allgather_base_", 150, 200), ev("c10d::recv_", 500, 100)])))
    assert rows(t) == [(1, "FSDP::all_gather", "compute", 100.0, 50.0), (1, "all_gather", "collective", 150.0, 200.0),
                       (1, "FSDP::all_gather", "compute", 350.0, 50.0), (1, "recv", "p2p", 500.0, 100.0)]
    assert t.column("peer").tolist() == [NOT_SET, NOT_SET, NOT_SET, 1]


def test_rank_from_the_file_name_else_an_error(tmp_path):
    assert set(read_profiler(write(tmp_path / "job_rank3.123.pt.trace.json", trace(gloo_step(1, 0), None))).rank) == {3}
    with pytest.raises(TraceError, match="no rank"):
        read_profiler(write(tmp_path / "worker.json", trace(gloo_step(1, 0), None)))


def test_without_a_base_time_the_ts_are_the_clock(tmp_path):
    t = read_profiler(write(tmp_path / "a.json", trace(gloo_step(1, 2_000_000.0), base_ns=None)))
    assert t.start[0] == pytest.approx(2.00001)


@pytest.mark.parametrize("name,content,why", [
    ("bad.json", '{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 2,}]}', r"bad JSON at byte 60 \(line 1, column 61"),
    ("nolist.json", '{"schemaVersion": 1}', "no traceEvents"),
    ("array.json", "[1, 2]", "not a JSON object"),
    ("nosteps.json", json.dumps(trace([ev("aten::mm", 0, 5)])), r"no ProfilerStep#N"),
    ("negdur.json", json.dumps(trace([ev("ProfilerStep#1", 0, -5)])), r"negdur.json:1: dur: -5"),
    ("nots.json", json.dumps(trace([{"ph": "X", "name": "ProfilerStep#1", "dur": 3}])), r":1: ts: None"),
    ("latin.json", b'{"traceEvents": ["\xff"]}', "not UTF-8 at byte 18"),
    ("trunc.json.gz", b"\x1f\x8b\x08\x00garbage", "cannot read"),
])
def test_bad_files_name_the_file_and_what_is_wrong(tmp_path, name, content, why):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(TraceError, match=why) as err:
        read_profiler(str(path))
    assert str(path) in str(err.value)


def test_a_file_over_the_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    plain = write(tmp_path / "big.json", trace(gloo_step(1, 0)))
    packed = write(tmp_path / "big.json.gz", trace(gloo_step(1, 0)))
    monkeypatch.setattr(profiler, "MAX_BYTES", 1000)
    for path in (plain, packed):
        with pytest.raises(TraceError, match="over the 1000 bytes"):
            read_profiler(path)


def test_the_sniff_reads_only_the_start(tmp_path):
    assert is_profiler_trace(write(tmp_path / "a.pt.trace.json.gz", trace(gloo_step(1, 0))))
    assert is_profiler_trace(write(tmp_path / "b.json", '{"traceEvents": [' + "x" * 200_000))  # not parsed
    assert not is_profiler_trace(write(tmp_path / "c.json", '{"rank": 0, "step": 1, "op": "a"}\n'))
    assert not is_profiler_trace(write(tmp_path / "d.json", "not json"))
    assert not is_profiler_trace(str(tmp_path / "missing.json"))
    (tmp_path / "e.json.gz").write_bytes(b"plain")
    assert not is_profiler_trace(str(tmp_path / "e.json.gz"))


def test_the_harness_profiles_only_when_asked_and_names_a_bad_window():
    from rankwatch.hooks.harness.profiling import StepProfiler, profiled_steps, window

    off = profiled_steps(0, env={})
    assert isinstance(off, StepProfiler) and not off.active
    off.step()  # a no-op
    assert window(None) == (5, 45) and window("1:3") == (1, 3)
    for bad in ("5", "a:b", "0:4", "9:9"):
        with pytest.raises(ValueError, match="RANKWATCH_PROFILE_STEPS"):
            window(bad)


# --- a real job ---------------------------------------------------------------------------

FIRST, LAST, ONSET, SLOW_RANK = 5, 45, 15, 1


@pytest.fixture(scope="module")
def profiled_job(tmp_path_factory) -> Path:
    """A 2-rank harness job on gloo, steps FIRST..LAST-1 profiled, rank 1's compute slowed
    (x1 its usual step time) from harness step ONSET on (profiler step ONSET - 1)."""
    out = tmp_path_factory.mktemp("profiled")
    job = torchrun(2, "--steps", str(LAST + 2), "--log-every", "0", "--no-rankwatch",
                   "--fault", f"slow_compute:{SLOW_RANK}:{ONSET}:1.0",
                   env={"RANKWATCH_PROFILE_DIR": str(out / "traces"), "RANKWATCH_PROFILE_STEPS": f"{FIRST}:{LAST}"},
                   log=out / "job.log")
    try:
        assert job.wait(300) == 0, (out / "job.log").read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
    return out / "traces"


def own_seconds(t, rank: int, steps: list[int]) -> float:
    """The rank's median step span less its collective rows."""
    out = []
    for s in steps:
        m = (t.rank == rank) & (t.step == s)
        span = (t.start[m] + t.duration[m]).max() - t.start[m].min()
        out.append(span - t.duration[m & (t.kind == KINDS.index("collective"))].sum())
    return float(np.median(out))


@pytest.mark.e2e
def test_a_profiled_job_reads_as_both_ranks_steps_and_paired_collectives(profiled_job):
    files = sorted(profiled_job.glob("rank*.pt.trace.json"))
    assert [f.name.split(".")[0] for f in files] == ["rank0", "rank1"]
    assert all(is_profiler_trace(str(f)) for f in files)
    traces = [parse_profiler(str(f)) for f in files]
    assert [(tr.rank, tr.world_size) for tr in traces] == [(0, 2), (1, 2)]
    t = concat([tr.table for tr in traces])
    steps = sorted(set(t.step.tolist()))
    assert steps == list(range(FIRST, LAST)), steps
    coll = t.kind == KINDS.index("collective")
    assert {t.names[o] for o in t.op[coll]} >= {"all_gather", "all_reduce"}
    assert {t.names[g] for g in t.group[coll]} == {"default_pg"}
    seqs = [t.column("seq")[coll & (t.rank == r)].tolist() for r in (0, 1)]
    assert seqs[0] == seqs[1] and len(seqs[0]) >= len(steps), "each collective pairs with its peer's"
    assert {KINDS[k] for k in t.kind} >= {"data", "optimizer", "compute", "collective"}
    before, after = list(range(FIRST, ONSET - 2)), list(range(ONSET + 1, LAST))
    slow, fast = own_seconds(t, SLOW_RANK, after), own_seconds(t, 1 - SLOW_RANK, after)
    assert slow > 2 * fast, (slow, fast)
    assert own_seconds(t, SLOW_RANK, before) < 1.5 * own_seconds(t, 1 - SLOW_RANK, before)


@pytest.mark.e2e
def test_analyze_names_the_slowed_rank_in_the_profiled_job(profiled_job):
    done = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "analyze", str(profiled_job), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert (out["ranks"], out["steps"]) == (2, LAST - FIRST)
    stragglers = [(i["rank"], i["detail"]["cause"]) for i in out["incidents"] if i["kind"] == "straggler"]
    assert stragglers == [(SLOW_RANK, "compute")], out["incidents"]
    ranks = [w for w in out["whatif"] if w["kind"] == "rank"]
    assert ranks[0]["what"] == SLOW_RANK and ranks[0]["speedup"] > 1.3, ranks
    assert out["replay"]["ok"] and not math.isnan(out["replay"]["error"]), out["replay"]
