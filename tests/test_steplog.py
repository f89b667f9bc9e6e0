"""The agent's step history (agent/durable/steplog.py): rows that tile each rank-step to the
own work, data wait and collective wait the live detectors used, a byte bound that holds
whatever comes in, and a full disk that costs rows, never the agent."""

from __future__ import annotations

import gzip
import json
import os
import random
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import grpc
import numpy as np
import pytest

from conftest import AgentProcess, wait_for
from rankstream import Stream, hello
from rankwatch.agent.durable.steplog import HISTORY_DIR, StepLog
from rankwatch.agent.node.intake import OPS, NodeState
from rankwatch.proto import pb

T0 = time.time() - 3600.0


def collectives(records: list[tuple], names: list[str]) -> pb.CollectiveColumns:
    """``records``: (op index, pg code, seq, start, duration, bytes)."""
    a = np.array(records, dtype=object).reshape(-1, 6)
    return pb.CollectiveColumns(
        op=a[:, 0].astype("<u1").tobytes(), pg=a[:, 1].astype("<u2").tobytes(), seq=a[:, 2].astype("<i8").tobytes(),
        start=a[:, 3].astype("<f8").tobytes(), duration=a[:, 4].astype("<f8").tobytes(),
        nbytes=a[:, 5].astype("<i8").tobytes(), pg_names=names)


def steps(rows: list[tuple]) -> pb.StepColumns:
    """``rows``: (step, start, duration, data, forward, backward, optimizer, wait)."""
    cols = pb.StepColumns()
    for step, start, dur, data, fwd, bwd, opt, wait in rows:
        cols.step.append(step)
        cols.start.append(start)
        cols.duration.append(dur)
        cols.data.append(data)
        cols.forward.append(fwd)
        cols.backward.append(bwd)
        cols.optimizer.append(opt)
        cols.tokens.append(0.0)
        cols.flops.append(0.0)
        cols.wait.append(wait)
    return cols


def one_step(rng: random.Random, step: int, start: float, seq0: int) -> tuple[tuple, list[tuple]]:
    """A step of varied shape: synchronous waits, asynchronous collectives waited for later,
    a P2P pair, now and then a wait with no record (or more wait than wall time)."""
    data, fwd, bwd, opt = (rng.uniform(0.001, 0.02) for _ in range(4))
    t, colls, blocked = start + data, [], 0.0
    for i in range(rng.randint(0, 5)):
        t += rng.uniform(0.0005, 0.01)                      # compute before the issue
        issue, waited = t, rng.uniform(0.0, 0.008)          # then an async gap of compute
        t += waited
        b = rng.uniform(0.0, 0.01)                          # blocked in the wait
        t += b
        blocked += b
        op = rng.choice([0, 1, 2, 9, 10])
        colls.append((op, i % 2, seq0 + i, issue, t - issue, rng.randint(0, 1 << 20)))
    extra = rng.choice([0.0, 0.0, 0.0, rng.uniform(0.0, 0.01)])   # waited with no record (dropped, DDP)
    wall = max(t - start, data + fwd + bwd + opt) + extra + rng.uniform(0, 0.005)
    wait = blocked + extra
    if rng.random() < 0.05:
        wait = wall * 1.3                                   # a step dated from the last one's end
    return (step, start, wall, data, fwd, bwd, opt, wait), colls


def feed(state: NodeState, ranks: int, n_steps: int, seed: int = 0, per_batch: int = 7,
         mesh: dict | None = None) -> dict:
    rng = random.Random(seed)
    handles = {r: state.hello(pb.Hello(rank=r, world_size=ranks, pid=os.getpid() + r, node_id="n0",
                                       backend="gloo", op_names=list(OPS), mesh_coords=mesh or {}))
               for r in range(ranks)}
    seqs = {r: 0 for r in range(ranks)}
    starts = {r: T0 for r in range(ranks)}
    batch_no = defaultdict(int)
    for first in range(0, n_steps, per_batch):
        for r, h in handles.items():
            step_rows, coll_rows = [], []
            for k in range(first, min(first + per_batch, n_steps)):
                s, c = one_step(rng, k, starts[r], seqs[r])
                step_rows.append(s)
                coll_rows += c
                seqs[r] += len(c)
                starts[r] += s[2] + rng.uniform(0, 0.003)
            batch_no[r] += 1
            batch = pb.Batch(seq=batch_no[r], steps=steps(step_rows))
            if coll_rows:
                batch.collectives.CopyFrom(collectives(coll_rows, ["default_pg", "tp_group"]))
            state.ingest(h, batch)
    return handles


