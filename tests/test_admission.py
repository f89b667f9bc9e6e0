"""Real ranks always get in: the admission rule, and a real agent under squatting streams.

The rule (:mod:`rankwatch.agent.rpc.admission`) as a pure function, then a real agent
whose Unix socket one hostile process fills with 200 streams (``tests/squatters.py``,
grpc.aio: one process, cheap on 2 cores): silent, hello-only, or sending a plausible step
every second.  A rank that arrives afterwards is served; the squatters give way, each told
why, and counted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from conftest import AgentProcess, parse_metrics, wait_for
from rankstream import Stream, hello
from rankwatch.agent.rpc import admission
from rankwatch.agent.rpc.admission import RANK, SILENT, STRANGER, Seat
from rankwatch.peercred import present
from rankwatch.proto import pb

SQUATTERS = Path(__file__).with_name("squatters.py")
WORLD = ("job", 2)


def _rank(key: int, rank: int, first: float | None = None, last: float | None = None, **kw) -> Seat:
    return Seat(key, opened=float(key), identified=True, rank=rank, pid=100 + rank, holds=True,
                world=kw.pop("world", WORLD), first_step=first, last_step=last, verified=kw.pop("verified", True), **kw)


def test_standings_rank_the_jobs_world_above_strangers_above_silent_streams():
    seats = [_rank(1, 0, first=1.0, last=5.0), _rank(2, 1), Seat(3, opened=3.0),
             _rank(4, 7, first=0.5, last=6.0, world=("squat", 4096), verified=False),   # no credentials
             _rank(5, 5, last=6.0),                                                    # outside the world
             Seat(6, opened=6.0, method="Commands", identified=True, rank=0, pid=100),
             Seat(7, opened=7.0, method="Commands", identified=True, rank=0, pid=999)]
    stands = admission.standings(seats)
    assert admission.current_world(seats) == WORLD   # (the uncredentialed stream stepped first)
    assert stands == {1: RANK, 2: RANK, 3: SILENT, 4: STRANGER, 5: STRANGER, 6: RANK, 7: STRANGER}


def test_a_newcomer_takes_the_seat_of_the_stream_with_no_step_for_longest():
    hello_only_old, hello_only_new = _rank(1, 10, world=("x", 64)), _rank(2, 11, world=("x", 64))
    stepped = _rank(3, 12, first=1.0, last=2.0, world=("x", 64))
    seats = [stepped, hello_only_new, hello_only_old]
    stands = {s.key: STRANGER for s in seats}
    assert admission.victim(STRANGER, seats, stands) is hello_only_old   # hello-only first, oldest first
    assert admission.victim(STRANGER, [stepped, _rank(4, 13, first=1.0, last=1.5)], {3: STRANGER, 4: STRANGER}).key == 4
    assert admission.victim(SILENT, seats, stands) is None               # not the other way round


def test_a_rank_of_the_world_is_never_evicted_for_a_stranger_or_another_rank():
    ranks = [_rank(1, 0, first=1.0, last=1.0), _rank(2, 1)]
    stands = {1: RANK, 2: RANK}
    assert admission.victim(STRANGER, ranks, stands) is None
    assert admission.victim(RANK, ranks, stands) is None
    assert admission.victim(RANK, [*ranks, Seat(3, opened=9.0)], {**stands, 3: SILENT}).key == 3


def test_the_world_is_the_one_the_first_stepping_rank_trains_in():
    assert admission.current_world([_rank(1, 0)]) is None   # nobody stepped yet: no world, all strangers
    seats = [_rank(1, 0, first=5.0, last=9.0), _rank(2, 3, first=2.0, last=3.0, world=("old", 4))]
    assert admission.current_world(seats) == ("old", 4)


# -- a real agent -------------------------------------------------------------------


class Squatters:
    """``n`` streams of one hostile process on ``agent``'s socket."""

    def __init__(self, agent: AgentProcess, n: int, mode: str, nonce: bool = True) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SQUATTERS), str(agent.sock), str(n), mode,
                                      "nonce" if nonce else "bare"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", line

    def ends(self) -> list[str]:
        out, _ = self.proc.communicate("", timeout=30)
        return out.splitlines()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _refused(agent: AgentProcess, reason: str) -> float:
    return parse_metrics(agent.metrics()).get(
        ("rankwatch_rpcs_refused_total", frozenset({("node", agent.node), ("reason", reason)})), 0.0)


def _steps(seq: int) -> pb.Batch:
    now = time.time()
    return pb.Batch(seq=seq, steps=pb.StepColumns(step=[seq], start=[now - 0.05], duration=[0.05], data=[0.0],
                                                  forward=[0.02], backward=[0.02], optimizer=[0.01],
                                                  tokens=[1.0], flops=[1.0], wait=[0.0]))


