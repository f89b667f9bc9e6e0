"""A survivor stuck in a collective that no failure reaches leaves it once another worker
leaves the step (:mod:`rankwatch.hooks.recovery.breakout`), in two real gloo processes with a
real store.

Rank 1 enters an all-reduce alone; rank 0 never enters it and never shuts a connection, so
nothing on the wire fails rank 1's collective (a member alive but gone to the recovery, or
a peer's closed connection that did not wake the gloo op).  Rank 0 only announces that it
left the step; rank 1's watch then shuts its own groups' connections and its collective
fails at once, where without the watch it waits out the group's timeout."""

from __future__ import annotations

import datetime
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rankwatch.address import NODE_ID_ENV
from rankwatch.hooks.recovery.breakout import BreakWatch, leave_step
from rankwatch.hooks.recovery.failure import is_peer_failure
from rankwatch.hooks.recovery.protocol import Round
from rankwatch.hooks.recovery.store import ROUND_ENV, STORE_ENV, connect

_GROUP_WAIT = datetime.timedelta(seconds=40)   # rank 1's bound on its lone all-reduce


def _rank(rank: int, pg_port: int, store_port: int) -> None:
    env = {STORE_ENV: f"127.0.0.1:{store_port}", ROUND_ENV: "t/", NODE_ID_ENV: f"n{rank}"}
    round_ = Round(*connect(env), env, settle=1.0)
    keep = {("127.0.0.1", store_port)}
    baseline = {(c[0], c[1], c[2]) for c in _tcp()}   # the recovery store's connection stays
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pg_port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(1))   # the group works
    watch = BreakWatch(round_, env, lambda: leave_step("gloo", baseline, keep))
    watch.follow(0)
    watch.start()
    if rank == 0:
        round_.store.wait([round_.key("entering")])
        watch.recovering()        # this worker leaves the step itself: its own watch stays off
        watch.announce(0, 0)
        round_.store.wait([round_.key("result")], _GROUP_WAIT * 2)
        result = json.loads(round_.read("result"))
        result["own_watch_broke"] = watch.broke
        round_.put("final", json.dumps(result))
        return
    round_.put("entering", "1")
    t0 = time.monotonic()
    error = ""
    try:
        dist.all_reduce(torch.ones(1), async_op=True).wait(_GROUP_WAIT)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        error = f"{type(exc).__name__}: {exc}"[:300]
        peer = is_peer_failure(exc)
    else:
        peer = False
    round_.put("result", json.dumps({"seconds": time.monotonic() - t0, "error": error, "peer_failure": peer,
                                     "broke": watch.broke}))


def _tcp() -> set[tuple]:
    import psutil

    return {(c.fd, c.laddr, c.raddr) for c in psutil.Process().net_connections(kind="tcp") if c.raddr}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_collective_no_failure_reaches_is_left_once_another_worker_leaves_the_step():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=90), wait_for_workers=False)
    mp.spawn(_rank, args=(_free_port(), store.port), nprocs=2)
    result = json.loads(Round(store, "t/", {}, 1.0).read("final"))
    assert result["error"], "rank 1's lone all-reduce returned"
    assert result["peer_failure"], result["error"]   # the tier takes it for a lost peer and recovers
    assert result["broke"] == 1
    assert result["seconds"] < _GROUP_WAIT.total_seconds() / 4, result   # not the group's timeout
    assert result["own_watch_broke"] == 0   # the worker that left did not break itself again


class _Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return 0


def test_the_watch_never_breaks_a_generation_it_does_not_follow(tmp_path):
    """The leave of generation 0 seen late, when the worker already recovered into 1 (or is
    recovering): its new groups are left alone."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    env = {STORE_ENV: f"127.0.0.1:{store.port}", ROUND_ENV: "t/", NODE_ID_ENV: "n0"}
    leave = _Counting()
    watch = BreakWatch(Round(store, "t/", env, 1.0), env, leave)
    watch.follow(1)
    watch._break(0)
    watch.recovering()
    watch._break(1)
    assert leave.calls == 0 and watch.broke == 0
    watch.follow(1)
    watch._break(1)
    watch._break(1)   # once per generation
    assert leave.calls == 1 and watch.broke == 1


def _late_agreement(said_it_left: bool) -> tuple[int, ...]:
    """Member 2 is gone; member 0 arrives first; member 1, alive, arrives 0.6 s after it (the
    ``settle`` is 0.3 s), having said it left the step, or not.  The members the decision keeps."""
    import threading

    from rankwatch.hooks.recovery.decide import Membership
    from rankwatch.hooks.recovery.net import Liveness

    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    env = {STORE_ENV: f"127.0.0.1:{master.port}", ROUND_ENV: "t/"}
    rounds = [Round(*connect(env), {**env, NODE_ID_ENV: f"n{r}"}, settle=0.3) for r in (0, 1, 2)]
    alive = [Liveness(), Liveness(), Liveness()]
    for r, round_ in enumerate(rounds):
        round_.register(r, 3, alive[r].address)
    alive[2].close()   # member 2's process is gone: its liveness port refuses
    if said_it_left:
        BreakWatch(rounds[1], env, _Counting()).announce(0, 1)
    late: dict = {}

    def member_1() -> None:
        rounds[1].store.wait([rounds[1].key("gen/1/post/1")])   # member 0 arrived first
        time.sleep(0.6)   # the fault: a member this late (not a synchronisation)
        late["d"] = rounds[1].agree(Membership(generation=0, rank=1, world_size=3, members=(0, 1, 2)), 3, 1, False, set())

    thread = threading.Thread(target=member_1)
    thread.start()
    decision = rounds[0].agree(Membership(generation=0, rank=0, world_size=3, members=(0, 1, 2)), 3, 1, False, set())
    thread.join(40)
    for a in alive[:2]:
        a.close()
    assert decision.ok and late["d"].members == decision.members
    return decision.members


def test_the_agreement_waits_past_settle_only_for_a_member_that_said_it_left_the_step():
    assert _late_agreement(said_it_left=True) == (0, 1)
    assert _late_agreement(said_it_left=False) == (0,)   # hung, as far as anyone can tell


def test_a_leave_written_without_the_job_s_token_breaks_nothing():
    """Anyone who reaches the store can write keys; only a worker of the job (its token) can
    make the others leave a healthy step, or make the agreement wait for it."""
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    env = {STORE_ENV: f"127.0.0.1:{master.port}", ROUND_ENV: "t/", NODE_ID_ENV: "n0", "RANKWATCH_TOKEN": "s3cret"}
    worker = Round(*connect(env), env, 1.0)
    forger = Round(*connect(env), {**env, "RANKWATCH_TOKEN": "guess"}, 1.0)
    for suffix in ("gen/1/leave", "gen/1/leaving/2"):
        # A store client's set is not acknowledged: a get on the same connection comes back
        # only after it, so the value is in the store before another client looks.
        master.set(worker.key(suffix), b"n9")               # bare
        assert master.get(worker.key(suffix)) == b"n9"
        assert worker.has(suffix) and not worker.said(suffix)
        forger.put(suffix, "n9")                            # sealed with another token
        assert forger.store.get(worker.key(suffix)) != b"n9"
        assert not worker.said(suffix)
    BreakWatch(worker, env, _Counting()).announce(0, 2)     # a worker of the job
    assert worker.said("gen/1/leave") and worker.said("gen/1/leaving/2")