def read_rows(directory: Path) -> list[dict]:
    out = []
    for path in sorted(directory.glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            out += [json.loads(line) for line in f]
    return out


def per_rank_step(rows: list[dict]) -> dict[tuple[int, int], dict]:
    by = defaultdict(list)
    for r in rows:
        by[(r["rank"], r["step"])].append(r)
    out = {}
    for key, rs in by.items():
        span = max(r["start"] + r["duration"] for r in rs) - min(r["start"] for r in rs)
        wait = sum(r["duration"] for r in rs if r["kind"] in ("collective", "p2p"))
        data = sum(r["duration"] for r in rs if r["kind"] == "data")
        out[key] = {"own": span - wait, "wait": wait, "data": data, "rows": sorted(rs, key=lambda r: r["start"])}
    return out


def test_rows_tile_each_step_to_what_the_live_detectors_used(tmp_path):
    state = NodeState("n0")
    log = StepLog.attach(state, tmp_path, OPS, 1 << 30)
    handles = feed(state, ranks=3, n_steps=60, mesh={"dp": 1, "tp": 0})
    log.close()
    got = per_rank_step(read_rows(tmp_path / HISTORY_DIR))
    assert len(got) == 3 * 60
    for r, h in handles.items():
        live = list(zip(h.own_work, h.data_wait, h.comm_wait))   # the detectors' windows (the last 60)
        for k, (own, data, wait) in enumerate(live):
            g = got[(r, k)]
            assert g["own"] == pytest.approx(own, abs=1e-6) and g["wait"] == pytest.approx(wait, abs=1e-6), (r, k)
            assert g["data"] == pytest.approx(min(data, own), abs=1e-6), (r, k)
            rows = g["rows"]
            for a, b in zip(rows, rows[1:]):      # no two rows of a step overlap (a Unix time
                assert b["start"] >= a["start"] + a["duration"] - 5e-7, (a, b)   # holds 0.24 us)
            assert all(x["node"] == "n0" and x["dp"] == 1 and x["tp"] == 0 for x in rows)
    kinds = {(x["op"], x["kind"]) for g in got.values() for x in g["rows"]}
    assert {("send", "p2p"), ("recv", "p2p"), ("all_reduce", "collective"), ("data", "data"),
            ("forward", "compute"), ("optimizer", "optimizer"), ("wait", "collective")} <= kinds
    named = [x for g in got.values() for x in g["rows"] if x["kind"] == "collective" and x["op"] != "wait"]
    assert named and all(x["group"] in ("default_pg", "tp_group") and x["seq"] >= 0 for x in named)
    assert log.outside == 0 and log.dropped == 0


def test_a_collective_ends_its_row_where_it_completed(tmp_path):
    # The rank waits 30 ms in its second collective: that row ends at the collective's end.
    state = NodeState("n0")
    log = StepLog.attach(state, tmp_path, OPS, 1 << 30)
    h = state.hello(hello(0, 2))
    coll = collectives([(0, 0, 0, T0 + 0.010, 0.001, 8), (0, 0, 1, T0 + 0.050, 0.040, 8)], ["default_pg"])
    state.ingest(h, pb.Batch(seq=1, collectives=coll, steps=steps([(0, T0, 0.1, 0.01, 0.03, 0.03, 0.01, 0.031)])))
    log.close()
    rows = [r for r in read_rows(tmp_path / HISTORY_DIR) if r["kind"] == "collective"]
    assert [r["seq"] for r in rows] == [0, 1]
    for r, end in zip(rows, (T0 + 0.011, T0 + 0.090)):
        assert r["start"] + r["duration"] == pytest.approx(end, abs=1e-9)
    assert sum(r["duration"] for r in rows) == pytest.approx(0.031, abs=1e-9)


def test_rotation_keeps_the_bound_and_deletes_the_oldest_first(tmp_path):
    bound = 48 << 10
    log = StepLog(tmp_path / HISTORY_DIR, "n0", OPS, bound, flush_bytes=8 << 10, background=False)
    sizes = []
    for seed in range(6):   # six jobs, one after the other
        state = NodeState("n0")
        state.collective_listeners.append(log.on_collectives)
        state.step_listeners.append(log.on_steps)
        feed(state, ranks=2, n_steps=150, seed=seed)
        log.drain(final=True)
        sizes.append(sum(p.stat().st_size for p in (tmp_path / HISTORY_DIR).iterdir()))
    log.close()
    assert max(sizes) <= bound and log.files.deleted_rows > 0, sizes
    files = sorted(p.name for p in (tmp_path / HISTORY_DIR).iterdir())
    numbers = [int(name.split("-")[-1].split(".")[0]) for name in files]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))) and numbers[0] > 0, files
    assert all(name.startswith("steps-n0-") for name in files)
    rows = read_rows(tmp_path / HISTORY_DIR)
    assert rows and rows[-1]["step"] == 149   # the newest kept