def _real_rank(agent: AgentProcess, channel: grpc.Channel, rank: int, timeout: float = 15.0) -> Stream:
    """Rank ``rank`` of a 2-rank world, reconnecting as the rank client does (with backoff)
    until a stream of it is served and has sent a step."""
    deadline, delay = time.monotonic() + timeout, 0.1
    while True:
        s = Stream(channel, hello(rank, world_size=2, job_id="job", peer_nonce=present(str(agent.sock))))
        s.batch(steps=_steps(1).steps)
        try:
            wait_for(lambda: s.future.done() or rank in _connected(agent), 2, what=f"rank {rank} served")
        except TimeoutError:
            pass
        if not s.future.done() and rank in _connected(agent):
            return s
        s.cancel()
        assert time.monotonic() < deadline, f"rank {rank} was never served: {s.future.exception()}"
        time.sleep(delay)
        delay = min(2 * delay, 2.0)


def _connected(agent: AgentProcess) -> set[int]:
    return {r["rank"] for r in agent.status()["ranks"] if r["state"] != "dead" and r["rank"] < 2}


@pytest.mark.parametrize("mode", ["idle", "stepping"])
def test_one_process_holds_no_more_than_a_rank_needs(tmp_path, mode):
    """200 streams of one process: a few are served, the rest refused (streams_per_peer), and
    two real ranks get in beside them, also with no seat to spare (--max-streams 8)."""
    agent = AgentProcess(tmp_path / "a.sock", extra=("--max-streams", "8")).start()
    squat = Squatters(agent, 200, mode)
    channel = grpc.insecure_channel(agent.addr.grpc_target())
    try:
        t0 = time.monotonic()
        streams = [_real_rank(agent, channel, r) for r in (0, 1)]
        assert _connected(agent) == {0, 1} and time.monotonic() - t0 < 15
        # Of the 200, the process keeps 4 (--max-streams-per-process) at most.
        gone = sum(_refused(agent, r) for r in ("evicted", "streams_per_peer", "streams_total"))
        assert gone >= 196, gone
        for s in streams:
            assert s.close().batches_accepted >= 1
    finally:
        squat.kill()
        channel.close()
        agent.stop()


@pytest.mark.parametrize("mode", ["silent", "idle", "stepping"])
def test_a_full_agent_evicts_squatters_for_real_ranks(tmp_path, mode):
    """Streams whose process the agent cannot know (no credentials nonce) count as one peer
    (32); with --max-streams 16 they fill every seat.  Two real ranks still get in, each
    taking the seat of the squatter with no step for longest, which is told why."""
    agent = AgentProcess(tmp_path / "a.sock", extra=("--max-streams", "16")).start()
    squat = Squatters(agent, 200, mode, nonce=False)
    channel = grpc.insecure_channel(agent.addr.grpc_target())
    try:
        wait_for(lambda: agent.status() and _refused(agent, "evicted") + _refused(agent, "streams_per_peer")
                 + _refused(agent, "streams_total") >= 150, 15, what="the squatters met the caps")
        t0 = time.monotonic()   # before the hello deadline (5 s) could free a silent squatter's seat
        streams = [_real_rank(agent, channel, r, timeout=4.0) for r in (0, 1)]
        for seq in range(2, 4):
            for s in streams:
                s.batch(steps=_steps(seq).steps)
        assert _connected(agent) == {0, 1} and time.monotonic() - t0 < 4.5
        assert [s.close().batches_accepted for s in streams] == [3, 3]
        ends = squat.ends()
        evicted = [e for e in ends if "evicted" in e]
        assert evicted and all(e.startswith("RESOURCE_EXHAUSTED") for e in evicted), ends[:5]
        assert _refused(agent, "evicted") >= 2
    finally:
        squat.kill()
        channel.close()
        agent.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["idle", "stepping"])
def test_a_real_job_is_served_beside_200_squatting_streams(tmp_path, mode):
    """A real two-rank harness job under torchrun, beside 200 streams of one process on the
    agent's socket (hello-only, or a step every second): both ranks are served within 15 s of
    torchrun's start (its start-up included) and train to the end, and none of the ranks' streams was ever refused."""
    from conftest import torchrun

    agent = AgentProcess(tmp_path / "a.sock").start()
    squat = Squatters(agent, 200, mode)
    log = tmp_path / "job.log"
    t0 = time.monotonic()
    job = torchrun(2, "--steps", "40", agent=agent.addr, log=log)
    try:
        wait_for(lambda: _connected(agent) == {0, 1}, 15, what="both ranks served")
        print(f"served {time.monotonic() - t0:.1f}s after torchrun started")
        assert job.wait(180) == 0, log.read_text()[-3000:]
        ranks = {r["rank"]: r for r in agent.status()["ranks"] if r["rank"] < 2}
        assert all(r["step"] >= 39 for r in ranks.values()), ranks
        assert "RESOURCE_EXHAUSTED" not in log.read_text()
    finally:
        if job.poll() is None:
            job.kill()
        squat.kill()
        agent.stop()
