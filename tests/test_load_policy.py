"""The coordinator's load rules: backpressure, and silence that is evidence only from a coordinator
that could have heard (pure functions), plus a real coordinator driven by simulated nodes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rankwatch.agent.job.pacing import (Load, LoadConfig, first_sync_delay, hang_shown_by_reports, interval_floor,
                                         node_silent, overload, quiet_until, retry_delay, silence_allowance,
                                         straggler_due, sync_interval)

# Its e2e tests mostly wait on timers: they may run beside another light file (tests/cores.py).
pytestmark = pytest.mark.light

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

CFG = LoadConfig()
IDLE = Load(cores=0.1, loop_lag=0.0, sync_delay=0.0)


def test_overload_has_three_kinds_of_evidence():
    assert overload(IDLE, CFG) is None
    assert "late" in overload(Load(cores=0.1, loop_lag=4.8, sync_delay=0.0), CFG)
    assert "cores" in overload(Load(cores=0.95, loop_lag=0.0, sync_delay=0.0), CFG)
    assert "arrive" in overload(Load(cores=0.1, loop_lag=0.0, sync_delay=0.8), CFG)
    assert "refused 3 calls" in overload(Load(cores=0.1, loop_lag=0.0, sync_delay=0.0, refused=3), CFG)
    # Syncs its callers gave up on before it answered: the nodes saw failures because of it.
    assert "answered 2 syncs after their callers' deadlines" in overload(
        Load(cores=0.6, loop_lag=0.0, sync_delay=0.0, late=2), CFG)
    # Hearing from few nodes is evidence against the coordinator only while it is busy itself:
    # an idle coordinator that hears from few nodes has lost nodes.
    assert "heard 30%" in overload(Load(cores=0.75, loop_lag=0.0, sync_delay=0.0, heard=0.3), CFG)
    assert overload(Load(cores=0.2, loop_lag=0.0, sync_delay=0.0, heard=0.3), CFG) is None


def test_a_job_wide_shortfall_is_overload_whatever_the_cpu_reads_beyond_the_burst_size():
    """Under half the summaries due heard, while idle: overload only when more nodes' worth
    are missing than the burst rule takes for dead at once (a small job that lost half its
    nodes has lost them)."""
    idle_short = Load(cores=0.1, loop_lag=0.0, sync_delay=0.0, heard=0.3, nodes=6)
    assert "4 nodes' worth missing" in overload(idle_short, CFG, burst=4)   # 4.2 missing > 4
    assert overload(Load(cores=0.1, loop_lag=0.0, sync_delay=0.0, heard=0.3, nodes=5), CFG, burst=4) is None
    assert overload(Load(cores=0.1, loop_lag=0.0, sync_delay=0.0, heard=0.6, nodes=2048), CFG, burst=41) is None
    assert "heard 10%" in overload(Load(cores=0.1, loop_lag=0.0, sync_delay=0.0, heard=0.1, nodes=2048), CFG,
                                   burst=41)
    assert overload(idle_short, CFG) is None   # no burst size given: the old rule

def test_nodes_slow_down_under_load_and_speed_up_again():
    busy = Load(cores=0.8, loop_lag=0.0, sync_delay=0.0)
    assert sync_interval(0.25, busy, CFG) == pytest.approx(0.375)
    assert sync_interval(4.0, busy, CFG) == CFG.max_interval
    assert sync_interval(1.0, IDLE, CFG) == pytest.approx(0.8)
    assert sync_interval(0.26, IDLE, CFG) == CFG.base_interval
    middling = Load(cores=0.6, loop_lag=0.0, sync_delay=0.0)
    assert sync_interval(1.0, middling, CFG) == 1.0     # between the marks: hold
    assert interval_floor(64, CFG) == CFG.base_interval
    assert interval_floor(4096, CFG) == pytest.approx(2.048)
    assert interval_floor(10**6, CFG) == CFG.max_interval


def test_silence_needs_a_few_intervals_and_none_during_the_quiet_after_overload():
    assert not node_silent(10.0, received_at=8.0, interval=0.25, node_timeout=3.0, quiet=0.0, cfg=CFG)
    assert node_silent(10.0, received_at=6.9, interval=0.25, node_timeout=3.0, quiet=0.0, cfg=CFG)
    # Told to sync every 2 s: silent only after 3 of its intervals.
    assert not node_silent(10.0, received_at=4.1, interval=2.0, node_timeout=3.0, quiet=0.0, cfg=CFG)
    assert node_silent(10.0, received_at=3.9, interval=2.0, node_timeout=3.0, quiet=0.0, cfg=CFG)
    quiet = quiet_until(9.0, interval=0.25, node_timeout=3.0, cfg=CFG)
    assert quiet == 12.0
    assert not node_silent(10.0, received_at=0.0, interval=0.25, node_timeout=3.0, quiet=quiet, cfg=CFG)
    assert node_silent(12.0, received_at=0.0, interval=0.25, node_timeout=3.0, quiet=quiet, cfg=CFG)


def test_during_the_quiet_a_node_is_silent_only_on_its_relays_word():
    """The coordinator's overload makes its own view no evidence; a relay that listened to
    the rest of its group, and not this node, for longer than the allowance (3 s) is."""
    kw = dict(interval=0.25, node_timeout=3.0, quiet=100.0, cfg=CFG)
    assert node_silent(10.0, received_at=5.0, witness=(5.5, 9.0), **kw), "unheard 3.5 s, said 1 s ago"
    assert not node_silent(10.0, received_at=5.0, **kw), "no word: the quiet holds"
    assert not node_silent(10.0, received_at=5.0, witness=(6.5, 9.0), **kw), "the relay heard it 2.5 s before"
    assert not node_silent(10.0, received_at=7.5, witness=(5.0, 9.0), **kw), "the coordinator heard it since"
    assert not node_silent(10.0, received_at=5.0, witness=(3.0, 6.5), **kw), "a word older than the allowance"
    assert not node_silent(10.0, received_at=5.0, witness=(5.5, 9.0), syncs=2, **kw), "heard steadily first"
    # Under backpressure the allowance is three of the node's intervals: the word must cover them.
    assert not node_silent(10.0, received_at=0.0, witness=(4.0, 9.0), **{**kw, "interval": 2.0})
    assert node_silent(10.0, received_at=0.0, witness=(2.5, 9.0), **{**kw, "interval": 2.0})


def _load_args(**kw):
    import coordinator_load

    args = coordinator_load.parser().parse_args([])
    for k, v in {"nodes": 64, "seconds": 10.0, "fault_at": 3.0, "warmup": 2.0, **kw}.items():
        setattr(args, k, v)
    return coordinator_load.run(args)


@pytest.mark.e2e
def test_64_nodes_a_silent_one_is_excluded_and_no_healthy_one():
    r = _load_args(silence=5)
    assert r["failed"] == 0 and r["healthy_excluded"] == []
    assert r["silent_excluded_after_s"] is not None and r["silent_excluded_after_s"] <= 5.0
    assert r["syncs_per_second"] > 0.8 * 64 * 4


_RELAYS = {"relay_group": 16, "relay_min_nodes": 16}


@pytest.mark.e2e
def test_64_nodes_behind_relays_a_silent_one_is_excluded_and_no_healthy_one():
    """The same job grouped behind relays (16 nodes each): the coordinator serves 4 group calls
    a round, many of them beats, and still finds the relayed node that went silent."""
    r = _load_args(silence=5, **_RELAYS)
    assert r["failed"] == 0 and r["healthy_excluded"] == []
    assert r["silent_excluded_after_s"] is not None and r["silent_excluded_after_s"] <= 5.0
    assert r["relayed_share"] > 0.5 and r["beat_share"] > 0.25, r
    assert r["latency"]["SyncGroup"]["calls"] > 0
    assert r["syncs_per_second"] > 0.8 * 64 * 4


@pytest.mark.e2e
def test_64_nodes_in_two_generator_processes_each_behind_relays_of_its_own():
    """``--processes 2``: the second process's nodes join later and are grouped behind relays
    of their own process; its silent node is excluded, and the figures are both processes'."""
    r = _load_args(silence=40, processes=2, seconds=12.0, fault_at=6.0, warmup=4.0, **_RELAYS)
    assert r["failed"] == 0 and r["healthy_excluded"] == [], r
    assert "relay in another generator process" not in r["direct_syncs_by_why"], r["direct_syncs_by_why"]
    assert r["silent_excluded_after_s"] is not None and r["silent_excluded_after_s"] <= 5.0
    # Four groups; a silenced node that was one of their relays hands its group to a member.
    assert r["relays_used"] == 4 + r["relays_silenced"] and r["relayed_share"] > 0.5, r
    assert r["steady"]["syncs_per_second"] > 0.8 * 64 * 4, r["steady"]
    # The nodes' own syncs, answered (by their relays, mostly), both processes' counted.
    assert r["steady"]["node_syncs_per_second"] > 0.8 * 64 * 4, r["steady"]


