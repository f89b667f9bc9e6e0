"""In-process recovery: a node's whole process tree is SIGKILLed, and the other nodes' workers
train on in the same processes, without a torchrun restart (``--in-process-recovery``).

Real torchrun "nodes" on c10d through ``rankwatch run``, each with its own agent; node n0's
torchrun hosts the rendezvous store and its agent coordinates.
"""

from __future__ import annotations

import json

import pytest

from conftest import wait_for
from multinode import Cluster
from rankwatch.agent.durable.incidents import IncidentLog

pytestmark = pytest.mark.e2e

_PHASES = ("left_step", "agreed", "reinitialised", "restored", "first_step")


def _training(cluster: Cluster, nodes: int, ranks: int, min_step: int):
    rs = cluster.coordinator.status()["ranks"]
    return len(rs) == ranks and len({r["node"] for r in rs}) == nodes and min(r["step"] for r in rs) >= min_step and rs


def _metrics(out, names):
    return {n: json.loads((out / n).read_text()) for n in names}


def _recorded(d: dict, steps: int) -> int:
    """Steps this rank trained and recorded itself: all, but those a rank behind at a recovery
    took from the newest replica's state instead (the others trained them)."""
    return steps - d.get("start", 0) - sum(r["step"] - r["from"] for r in d["recoveries"])


def _kill_and_finish(c: Cluster, jobs, victim: int, nodes: int, ranks: int) -> dict[str, int]:
    """Once all train, SIGKILL node ``victim``; wait for the others' torchruns to end. Returns
    the survivors' worker pids as the agents saw them before the kill."""
    rs = wait_for(lambda: _training(c, nodes, ranks, 15), 180, what=f"{nodes} nodes training")
    c.kill_node(victim, jobs[victim], [r["pid"] for r in rs if r["node"] == f"n{victim}"])
    for i, job in enumerate(jobs):
        if i != victim:
            assert job.wait(240) == 0, f"node n{i}'s torchrun failed"
    return {r["pid"]: r["rank"] for r in rs if r["node"] != f"n{victim}"}


def test_node_kill_survivors_regroup_in_process(tmp_path):
    """Four nodes, one replica each (HSDP, --replicate 4): the replicate group's ring has ranks
    that are not the dead one's neighbours, so this also needs the survivors to break each
    other out of the failed all-reduce."""
    out = tmp_path / "metrics"
    steps = 60
    with Cluster(tmp_path, 4) as c:
        jobs = [c.torchrun(i, "2:4", 1, "--steps", str(steps), "--log-every", "0", "--replicate", "4",
                           "--in-process-recovery", "--metrics-out", str(out),
                           "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "10",
                           launcher="rankwatch")
                for i in range(4)]
        before = _kill_and_finish(c, jobs, victim=2, nodes=4, ranks=4)
        status = c.coordinator.status()
    m = _metrics(out, [f"rank{r}.json" for r in sorted(before.values())])
    # The same processes trained to the end: no torchrun restart, no step lost or trained twice.
    assert sorted(d["pid"] for d in m.values()) == sorted(before), (before, [d["pid"] for d in m.values()])
    for d in m.values():
        assert d["start"] == 0 and len(d["losses"]) == _recorded(d, steps), (d["start"], len(d["losses"]))
        assert d["world_size_now"] == 3
        (rec,) = d["recoveries"]
        assert rec["world_size"] == 3 and 15 <= rec["step"] < steps, rec
        assert list(rec["phases"]) == list(_PHASES), rec
        times = [rec["phases"][k] for k in _PHASES]
        assert times == sorted(times) and times[0] >= 0, rec
    # The survivors recovered at the same step, and their replicas are equal bit for bit.
    assert len({d["recoveries"][0]["step"] for d in m.values()}) == 1
    assert len({d["param_digest"] for d in m.values()}) == 1
    # The agents saw one in-process restart, without n2; the coordinator excluded the dead node
    # and that exclusion restarted nothing.
    recs = [i for i in status["incidents"] if i["kind"] == "restart" and i["detail"].get("tier") == "in_process"]
    assert len(recs) == 1, status["incidents"]
    d = recs[0]["detail"]
    assert d["ok"] is True and d["dropped_nodes"] == ["n2"] and (d["old_world_size"], d["new_world_size"]) == (4, 3), d
    assert "n2" in status["excluded_nodes"]
    assert status["time_seconds"]["restart"] > 0
    # The last save says what the world was when it was made, not at the job's start: a
    # restart from it keeps the survivors' global batch (16 samples over dp 4 became 12 over dp 3).
    (marker,) = sorted((tmp_path / "ckpt").glob("step_*/COMPLETE"))[-1:]
    saved = json.loads(marker.read_text())
    assert saved["step"] == steps and (saved["world_size"], saved["dp"], saved["global_batch"]) == (3, 3, 12), saved


