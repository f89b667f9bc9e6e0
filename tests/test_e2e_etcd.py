"""No single point of failure: on etcd the job survives the loss of any node, and of its coordinator.

With c10d the rendezvous store lives in the first node's torchrun, so that node's loss
ends the job.  Here nodes run under ``rankwatch run`` with ``--rdzv-backend etcd-v2``
(mapped to rankwatch's exclusion-aware wrapper of it) against a real etcd on loopback
(Debian's etcd-server, v2 API on), and their agents elect the coordinator there:

* the first node is SIGKILLed whole (torchrun, workers, agent);
* only the coordinator's agent is SIGKILLed, and a later fault must still be handled;
* an etcd member of three is SIGKILLed mid-run.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import wait_for
from etcdcluster import EtcdCluster
from multinode import Cluster
from rankwatch.agent.durable.incidents import IncidentLog

pytestmark = pytest.mark.e2e

STEPS = 120   # n0 is killed past step 60; the two others resume from step 40 or 60


def _store_keys(endpoint: str) -> set[str]:
    """The keys torch's EtcdStore holds in etcd (v2 API), decoded (it writes them base64-encoded)."""
    with urllib.request.urlopen(f"http://{endpoint}/v2/keys/torch/elastic/store?recursive=true",
                                timeout=5) as r:
        nodes = json.load(r)["node"].get("nodes", [])
    return {base64.b64decode(n["key"].rsplit("/", 1)[1]).decode() for n in nodes}


@pytest.fixture
def etcd(tmp_path: Path):
    cluster = EtcdCluster(tmp_path)
    try:
        yield cluster.endpoints[0]
    finally:
        cluster.stop()


def test_the_first_nodes_loss_leaves_the_job_training(tmp_path, etcd):
    """Three nodes as the README runs them on etcd: agents electing their coordinator there,
    ``rankwatch run`` with its own rendezvous timings and restarts (no ``--rdzv-conf``, no
    ``--max-restarts``).  Node n0 (the first: its agent holds the seat, and with c10d its
    torchrun would host the store) is SIGKILLed whole; the other two train again from the
    newest checkpoint, one of their agents coordinates, and they train to the end."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    with Cluster(tmp_path, 3, ("--min-nodes", "2"), election=etcd) as c:
        wait_for(lambda: c.agents[0].status()["coordinator"], 15, what="n0 holding the seat (it started first)")
        jobs = [c.torchrun(i, "2:3", 1, "--steps", str(STEPS), "--log-every", "0",
                           "--no-in-process-recovery", "--step-sleep", "0.02",
                           "--checkpoint-dir", str(ckpt), "--checkpoint-interval", "20", "--metrics-out", str(out),
                           launcher="rankwatch", etcd=etcd) for i in range(3)]
        ranks = wait_for(lambda: (rs := [r for i in range(3) for r in _own(c, i)]) and len(rs) == 3
                         and all(r["step"] >= 60 for r in rs) and rs, 180, what="three nodes past step 60")
        (n0_worker,) = [r["pid"] for r in ranks if r["node"] == "n0"]
        c.kill_node(0, jobs[0], [n0_worker])
        reached = max(r["step"] for r in ranks)
        killed_at = time.monotonic()
        old = {r["pid"] for r in ranks}

        def survivors_stepping() -> bool:
            return all((r := _own(c, i)) and r[0]["pid"] not in old and r[0]["step"] > 0 for i in (1, 2))

        wait_for(survivors_stepping, 120, what="nodes n1 and n2 training again")
        recovered = time.monotonic() - killed_at
        new = c.coordinator
        assert new.node in ("n1", "n2")
        assert [j.wait(240) for j in jobs[1:]] == [0, 0]
        for rank in (0, 1):   # the world of two, resumed from the checkpoint it loaded
            m = json.loads((out / f"rank{rank}.json").read_text())
            assert m["start"] % 20 == 0 and reached - 60 <= m["start"] <= reached, (m["start"], reached)
            assert len(m["losses"]) == STEPS - m["start"]
        # rankwatch's handler ran, not the stock one: its generation and the first round's
        # members are in etcd.
        keys = _store_keys(etcd)
        assert any(k.startswith("rankwatch/job/") and k.endswith("generation") for k in keys), keys
        assert {f"torch.rendezvous.job.0/rankwatch/member/n{i}" for i in range(3)} <= keys, keys
        print(f"nodes n1 and n2 trained again {recovered:.1f} s after node n0 was killed; {new.node} coordinates")


def _replays_as_shown(agent, path: Path, kinds: set[str]) -> None:
    """Nothing lost: the coordinator's ``incidents.jsonl`` replays to the incidents of ``kinds``
    its status shows, with the same resolutions."""
    shown = {i["id"]: i for i in agent.status()["incidents"] if i["kind"] in kinds}
    replayed = {i.id: i.as_status() for i in IncidentLog.replay(path) if i.kind in kinds}
    assert shown and replayed.keys() == shown.keys(), (replayed.keys(), shown.keys())
    for key, i in shown.items():
        r = replayed[key]
        assert (r["kind"], r["node"], r["rank"], r["step"]) == (i["kind"], i["node"], i["rank"], i["step"])
        assert r["detail"].get("resolved_at") == i["detail"].get("resolved_at"), (r, i)


def _own(c: Cluster, i: int) -> list[dict]:
    """Node i's own connected ranks, from its own agent."""
    return [r for r in c.agents[i].status()["ranks"] if r["node"] == f"n{i}" and r["connected"]]