@pytest.mark.e2e
def test_nodes_behind_a_real_relay_process_are_answered_and_their_summaries_sent_on():
    """Node 0 is a real agent process: the nodes of its group sync with it over gRPC, and
    it hands every summary it took on to the coordinator in its own group calls."""
    r = _load_args(relay_process=True, **_RELAYS)
    via, lat = r["relay_process"], r["latency"]["Sync via a relay process"]
    assert r["failed"] == 0 and r["healthy_excluded"] == [], r
    assert via["nodes_behind_it"] == _RELAYS["relay_group"] - 1, via   # the first group, behind it
    assert lat["calls"] > 0.8 * 15 * 4 * 6, lat   # every node of it at ~4 Hz after the start
    assert via["sent_on"] >= 0.95 * lat["calls"], (via, lat)
    assert lat["steady_p99_ms"] < 250, lat


@pytest.mark.e2e
def test_64_nodes_behind_relays_the_slow_node_is_flagged():
    """Windows of nodes behind different relays, sent whole at different times, still line up."""
    r = _load_args(slow=9, seconds=20.0, **_RELAYS)
    assert r["straggler_nodes_flagged"] == ["sim00009"], "the 25 % slower node, compared across relays"
    assert r["beat_share"] > 0.25 and r["healthy_excluded"] == [], r


