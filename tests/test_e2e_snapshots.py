"""In-process recovery without replicas: plain FSDP2 over several nodes (``--replicate 1``),
peer snapshots every K steps (``--snapshot-every K``).  One node's whole tree is SIGKILLed;
the survivors find its shards in their buddies' copies, reshard them for the smaller world
and train on in their own processes from the snapshot's step, the global batch kept.

Real torchrun "nodes" on c10d through ``rankwatch run``, each with its own agent.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from conftest import parse_metrics, wait_for
from multinode import Cluster
from rankwatch.hooks.harness.dcp import complete_checkpoints
from rankwatch.hooks.recovery.buddies import buddy_map

pytestmark = pytest.mark.e2e

K = 5
DATA = Path(__file__).parent / "data"


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


def test_plain_fsdp2_node_kill_recovers_from_peer_snapshots_and_a_returning_node_grows_it_back(tmp_path):
    """Two nodes of one rank.  n1 is SIGKILLed: n0 goes on alone in its own process from the
    newest snapshot, n1's shards taken from its copy.  Then n1 comes back (its torchrun
    started again, as n2): a world of one has no collective that could fail, yet n0 leaves
    the step and admits the joiner; its state of the step it completed is resharded for two
    ranks, and the two train to the end.  The losses follow an uninterrupted run at the same
    global batch throughout."""
    steps = 200   # the returning node is in by step ~100 on two cores
    common = ("--steps", str(steps), "--log-every", "0", "--batch-size", "2", "--step-sleep", "0.03")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    out, ckpt = tmp_path / "a" / "m", tmp_path / "a" / "ckpt"
    args = (*common, "--in-process-recovery", "--snapshot-every", str(K), "--checkpoint-dir", str(ckpt),
            "--checkpoint-interval", "10", "--metrics-out", str(out))
    with Cluster(tmp_path / "a", 3) as c:
        jobs = [c.torchrun(i, "2:2", 1, *args, launcher="rankwatch") for i in range(2)]
        rs = wait_for(lambda: _training(c, 2, 2, 12), 180, what="2 nodes training")
        _check_snapshot_metrics(c, next(r["rank"] for r in rs if r["node"] == "n0"))
        c.kill_node(1, jobs[1], [r["pid"] for r in rs if r["node"] == "n1"])
        wait_for(lambda: any(i["kind"] == "restart" and i["detail"].get("tier") == "in_process"
                             for i in c.coordinator.status()["incidents"]), 60, what="n0 went on alone")
        back = c.torchrun(2, "2:2", 1, *args, launcher="rankwatch")
        for job in (jobs[0], back):
            assert job.wait(240) == 0
        status = c.coordinator.status()
    before = {r["pid"]: r["rank"] for r in rs if r["node"] != "n1"}
    # The reference: the same job on one node, uninterrupted.
    with Cluster(tmp_path / "b", 1) as c:
        ref = c.torchrun(0, "1", 2, *common, "--metrics-out", str(tmp_path / "b" / "m"), launcher="rankwatch")
        assert ref.wait(240) == 0
    want = json.loads((tmp_path / "b" / "m" / "rank0.json").read_text())["dp_mean_losses"]
    got = {n: json.loads((out / n).read_text()) for n in [f"rank{r}.json" for r in sorted(before.values())]}
    logs = (tmp_path / "a" / "job-n0.log").read_text()
    # The survivors' own processes trained to the end: no torchrun restart.
    assert sorted(d["pid"] for d in got.values()) == sorted(before)
    for d in got.values():
        rec, grew = d["recoveries"]
        at, was = rec["step"], rec["from"]
        assert rec["world_size"] == 1 and d["world_size_now"] == 2
        if "reloaded" in rec["phases"]:
            # The kill cut the exchange of the newest snapshot: the buddy had dropped its older
            # copy of n1's shards to receive it (a copy each, the memory bound), so the survivors
            # reloaded the newest complete checkpoint, in their own processes.
            cut = int(re.findall(r"peer snapshot exchange of step (\d+) failed", logs)[0])
            assert was - K <= cut <= was and at % 10 == 0 and 0 <= was - at <= 20, (rec, cut)
        else:
            # From the newest snapshot (a multiple of K), at most K steps recomputed.
            assert at % K == 0 and 0 <= was - at <= K and at >= 10, rec
            assert "resharded" in rec["phases"] and rec["phases"]["first_step"] >= rec["phases"]["resharded"], rec
        # The returning node: from the step the survivors completed, nothing recomputed.
        assert grew["world_size"] == 2 and grew["step"] == grew["from"] > was and "resharded" in grew["phases"], grew
        # Every step recorded once before the loss (1..was) and once again from the snapshot on.
        means = d["dp_mean_losses"]
        assert len(means) == was + steps - at, (len(means), was, at)
        first, again = means[:was], means[was:]
        ok = [s for s in range(1, was + 1) if first[s - 1] == first[s - 1]]   # the cut step's may be nan
        assert [first[s - 1] for s in ok] == pytest.approx([want[s - 1] for s in ok], rel=1e-5)
        # On one rank the same global batch (2 micro-batches), then on two again,
        # follows the reference within the reduction order's tolerance.
        assert again == pytest.approx(want[at:], rel=1e-3), (at, again[:5], want[at:at + 5])
    (new,) = [json.loads(p.read_text()) for p in out.glob("rank*.json") if p.name not in got]
    joined = grew["step"]
    assert new["start"] == joined and new["world_size_now"] == 2 and new["recoveries"] == []
    assert new["dp_mean_losses"] == means[-(steps - joined):]   # one all-reduced loss a step
    assert len({d["param_digest"] for d in [*got.values(), new]}) == 2   # two shards, not replicas
    # The new worlds' asynchronous saves complete (the newest three are kept): a resharded
    # state stages like any other.
    assert sorted(s for s, _ in complete_checkpoints(ckpt)) == [steps - 20, steps - 10, steps]
    recs = [i["detail"] for i in status["incidents"] if i["kind"] == "restart"
            and i["detail"].get("tier") == "in_process"]
    assert len(recs) == 2 and all(r["ok"] for r in recs) and recs[0]["dropped_nodes"] == ["n1"], recs
    assert recs[1]["new_world_size"] == 2 and recs[1]["recomputed_steps"] == 0, recs
    # What the snapshot cost: the steps trained again, and its copy and send.
    assert 0 <= recs[0]["recomputed_steps"] <= was - at and recs[0]["snapshot"]["copy_seconds"] > 0, recs


def test_a_hot_spare_standing_by_takes_the_lost_node_s_place_at_the_loss_bit_for_bit(tmp_path):
    """Three nodes of one rank, plain FSDP2 with snapshots every 10 steps.  A fourth node
    arrives while the job is full: it stands by, its worker warmed up and asking to join
    ahead of any loss.  n1 is SIGKILLed: at that one recovery the spare takes n1's place in
    the rank order, receiving n1's shards from n1's buddy; the survivors put back their own
    snapshot.  The world keeps its size and layout, so every step from the snapshot on is
    trained exactly as before: the recomputed steps' losses equal the first run's bit for
    bit, and no torchrun restarts anyone.  (A kill inside the snapshot exchange's window
    sends every member, the spare too, to the newest checkpoint instead, in process: the
    same checks hold from its step.)"""
    k, steps = 10, 200   # the spare stands by, and n1 is killed, by step ~75 on two cores
    out, ckpt = tmp_path / "m", tmp_path / "ckpt"
    args = ("--steps", str(steps), "--log-every", "0", "--batch-size", "2", "--step-sleep", "0.03",
            "--in-process-recovery", "--snapshot-every", str(k), "--checkpoint-dir", str(ckpt),
            "--checkpoint-interval", "10", "--metrics-out", str(out))
    with Cluster(tmp_path, 4) as c:
        jobs = [c.torchrun(i, "2:3", 1, *args, launcher="rankwatch") for i in range(3)]
        rs = wait_for(lambda: _training(c, 3, 3, 12), 180, what="3 nodes training")
        spare = c.torchrun(3, "2:3", 1, *args, launcher="rankwatch")
        spare_log = tmp_path / "job-n3.log"
        wait_for(lambda: "asks to join the training in process at the next lost node's place"
                 in spare_log.read_text(), 120, 0.2, "the spare standing by")
        c.kill_node(1, jobs[1], [r["pid"] for r in rs if r["node"] == "n1"])
        for job in (jobs[0], jobs[2], spare):
            assert job.wait(240) == 0
        status = c.coordinator.status()
    survivors = {r["pid"] for r in rs if r["node"] != "n1"}
    got = [json.loads(p.read_text()) for p in out.glob("rank*.json")]
    old = [d for d in got if d["pid"] in survivors]
    (new,) = [d for d in got if d["pid"] not in survivors]
    assert len(old) == 2
    recs = [i["detail"] for i in status["incidents"] if i["kind"] == "restart"
            and i["detail"].get("tier") == "in_process"]
    assert len(recs) == 1 and recs[0]["ok"] and recs[0]["dropped_nodes"] == ["n1"], recs
    logs = (tmp_path / "job-n0.log").read_text()
    (rec,) = old[0]["recoveries"]
    at, was = rec["step"], rec["from"]
    if "reloaded" in rec["phases"]:
        # The kill cut the exchange of the newest snapshot (docs: the exchange window): every
        # member, the spare too, loaded the newest complete checkpoint in process instead.
        cut = int(re.findall(r"peer snapshot exchange of step (\d+) failed", logs)[0])
        assert was - k <= cut <= was and 0 <= was - at <= 2 * k, (rec, cut)
    else:
        assert 0 <= was - at <= k and 0 <= recs[0]["recomputed_steps"] <= k, (rec, recs)
    assert at % k == 0 and rec["world_size"] == 3 == recs[0]["new_world_size"], rec
    assert new["start"] == at and new["world_size_now"] == 3 and new["recoveries"] == []
    for d in old:
        means = d["dp_mean_losses"]
        assert len(means) == was + steps - at
        first, again = means[at:was], means[was:was + (was - at)]
        ok = [i for i, x in enumerate(first) if x == x]   # the cut step's may be nan
        assert [again[i] for i in ok] == [first[i] for i in ok], (at, was)   # bit for bit
        assert means[was:] == new["dp_mean_losses"]   # the spare trained every step with them
    assert len({d["param_digest"] for d in got}) == 3   # three shards, n1's in the spare


def test_a_users_plain_fsdp2_loop_recovers_from_peer_snapshots(tmp_path):
    """tests/data/user_recovery.py with ``--snapshot-every K``: a user's own plain FSDP2 loop
    (its model, a one-dimensional ``init_device_mesh``, its DataLoader) and the tier's
    ``snapshot_every``.  Three nodes of one rank; n1 is SIGKILLed whole.  The survivors go on
    in their own processes from the newest snapshot: the steps after it are undone and trained
    again, and the losses follow an uninterrupted run of the same loop."""
    script = str(DATA / "user_recovery.py")
    steps = 40
    # Eight micro-batches a rank per step (about 0.15 s here): the snapshot's copy and send
    # take a fraction of a step, as the docs ask of K.  With steps of a few ms the exchange is
    # in flight most of the time, and a kill then finds no whole snapshot step (the exchange
    # window); the kill below comes two steps after a snapshot, its exchange long done.
    args = ("--steps", str(steps), "--snapshot-every", str(K), "--global-batch", "192")
    out, ref_out = tmp_path / "a" / "out", tmp_path / "b" / "out"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with Cluster(tmp_path / "a", 3) as c:
        jobs = [c.torchrun(i, "2:3", 1, *args, "--out", str(out), launcher="rankwatch", script=script)
                for i in range(3)]
        rs = wait_for(lambda: _training(c, 3, 3, 3 * K + 2), 180, 0.05, "3 nodes past a snapshot's exchange")
        c.kill_node(1, jobs[1], [r["pid"] for r in rs if r["node"] == "n1"])
        for i in (0, 2):
            assert jobs[i].wait(240) == 0, f"node n{i}'s torchrun failed"
        status = c.coordinator.status()
    with Cluster(tmp_path / "b", 1) as c:   # the reference: the same loop, uninterrupted
        ref = c.torchrun(0, "1", 3, *args, "--out", str(ref_out), launcher="rankwatch", script=script)
        assert ref.wait(240) == 0
    want = json.loads((ref_out / "rank0.json").read_text())["mean_losses"]
    before = {r["pid"]: r["rank"] for r in rs if r["node"] != "n1"}
    got = [json.loads((out / f"rank{r}.json").read_text()) for r in sorted(before.values())]
    assert sorted(d["pid"] for d in got) == sorted(before)   # the same processes, no restart
    for d in got:
        (rec,) = d["recoveries"]
        at, was = rec["step"], rec["from"]
        assert at % K == 0 and 0 <= was - at <= K and rec["world_size"] == 2 == d["world_size"], rec
        # Steps after the snapshot were undone and trained again: applied once each in the end.
        assert d["applied"] == list(range(1, was + 1)) + list(range(at + 1, steps + 1))
        first, again = d["mean_losses"][:was], d["mean_losses"][was:]
        assert first == pytest.approx(want[:was], rel=1e-5)
        # Two ranks of 3 micro-batches keep the global batch of three ranks of 2: the same
        # samples per step, reduced in another order.
        assert again == pytest.approx(want[at:], rel=1e-3), (at, again[:5], want[at:at + 5])
    assert got[0]["digest"] == got[1]["digest"]   # the whole parameters, gathered, agree
    recs = [i["detail"] for i in status["incidents"] if i["kind"] == "restart"
            and i["detail"].get("tier") == "in_process"]
    assert len(recs) == 1 and recs[0]["ok"] and recs[0]["dropped_nodes"] == ["n1"], recs
    assert 0 <= recs[0]["recomputed_steps"] <= K, recs


def _node_and_its_buddy(ranks: list[dict]) -> tuple[str, str]:
    """Two nodes, neither n0 (the store's host), the second holding the first's only snapshot
    copy: torchrun's rendezvous deals ranks to nodes in its own order, and the buddy ring
    follows the ranks (one rank a node here: rank r's buddy is rank r + 1)."""
    node_of = {r["rank"]: r["node"] for r in ranks}
    first = (next(r for r, n in node_of.items() if n == "n0") + 1) % len(node_of)
    buddy = buddy_map([node_of[r] for r in range(len(node_of))])[first]
    return node_of[first], node_of[buddy]


def test_a_node_and_its_buddy_lost_reload_the_checkpoint_in_process(tmp_path):
    """Four nodes of one rank, plain FSDP2 with snapshots and a save every 10 steps.  A node
    and its buddy (its snapshot's only copy) are lost together.  No survivor holds the first
    one's shards, so the other two load the newest complete checkpoint in their own
    processes, resharded for two ranks, and train on.  (That load made to fail, torchrun's
    restart resumes: tests/test_e2e_inprocess.py.)"""
    steps, ckpt = 70, tmp_path / "ckpt"
    args = ("--steps", str(steps), "--log-every", "0", "--batch-size", "2", "--step-sleep", "0.03",
            "--in-process-recovery", "--snapshot-every", str(K), "--checkpoint-dir", str(ckpt),
            "--checkpoint-interval", "10", "--metrics-out", str(tmp_path / "m"))
    rdzv = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"
    with Cluster(tmp_path, 4, ("--min-nodes", "2")) as c:
        jobs = [c.torchrun(i, "2:4", 1, *args, launcher="rankwatch", rdzv_conf=rdzv,
                           launcher_args=("--max-restarts", "1")) for i in range(4)]
        rs = wait_for(lambda: _training(c, 4, 4, 25), 180, what="4 nodes past step 25")
        pair = _node_and_its_buddy(rs)
        lost = [r["pid"] for r in rs if r["node"] in pair]
        for pid in lost:   # both at once: neither takes part in the survivors' agreement
            os.kill(pid, signal.SIGSTOP)
        for node in pair:
            c.kill_node(int(node[1:]), jobs[int(node[1:])], lost)
        for i in range(4):
            if f"n{i}" not in pair:
                assert jobs[i].wait(240) == 0, f"node n{i}'s torchrun failed"
        status = c.coordinator.status()
    survivors = {r["pid"]: r["rank"] for r in rs if r["node"] not in pair}
    tried = [i["detail"] for i in status["incidents"] if i["kind"] == "restart"
             and i["detail"].get("tier") == "in_process"]
    got = [json.loads(p.read_text()) for p in sorted((tmp_path / "m").glob("rank*.json"))]
    assert len(got) == 2, [d["pid"] for d in got]
    assert sorted(d["pid"] for d in got) == sorted(survivors)   # the same processes, to the end
    for d in got:
        (rec,) = d["recoveries"]
        at, was = rec["step"], rec["from"]
        assert at % 10 == 0 and at >= 10 and 0 <= was - at <= 20 and rec["world_size"] == 2, rec
        assert "reloaded" in rec["phases"] and "resharded" not in rec["phases"], rec
        # The steps after the checkpoint, trained again by two ranks on the same global batch,
        # repeat the four ranks' losses within the reduction order's tolerance.
        means = d["dp_mean_losses"]
        assert len(means) == was + steps - at
        first, again = means[at:was], means[was:was + (was - at)]
        ok = [i for i, x in enumerate(first) if x == x]   # the cut step's may be nan
        assert [again[i] for i in ok] == pytest.approx([first[i] for i in ok], rel=1e-3), (at, was)
    (rec,) = [d for d in tried if d["ok"]]
    assert sorted(rec["dropped_nodes"]) == sorted(pair) and rec["new_world_size"] == 2, rec
    assert 0 <= rec["recomputed_steps"] <= 20, rec