@pytest.mark.parametrize("split", [("--tp", "2"), ("--pp", "2")], ids=["tensor_parallel", "pipeline"])
def test_replicas_split_over_a_nodes_ranks_regroup_in_process(tmp_path, split):
    """Three nodes of two ranks, each node one replica of the model split over its two ranks:
    by tensor parallelism (--tp 2 --replicate 3), or as a two-stage pipeline (--pp 2
    --replicate 3: stage 0 and stage 1 on the node's two ranks).  n1 is SIGKILLed whole: n0
    and n2 train on in their processes, and the two replicas left hold the same shards (TP
    positions, or stages), bit for bit, at each position."""
    out = tmp_path / "metrics"
    steps = 60
    with Cluster(tmp_path, 3) as c:
        jobs = [c.torchrun(i, "2:3", 2, "--steps", str(steps), "--log-every", "0", "--replicate", "3",
                           *split, "--in-process-recovery", "--metrics-out", str(out), launcher="rankwatch")
                for i in range(3)]
        before = _kill_and_finish(c, jobs, victim=1, nodes=3, ranks=6)
    m = _metrics(out, [f"rank{r}.json" for r in sorted(before.values())])
    assert sorted(d["pid"] for d in m.values()) == sorted(before)   # the same processes
    for d in m.values():
        (rec,) = d["recoveries"]
        assert d["world_size_now"] == 4 and rec["world_size"] == 4, rec
        assert len(d["losses"]) == _recorded(d, steps)   # no step lost or trained twice
    # Ranks 0, 1 of the new world are one replica's pair, 2, 3 the other's.
    by_rank = {d["recoveries"][0]["rank"]: d["param_digest"] for d in m.values()}
    assert sorted(by_rank) == [0, 1, 2, 3]
    assert by_rank[0] == by_rank[2] and by_rank[1] == by_rank[3] and by_rank[0] != by_rank[1], by_rank


def test_a_users_own_hsdp_loop_regroups_in_process(tmp_path):
    """tests/data/user_recovery.py, a user's loop written as the README shows it (its own
    model, mesh, HSDP and DataLoader): three nodes of two ranks, one replica per node.  n1 is
    SIGKILLed whole; n0's and n2's workers train on in their processes to the last step, and
    the two replicas left stay equal.  The job has a token: the user's loop recovers through
    sealed values as the harness does."""
    from pathlib import Path

    out = tmp_path / "out"
    steps = 100
    script = str(Path(__file__).parent / "data" / "user_recovery.py")
    with Cluster(tmp_path, 3) as c:
        jobs = [c.torchrun(i, "2:3", 2, "--steps", str(steps), "--out", str(out), launcher="rankwatch",
                           script=script, env={"RANKWATCH_TOKEN": "user-loop-token"})
                for i in range(3)]
        before = _kill_and_finish(c, jobs, victim=1, nodes=3, ranks=6)
        status = c.coordinator.status()
    got = _metrics(out, [f"rank{r}.json" for r in sorted(before.values())])
    assert sorted(d["pid"] for d in got.values()) == sorted(before)  # the same processes
    for d in got.values():
        skipped = {s for r in d["recoveries"] for s in range(r["from"] + 1, r["step"] + 1)}
        assert d["applied"] == [s for s in range(1, steps + 1) if s not in skipped]  # each once, in order
        assert d["world_size"] == 4
        (rec,) = d["recoveries"]
        assert rec["world_size"] == 4 and 15 <= rec["step"] < steps, rec
        assert list(rec["phases"]) == list(_PHASES), rec
    assert len({d["digest"] for d in got.values()}) == 1   # both replicas left, bit for bit
    # The loop's loss for the log rode in the tier's commit: every rank read the world's sum
    # (their own losses differ: each has its own data), before the loss of n1 and after it.
    by_step = [dict(zip(d["applied"], d["mean_losses"])) for d in got.values()]
    common = set.intersection(*(set(b) for b in by_step))
    assert len(common) >= steps - 2 and all(b[s] == by_step[0][s] for b in by_step for s in common)
    recs = [i for i in status["incidents"] if i["kind"] == "restart" and i["detail"].get("tier") == "in_process"]
    assert len(recs) == 1 and recs[0]["detail"]["dropped_nodes"] == ["n1"], recs