@pytest.mark.e2e
def test_a_paused_coordinator_excludes_no_healthy_node():
    """SIGSTOP the coordinator for 5 s (a long GC pause, a starved VM) under 64 nodes' syncs: once
    it runs again, every node looks silent and every rank stalled.  None of that is evidence."""
    r = _load_args(pause=5.0, seconds=13.0)
    assert r["failed_by_code"].get("DEADLINE_EXCEEDED", 0) > 0, "the pause must have cost syncs"
    assert r["healthy_excluded"] == []


def test_a_node_heard_only_a_few_times_is_never_silent():
    # The join rush: heard once, then its syncs refused at the door before the load window
    # showed the overload; it is not silent, however long ago its one summary came.
    assert not node_silent(100.0, received_at=0.0, interval=0.25, node_timeout=3.0, quiet=0.0, cfg=CFG, syncs=1)
    assert not node_silent(100.0, received_at=0.0, interval=0.25, node_timeout=3.0, quiet=0.0, cfg=CFG,
                           syncs=CFG.min_syncs - 1)
    assert node_silent(100.0, received_at=0.0, interval=0.25, node_timeout=3.0, quiet=0.0, cfg=CFG,
                       syncs=CFG.min_syncs)


def test_first_syncs_are_spread_except_the_coordinators_own():
    assert first_sync_delay(0.0, False, CFG) == 0.0
    assert first_sync_delay(0.5, False, CFG) == pytest.approx(CFG.first_sync_spread / 2)
    assert first_sync_delay(0.999, False, CFG) < CFG.first_sync_spread
    assert first_sync_delay(0.7, True, CFG) == 0.0  # the first candidate takes the role at once
    # 2,048 agents started together reach the coordinator at about 1,000 a second.
    delays = [first_sync_delay(i / 2048, False, CFG) for i in range(2048)]
    assert max(sum(1 for d in delays if t <= d < t + 0.25) for t in (0.0, 0.5, 1.0, 1.5)) <= 260