def test_bad_input_cannot_blow_the_bound(tmp_path):
    # Endless collectives that fall in no step, names at the wire's length cap, a member bigger
    # than the whole bound, a queue never drained: the bound, the queue and the pending records
    # all hold.
    state = NodeState("n0")
    bound = 16 << 10
    log = StepLog(tmp_path / HISTORY_DIR, "n0", OPS, bound, flush_bytes=1 << 30, queue_records=5000,
                  background=False)
    state.collective_listeners.append(log.on_collectives)
    state.step_listeners.append(log.on_steps)
    h = state.hello(hello(0, 2))
    names = ["g" * 128 + str(i) for i in range(4)]
    for b in range(1, 40):
        recs = [(0, i % 4, b * 1000 + i, T0 + b, 0.001, 1) for i in range(1000)]
        state.ingest(h, pb.Batch(seq=b, collectives=collectives(recs, [n[:128] for n in names])))
    assert log.queued == 5000 and log.dropped == 34_000   # the queue is full: the rest is dropped
    log.drain()
    assert log.outside == 0   # waiting for a step: bounded by MAX_PENDING records
    for b in range(10):     # 4,000 steps, drained as they come, written as one member at the end
        many = [(k, T0 + 100 + k * 0.001, 0.001, 0.0, 0.0005, 0.0003, 0.0001, 0.0) for k in range(b * 400, b * 400 + 400)]
        state.ingest(h, pb.Batch(seq=100 + b, steps=steps(many)))
        log.drain()
    assert log.files.written_rows == 0
    log.drain(final=True)   # that member is bigger than the whole bound: dropped
    held = sum(p.stat().st_size for p in (tmp_path / HISTORY_DIR).glob("*"))
    assert held <= bound and log.files.dropped_rows >= 4000 and log.files.written_rows == 0
    assert log.outside == 5000   # the collectives before step 0
    log.close()


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))   # Python ignores SIGXFSZ: EFBIG