def test_a_spare_joins_in_process_and_the_world_grows_back(tmp_path):
    """n2 is SIGKILLed and n0, n1 regroup in process; then a spare, n3, starts: it joins the
    running round in process (no torchrun restarts anyone), takes its state from a live
    replica (the job keeps no checkpoints), and the three train to the end together.  The job
    has a token, so every value the workers and the handlers read from the recovery store is
    sealed with it (tests/test_recovery_seal.py refuses forged ones).

    The job saves asynchronously after every step, so a save is in flight whenever the
    survivors leave a step to admit the spare: that break shuts every group's connections,
    and the save of the step it came after must be drained first, written and marked
    complete (it used to fail with gloo's "Connection closed by peer")."""
    out = tmp_path / "metrics"
    steps = 160   # a save after each step: the spare is in by step ~55 on two cores
    args = ("--steps", str(steps), "--log-every", "0", "--replicate", "3", "--in-process-recovery",
            "--step-sleep", "0.02", "--metrics-out", str(out),
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "1")
    token = {"RANKWATCH_TOKEN": "spare-join-token"}
    with Cluster(tmp_path, 4) as c:
        jobs = [c.torchrun(i, "2:3", 1, *args, launcher="rankwatch", env=token) for i in range(3)]
        rs = wait_for(lambda: _training(c, 3, 3, 15), 180, what="3 nodes training")
        c.kill_node(2, jobs[2], [r["pid"] for r in rs if r["node"] == "n2"])
        wait_for(lambda: any(i["kind"] == "restart" and i["detail"].get("tier") == "in_process"
                             for i in c.coordinator.status()["incidents"]), 60, what="the survivors regrouped")
        spare = c.torchrun(3, "2:3", 1, *args, launcher="rankwatch", env=token)
        for job in (jobs[0], jobs[1], spare):
            assert job.wait(300) == 0
    survivors = {r["pid"]: r["rank"] for r in rs if r["node"] != "n2"}
    m = _metrics(out, sorted(p.name for p in out.glob("rank*.json")))
    old = [d for d in m.values() if d["pid"] in survivors]
    (new,) = [d for d in m.values() if d["pid"] not in survivors]
    assert len(old) == 2   # the survivors' own processes, to the end
    for d in old:
        assert d["start"] == 0 and len(d["losses"]) == _recorded(d, steps) and d["world_size_now"] == 3
        lost, joined = d["recoveries"]
        assert lost["world_size"] == 2 and joined["world_size"] == 3, d["recoveries"]
    # The spare came in where the survivors admitted it, and trained every step from there.
    at = old[0]["recoveries"][1]["step"]
    assert 15 < at < steps and new["start"] == at and len(new["losses"]) == steps - at
    assert new["world_size_now"] == 3 and new["recoveries"] == []
    assert len({d["param_digest"] for d in m.values()}) == 1   # three equal replicas
    assert "joins the running round in process" in (tmp_path / "job-n3.log").read_text()
    # From the coordinator's file: its memory keeps 64 incidents a rank, and a save every
    # step records more checkpoints than that (the file keeps every incident).
    state = c.coordinator.sock.parent / f"state-{c.coordinator.node}" / "incidents.jsonl"
    recs = [i for i in IncidentLog.replay(state) if i.kind == "restart" and i.detail.get("tier") == "in_process"]
    assert len(recs) == 2 and all(i.detail["ok"] for i in recs), recs
    # The save in flight at the break (the step it came after) was written; so was every save
    # from there on, the spare's included (only the loss of n2 may cut one short).
    for d in m.values():
        later = [s for s in d["checkpoints"] if s["step"] >= at]
        assert later and all(s["ok"] for s in later), [s for s in later if not s["ok"]]
    for d in old:
        assert any(s["step"] == at and s["ok"] for s in d["checkpoints"]), f"the save of step {at} is missing"