def test_a_job_of_known_size_spreads_its_first_syncs_by_its_size():
    # 2,048 nodes whose agents know the job's size: about 400 first syncs a second, over 5.1 s.
    delays = [first_sync_delay(i / 2048, False, CFG, nodes=2048) for i in range(2048)]
    assert max(delays) == pytest.approx(2048 / CFG.first_syncs_per_second, rel=1e-3)
    assert max(sum(1 for d in delays if t <= d < t + 0.25) for t in range(0, 5)) <= 101
    # a small job keeps the 2 s floor; an unknown or nonsense size is no size
    assert first_sync_delay(0.5, False, CFG, nodes=16) == pytest.approx(CFG.first_sync_spread / 2)
    assert first_sync_delay(0.5, False, CFG, nodes=-5) == pytest.approx(CFG.first_sync_spread / 2)
    assert first_sync_delay(0.5, True, CFG, nodes=2048) == 0.0


def test_a_sync_answered_after_its_deadline_counts_as_overload(tmp_path):
    """A real coordinator (in this process, real gRPC): the test holds the coordinator's lock,
    so a node's Sync waits inside it until its caller's deadline has passed.  Once the lock is
    let go the sync is answered, too late, and the coordinator's own load measure finds it
    overloaded: no node is called silent for the node timeout after it."""
    import threading
    import time
    from datetime import timedelta

    import grpc

    from conftest import wait_for
    from rankwatch.address import Address
    from rankwatch.agent.server import Agent, AgentConfig
    from rankwatch.proto import pb, pb_grpc

    sock = Address(path=str(tmp_path / "c.sock"))
    agent = Agent(AgentConfig(node_id="n0", listen=[sock], metrics_port=None, coordinators=[sock]))
    agent.start()
    channel = grpc.insecure_channel(sock.grpc_target())
    try:
        wait_for(agent.is_coordinator, 10, what="the agent to coordinate")
        load = agent.coordinator.load
        stub = pb_grpc.AgentStub(channel)
        stub.Sync(pb.NodeSummary(node_id="n1", seq=1, sent_at=time.time()), timeout=5)   # on time
        assert load.overloads == 0 and load.overloaded is None
        failed = threading.Event()

        def call() -> None:
            try:
                stub.Sync(pb.NodeSummary(node_id="n1", seq=2, sent_at=time.time()), timeout=0.3)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    failed.set()

        with agent.coordinator.lock:
            t = threading.Thread(target=call)
            t.start()
            assert failed.wait(10), "the caller's deadline passed while the coordinator was held"
            held_until = time.time()
        t.join(10)
        wait_for(lambda: load.overloaded is not None, 10, what="the coordinator to find itself overloaded")
        assert "after their callers' deadlines" in load.overloaded, load.overloaded
        assert load.quiet >= held_until + load.node_timeout
    finally:
        channel.close()
        agent.stop(timedelta(seconds=0.5))