def test_a_new_coordinator_names_and_excludes_a_later_fault(tmp_path, etcd):
    """Only the coordinator's agent is killed: another agent takes the seat, the job trains on
    (its workers keep training without their agent), and a worker SIGSTOPped on a third node
    later is named and its node excluded by the new coordinator.  Decision ids never repeat and
    the generation only grows."""
    ckpt = tmp_path / "ckpt"
    with Cluster(tmp_path, 3, ("--min-nodes", "2"), election=etcd) as c:
        jobs = [c.torchrun(i, "2:3", 1, "--steps", "100000", "--log-every", "0",
                           "--no-in-process-recovery", "--step-sleep", "0.02",
                           "--checkpoint-dir", str(ckpt), "--checkpoint-interval", "20",
                           launcher="rankwatch", etcd=etcd, launcher_args=("--monitor-interval", "0.1"))
                for i in range(3)]
        wait_for(lambda: all(len(_own(c, i)) == 1 and _own(c, i)[0]["step"] >= 30 for i in range(3)), 180,
                 what="three nodes past step 30")
        old = c.coordinator
        old.kill()
        alive = [a for a in c.agents if a is not old]
        new = wait_for(lambda: next((a for a in alive if a.status()["coordinator"]), None), 15,
                       what="another agent taking the coordinator seat")
        (victim,) = [a for a in alive if a is not new]
        v = int(victim.node[1:])
        wait_for(lambda: victim.node in new.status()["nodes"] and new.status()["coordinator_node"] == new.node, 10,
                 what="the new coordinator hearing the victim's node")
        before = {r["node"]: r["step"] for r in new.status()["ranks"]}
        # The job trains on under the new coordinator, the dead agent's node with it.
        wait_for(lambda: min(r["step"] for r in _own(c, v)) >= before[victim.node] + 10, 60,
                 what="the job training on after the coordinator's agent died")
        (worker,) = _own(c, v)
        s = int(new.node[1:])
        (healthy,) = _own(c, s)
        os.kill(worker["pid"], signal.SIGSTOP)
        try:
            status = wait_for(lambda: (s := new.status()) and victim.node in s["excluded_nodes"] and s, 60,
                              what="the new coordinator excluding the stopped worker's node")
        finally:
            try:
                os.kill(worker["pid"], signal.SIGCONT)
            except ProcessLookupError:
                pass
        hangs = [i for i in status["incidents"] if i["kind"] == "hang"]
        assert hangs and hangs[-1]["node"] == victim.node, hangs
        decisions = status["decisions"]
        excluded = [d["node"] for d in decisions if d["kind"] == "exclude"]
        assert excluded == [victim.node], decisions   # not the node whose agent died
        ids = [d["id"] for d in decisions]
        assert len(set(ids)) == len(ids), ids
        gens = [d["generation"] for d in decisions]
        assert gens == sorted(gens) and len(set(gens)) == len(gens), gens
        # The other two nodes train again without the excluded one: the new coordinator's node
        # with a new worker (the restart) as one of two ranks.
        wait_for(lambda: (r := _own(c, s)) and r[0]["pid"] != healthy["pid"] and r[0]["step"] > 0
                 and r[0]["rank"] in (0, 1), 120, what="the survivors training again")
        _replays_as_shown(new, tmp_path / f"state-{new.node}" / "incidents.jsonl", {"hang", "restart"})
        for job in jobs:
            if job.poll() is None:
                job.terminate()


def test_training_never_stops_when_an_etcd_member_dies(tmp_path):
    """A 3-member etcd cluster loses its leader mid-run (SIGKILL; the rendezvous talks to
    another member, torch's etcd client takes one endpoint): the job trains on, with the
    same workers, to its end, and the agents keep one coordinator."""
    cluster = EtcdCluster(tmp_path, members=3)
    try:
        cluster.move_leader(2)
        wait_for(lambda: cluster.leader() == 2, 10, what="member e2 leading")
        election = ",".join(cluster.endpoints)
        with Cluster(tmp_path, 2, ("--min-nodes", "1"), election=election) as c:
            jobs = [c.torchrun(i, "1:2", 1, "--steps", "250", "--log-every", "0",
                               "--no-in-process-recovery", "--step-sleep", "0.02",
                               launcher="rankwatch", etcd=cluster.endpoints[0]) for i in range(2)]
            ranks = wait_for(lambda: (rs := _own(c, 0) + _own(c, 1)) and len(rs) == 2
                             and all(r["step"] >= 40 for r in rs) and rs, 180, what="both nodes past step 40")
            cluster.kill(2)
            at_kill = max(r["step"] for r in ranks)
            wait_for(lambda: cluster.leader() in (0, 1), 10, what="a new etcd leader")
            assert [j.wait(240) for j in jobs] == [0, 0]
            final = [r for i in range(2) for r in c.agents[i].status()["ranks"] if r["node"] == f"n{i}"]
            # The same two workers from before the kill to the last step: no restart.
            assert sorted((r["pid"], r["step"]) for r in final) == sorted((r["pid"], 250) for r in ranks), final
            assert at_kill < 250
            holders = [a.node for a in c.agents if a.status()["coordinator"]]
            assert len(holders) == 1, holders
    finally:
        cluster.stop()