def _hsdp_nodes_training(c: Cluster, steps: int, rebuilt: int, out) -> tuple[list, list[dict]]:
    """tests/data/user_recovery.py on three nodes of two ranks, training past ``steps`` until
    the world is six again after ``rebuilt`` recoveries; returns the torchruns and the ranks
    once all train.  Each step waits 20 ms for its data: on two cores, the restarted workers'
    start (their imports) then does not compete with four ranks training flat out."""
    from pathlib import Path

    script = str(Path(__file__).parent / "data" / "user_recovery.py")
    jobs = [c.torchrun(i, "2:3", 2, "--steps", str(steps), "--until-world", "6",
                       "--until-recoveries", str(rebuilt), "--out", str(out),
                       "--data-wait", "0.02", launcher="rankwatch", script=script)
            for i in range(3)]
    return jobs, wait_for(lambda: _training(c, 3, 6, 15), 180, what="3 nodes training")


def test_a_rejoined_node_loses_a_worker_again_and_rejoins_again(tmp_path):
    """tests/data/user_recovery.py on three nodes of two ranks (a replica per node).  One
    worker of n1 is SIGKILLed, as an out-of-memory kill would; n1 and its torchrun live on.
    n1's torchrun stops its other worker to restart both; the other nodes' workers leave n1
    out whole in process, and the two workers n1's torchrun starts again join them in
    process: no other node restarts, and the world grows back to six.  Once n1's new workers
    trained in the world of six, one of them is SIGKILLed too: the same other workers leave
    n1 out and admit it back a second time, all in process (four recoveries, each whole),
    and the replicas end equal."""
    import os
    import signal

    out = tmp_path / "out"
    steps = 50   # then on until the world is whole again after its four recoveries
    with Cluster(tmp_path, 3) as c:
        jobs, rs = _hsdp_nodes_training(c, steps, 4, out)
        os.kill(next(r["pid"] for r in rs if r["node"] == "n1"), signal.SIGKILL)

        def rejoined():
            st = c.coordinator.status()
            ok = [i for i in st["incidents"] if i["kind"] == "restart" and i["detail"].get("tier") == "in_process"
                  and i["detail"]["ok"] and i["detail"]["new_world_size"] == 6]
            fresh = [r for r in st["ranks"] if r["node"] == "n1" and r["connected"]
                     and r["pid"] not in {x["pid"] for x in rs} and r["step"] > 0]
            return ok and len(fresh) == 2 and fresh
        second = wait_for(rejoined, 240, what="n1's new workers trained in the world of six")
        os.kill(second[0]["pid"], signal.SIGKILL)
        for job in jobs:
            assert job.wait(400) == 0
        status = c.coordinator.status()
    survivors = {r["pid"] for r in rs if r["node"] != "n1"}
    got = _metrics(out, sorted(p.name for p in out.glob("*.json")))
    old = [d for name, d in got.items() if name.startswith("rank")]
    new = [d for name, d in got.items() if name.startswith("joiner")]
    assert sorted(d["pid"] for d in old) == sorted(survivors)
    # The second round's joiners end the job; the first round's were killed or stopped.
    assert len(new) == 2 and not {d["pid"] for d in new} & ({r["pid"] for r in rs} | {r["pid"] for r in second})
    last = old[0]["applied"][-1]
    for d in old:
        assert [r["world_size"] for r in d["recoveries"]] == [4, 6, 4, 6], d["recoveries"]
        skipped = {s for r in d["recoveries"] for s in range(r["from"] + 1, r["step"] + 1)}
        assert d["applied"] == [s for s in range(1, last + 1) if s not in skipped]
    at = old[0]["recoveries"][3]["step"]
    for d in new:
        assert d["applied"] == list(range(at + 1, last + 1)) and d["world_size"] == 6 and d["recoveries"] == []
    assert len({d["digest"] for d in got.values()}) == 1
    recs = [i["detail"] for i in status["incidents"] if i["kind"] == "restart"
            and i["detail"].get("tier") == "in_process" and i["detail"]["ok"]]
    assert [r["new_world_size"] for r in recs] == [4, 6, 4, 6], recs
    assert recs[0]["dropped_nodes"] == ["n1"]
    assert (tmp_path / "job-n1.log").read_text().count("joins the running round in process") >= 2
    # n1's other worker, if it reached an agreement before its torchrun stopped it, was told
    # that its node is left out whole, and said so.
    failed = [i["detail"] for i in status["incidents"] if i["kind"] == "restart"
              and i["detail"].get("tier") == "in_process" and not i["detail"]["ok"]]
    assert all("left out whole" in d["error"] for d in failed), failed
    assert status["excluded_nodes"] == []   # a worker's crash is not the node's


