"""Two torchrun "nodes" with their own agents: the coordinator names a culprit on the other node."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from conftest import parse_metrics, processes_cleaned_up, wait_for
from multinode import Cluster, check_buckets, seconds_per_step

pytestmark = pytest.mark.e2e

# The hang tests keep both nodes (no exclusion): they are about naming the culprit.
_KEEP = ("--min-nodes", "2")


def job_hangs(cluster):
    return [i for i in cluster.coordinator.status()["incidents"] if i["kind"] == "hang"]


def running(cluster, min_step):
    ranks = cluster.coordinator.status()["ranks"]
    return (len(ranks) == 2 and {r["node"] for r in ranks} == {"n0", "n1"}
            and min(r["step"] for r in ranks) >= min_step and ranks)


def start(cluster, *n1_args, steps="400", n0_too=False):
    """The job on both nodes; ``n1_args`` on n1 alone, or on both with ``n0_too``."""
    for node in (0, 1):
        cluster.torchrun(node, "2", 1, "--steps", steps, "--log-every", "0", "--no-in-process-recovery",
                         *(n1_args if node == 1 or n0_too else ()))


@pytest.fixture(scope="module")
def clean_then_stopped(tmp_path_factory):
    """One two-node job (a rank a node, checkpoints to a directory) read by two tests: while it
    trains clean, a checkpoint is asked for through n1's agent; then n1's worker is SIGSTOPped
    and the coordinator names the hang.  Returns what each test reads."""
    from rankwatch.agent.link.uplink import forward_checkpoint

    tmp = tmp_path_factory.mktemp("clean_then_stopped")
    ck = tmp / "ck"
    facts: dict = {}
    with processes_cleaned_up(), Cluster(tmp, 2, _KEEP) as c:
        start(c, "--checkpoint-dir", str(ck), steps="5000", n0_too=True)
        ranks = wait_for(lambda: running(c, 20), 120, what="both nodes training")
        # The coordinator's view shows the other node's rank as fully as its own.
        (facts["remote"],) = wait_for(lambda: [r for r in c.coordinator.status()["ranks"]
                                               if r["node"] == "n1" and r["op_latency"]], 10, what="n1's rank in full")
        step_s = seconds_per_step(c.coordinator.status)
        # Asked through the second node's agent: it forwards to the coordinator; asked again
        # through n0's, it is a duplicate.
        facts["reply"] = forward_checkpoint(c.agents[1].addr, "test")
        facts["again"] = forward_checkpoint(c.agents[0].addr, "duplicate")

        def saved():
            per_node = {a.node: [i for i in a.status()["incidents"] if i["kind"] == "checkpoint"] for a in c.agents}
            return all(per_node.values()) and per_node
        facts["saves"] = wait_for(saved, 60, what="checkpoint incidents on both nodes")
        facts["saved_dir"] = ck
        facts["status"], facts["step_s"] = c.coordinator.status(), step_s

        victim = facts["victim"] = next(r for r in ranks if r["node"] == "n1")
        os.kill(victim["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        facts["hangs"] = wait_for(lambda: job_hangs(c), 20, interval=0.1, what="job hang incident")
        facts["latency"] = time.monotonic() - t0
        # The culprit's own node agent got the job's verdict too, and marks its rank hung.
        facts["n1"] = wait_for(lambda: (s := c.agents[1].status())["ranks"][0]["state"] == "hung" and s, 3,
                               what="the verdict on n1's agent")
        facts["n0_hangs"] = [i for i in job_hangs(c) if i["node"] == "n0"]
        os.kill(victim["pid"], signal.SIGCONT)
    return facts


def test_sigstopped_worker_on_second_node(clean_then_stopped):
    f = clean_then_stopped
    victim, latency = f["victim"], f["latency"]
    (inc,) = f["hangs"]
    assert latency < 10.0, latency
    assert (inc["node"], inc["rank"]) == ("n1", victim["rank"]), inc
    d = inc["detail"]
    assert d["alive"] is True and d["stopped"] is True and d["pid"] == victim["pid"], d
    n1 = f["n1"]
    assert any(i["kind"] == "hang" and i["rank"] == victim["rank"] for i in n1["incidents"])
    assert n1["coordinator_node"] == "n0"
    # n0 raised no hang of its own about its waiting rank.
    assert f["n0_hangs"] == []
    print(f"cross-node SIGSTOP hang named after {latency:.2f}s")


def test_desync_on_second_node(tmp_path):
    with Cluster(tmp_path, 2, _KEEP) as c:
        start(c, "--fault", "skip_collective:-1:30:60")
        (inc,) = wait_for(lambda: job_hangs(c), 120, interval=0.2, what="job hang incident")
        n1_rank = next(r["rank"] for r in c.agents[1].status()["ranks"])
        assert (inc["node"], inc["rank"]) == ("n1", n1_rank), inc
        d = inc["detail"]
        assert "behind" in d["reason"], d
        assert d["collective"]["op"] == "all_reduce" and d["collective"]["seq"] > 0, d
        # Each node's Flight Recorder extract reached the coordinator: n0's rank issued the
        # all-reduce it waits in, n1's rank never did.
        coll, fr = d["collective"], d["flight_recorder"]
        n0_rank = next(r["rank"] for r in c.agents[0].status()["ranks"])
        assert [(e["op"], e["group"], e["seq"]) for e in fr[str(n0_rank)]["pending"]] == [
            ("all_reduce", coll["group"], coll["seq"])], fr
        assert fr[str(n1_rank)]["enqueued"][coll["group"]] == coll["seq"] - 1, fr


def test_stuck_in_python_on_second_node(tmp_path):
    with Cluster(tmp_path, 2, _KEEP) as c:
        start(c, "--fault", "sleep_forward:-1:25:20", steps="40")
        (inc,) = wait_for(lambda: job_hangs(c), 120, interval=0.2, what="job hang incident")
        assert inc["node"] == "n1", inc
        assert "_injected_sleep_in_forward" in (inc["detail"]["stacks"] or ""), inc["detail"]
        assert inc["detail"]["alive"] and not inc["detail"]["stopped"]


def test_checkpoint_on_demand_saves_one_step_on_every_node(clean_then_stopped):
    f = clean_then_stopped
    remote, reply, again = f["remote"], f["reply"], f["again"]
    assert remote["mesh"] == {"dp": remote["rank"], "tp": 0}, remote
    assert remote["phase_seconds"]["forward"] > 0 and remote["backend"] == "gloo", remote
    assert remote["op_latency"]["all_gather"]["count"] > 0 and remote["collectives"] > 0, remote
    assert reply.accepted, reply.message
    assert again.id == reply.id and again.step == reply.step  # a duplicate is not a second save
    per_node = f["saves"]
    steps = {i["step"] for incs in per_node.values() for i in incs}
    assert steps == {reply.step}, (steps, reply.step)
    assert all(i["detail"]["ok"] and i["detail"]["request"] == reply.id
               for incs in per_node.values() for i in incs)
    assert (f["saved_dir"] / f"step_{reply.step:08d}" / "COMPLETE").is_file()
    status = f["status"]
    assert status["coordinator"]
    # No fault yet: the save is the only time lost, and the rest trained steps.
    check_buckets(status, f["step_s"], lost=("checkpoint",))


def test_a_users_script_straggling_on_one_node_is_named_by_the_coordinator(tmp_path):
    """A user's own FSDP2 script, one rank per node: no node's agent can compare its ranks, so
    only the coordinator, from the nodes' summaries (each rank's windows, packed), can name
    the rank whose loader went slow, with its cause, and tell that rank's node."""
    script = str(Path(__file__).parent / "data" / "user_fsdp.py")
    onset = 40
    with Cluster(tmp_path, 2, _KEEP) as c:
        for node in (0, 1):
            c.torchrun(node, "2", 1, "--steps", "2000", "--slow-loader", f"1:{onset}:0.1", script=script)
        ranks = wait_for(lambda: running(c, 5), 120, what="both nodes training")
        slow_node = next(r["node"] for r in ranks if r["rank"] == 1)

        def flagged():
            return [i for i in c.coordinator.status()["incidents"] if i["kind"] == "straggler"]

        (inc, *more) = wait_for(flagged, 90, interval=0.2, what="the coordinator's straggler incident")
        assert (inc["node"], inc["rank"]) == (slow_node, 1), inc
        assert inc["step"] >= onset and inc["detail"]["cause"] == "data", inc
        assert all(i["rank"] == 1 for i in more), more   # the rank that waits for it is not named
        # The coordinator's view shows the flagged rank's slowdown, and 1 for the other (not
        # the 0 of a field never set).
        slow = {r["rank"]: r["slowdown"] for r in c.coordinator.status()["ranks"]}
        assert slow[1] >= 1.08 and slow[0] == 1.0, slow
        # The slow rank's own node agent holds the job's verdict, and exports it.
        agent = next(a for a in c.agents if a.node == slow_node)
        wait_for(lambda: {r["rank"]: r["state"] for r in agent.status()["ranks"]}.get(1) == "straggler", 10,
                 what="the verdict on the slow rank's node")
        flag = ("rankwatch_rank_straggler", frozenset({("node", slow_node), ("rank", "1"), ("cause", "data")}))
        assert parse_metrics(agent.metrics()).get(flag) == 1.0
