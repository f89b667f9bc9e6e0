"""No single point of failure: on an etcd rendezvous the job survives the loss of its first node.

With c10d the rendezvous store lives in the first node's torchrun, so that
node's loss ends the job.  Here two nodes run under ``rankwatch run`` with
``--rdzv-backend etcd-v2`` (mapped to rankwatch's exclusion-aware wrapper of
it) against a real etcd on loopback (Debian's etcd-server, v2 API on).  Node
n0, torchrun, workers and agent, is SIGKILLed; node n1 re-forms the job alone
from the newest checkpoint and trains to the end.
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

pytestmark = pytest.mark.e2e

STEPS = 600
RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=60"


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
    ckpt = tmp_path / "ckpt"
    with Cluster(tmp_path, 2) as c:
        jobs = [c.torchrun(i, "1:2", 1, "--steps", str(STEPS), "--log-every", "0", "--step-sleep", "0.02",
                           "--checkpoint-dir", str(ckpt), "--checkpoint-interval", "20",
                           launcher="rankwatch", rdzv_conf=RDZV, etcd=etcd,
                           launcher_args=("--max-restarts", "2", "--monitor-interval", "0.1")) for i in (0, 1)]

        def own(i: int) -> list[dict]:  # node i's own ranks (the coordinator's status lists all)
            return [r for r in c.agents[i].status()["ranks"] if r["node"] == f"n{i}" and r["connected"]]

        def both_stepping():
            ranks = own(0) + own(1)
            return ranks if len(ranks) == 2 and all(r["step"] >= 60 for r in ranks) else None

        ranks = wait_for(both_stepping, 180, what="both nodes past step 60")
        n0_workers = [r["pid"] for r in ranks if r["node"] == "n0"]
        assert len(n0_workers) == 1
        killed_at = time.monotonic()
        c.kill_node(0, jobs[0], n0_workers)

        def n1_alone_stepping():
            new = [r for r in own(1) if r["pid"] not in {x["pid"] for x in ranks} and r["step"] > 60]
            return new[0] if new else None

        back = wait_for(n1_alone_stepping, 120, what="node n1 training alone")
        recovered = time.monotonic() - killed_at
        assert jobs[1].wait(240) == 0
        (rank,) = [r for r in c.agents[1].status()["ranks"] if r["pid"] == back["pid"]]
        assert rank["step"] == STEPS and rank["rank"] == 0  # the job of one node, to its end
        # rankwatch's handler ran, not the stock one: its generation and the first round's
        # members are in etcd.
        keys = _store_keys(etcd)
        assert any(k.startswith("rankwatch/job/") and k.endswith("generation") for k in keys), keys
        assert {"torch.rendezvous.job.0/rankwatch/member/n0",
                "torch.rendezvous.job.0/rankwatch/member/n1"} <= keys, keys
        print(f"node n1 trained again {recovered:.1f} s after node n0 was killed")


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
        jobs = [c.torchrun(i, "2:3", 1, "--steps", "100000", "--log-every", "0", "--step-sleep", "0.02",
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
        for job in jobs:
            if job.poll() is None:
                job.terminate()