def test_a_full_disk_costs_rows_never_the_agent(tmp_path):
    """A real agent whose files may not grow past 20 kB (RLIMIT_FSIZE: every write past it
    fails with EFBIG, as on a full disk), fed steps over its socket."""
    state = tmp_path / "state-n0"
    agent = AgentProcess(tmp_path / "agent.sock")
    agent.start = lambda timeout=15.0: _start_limited(agent, state, timeout)  # type: ignore[method-assign]
    agent.start()
    channel = grpc.insecure_channel(agent.addr.grpc_target())
    try:
        s = Stream(channel, hello(0, 2))
        rng = random.Random(1)
        start = time.time() - 600
        for b in range(1, 61):
            rows = []
            for k in range((b - 1) * 20, b * 20):
                row, _ = one_step(rng, k, start, 0)
                rows.append(row)
                start += row[2]
            s.batch(steps=steps(rows))
        wait_for(lambda: agent.status()["storage"]["history"]["failures"] > 0, 30, what="a failed history write")
        hist = agent.status()["storage"]["history"]
        assert hist["ok"] is False and "File too large" in hist["last_error"] and hist["dropped"] > 0, hist
        assert agent.proc.poll() is None and agent.status()["ranks"][0]["step"] == 1199   # still taking records
        files = list((state / HISTORY_DIR).glob("*.jsonl.gz"))
        assert files and all(p.stat().st_size <= 20_000 for p in files)
        for p in files:     # every file whole: each failed member was cut away
            with gzip.open(p, "rt") as f:
                assert all(json.loads(line)["rank"] == 0 for line in f)
        s.close()
    finally:
        channel.close()
        agent.stop()


def _start_limited(agent: AgentProcess, state: Path, timeout: float) -> AgentProcess:
    with open(agent.log, "a") as log:
        agent.proc = subprocess.Popen(
            [sys.executable, "-m", "rankwatch.agent.cli", "agent", "--listen", str(agent.sock), "--metrics-port", "0",
             "--metrics-addr", "127.0.0.1", "--node-id", "n0", "--state-dir", str(state)],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_limit_file_size)
    wait_for(lambda: agent.proc.poll() is not None or _answers(agent), timeout, what="the agent")
    assert agent.proc.poll() is None, agent.log.read_text()
    return agent


def _answers(agent: AgentProcess) -> bool:
    try:
        agent.status()
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


def test_analyze_reads_the_latest_job_whole_members_only(tmp_path):
    from rankwatch.agent.analyze.agent_record import read_history
    from rankwatch.agent.analyze.table import KINDS

    log = StepLog(tmp_path / HISTORY_DIR, "n0", OPS, 1 << 30, flush_bytes=4 << 10, background=False)
    for job, n_steps in (("old-job", 30), ("new-job", 50)):   # two jobs, one state directory
        state = NodeState("n0")
        state.collective_listeners.append(log.on_collectives)
        state.step_listeners.append(log.on_steps)
        handles = {r: state.hello(pb.Hello(rank=r, world_size=2, pid=os.getpid() + r, node_id="n0",
                                           backend="gloo", op_names=list(OPS), job_id=job)) for r in range(2)}
        rng = random.Random(job)
        for r, h in handles.items():
            rows, colls = zip(*(one_step(rng, k, T0 + k, 0) for k in range(n_steps)))
            state.ingest(h, pb.Batch(seq=1, steps=steps(list(rows))))
        log.drain(final=True)
    t = read_history(tmp_path)
    assert sorted(set(t.step.tolist())) == list(range(50)) and set(t.rank.tolist()) == {0, 1}
    wait = t.duration[np.isin(t.kind, [KINDS.index("collective"), KINDS.index("p2p")])].sum()
    assert wait == pytest.approx(sum(sum(h.comm_wait) for h in handles.values()), abs=1e-7)
    # A crash in the middle of a member: the file is read up to it.
    newest = sorted((tmp_path / HISTORY_DIR).glob("*.jsonl.gz"))[-1]
    whole = len(read_history(tmp_path))
    newest.write_bytes(newest.read_bytes()[:-50])
    assert 0 < len(read_history(tmp_path)) < whole


def test_no_history_without_a_state_directory_or_with_a_zero_bound(tmp_path):
    from rankwatch.address import Address
    from rankwatch.agent.config import AgentConfig

    state = NodeState("n0")
    assert StepLog.attach(state, None, OPS, 1 << 20) is None
    assert StepLog.attach(state, tmp_path, OPS, 0) is None
    assert state.step_listeners == [] and state.collective_listeners == []
    with pytest.raises(ValueError, match="history_bytes"):
        AgentConfig(node_id="n0", listen=[Address(path=str(tmp_path / "s"))], history_bytes=-1)
