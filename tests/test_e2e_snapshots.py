"""In-process recovery without replicas: plain FSDP2 over three nodes (``--replicate 1``),
peer snapshots every K steps (``--snapshot-every K``).  One node's whole tree is SIGKILLed;
the survivors find its shards in their buddies' copies, reshard them for the smaller world
and train on in their own processes from the snapshot's step, the global batch kept.

Real torchrun "nodes" on c10d through ``rankwatch run``, each with its own agent.
"""

from __future__ import annotations

import json

import pytest

from conftest import parse_metrics, wait_for
from multinode import Cluster

pytestmark = pytest.mark.e2e

K = 5


def _training(cluster: Cluster, nodes: int, ranks: int, min_step: int):
    rs = cluster.coordinator.status()["ranks"]
    return len(rs) == ranks and len({r["node"] for r in rs}) == nodes and min(r["step"] for r in rs) >= min_step and rs


def _check_snapshot_metrics(c: Cluster, rank: int) -> None:
    """n0's agent exports its rank's snapshots: memory (its own and its buddy's copy: 2x its
    shard at most, the shards being alike), age in steps and the exchange's bandwidth."""
    key = frozenset({("node", "n0"), ("rank", str(rank))})

    def exchanged():
        m = parse_metrics(c.agents[0].metrics())
        return m if m.get(("rankwatch_rank_snapshot_exchanges_total", key), 0) >= 2 else None

    m = wait_for(exchanged, 60, 0.5, "two snapshot exchanges in n0's metrics")
    shard = m[("rankwatch_rank_snapshot_shard_bytes", key)]
    memory = m[("rankwatch_rank_snapshot_memory_bytes", key)]
    assert m[("rankwatch_rank_snapshot_send_bytes_per_second", key)] > 0
    assert m[("rankwatch_rank_snapshot_failures_total", key)] == 0
    assert 0 <= m[("rankwatch_rank_snapshot_age_steps", key)] <= 2 * K
    assert shard < memory <= 2.2 * shard   # its own and one buddy's copy of a like shard


def test_plain_fsdp2_node_kill_recovers_from_peer_snapshots(tmp_path):
    steps = 60
    common = ("--steps", str(steps), "--log-every", "0", "--batch-size", "2", "--step-sleep", "0.03")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    out = tmp_path / "a" / "m"
    with Cluster(tmp_path / "a", 3) as c:
        jobs = [c.torchrun(i, "2:3", 1, *common, "--in-process-recovery", "--snapshot-every", str(K),
                           "--metrics-out", str(out), launcher="rankwatch") for i in range(3)]
        rs = wait_for(lambda: _training(c, 3, 3, 12), 180, what="3 nodes training")
        _check_snapshot_metrics(c, next(r["rank"] for r in rs if r["node"] == "n0"))
        c.kill_node(1, jobs[1], [r["pid"] for r in rs if r["node"] == "n1"])
        for i in (0, 2):
            assert jobs[i].wait(240) == 0, f"node n{i}'s torchrun failed"
        status = c.coordinator.status()
    before = {r["pid"]: r["rank"] for r in rs if r["node"] != "n1"}
    # The reference: the same job on one node, uninterrupted.
    with Cluster(tmp_path / "b", 1) as c:
        ref = c.torchrun(0, "1", 3, *common, "--metrics-out", str(tmp_path / "b" / "m"), launcher="rankwatch")
        assert ref.wait(240) == 0
    want = json.loads((tmp_path / "b" / "m" / "rank0.json").read_text())["dp_mean_losses"]
    got = {n: json.loads((out / n).read_text()) for n in [f"rank{r}.json" for r in sorted(before.values())]}
    # The survivors' own processes trained to the end: no torchrun restart.
    assert sorted(d["pid"] for d in got.values()) == sorted(before)
    for d in got.values():
        (rec,) = d["recoveries"]
        at, was = rec["step"], rec["from"]
        # From the newest snapshot (a multiple of K), at most K steps recomputed.
        assert at % K == 0 and 0 <= was - at <= K and at >= 10, rec
        assert rec["world_size"] == 2 and d["world_size_now"] == 2
        assert "resharded" in rec["phases"] and rec["phases"]["first_step"] >= rec["phases"]["resharded"], rec
        # Every step recorded once before the loss (1..was) and once again from the snapshot on.
        means = d["dp_mean_losses"]
        assert len(means) == was + steps - at, (len(means), was, at)
        first, again = means[:was], means[was:]
        ok = [s for s in range(1, was + 1) if first[s - 1] == first[s - 1]]   # the cut step's may be nan
        assert [first[s - 1] for s in ok] == pytest.approx([want[s - 1] for s in ok], rel=1e-5)
        # On two ranks the same global batch (3 micro-batches of 1 a rank) follows the reference
        # within the reduction order's tolerance; the recomputed steps repeat the first ones.
        assert again == pytest.approx(want[at:], rel=1e-3), (at, again[:5], want[at:at + 5])
    assert len({d["param_digest"] for d in got.values()}) == 2   # two shards, not replicas
    recs = [i["detail"] for i in status["incidents"] if i["kind"] == "restart"
            and i["detail"].get("tier") == "in_process"]
    assert len(recs) == 1 and recs[0]["ok"] and recs[0]["dropped_nodes"] == ["n1"], recs
    # What the snapshot cost: the steps trained again, and its copy and send.
    assert 0 <= recs[0]["recomputed_steps"] <= K and recs[0]["snapshot"]["copy_seconds"] > 0, recs
