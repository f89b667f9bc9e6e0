"""Hangs in real torchrun jobs, injected from outside (SIGSTOP) or by the harness's fault flag."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import torchrun, wait_for
from rankwatch.agent.durable.incidents import IncidentLog

pytestmark = [pytest.mark.e2e, pytest.mark.light]


def hangs(agent):
    return [i for i in agent.status()["incidents"] if i["kind"] == "hang"]


def stop_job(job):
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)


def ranks_running(agent, n, min_step):
    ranks = agent.status()["ranks"]
    return len(ranks) == n and min(r["step"] for r in ranks) >= min_step and ranks


def test_sigstopped_worker_named_within_10s(agent_proc, tmp_path):
    job = torchrun(2, "--steps", "5000", "--log-every", "0", agent=agent_proc.addr,
                   log=tmp_path / "job.log")
    try:
        ranks = wait_for(lambda: ranks_running(agent_proc, 2, 10), 90, what="job running")
        victim = next(r for r in ranks if r["rank"] == 1)
        os.kill(victim["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        (inc,) = wait_for(lambda: hangs(agent_proc), 15, interval=0.1, what="hang incident")
        latency = time.monotonic() - t0
        assert latency < 10.0, latency
        assert inc["rank"] == 1 and inc["node"] == "n0"
        d = inc["detail"]
        assert d["alive"] is True and d["stopped"] is True and d["pid"] == victim["pid"]
        assert d["stacks"] is None and "SIGSTOP" in d["stacks_note"]
        assert {r["rank"]: r["state"] for r in agent_proc.status()["ranks"]}[1] == "hung"
        # Kept on disk, and readable with diagnose.
        on_disk = IncidentLog.replay(agent_proc.sock.parent / "state-n0" / "incidents.jsonl")
        assert [i.rank for i in on_disk if i.id == inc["id"] and i.kind == "hang"] == [1]
        out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "diagnose", "--json", "--agent",
                              str(agent_proc.addr), inc["id"]], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and json.loads(out.stdout)["rank"] == 1
        os.kill(victim["pid"], signal.SIGCONT)
        wait_for(lambda: all(r["state"] == "ok" for r in agent_proc.status()["ranks"]), 20,
                 what="recovery after SIGCONT")
        assert len(hangs(agent_proc)) == 1, "one incident per stall"
        print(f"SIGSTOP hang detected after {latency:.2f}s")
    finally:
        stop_job(job)


def test_rank_stuck_in_python_carries_its_stack(agent_proc, tmp_path):
    job = torchrun(2, "--steps", "12", "--log-every", "0", "--fault", "sleep_forward:1:8:9",
                   agent=agent_proc.addr, log=tmp_path / "job.log")
    try:
        (inc,) = wait_for(lambda: hangs(agent_proc), 90, interval=0.2, what="hang incident")
        assert inc["rank"] == 1 and inc["detail"]["alive"] and not inc["detail"]["stopped"]
        assert "_injected_sleep_in_forward" in (inc["detail"]["stacks"] or ""), inc["detail"]
        # Rank 0 went on into step 8's forward, where FSDP2 all-gathers the parameters on the
        # data-parallel group: it waits in that all-gather, which rank 1 has not issued.
        d = inc["detail"]
        coll, fr = d["collective"], d["flight_recorder"]
        print("collective:", coll, "flight recorder:", fr)
        assert coll["op"] == "all_gather" and coll["group"] and coll["seq"] > 0, coll
        assert coll["source"] == "hooks", coll
        assert ("all_gather", coll["group"], coll["seq"]) in [
            (e["op"], e["group"], e["seq"]) for e in fr["0"]["pending"]], fr
        assert fr["1"]["enqueued"][coll["group"]] == coll["seq"] - 1, fr
        assert job.wait(90) == 0
    finally:
        stop_job(job)


def test_slow_checkpoint_and_warmup_are_not_hangs(agent_proc, tmp_path):
    # Every rank spends 8 s (over the 5 s floor, ~100x a step) in a checkpoint save.
    job = torchrun(2, "--steps", "12", "--log-every", "0", "--fault", "slow_checkpoint:-1:6:8",
                   agent=agent_proc.addr, log=tmp_path / "job.log")
    try:
        assert job.wait(120) == 0, (tmp_path / "job.log").read_text()[-2000:]
        assert agent_proc.status()["incidents"] == []
    finally:
        stop_job(job)


def test_desync_names_the_rank_and_the_collective(agent_proc, tmp_path):
    # Rank 1 skips the dp loss all-reduce of step 30; rank 0 waits in it.
    job = torchrun(2, "--steps", "200", "--log-every", "0", "--fault", "skip_collective:1:30:60",
                   agent=agent_proc.addr, log=tmp_path / "job.log")
    try:
        (inc,) = wait_for(lambda: hangs(agent_proc), 90, interval=0.2, what="hang incident")
        d = inc["detail"]
        assert inc["rank"] == 1 and "behind" in d["reason"], d
        coll = d["collective"]
        assert coll["op"] == "all_reduce" and coll["group"] and coll["seq"] > 0, coll
        assert coll["source"] == "hooks"
        # PyTorch's Flight Recorder, read by each rank's sender thread, agrees: rank 0 issued
        # that all-reduce (same group and sequence number) and it is not retired; rank 1,
        # the culprit, never issued it.
        fr = d["flight_recorder"]
        assert [(e["op"], e["group"], e["seq"]) for e in fr["0"]["pending"]] == [
            ("all_reduce", coll["group"], coll["seq"])], fr
        assert fr["0"]["completed"][coll["group"]] == coll["seq"] - 1, fr
        assert fr["1"]["enqueued"][coll["group"]] == coll["seq"] - 1, fr
        assert fr["1"]["pending"] == [], fr
        # Stacks of the culprit, taken between steps too: the harness's stall after the skip.
        assert "time.sleep(skip)" in (d["stacks"] or ""), d["stacks"]
        waiting = {r["rank"]: r for r in agent_proc.status()["ranks"]}[0]
        assert waiting["state"] == "ok"
    finally:
        stop_job(job)


def test_a_pipeline_stage_stuck_in_python_is_named_with_the_stage_waiting_on_it(agent_proc, tmp_path):
    # Two pipeline stages (GPipe, 4 microbatches); stage 1's rank sleeps in Python before its
    # step-8 schedule: stage 0 sends its microbatches and blocks in a send or receive whose
    # other end is rank 1.
    job = torchrun(2, "--steps", "12", "--log-every", "0", "--pp", "2", "--pp-schedule", "gpipe",
                   "--microbatches", "4", "--fault", "sleep_forward:1:8:9", agent=agent_proc.addr,
                   log=tmp_path / "job.log")
    try:
        (inc,) = wait_for(lambda: hangs(agent_proc), 90, interval=0.2, what="hang incident")
        d = inc["detail"]
        print("reason:", d["reason"], "p2p:", d.get("p2p"))
        assert inc["rank"] == 1 and d["alive"] and not d["stopped"]
        p2p = d["p2p"]
        assert (p2p["waiter"], p2p["waiter_stage"], p2p["peer"], p2p["peer_stage"]) == (0, 0, 1, 1), p2p
        assert p2p["op"] in ("send", "recv") and p2p["peer_op"] is None, p2p
        assert p2p["microbatch"] in range(4) and p2p["microbatch_pass"] in ("forward", "backward"), p2p
        assert d["reason"].startswith("it never posted the point-to-point operation a peer waits in: "
                                      f"rank 0 (stage 0) waits in {p2p['op']}"), d["reason"]
        assert d["inflight"] is None   # the culprit itself is in no operation
        assert job.wait(90) == 0
    finally:
        stop_job(job)
