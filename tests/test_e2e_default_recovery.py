"""Fast recovery with the harness's default flags: in-process recovery and peer snapshots are
on by default over several nodes (issue 60), and off with the reason said where the host's
memory is too small.

Real torchrun "nodes" on c10d through ``rankwatch run``, each with its own agent; node n0's
torchrun hosts the rendezvous store and its agent coordinates.
"""

from __future__ import annotations

import re

import pytest

from conftest import parse_metrics, wait_for
from multinode import Cluster

pytestmark = pytest.mark.e2e


def _ranks(c: Cluster, nodes: int, min_step: int):
    rs = [r for a in c.agents[:nodes] for r in a.status()["ranks"] if r["node"] == a.node]
    return len(rs) == nodes and min(r["step"] for r in rs) >= min_step and rs


def _recovery(c: Cluster):
    for i in c.agents[0].status()["incidents"]:
        d = i["detail"]
        if i["kind"] == "restart" and d.get("tier") == "in_process" and "first_step" in d.get("phases", {}):
            return d
    return None


def test_default_flags_survivors_regain_the_kill_step_in_their_own_processes(tmp_path):
    """Three nodes of plain FSDP2, no recovery flag: n2's tree is SIGKILLed after step 50; the
    survivors recover in process from their peer snapshots (K chosen by themselves) and train
    past the step they had reached, in the same processes."""
    with Cluster(tmp_path, 3, ("--min-nodes", "2")) as c:
        jobs = [c.torchrun(i, "2:3", 1, "--steps", "120", "--log-every", "0", launcher="rankwatch")
                for i in range(3)]
        rs = wait_for(lambda: _ranks(c, 3, 50), 240, interval=0.05, what="three nodes past step 50")
        c.kill_node(2, jobs[2], [r["pid"] for r in rs if r["node"] == "n2"])
        reached = max(r["step"] for r in rs)
        rec = wait_for(lambda: _recovery(c), 60, what="the in-process recovery's first step")
        assert rec["ok"], rec
        assert rec["new_world_size"] == 2
        assert 0 <= rec["recomputed_steps"] <= 60, rec   # from a snapshot, not from step 0
        assert rec["phases"]["first_step"] < 10.0, rec
        survivors = {r["pid"] for r in rs if r["node"] != "n2"}
        after = wait_for(lambda: _ranks(c, 2, reached + 1), 60, what="the survivors past the kill step")
        assert {r["pid"] for r in after} == survivors, "a survivor's process was restarted"
        for i in (0, 1):
            assert jobs[i].wait(240) == 0, f"node n{i}'s torchrun failed"
        logs = [(tmp_path / f"job-n{i}.log").read_text(errors="replace") for i in (0, 1)]
    for text in logs:
        plan = re.findall(r"rankwatch: peer snapshots every (\d+) steps", text)
        assert plan, "no rank said what it chose"
        regained = re.findall(r"regained step (\d+) ([\d.]+) s after the failure", text)
        assert regained and float(regained[0][1]) < 15.0, regained
        assert "exits for torchrun's restart" not in text


def test_a_host_too_small_keeps_snapshots_off_says_why_and_trains(tmp_path):
    """A memory budget far below the snapshots' need: no snapshot is taken, the log and the
    agent's metric say why, and the job trains to its end."""
    with Cluster(tmp_path, 2) as c:
        jobs = [c.torchrun(i, "2", 1, "--steps", "40", "--log-every", "0", launcher="rankwatch",
                           env={"RANKWATCH_SNAPSHOT_MEMORY_LIMIT": "1000000"})
                for i in range(2)]
        wait_for(lambda: _ranks(c, 2, 5), 240, what="two nodes training")

        def off_metric():
            m = parse_metrics(c.agents[1].metrics())
            return [v for (name, labels), v in m.items()
                    if name == "rankwatch_rank_snapshot_enabled" and ("reason", "memory") in labels]
        assert wait_for(off_metric, 30, what="the plan in the metrics") == [0.0]
        m = parse_metrics(c.agents[1].metrics())
        assert {v for (name, _), v in m.items() if name == "rankwatch_rank_snapshot_every_steps"} == {0.0}
        assert not [k for k in m if k[0] == "rankwatch_rank_snapshot_memory_bytes"], "a snapshot was taken"
        for i in (0, 1):
            assert jobs[i].wait(240) == 0, f"node n{i}'s torchrun failed"
        logs = [(tmp_path / f"job-n{i}.log").read_text(errors="replace") for i in (0, 1)]
    for text in logs:
        assert re.search(r"peer snapshots are off: the node's 1 rank\(s\) need .* and the host leaves", text), \
            text[-3000:]
        assert "--snapshot-every K turns them on" in text
        assert "peer snapshots every" not in text