def test_loss_continues_as_an_uninterrupted_run(tmp_path):
    """Two nodes of two ranks (HSDP: a replica per node, sharded over its two ranks).  After
    n1 is lost, n0's two ranks keep the global batch by accumulating two micro-batches, so
    the loss goes on as a run that never lost a node does."""
    steps = 50
    common = ("--steps", str(steps), "--log-every", "0", "--replicate", "2", "--batch-size", "4",
              "--in-process-recovery")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with Cluster(tmp_path / "a", 2) as c:
        jobs = [c.torchrun(i, "1:2", 2, *common, "--metrics-out", str(tmp_path / "a" / "m"), launcher="rankwatch")
                for i in range(2)]
        before = _kill_and_finish(c, jobs, victim=1, nodes=2, ranks=4)
    # The reference runs without the tier: its dp-mean losses come from the harness's own
    # all-reduce, the recovered run's from the step commit that carried them.
    plain = [a for a in common if a != "--in-process-recovery"]
    with Cluster(tmp_path / "b", 1) as c:
        ref = c.torchrun(0, "1", 4, *plain, "--metrics-out", str(tmp_path / "b" / "m"), launcher="rankwatch")
        assert ref.wait(240) == 0
    got = _metrics(tmp_path / "a" / "m", [f"rank{r}.json" for r in sorted(before.values())])
    want = json.loads((tmp_path / "b" / "m" / "rank0.json").read_text())["dp_mean_losses"]
    for d in got.values():
        (rec,) = d["recoveries"]
        at = rec["step"]
        assert d["world_size_now"] == 2 and len(d["losses"]) == _recorded(d, steps)
        # Each recorded dp-mean by its step (a rank a step behind at the recovery skipped one).
        own = list(range(1, rec["from"] + 1)) + list(range(at + 1, steps + 1))
        assert len(d["dp_mean_losses"]) == len(own)
        by_step = dict(zip(own, d["dp_mean_losses"]))
        # The failure may cut the last step's dp-mean all-reduce short (its step applied): nan there.
        assert all(v == v for s, v in by_step.items() if s != rec["from"]), by_step
        before_loss = [s for s in own if s <= at and by_step[s] == by_step[s]]
        after = [s for s in own if s > at]
        # Steps before the loss were the same run; after it, the same global batch on half the ranks.
        assert [by_step[s] for s in before_loss] == pytest.approx([want[s - 1] for s in before_loss], rel=1e-5)
        mean, ref_after = [by_step[s] for s in after], [want[s - 1] for s in after]
        assert mean == pytest.approx(ref_after, rel=1e-3), (at, mean[:5], ref_after[:5])


@pytest.mark.parametrize("reload_fails", [False, True], ids=["in_process", "torchrun_restart"])
def test_without_replicas_the_checkpoint_is_reloaded(tmp_path, reload_fails):
    """Without replicas (--replicate 1: plain FSDP2 over the three nodes) and without peer
    snapshots, the dead node's shards exist only in the checkpoint: the survivors agree to
    load it in their own processes, resharded for two ranks, and train on from its step.
    With that load failing too (an injected fault), they report it and exit, and torchrun's
    restart resumes the job from the checkpoint."""
    out, ckpt = tmp_path / "metrics", tmp_path / "ckpt"
    fault = ("--fault", "reload_fails:-1:0:0") if reload_fails else ()
    with Cluster(tmp_path, 3) as c:
        jobs = [c.torchrun(i, "2:3", 1, "--steps", "60", "--log-every", "0", "--in-process-recovery",
                           "--snapshot-every", "off",   # peer snapshots are on by default where they fit
                           "--checkpoint-dir", str(ckpt), "--checkpoint-interval", "10",
                           "--metrics-out", str(out), *fault, launcher="rankwatch")
                for i in range(3)]
        before = _kill_and_finish(c, jobs, victim=2, nodes=3, ranks=3)
        status = c.coordinator.status()
    recs = [i["detail"] for i in status["incidents"] if i["kind"] == "restart" and i["detail"].get("tier") == "in_process"]
    if reload_fails:
        m = _metrics(out, ["rank0.json", "rank1.json"])
        assert not set(before) & {d["pid"] for d in m.values()}, "torchrun restarted the workers"
        assert all(d["start"] > 0 and d["start"] % 10 == 0 and d["recoveries"] == [] for d in m.values())
        assert recs and not any(d["ok"] for d in recs) and all("injected fault" in d["error"] for d in recs), recs
        return
    m = _metrics(out, [f"rank{r}.json" for r in sorted(before.values())])
    assert sorted(d["pid"] for d in m.values()) == sorted(before), "the survivors' own processes, to the end"
    for d in m.values():
        (rec,) = d["recoveries"]
        assert d["start"] == 0 and rec["step"] % 10 == 0 and rec["world_size"] == 2, rec
        assert rec["phases"]["first_step"] > rec["phases"]["reloaded"] > rec["phases"]["reinitialised"], rec
    assert len(recs) == 1 and recs[0]["ok"] and recs[0]["dropped_nodes"] == ["n2"], recs
    assert "reloaded" in recs[0]["phases"], recs