def test_a_sync_whose_caller_is_gone_before_a_server_thread_takes_it_is_shed(tmp_path):
    """A real coordinator on real gRPC with three server threads.  The test holds the
    coordinator's lock, so three syncs wait inside their handlers; a fourth waits in the
    server's queue until its caller's deadline has passed.  When the lock is let go, the three
    are taken (late), and the fourth is not served: it is refused as ``expired``, and the
    coordinator finds itself overloaded by it."""
    import threading
    import time
    from datetime import timedelta

    import grpc

    from conftest import wait_for
    from rankwatch.address import Address
    from rankwatch.agent.server import Agent, AgentConfig
    from rankwatch.agent.rpc.limits import StreamLimits
    from rankwatch.proto import pb, pb_grpc

    sock = Address(path=str(tmp_path / "c.sock"))
    agent = Agent(AgentConfig(node_id="n0", listen=[sock], metrics_port=None, coordinators=[sock],
                              streams=StreamLimits(total=1, reserve=2)))
    agent.start()
    channel = grpc.insecure_channel(sock.grpc_target())
    try:
        wait_for(agent.is_coordinator, 10, what="the agent to coordinate")
        stub = pb_grpc.AgentStub(channel)
        view, load = agent.coordinator.view, agent.coordinator.load
        codes: dict[str, grpc.StatusCode] = {}

        def call(node: str, timeout: float) -> None:
            try:
                stub.Sync(pb.NodeSummary(node_id=node, seq=1, sent_at=time.time()), timeout=timeout)
                codes[node] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                codes[node] = exc.code()

        with agent.coordinator.lock:
            held = [threading.Thread(target=call, args=(f"n{i}", 30.0)) for i in (1, 2, 3)]
            for t in held:
                t.start()
            # Each held call has a server thread (the pool starts one per call up to its size).
            wait_for(lambda: sum(t.name.startswith("rankwatch-grpc") for t in threading.enumerate()) >= 3, 10,
                     what="three server threads, each serving a held sync")
            queued = threading.Thread(target=call, args=("n4", 0.5))
            queued.start()
            queued.join(10)
            assert codes.get("n4") == grpc.StatusCode.DEADLINE_EXCEEDED
            assert agent.gate.refused.get("expired", 0) == 0, "no thread was free to see it yet"
        for t in held:
            t.join(10)
        assert all(codes[n] == grpc.StatusCode.OK for n in ("n1", "n2", "n3")), codes
        wait_for(lambda: agent.gate.refused.get("expired", 0) == 1, 10, what="the queued sync refused as expired")
        assert {"n1", "n2", "n3"} <= set(view.nodes) and "n4" not in view.nodes, sorted(view.nodes)
        wait_for(lambda: load.overloaded is not None, 10, what="the coordinator to find itself overloaded")
        assert "refused 1 calls" in load.overloaded, load.overloaded
    finally:
        channel.close()
        agent.stop(timedelta(seconds=0.5))


def test_a_node_answered_syncs_at_the_rate_asked_from_the_start_of_its_last_sync():
    far = 100.0
    assert retry_delay(0, 0.25, 0.5, CFG, far, took=0.065) == pytest.approx(0.185)   # 4 Hz, not 3.2
    assert retry_delay(0, 0.25, 0.5, CFG, far, took=0.2) == pytest.approx(0.125)     # never back to back
    assert retry_delay(0, 0.25, 0.5, CFG, far, took=-1.0) == 0.25                   # a clock step back
    # Backing off a busy coordinator counts from the end, as before.
    assert retry_delay(1, 0.25, 1.0, CFG, far, took=0.2) == pytest.approx(0.5)


def test_a_node_backs_off_a_busy_coordinator_spread_out_and_bounded():
    far = 100.0   # a coordinator that waits long before it calls a node silent

    def delay(failures: int, interval: float, u: float, allowance: float = far) -> float:
        return retry_delay(failures, interval, u, CFG, allowance)

    assert delay(0, 0.25, 0.9) == 0.25          # answered (or gone): the interval
    assert delay(1, 0.25, 0.0) == 0.25          # the upper half of twice the interval
    assert delay(1, 0.25, 1.0) == pytest.approx(0.5)
    assert delay(3, 0.25, 1.0) == pytest.approx(2.0)
    assert delay(3, 0.25, 0.0) == pytest.approx(1.0)
    # Bounded by max_backoff intervals and by max_interval, however long it lasts...
    assert delay(1000, 0.25, 1.0) == pytest.approx(0.25 * CFG.max_backoff)
    assert delay(1000, 1.0, 1.0) == pytest.approx(CFG.max_interval)
    # ... and by a third of the time the coordinator gives a node before it calls it silent,
    # so a node that backs off is heard again before that, busy or not.
    allowance = silence_allowance(0.25, 3.0, CFG)
    assert allowance == 3.0 and delay(1000, 0.25, 1.0, allowance) == pytest.approx(1.0)
    assert silence_allowance(2.0, 3.0, CFG) == 6.0 and delay(1000, 2.0, 1.0, 6.0) == pytest.approx(2.0)
    # Spread: nodes that failed together do not come back together.
    delays = {round(delay(4, 0.25, u / 10), 3) for u in range(10)}
    assert len(delays) == 10 and min(delays) >= 2.0 and max(delays) <= 4.0


