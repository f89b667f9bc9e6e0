"""Restarts through torchrun's own rendezvous: the coordinator excludes a failed node.

Three torchrun "nodes" (one rank each) under ``rankwatch run``, ``--nnodes 2:3``
and the ``rankwatch`` rendezvous backend (c10d plus exclusions), with
``--max-restarts 0``: recovery must come from the exclusion path, not from
spending restarts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import wait_for
from multinode import Cluster, check_buckets, seconds_per_step

pytestmark = pytest.mark.e2e

_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"
_LAUNCH = ("--max-restarts", "0", "--monitor-interval", "0.1")
# Four torchruns and their workers on two cores delay keep-alives past 2 s, and the stock
# rendezvous then drops live nodes from the round: allow 5 s.
_RDZV_SPARE = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=60"


def test_hung_node_is_excluded_and_the_job_continues_without_it(tmp_path):
    ck = tmp_path / "ck"
    with Cluster(tmp_path, 3, ("--min-nodes", "2")) as c:
        jobs = [c.torchrun(i, "2:3", 1, "--steps", "100000", "--log-every", "0", "--no-in-process-recovery",
                           "--checkpoint-dir", str(ck), "--checkpoint-interval", "20",
                           launcher="rankwatch", rdzv_conf=_RDZV, launcher_args=_LAUNCH)
                for i in range(3)]
        # Started one after another so node n0 hosts the store; all three train.
        def training(min_step):
            r = c.coordinator.status()["ranks"]
            return len(r) == 3 and min(x["step"] for x in r) >= min_step and r
        wait_for(lambda: training(10), 180, what="three nodes training")
        step_s = seconds_per_step(c.coordinator.status)
        # Stopped between two saves (every 20 steps): a rank in a save, or waiting in its
        # barrier, has a long allowance, and the hang would not be called within the test.
        ranks = wait_for(lambda: training(25), 60, what="three nodes past step 25")
        victim = next(r for r in ranks if r["node"] == "n2")
        t0 = time.monotonic()
        os.kill(victim["pid"], signal.SIGSTOP)

        def excluded():
            s = c.coordinator.status()
            return "n2" in s["excluded_nodes"] and s
        status = wait_for(excluded, 30, what="n2 excluded")
        t_excluded = time.monotonic() - t0
        hang = next(i for i in status["incidents"] if i["kind"] == "hang")
        assert (hang["node"], hang["rank"]) == ("n2", victim["rank"])
        # n2's torchrun leaves cleanly (rankwatch run exits 0), its stopped worker is gone.
        assert jobs[2].wait(60) == 0
        assert not _alive(victim["pid"])

        seen = set()   # the states n0's and n1's ranks show while their workers restart

        def resumed():
            s = c.coordinator.status()
            seen.update("restarting" if r.get("restarting") else r["state"]
                        for r in s["ranks"] if r["node"] in ("n0", "n1"))
            live = [r for r in s["ranks"] if r["node"] in ("n0", "n1") and r["connected"]]
            pids = {r["pid"] for r in ranks if r["node"] in ("n0", "n1")}
            restart = next((i for i in s["incidents"] if i["kind"] == "restart"), None)
            back = (len(live) == 2 and all(r["pid"] not in pids for r in live) and restart
                    and "recovered_after_seconds" in restart["detail"])
            return back and (s, restart)
        s, restart = wait_for(resumed, 90, interval=0.1, what="n0 and n1 training again")
        t_back = time.monotonic() - t0
        # Their workers were stopped by the restart: state dead (the contract's value), flagged
        # as restarting, and never dead without the flag.
        assert "dead" not in seen and "restarting" in seen, seen
        assert jobs[0].poll() is None and jobs[1].poll() is None, "no --max-restarts to spend"
        # The stall (over the 5 s hang floor, until the exclusion) and the restart (the
        # decision until both nodes train again) cost time; the rest trained steps.  Steps
        # retrained from the last checkpoint count once past the old high-water mark, so
        # recompute may or may not have begun.
        check_buckets(s, step_s, lost=("hang", "restart", "checkpoint"), unjudged=("recompute",))
        t = s["time_seconds"]
        assert 4.0 <= t["hang"] <= t_excluded + 2.0, (t, t_excluded)
        # The restart bucket is the restart's span joined with the workers' downtime seen in
        # their progress, less the hang: the downtime runs from the ranks' last completed step,
        # the hang from their last collective, up to a step earlier or later, and both are
        # sampled at the coordinator's ticks (0.25 s apart).  On a loaded machine: within 1 s.
        assert t["restart"] == pytest.approx(restart["detail"]["recovered_after_seconds"], abs=1.0)
        assert t["restart"] < t_back - t_excluded + 2.0, (t, t_excluded, t_back)
        print(f"SIGSTOP -> excluded {t_excluded:.1f}s -> training again {t_back:.1f}s "
              f"(restart {restart['detail']['recovered_after_seconds']:.1f}s after the decision)")


def test_gpu_risk_checkpoints_and_a_fatal_xid_excludes_the_node(tmp_path):
    # Scripted GPUs (one per node, for its one rank): a corrected-ECC rise on n1 is a
    # risk (checkpoint now), an XID 79 on n2 is fatal (exclude n2, restart the rest).
    def script(name, events):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"gpus": {"count": 1, "name": "scripted"}, "events": events}))
        return ("--gpu-source", f"script:{path}")
    ck = tmp_path / "ck"
    with Cluster(tmp_path, 3, ("--min-nodes", "2"), node_args={
            1: script("n1", [{"at": 24, "gpu": 0, "ecc": {"corrected": 4}}]),
            2: script("n2", [{"at": 36, "gpu": 0, "xid": 79}])}) as c:
        jobs = [c.torchrun(i, "2:3", 1, "--steps", "100000", "--log-every", "0", "--no-in-process-recovery",
                           "--checkpoint-dir", str(ck), launcher="rankwatch", rdzv_conf=_RDZV,
                           launcher_args=_LAUNCH) for i in range(3)]

        def risk_checkpoint():
            incs = c.coordinator.status()["incidents"]
            return [i for i in incs if i["kind"] == "checkpoint" and "gpu risk" in i["detail"]["reason"]]
        (saved,) = wait_for(risk_checkpoint, 90, what="a checkpoint on the ECC risk")[:1]
        assert saved["detail"]["ok"] and (ck / f"step_{saved['step']:08d}" / "COMPLETE").is_file()

        def excluded():
            s = c.coordinator.status()
            return "n2" in s["excluded_nodes"] and s
        s = wait_for(excluded, 120, what="n2 excluded on its XID")
        fault = next(i for i in s["incidents"] if i["kind"] == "gpu_fault")
        assert fault["node"] == "n2" and fault["detail"]["xid"] == 79 and fault["detail"]["action"] == "reboot"
        assert "fatal GPU fault" in next(d["reason"] for d in s["decisions"] if d["kind"] == "exclude")
        assert jobs[2].wait(60) == 0

        def resumed():
            s = c.coordinator.status()
            restart = next((i for i in s["incidents"] if i["kind"] == "restart"), None)
            live = {r["node"] for r in s["ranks"] if r["connected"] and r["step"] > 0}
            return (restart and "recovered_after_seconds" in restart["detail"]
                    and live == {"n0", "n1"} and s)
        s = wait_for(resumed, 90, what="n0 and n1 training again")
        assert jobs[0].poll() is None and jobs[1].poll() is None
        # They resumed from the risk checkpoint: nothing before it is retrained.  (On a machine
        # so loaded that training began after the XID, there was no checkpoint to resume from.)
        exclude = next(d for d in s["decisions"] if d["kind"] == "exclude")
        steps = [r["step"] for r in s["ranks"] if r["connected"]]
        if saved["detected_at"] < exclude["decided_at"]:
            assert min(steps) >= saved["step"], (steps, saved["step"])


def test_dead_node_is_excluded_and_refused_when_it_returns(tmp_path):
    # Node n2's whole process tree and its agent are SIGKILLed: the coordinator hears nothing
    # from n2 for 3 s, calls it dead and excludes it.  n0 and n1 train on (their workers broke
    # on the dead peer, so torchrun restarts them: one --max-restarts each).  A torchrun
    # started again on n2 is refused by the rendezvous and leaves cleanly.
    ck = tmp_path / "ck"
    args = ("--steps", "100000", "--log-every", "0", "--no-in-process-recovery", "--checkpoint-dir", str(ck),
            "--checkpoint-interval", "20")
    launch = ("--max-restarts", "1", "--monitor-interval", "0.1")
    with Cluster(tmp_path, 3, ("--min-nodes", "2")) as c:
        # The keep-alive of _RDZV_SPARE: once, with 2 s, the restart dropped live n0 from the new
        # round (n1 trained alone, n0 waited out its rank assignment); the exclusion, not the
        # keep-alive, takes n2 out.
        jobs = [c.torchrun(i, "2:3", 1, *args, launcher="rankwatch", rdzv_conf=_RDZV_SPARE, launcher_args=launch)
                for i in range(3)]
        ranks = wait_for(lambda: (r := c.coordinator.status()["ranks"]) and len(r) == 3
                         and min(x["step"] for x in r) >= 25 and r, 180, what="three nodes training")
        c.kill_node(2, jobs[2], [r["pid"] for r in ranks if r["node"] == "n2"])
        t0 = time.monotonic()
        s = wait_for(lambda: "n2" in (x := c.coordinator.status())["excluded_nodes"] and x, 30,
                     what="n2 excluded as dead")
        assert "node dead" in next(d["reason"] for d in s["decisions"] if d["kind"] == "exclude")
        old = {r["pid"] for r in ranks}

        def back():
            s = c.coordinator.status()
            live = {r["node"] for r in s["ranks"] if r["connected"] and r["pid"] not in old and r["step"] > 0}
            return live == {"n0", "n1"} and s
        wait_for(back, 120, interval=0.25, what="n0 and n1 training again")
        print(f"node killed -> training again on two nodes after {time.monotonic() - t0:.1f}s")
        assert jobs[0].poll() is None and jobs[1].poll() is None
        _the_lost_node_is_the_root_cause(c, ranks)
        # n2 comes back: its agent and torchrun start again, and the rendezvous refuses it.
        c.agents[2].start()
        again = c.torchrun(2, "2:3", 1, *args, launcher="rankwatch", rdzv_conf=_RDZV_SPARE, launcher_args=launch)
        assert again.wait(90) == 0
        assert "excluded" in (tmp_path / "job-n2.log").read_text()
        c.coordinator.stop()   # the coordinator's state directory tells the same story
        text = _cli("diagnose", "--agent", str(c.coordinator.sock)).stdout
        assert "\nnode n2 was lost first: its agent went silent" in text, text


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", *args], capture_output=True, text=True,
                          timeout=60)


def _the_lost_node_is_the_root_cause(c: Cluster, ranks: list[dict]) -> None:
    """n2's rank ended with its node (``how: node_lost``, its own root), the survivors' workers'
    exits (they broke on the lost peer) are its consequences, and ``diagnose`` tells n2's loss
    first; n1's agent, which sees only its own exits, says they followed a lost peer."""
    lost_pids = {r["pid"]: r for r in ranks if r["node"] == "n2"}
    others = {r["pid"] for r in ranks if r["node"] != "n2"}

    def linked():
        found = [i for i in c.coordinator.status()["incidents"] if i["kind"] == "rank_exit"]
        lost = [i for i in found if i["detail"].get("pid") in lost_pids]
        after = [i for i in found if i["detail"].get("pid") in others]
        return (len(lost) == len(lost_pids) and len(after) == len(others)
                and all(i["detail"].get("root_cause") for i in found) and (lost, after))
    lost, after = wait_for(linked, 60, interval=0.25, what="the lost node's exits and the survivors'")
    for i in lost:
        d, seen = i["detail"], lost_pids[i["detail"]["pid"]]
        assert (i["node"], i["rank"], d["how"], d["why"]) == ("n2", seen["rank"], "node_lost",
                                                              "its agent went silent"), i
        assert d["root_cause"] == i["id"] and d["consequence"] is False, i
        assert seen["step"] <= i["step"] and d["started_at"] <= i["detected_at"], i
    roots = {i["id"] for i in lost}
    for i in after:
        assert i["detail"]["root_cause"] in roots and i["detail"]["consequence"] is True, i
    text = _cli("diagnose", "--agent", str(c.coordinator.sock)).stdout
    print(text)
    lines = text.splitlines()
    assert lines[0].startswith("node n2 was lost first: its agent went silent"), text
    then = lines.index(f"  then, as consequences ({len(after)}):")
    assert all(f"{i['id']}: rank" in "\n".join(lines[then:]) for i in after), text
    assert "failed first" not in text, text
    n1 = [i for i in c.agents[1].status()["incidents"] if i["kind"] == "rank_exit" and i["node"] == "n1"]
    story = _cli("diagnose", "--agent", str(c.agents[1].sock), n1[0]["id"]).stdout
    assert "a consequence of a lost peer" in story and "failed first" not in story, story


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_hot_spare_takes_the_excluded_nodes_place(tmp_path):
    # Four nodes for a job of at most three (--nnodes 2:3): the fourth waits as a spare
    # without restarting the others (--max-restarts 0).  A hung node is excluded;
    # the spare joins the next round and the world is three ranks again.
    ck = tmp_path / "ck"
    with Cluster(tmp_path, 4, ("--min-nodes", "2")) as c:
        jobs = [c.torchrun(i, "2:3", 1, "--steps", "100000", "--log-every", "0", "--no-in-process-recovery",
                           "--checkpoint-dir", str(ck), "--checkpoint-interval", "20",
                           launcher="rankwatch", rdzv_conf=_RDZV_SPARE, launcher_args=_LAUNCH)
                for i in range(4)]

        def three_training():
            r = [x for x in c.coordinator.status()["ranks"] if x["connected"]]
            return len(r) == 3 and min(x["step"] for x in r) >= 25 and r
        ranks = wait_for(three_training, 180, what="three nodes training, one spare")
        active = {r["node"] for r in ranks}
        spare = ({"n0", "n1", "n2", "n3"} - active).pop()
        assert jobs[int(spare[1:])].poll() is None, "the spare's torchrun waits"
        victim = next(r for r in ranks if r["node"] != "n0")  # n0 hosts the store
        os.kill(victim["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        s = wait_for(lambda: victim["node"] in (x := c.coordinator.status())["excluded_nodes"] and x,
                     30, what=f"{victim['node']} excluded")
        assert next(i for i in s["incidents"] if i["kind"] == "hang")["node"] == victim["node"]
        assert jobs[int(victim["node"][1:])].wait(60) == 0

        def restored():
            live = [r for r in c.coordinator.status()["ranks"] if r["connected"] and r["step"] > 0
                    and r["pid"] not in {x["pid"] for x in ranks}]
            return len(live) == 3 and live
        live = wait_for(restored, 120, interval=0.25, what="world of three again, spare included")
        print(f"SIGSTOP -> spare {spare} training in a world of 3 after {time.monotonic() - t0:.1f}s")
        assert {r["node"] for r in live} == active - {victim["node"]} | {spare}
        assert sorted(r["rank"] for r in live) == [0, 1, 2]
        assert all(j.poll() is None for i, j in enumerate(jobs) if f"n{i}" != victim["node"])
        # No restart storm: the stock handler restarted every few seconds with a spare waiting.
        stops = [(tmp_path / f"job-n{i}.log").read_text().count("closing signal") for i in range(4)]
        print("worker stops per node:", stops)
        assert max(stops) <= 4, stops