def test_hung_node_excluded_then_left_out_in_process(tmp_path):
    """n2's worker is SIGSTOPped: the others wait in a collective that never fails.  The
    coordinator names the hang and excludes n2; n2's relay kills its worker at once, which
    breaks the survivors' collective, and they regroup in process instead of restarting."""
    import os
    import signal

    out = tmp_path / "metrics"
    steps = 80
    with Cluster(tmp_path, 3, ("--min-nodes", "2")) as c:
        jobs = [c.torchrun(i, "2:3", 1, "--steps", str(steps), "--log-every", "0", "--replicate", "3",
                           "--in-process-recovery", "--metrics-out", str(out), launcher="rankwatch")
                for i in range(3)]
        rs = wait_for(lambda: _training(c, 3, 3, 15), 180, what="3 nodes training")
        victim = next(r for r in rs if r["node"] == "n2")
        os.kill(victim["pid"], signal.SIGSTOP)
        for job in jobs[:2]:
            assert job.wait(240) == 0
        status = c.coordinator.status()
    survivors = {r["pid"]: r["rank"] for r in rs if r["node"] != "n2"}
    m = _metrics(out, [f"rank{r}.json" for r in sorted(survivors.values())])
    assert sorted(d["pid"] for d in m.values()) == sorted(survivors)  # no torchrun restart
    for d in m.values():
        assert len(d["losses"]) == _recorded(d, steps) and d["world_size_now"] == 2
        (rec,) = d["recoveries"]
        assert list(rec["phases"]) == list(_PHASES)
    kinds = [(i["kind"], i["node"]) for i in status["incidents"]]
    assert ("hang", "n2") in kinds, kinds
    assert "n2" in status["excluded_nodes"]
    (rec,) = [i for i in status["incidents"] if i["kind"] == "restart" and i["detail"].get("tier") == "in_process"]
    assert rec["detail"]["ok"] is True and rec["detail"]["dropped_nodes"] == ["n2"], rec


def test_first_node_lost_on_etcd_regroup_in_process(tmp_path):
    """On etcd the store outlives every node: n0, whose torchrun would host the c10d store
    and whose agent holds the coordinator's seat, is SIGKILLed whole, and n1 and n2 regroup
    in process through the etcd store (the workers' own store died with n0's torchrun)."""
    from etcdcluster import EtcdCluster

    out = tmp_path / "metrics"
    steps = 60
    etcd = EtcdCluster(tmp_path)
    try:
        with Cluster(tmp_path, 3, ("--min-nodes", "2"), election=etcd.endpoints[0]) as c:
            wait_for(lambda: c.agents[0].status()["coordinator"], 15, what="n0 holding the seat")
            jobs = [c.torchrun(i, "2:3", 1, "--steps", str(steps), "--log-every", "0", "--replicate", "3",
                               "--in-process-recovery", "--metrics-out", str(out), launcher="rankwatch",
                               etcd=etcd.endpoints[0])
                    for i in range(3)]
            before = _kill_and_finish(c, jobs, victim=0, nodes=3, ranks=3)
            status = c.coordinator.status()
    finally:
        etcd.stop()
    m = _metrics(out, [f"rank{r}.json" for r in sorted(before.values())])
    assert sorted(d["pid"] for d in m.values()) == sorted(before)  # the same processes
    for d in m.values():
        assert len(d["losses"]) == _recorded(d, steps) and d["world_size_now"] == 2
        (rec,) = d["recoveries"]
        assert list(rec["phases"]) == list(_PHASES)
    assert len({d["param_digest"] for d in m.values()}) == 1
    # The new coordinator heard of the recovery from the survivors' agents.
    recs = [i for i in status["incidents"] if i["kind"] == "restart" and i["detail"].get("tier") == "in_process"]
    assert len(recs) == 1 and recs[0]["detail"]["dropped_nodes"] == ["n0"], recs