def test_a_node_agent_backs_off_while_its_coordinator_is_busy_and_not_when_it_is_gone(tmp_path):
    """Two real agents over real gRPC.  The test holds the coordinator's lock, so the node's
    syncs run past their deadline (a busy coordinator): the node counts them and waits longer
    between tries.  Once let go, the next sync is answered and the count drops to 0.  With the
    coordinator stopped (connection refused: gone, not busy), the node keeps its interval."""
    from datetime import timedelta

    from conftest import wait_for
    from rankwatch.address import Address
    from rankwatch.agent.server import Agent, AgentConfig

    csock, nsock = Address(path=str(tmp_path / "c.sock")), Address(path=str(tmp_path / "n.sock"))
    coord = Agent(AgentConfig(node_id="c", listen=[csock], metrics_port=None, coordinators=[csock]))
    node = Agent(AgentConfig(node_id="n", listen=[nsock], metrics_port=None, coordinators=[csock]))
    coord.start()
    node.start()
    try:
        wait_for(lambda: node.link.last_ok > 0, 15, what="the node's first sync")
        with coord.coordinator.lock:
            wait_for(lambda: node.link.busy_failures >= 2, 20, what="two syncs past their deadline")
        answered = node.link.last_ok
        wait_for(lambda: node.link.last_ok > answered, 20, what="a sync answered after the lock")
        assert node.link.busy_failures == 0
        coord.stop(timedelta(seconds=0.5))
        tried = node.link.attempts
        wait_for(lambda: node.link.attempts >= tried + 3, 10, what="three tries at the stopped coordinator")
        assert node.link.busy_failures == 0
    finally:
        node.stop(timedelta(seconds=0.5))
        coord.stop(timedelta(seconds=0.5))


def test_an_overloaded_coordinator_acts_only_on_a_hang_the_ranks_report():
    # Quiet period over: any verdict stands.
    assert hang_shown_by_reports(20.0, quiet=15.0, reported_for=0.0, allowance=5.0, by_silence=True)
    # Before its end: the heard ranks must have reported the stall themselves ...
    assert hang_shown_by_reports(10.0, quiet=15.0, reported_for=5.0, allowance=5.0, by_silence=False)
    assert not hang_shown_by_reports(10.0, quiet=15.0, reported_for=4.9, allowance=5.0, by_silence=False)
    # ... and the culprit must not be named for its silence alone.
    assert not hang_shown_by_reports(10.0, quiet=15.0, reported_for=9.0, allowance=5.0, by_silence=True)


def test_the_straggler_pass_is_once_per_interval_and_every_few_seconds_while_overloaded():
    assert not straggler_due(100.9, 100.0, 0.25, False, CFG) and straggler_due(101.0, 100.0, 0.25, False, CFG)
    assert not straggler_due(102.9, 100.0, 3.0, False, CFG) and straggler_due(103.0, 100.0, 3.0, False, CFG)
    assert not straggler_due(104.9, 100.0, 0.25, True, CFG)
    assert straggler_due(100.0 + CFG.straggler_every_overloaded, 100.0, 0.25, True, CFG)


def test_a_node_heard_through_a_relay_is_allowed_the_relays_hop():
    kw = dict(received_at=0.0, interval=1.1, node_timeout=3.0, quiet=0.0, cfg=CFG)
    assert node_silent(3.4, **kw) and not node_silent(3.4, relayed=True, **kw)
    assert node_silent(4.5, relayed=True, **kw)
    # At 4 Hz the node timeout (3 s) is the allowance either way.
    assert silence_allowance(0.25, 3.0, CFG, relayed=True) == silence_allowance(0.25, 3.0, CFG) == 3.0


def test_the_straggler_pass_is_spaced_by_its_own_cost():
    # A pass of 0.15 s (16,384 ranks on a slow machine) runs at most a twentieth of the time.
    assert not straggler_due(102.9, 100.0, 0.25, False, CFG, last_cost=0.15)
    assert straggler_due(103.0, 100.0, 0.25, False, CFG, last_cost=0.15)
    # A cheap one, once a second as before.
    assert straggler_due(101.0, 100.0, 0.25, False, CFG, last_cost=0.01)
