"""``rank_exit``: a real agent (thread, gRPC on a Unix socket) and a real rank process.

The rank runs ``rankwatch.hooks.init`` in a subprocess; a SIGKILL ends its stream
without a close, a ``Monitor.close()`` ends it cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from conftest import wait_for
from rankwatch.address import Address
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.agent.node.rankexit import BrokenStream, ExitConfig, ExitWatch, judge
from rankwatch.agent.server import Agent, AgentConfig

_RANK = """
import sys
import rankwatch.hooks as rw

mon = rw.init(address=sys.argv[1], node="n0", job_id="job-5", collectives=False)
for step in (1, 2, 3):
    with mon.step(step, tokens=8):
        mon.mark("data")
        mon.mark("forward")
if sys.stdin.readline().strip() == "close":  # the test says when (or kills it first)
    mon.close()
"""


@pytest.fixture
def agent(tmp_path):
    a = Agent(AgentConfig(node_id="n0", listen=[Address(path=str(tmp_path / "a.sock"))], metrics_port=None,
                          state_dir=tmp_path / "state"))
    a.start()
    yield a
    a.stop(timedelta(seconds=0.5))


def start_rank(agent: Agent) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _RANK, str(agent.config.listen[0])], text=True,
                            stdin=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for(lambda: 0 in agent.state.ranks and agent.state.ranks[0].step == 3, 60, what="the rank's steps")
    return proc


def exits(agent: Agent) -> list:
    return [i for i in agent.incidents.items if i.kind == "rank_exit"]


def test_a_killed_rank_is_a_rank_exit_with_its_evidence(agent, tmp_path):
    proc = start_rank(agent)
    try:
        proc.kill()
        proc.wait(10)
        (inc,) = wait_for(lambda: exits(agent), 10, what="a rank_exit incident")
    finally:
        proc.kill()
    assert (inc.node, inc.rank, inc.step, inc.run_id) == ("n0", 0, 3, "job-5")
    d = inc.detail
    assert d["pid"] == proc.pid and d["alive"] is False and d["stream"] == "ended without a goodbye"
    assert d["error"] in ("closed", "cancelled")  # gRPC ends a dead peer's stream either way
    assert d["last_seen"] <= d["stream_ended_at"] <= inc.detected_at
    assert agent.state.ranks[0].state == "dead"
    assert [(i.kind, i.detail["pid"]) for i in IncidentLog.replay(tmp_path / "state" / "incidents.jsonl")] == [
        ("rank_exit", proc.pid)]
    agent.watch.check_exits(time.time())
    assert len(exits(agent)) == 1, "one incident per exit"


def test_a_clean_close_is_no_rank_exit(agent):
    proc = start_rank(agent)
    proc.communicate("close\n", timeout=30)
    assert proc.returncode == 0
    wait_for(lambda: not agent.state.ranks[0].connected, 10, what="the stream's end")
    assert agent.state.ranks[0].exited_cleanly
    assert agent.watch.check_exits(time.time()) == [] and exits(agent) == []
    assert agent.state.ranks[0].state == "ok"


def test_a_broken_stream_is_judged_until_the_process_is_gone_or_streams_again():
    cfg = ExitConfig(wait_seconds=30, restart_seconds=10)
    b = BrokenStream(rank=1, node="n0", pid=42, stream=7, step=9, activity="train", last_seen=99.0,
                     ended_at=100.0, error="cancelled")

    def verdict(now=101.0, alive=False, reconnected=False, restarts=()):
        return judge(now, b, alive=alive, reconnected=reconnected, restarts=restarts, cfg=cfg)

    assert verdict() == "exit"
    assert verdict(restarts=[50.0, 120.0]) == "exit", "restarts long before or after it are not its cause"
    assert verdict(restarts=[95.0]) == "drop", "a worker stopped by a restart decided just before"
    assert verdict(alive=True) == "wait"
    assert verdict(alive=True, reconnected=True) == "drop"
    assert verdict(now=131.0, alive=True) == "drop"


def test_the_watch_is_bounded_and_forgets_what_it_settled():
    watch = ExitWatch(ExitConfig(), limit=2)
    for stream in (1, 2, 3):
        watch.broke(BrokenStream(rank=stream, node="n0", pid=100 + stream, stream=stream, step=5,
                                 activity="train", last_seen=10.0, ended_at=11.0, error="cancelled"))
    alive = {102: True, 103: False}
    exited = watch.review(12.0, alive=lambda pid: alive[pid], streaming={}, restarts=[])
    assert [b.stream for b in exited] == [3], "the oldest was dropped at the bound; 2 lives on"
    assert watch.review(12.5, alive=lambda pid: alive[pid], streaming={}, restarts=[]) == []
    assert watch.review(13.0, alive=lambda pid: False, streaming={}, restarts=[])[0].stream == 2
