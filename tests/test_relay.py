"""Relays: a big job's nodes sync through one agent per group (agent/relays/routing.py, agent/relays/relay.py).

The rules and the relay's bounds are checked directly; the tier itself with real agent
processes over real gRPC: a relayed node's decisions reach it through its relay, and a
relay SIGKILLed costs its group no verdict (its nodes sync with the coordinator directly).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from conftest import AgentProcess, parse_metrics, wait_for
from rankwatch.agent.job.coordinator import Coordinator, PolicyConfig
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.agent.cli.ports import free_port
from rankwatch.agent.wire.bounds import MAX_SUMMARY_BYTES
from rankwatch.agent.relays.relay import MAX_GROUP, Relay, RelayBusy, RelayUnavailable
from rankwatch.agent.relays.routing import (RelayConfig, assign, callers, relay_answer, send_whole, signature,
                                          wait_spread)
from rankwatch.agent.wire.ranges import Rejected
from rankwatch.proto import pb

# Its e2e tests mostly wait on timers: they may run beside another light file (tests/cores.py).
pytestmark = pytest.mark.light


# -- the rules --------------------------------------------------------------------

def test_groups_in_node_order_each_behind_its_first_eligible_node():
    nodes = [(f"n{i:02d}", f"h{i}:1", i != 4) for i in range(10)]   # n04 is not eligible
    got = assign(reversed(nodes), RelayConfig(group_size=4, min_nodes=2))
    assert got == {"n00": "", "n01": "h0:1", "n02": "h0:1", "n03": "h0:1",
                   "n04": "h5:1", "n05": "", "n06": "h5:1", "n07": "h5:1",   # n04 skipped: n05 relays
                   "n08": "", "n09": "h8:1"}
    assert callers(got, 10) == 3
    # Groups are kept: a node joining fills a group with room; a relay no longer eligible
    # hands its group to its first eligible member; nobody else moves.
    later = [(f"n{i:02d}", f"h{i}:1", i not in (4, 5)) for i in range(11)]
    again = assign(later, RelayConfig(group_size=4, min_nodes=2), got)
    assert again == {**got, "n04": "h6:1", "n05": "h6:1", "n06": "", "n07": "h6:1", "n10": "h8:1"}
    assert assign(later, RelayConfig(group_size=4, min_nodes=2), again) == again


def test_no_relays_in_a_small_job_when_off_or_without_addresses():
    nodes = [(f"n{i}", f"h{i}:1", True) for i in range(5)]
    assert assign(nodes, RelayConfig(group_size=2, min_nodes=6)) == {}
    assert assign(nodes, RelayConfig(group_size=0, min_nodes=2)) == {}
    assert assign([(n, "", True) for n, _, _ in nodes], RelayConfig(group_size=2, min_nodes=2)) == {}
    with pytest.raises(ValueError):
        RelayConfig(group_size=1)


def _ranked(node: str, seq: int, sent_at: float, progress: float, **rank) -> pb.NodeSummary:
    s = pb.NodeSummary(node_id=node, seq=seq, sent_at=sent_at)
    s.ranks.append(pb.RankSummary(**{"rank": 0, "pid": 7, "connected": True, "alive": True, "state": "ok",
                                     "progress_at": progress, **rank}))
    return s


def test_a_summary_goes_whole_when_what_the_detectors_act_on_changed():
    cfg = RelayConfig(whole_every_seconds=1.0, long_wait_seconds=1.0, long_wait_spread_seconds=0.0)
    sig, progress, steps = signature(_ranked("n1", 1, 100.0, 99.9, steps_completed=20), cfg)
    assert (progress, steps) == (99.9, 20)
    last = (10.0, sig, 20)
    assert send_whole(10.0, sig, 20, None, cfg), "nothing sent whole yet"
    assert not send_whole(10.5, signature(_ranked("n1", 2, 100.5, 100.4), cfg)[0], 23, last, cfg), \
        "progress alone is a beat"
    assert send_whole(11.0, sig, 20, last, cfg), "whole at least every second"
    assert send_whole(10.5, sig, 20 + cfg.whole_every_steps, last, cfg), "... and every few steps"
    assert send_whole(10.5, sig, 3, last, cfg), "steps going back: the ranks restarted"
    for changed in (dict(stopped=True), dict(alive=False), dict(state="hung"), dict(pid=8)):
        assert send_whole(10.5, signature(_ranked("n1", 2, 100.5, 100.4, **changed), cfg)[0], 20, last, cfg), \
            changed
    waiting = _ranked("n1", 2, 100.5, 100.4)
    waiting.ranks[0].inflight.CopyFrom(pb.InFlight(op="all_reduce", group="0", seq=3, since=100.2))
    assert not send_whole(10.5, signature(waiting, cfg)[0], 20, last, cfg), "a collective in flight briefly"
    waiting.ranks[0].inflight.since = 99.4
    assert send_whole(10.5, signature(waiting, cfg)[0], 20, last, cfg), "a collective in flight over a second"
    news = _ranked("n1", 2, 100.5, 100.4)
    news.incidents.append(pb.Incident(id="i1", kind="checkpoint", node="n1"))
    assert send_whole(10.5, signature(news, cfg)[0], 20, last, cfg)


def test_a_node_whose_ranks_stopped_moving_goes_whole_once():
    """A node one collective behind a hung job waits in nothing, so no in-flight wait sends it
    whole; its ranks' progress stopping does, once (the hang detector needs its current copy)."""
    cfg = RelayConfig(whole_every_seconds=2.0, long_wait_seconds=1.0, long_wait_spread_seconds=0.0)
    moving = signature(_ranked("n1", 1, 100.0, 99.9), cfg)[0]
    last = (10.0, moving, 20)
    assert not send_whole(10.5, signature(_ranked("n1", 2, 100.5, 99.6), cfg)[0], 20, last, cfg), "0.9 s: a beat"
    stalled = signature(_ranked("n1", 3, 101.0, 99.9), cfg)[0]
    assert send_whole(11.0, stalled, 20, last, cfg), "1.1 s without progress: whole"
    assert not send_whole(11.5, signature(_ranked("n1", 4, 105.0, 99.9), cfg)[0], 20, (11.0, stalled, 20), cfg), \
        "still stalled: beats again"


def test_a_job_wide_stall_sends_its_nodes_whole_over_a_second_not_in_one_interval():
    """Every rank of a 2,048-node job stops in the same instant: each node goes whole at its own
    point between long_wait_seconds and that plus the spread (the same point wherever it is
    relayed), so about a quarter of the nodes go whole in any quarter second, not all."""
    cfg = RelayConfig(long_wait_seconds=1.0, long_wait_spread_seconds=1.0)
    names = [f"node{i:05d}" for i in range(2048)]

    def whole_at(name):
        """The first of its syncs, 0.05 s apart from the stall at 100.0, that goes whole."""
        moving = signature(_ranked(name, 1, 99.9, 99.9), cfg)[0]
        for k in range(1, 80):
            sent = 100.0 + 0.05 * k
            waiting = _ranked(name, k + 1, sent, 100.0)
            waiting.ranks[0].inflight.CopyFrom(pb.InFlight(op="all_reduce", group="0", seq=3, since=100.0))
            if send_whole(sent, signature(waiting, cfg)[0], 20, (99.9, moving, 20), cfg):
                return sent - 100.0
        return None

    at = [whole_at(n) for n in names]
    assert all(a is not None and 1.0 < a <= 2.05 for a in at), (min(at), max(at))
    for lo in (1.0, 1.25, 1.5, 1.75):
        share = sum(1 for a in at if lo < a <= lo + 0.25) / len(at)
        assert 0.2 < share < 0.3, (lo, share)
    assert wait_spread("node00007", cfg) == wait_spread("node00007", RelayConfig()), "a node's own point, everywhere"


def test_under_backpressure_a_node_goes_whole_every_few_intervals_not_every_sync():
    """Nodes told to sync every 3 s: a fixed 2 s would send every summary whole; the relay
    stretches it to 4 intervals, and what the detectors act on still goes whole at once."""
    cfg = RelayConfig(whole_every_seconds=2.0, whole_every_intervals=4.0)
    sig, _, _ = signature(_ranked("n1", 1, 100.0, 99.9, steps_completed=20), cfg)
    last = (10.0, sig, 20)
    beat = signature(_ranked("n1", 2, 103.0, 102.9), cfg)[0]
    assert send_whole(13.0, beat, 22, last, cfg, interval=0.25), "at 4 Hz: whole every 2 s, as before"
    assert not send_whole(13.0, beat, 22, last, cfg, interval=3.0), "at 3 s: a beat"
    assert not send_whole(21.9, beat, 22, last, cfg, interval=3.0)
    assert send_whole(22.0, beat, 22, last, cfg, interval=3.0), "... whole after 4 intervals"
    assert send_whole(13.0, beat, 20 + cfg.whole_every_steps, last, cfg, interval=3.0), "the steps still count"
    stopped = signature(_ranked("n1", 2, 103.0, 102.9, stopped=True), cfg)[0]
    assert send_whole(13.0, stopped, 22, last, cfg, interval=3.0), "a change still goes whole at once"
    off = RelayConfig(whole_every_seconds=2.0, whole_every_intervals=0.0)
    assert send_whole(13.0, beat, 22, last, off, interval=3.0), "0: never stretched"
    assert not send_whole(13.0, beat, 22, last, cfg, interval=1e9), "an absurd interval is bounded..."
    assert send_whole(10.0 + 240.0, beat, 22, last, cfg, interval=1e9), "... at 4 x 60 s"


def test_a_relay_sends_beats_between_wholes_and_a_refused_beat_goes_whole_next():
    clock = Clock()
    relay = Relay("h1:1", cfg=RelayConfig(whole_every_seconds=1.0), clock=clock)
    relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25))
    sent: list[tuple[list[str], list[str]]] = []

    def flush() -> pb.GroupSummary:
        g = relay.group(_summary("n1", sent_at=1000.0 + clock.t))
        sent.append(([s.node_id for s in g.nodes[1:]], [b.node_id for b in g.beats]))
        return g

    relay.take(_ranked("n2", 1, 1000.0, 999.5))
    flush()
    clock.t += 0.25
    relay.take(_ranked("n2", 2, 1000.25, 1000.2))
    beat = flush().beats[0]
    assert (beat.seq, beat.sent_at, beat.latest_progress) == (2, 1000.25, 1000.2)
    clock.t += 0.25
    relay.take(_ranked("n2", 3, 1000.5, 1000.4))
    relay.take(_ranked("n2", 4, 1000.6, 1000.5, stopped=True))   # a whole one waiting stays whole:
    relay.take(_ranked("n2", 5, 1000.7, 1000.6, stopped=True))
    g = flush()
    assert [s.seq for s in g.nodes[1:]] == [5] and not g.beats
    clock.t += 0.25
    relay.take(_ranked("n2", 6, 1000.8, 1000.7, stopped=True))
    flush()
    relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25, refused=["n2"]))
    clock.t += 0.25
    relay.take(_ranked("n2", 7, 1000.9, 1000.8, stopped=True))
    flush()
    assert sent == [(["n2"], []), ([], ["n2"]), (["n2"], []), ([], ["n2"]), (["n2"], [])]


# -- the relay's own bounds -------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _summary(node: str, seq: int = 1, sent_at: float = 1000.0) -> pb.NodeSummary:
    return pb.NodeSummary(node_id=node, seq=seq, sent_at=sent_at)


def test_a_relay_answers_only_from_a_fresh_coordinator_reply():
    clock = Clock()
    relay = Relay("h1:1", max_nodes=2, fresh_seconds=2.0, clock=clock)
    with pytest.raises(RelayUnavailable):
        relay.take(_summary("n2"))   # nothing heard from the coordinator yet
    reply = pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25, relays={"n3": "h9:1"})
    reply.decisions.append(pb.Decision(id="d1", kind="exclude", node="n5", generation=1))
    reply.incidents.append(pb.Incident(id="i1", kind="hang", node="n2"))
    relay.answered(reply)
    got = relay.take(_summary("n2"))
    assert [d.id for d in got.decisions] == ["d1"] and [i.id for i in got.incidents] == ["i1"]
    assert got.relay == "h1:1", "a node new to this relay keeps syncing here"
    assert relay.take(_summary("n3")).relay == "h9:1" and not relay.take(_summary("n3", 2)).incidents
    with pytest.raises(RelayUnavailable):
        relay.take(_summary("n4"))   # it holds its most nodes
    with pytest.raises(Rejected):
        relay.take(_summary("bad\nid"))
    huge = _summary("n2", 2)
    huge.ranks.add(stacks="x" * (MAX_SUMMARY_BYTES + 1))
    with pytest.raises(Rejected):
        relay.take(huge)
    clock.t += 1.5
    group = relay.group(_summary("n1"))
    assert [s.node_id for s in group.nodes] == ["n1", "n2", "n3"]
    assert [s.seq for s in group.nodes] == [1, 1, 2], "the newest summary per node"
    assert list(group.held_seconds) == [0.0, 1.5, 1.5] and not relay.pending()
    relay.answered(reply)
    clock.t += 2.5   # 2.5 s after the reply, nothing asked since: stale
    with pytest.raises(RelayUnavailable):
        relay.take(_summary("n2", 3))
    relay.answered_directly(pb.SyncReply(coordinator="n0", sync_interval_seconds=0.25))
    assert relay.take(_summary("n2", 3)).coordinator == "n0"
    relay.lost_coordinator()
    with pytest.raises(RelayUnavailable):
        relay.take(_summary("n2", 4))


def test_a_busy_coordinator_keeps_the_relay_answering_and_what_it_missed_goes_whole_again():
    # A SyncGroup past its deadline is a busy coordinator, not a gone one: refusing the group
    # here would send its 63 nodes to the coordinator directly, at the moment it is busiest.
    clock = Clock()
    relay = Relay("h1:1", fresh_seconds=2.0, cfg=RelayConfig(whole_every_seconds=10.0), clock=clock)
    relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25))
    relay.take(_ranked("n2", 1, 1000.0, 999.9))
    relay.take(_ranked("n3", 1, 1000.0, 999.9))
    g = relay.group(_summary("n1"))
    assert [s.node_id for s in g.nodes[1:]] == ["n2", "n3"]
    relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25))
    clock.t += 0.25
    relay.take(_ranked("n2", 2, 1000.25, 1000.2))
    g = relay.group(_summary("n1", 2))
    assert [b.node_id for b in g.beats] == ["n2"] and not g.nodes[1:], "n2 was sent whole lately: a beat"
    clock.t += 0.25
    relay.take(_ranked("n3", 2, 1000.5, 1000.4, stopped=True))   # what the detectors act on: whole
    failed = relay.group(_summary("n1", 3))
    assert [s.node_id for s in failed.nodes[1:]] == ["n3"]
    relay.unanswered(failed, busy=True)   # deadline exceeded
    clock.t += 0.25
    assert relay.take(_ranked("n2", 3, 1000.75, 1000.7)).coordinator == "n0", "still answering"
    relay.take(_ranked("n3", 3, 1000.75, 1000.4, stopped=True))
    g = relay.group(_summary("n1", 4))
    assert [s.node_id for s in g.nodes[1:]] == ["n3"], "the copy the coordinator missed goes whole again"
    assert [b.node_id for b in g.beats] == ["n2"]
    clock.t += 2.5   # no answer for longer than the reply stays fresh: held, not answered
    with pytest.raises(RelayBusy):
        relay.take(_ranked("n2", 4, 1003.25, 1003.2))
    relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25))
    relay.unanswered(None, busy=False)   # unreachable: refused at once
    with pytest.raises(RelayUnavailable):
        relay.take(_ranked("n2", 5, 1003.5, 1003.4))


def test_what_a_relay_does_with_a_sync_once_its_reply_is_stale():
    cfg = RelayConfig(busy_hold_seconds=10.0)
    assert relay_answer(1.9, 0.25, False, 2.0, cfg) == "answer"
    assert relay_answer(2.9, 1.0, True, 2.0, cfg) == "answer", "three intervals stay fresh"
    assert relay_answer(2.1, 0.25, False, 2.0, cfg) == "refuse", "stale, and the coordinator not only busy"
    assert relay_answer(2.1, 0.25, True, 2.0, cfg) == "hold"
    assert relay_answer(10.0, 0.25, True, 2.0, cfg) == "hold"
    assert relay_answer(10.1, 0.25, True, 2.0, cfg) == "refuse", "held at most busy_hold_seconds"
    assert relay_answer(2.1, 0.25, True, 2.0, RelayConfig(busy_hold_seconds=0.0)) == "refuse"
    with pytest.raises(ValueError):
        RelayConfig(busy_hold_seconds=-1.0)


def test_a_relay_holds_its_nodes_summaries_while_the_coordinator_is_busy():
    # Past a fresh reply, a relay whose SyncGroup a busy coordinator did not answer keeps
    # each node's summary for its next call and says so (the node backs off behind it):
    # sending the group to the coordinator directly is what keeps a busy coordinator busy.
    clock = Clock()
    relay = Relay("h1:1", fresh_seconds=2.0, cfg=RelayConfig(busy_hold_seconds=10.0), clock=clock)
    relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25))
    relay.unanswered(relay.group(_summary("n1")), busy=True)
    clock.t += 3.0
    with pytest.raises(RelayBusy):
        relay.take(_ranked("n2", 1, 1003.0, 1002.9))
    with pytest.raises(RelayBusy):
        relay.take(_ranked("n2", 2, 1003.25, 1003.2))
    g = relay.group(_summary("n1", 2))
    assert [(s.node_id, s.seq) for s in g.nodes[1:]] == [("n2", 2)], "the held summary goes on, the newest"
    relay.unanswered(g, busy=True)
    clock.t += 7.5   # 10.5 s since the last reply: past the hold
    with pytest.raises(RelayUnavailable):
        relay.take(_ranked("n2", 3, 1010.5, 1010.4))
    relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25))
    assert relay.take(_ranked("n2", 4, 1010.75, 1010.7)).coordinator == "n0"
    relay.unanswered(relay.group(_summary("n1", 3)), busy=False)   # unreachable: no hold
    with pytest.raises(RelayUnavailable):
        relay.take(_ranked("n2", 5, 1011.0, 1010.9))
    relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25))
    relay.unanswered(relay.group(_summary("n1", 4)), busy=True)
    relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25))   # answered again
    clock.t += 3.0
    with pytest.raises(RelayUnavailable):   # stale, with nothing unanswered since: not busy
        relay.take(_ranked("n2", 6, 1014.0, 1013.9))


def test_a_relay_waiting_for_its_calls_answer_holds_its_nodes():
    # A SyncGroup still on its way (a slow coordinator, not yet past the call's deadline)
    # counts as busy: the relay holds rather than refuses when its last reply turns stale.
    clock = Clock()
    relay = Relay("h1:1", fresh_seconds=2.0, cfg=RelayConfig(busy_hold_seconds=10.0), clock=clock)
    relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25))
    relay.take(_ranked("n2", 1, 1000.0, 999.9))
    relay.group(_summary("n1"))   # sent; no answer yet
    clock.t += 2.5
    with pytest.raises(RelayBusy):
        relay.take(_ranked("n2", 2, 1002.5, 1002.4))
    relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25))
    assert relay.take(_ranked("n2", 3, 1002.75, 1002.7)).coordinator == "n0"
    clock.t += 2.5   # stale, and nothing asked since the answer: refused
    with pytest.raises(RelayUnavailable):
        relay.take(_ranked("n2", 4, 1005.25, 1005.2))


def test_a_relay_vouches_only_for_members_it_listened_for_and_did_not_hear():
    """Each group names the members (nodes the coordinator sent to this relay) the relay has
    not heard lately, with how long: but never for time it was not listening itself, nor for
    a node it refused (that node went to the coordinator)."""
    clock = Clock()
    relay = Relay("h1:1", fresh_seconds=2.0, clock=clock)

    relays = {"n1": "", "n2": "h1:1", "n3": "h1:1", "n4": "h9:1"}

    def answer(*carried: str) -> None:   # (a reply names the relays of the nodes its call carried)
        relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25,
                                     relays={n: relays[n] for n in ("n1", *carried)}))

    def beat(seconds: float) -> list[tuple[str, float]]:
        """n2 syncs every 0.25 s for ``seconds``, the relay sending each time; its last group's absences."""
        for _ in range(int(seconds / 0.25)):
            clock.t += 0.25
            relay.take(_summary("n2", sent_at=clock.t))
            g = relay.group(_summary("n1"))
            answer("n2")
        return [(a.node_id, round(a.unheard_seconds, 2)) for a in g.absent]

    answer()
    for n in ("n2", "n3", "n4"):
        relay.take(_summary(n))
    assert not relay.group(_summary("n1")).absent
    answer("n2", "n3", "n4")   # n2 and n3 are its group; n4 was sent to another relay
    assert beat(1.0) == [], "unheard for no longer than a second: not worth a word"
    assert beat(2.0) == [("n3", 3.0)]
    relay.woke_late(0.9)
    assert beat(0.25) == [("n3", 3.25)], "its agent woke late by less than a node's deadline: still listening"
    relay.woke_late(1.25)   # paused or starved for over a second: it may have failed its nodes meanwhile
    assert beat(0.25) == [] and beat(1.0) == [("n3", 1.25)], "counted from when it listened again"
    clock.t += 1.5   # no node's sync for 1.5 s (its nodes' loop stalled, or their network): not listening
    assert beat(0.25) == [] and beat(1.25) == [("n3", 1.25)], "counted from the sync that ended the gap"
    clock.t += 2.5   # stale, and nothing unanswered: n3's sync is refused (it goes to the coordinator)
    with pytest.raises(RelayUnavailable):
        relay.take(_summary("n3", sent_at=clock.t))
    answer()
    assert beat(3.0) == [], "a node the relay refused is no member until a reply sends it back"
    relay.take(_summary("n3", sent_at=clock.t))
    relay.group(_summary("n1"))
    answer("n3")
    assert beat(2.0) == [("n3", 2.0)]


def test_a_relay_holds_a_bounded_number_of_bytes():
    relay = Relay("h1:1", max_bytes=1000)
    relay.answered(pb.GroupReply(coordinator="n0", sync_interval_seconds=0.25))
    big = _summary("n2")
    big.ranks.add(stacks="x" * 600)
    relay.take(big)
    relay.take(big)   # the same node's newer summary takes its place: no more held
    other = _summary("n3")
    other.ranks.add(stacks="y" * 600)
    with pytest.raises(RelayUnavailable):
        relay.take(other)   # n3 syncs with the coordinator itself
    relay.group(_summary("n1"))
    relay.take(other)


# -- the coordinator's side ---------------------------------------------------------

def test_a_beat_after_progress_marks_the_coordinators_copy_as_old_until_the_next_whole():
    clock = Clock()
    clock.t = 1000.0
    c = Coordinator("n0", incidents=IncidentLog(None), policy=PolicyConfig(), clock=clock,
                    relay=RelayConfig(group_size=2, min_nodes=2))
    c.sync(_ranked("n1", 1, 1000.0, 999.8))

    def current() -> list[bool]:
        return [r.current for r in c.view.snapshot(clock.t).ranks]

    assert current() == [True]
    beat = pb.NodeBeat(node_id="n1", seq=2, sent_at=1000.25, latest_progress=999.9)
    c.sync_group(pb.GroupSummary(nodes=[_summary("n9", sent_at=1000.25)], held_seconds=[0.0], beats=[beat]))
    assert current() == [True], "no progress since the copy was sent"
    beat = pb.NodeBeat(node_id="n1", seq=3, sent_at=1000.5, latest_progress=1000.4)
    c.sync_group(pb.GroupSummary(nodes=[_summary("n9", 2, sent_at=1000.5)], held_seconds=[0.0], beats=[beat]))
    assert current() == [False], "its ranks moved after the copy: the copy is old"
    c.sync(_ranked("n1", 4, 1000.75, 1000.7))
    assert current() == [True], "a whole summary is current again"

def test_what_can_end_a_hang_is_counted_from_summaries_and_beats():
    """A node's ranks progressing (said by a beat or a whole summary) or its streams opening or
    closing counts as a move (hangend.end_possible); a beat or a copy saying nothing new does not."""
    clock = Clock()
    clock.t = 1000.0
    c = Coordinator("n0", incidents=IncidentLog(None), policy=PolicyConfig(), clock=clock,
                    relay=RelayConfig(group_size=2, min_nodes=2))
    c.sync(_ranked("n1", 1, 1000.0, 999.8))
    c.sync_group(pb.GroupSummary(nodes=[_summary("n9", sent_at=1000.1)], held_seconds=[0.0]))   # the relay: new
    moves = c.view.moves

    def beat(seq: int, at: float, progress: float) -> int:
        c.sync_group(pb.GroupSummary(nodes=[_summary("n9", seq, sent_at=at)], held_seconds=[0.0],
                                     beats=[pb.NodeBeat(node_id="n1", seq=seq, sent_at=at, latest_progress=progress)]))
        return c.view.moves - moves

    assert beat(2, 1000.25, 999.8) == 0, "heard, no progress"
    assert beat(3, 1000.5, 1000.4) == 1, "its ranks progressed"
    c.sync(_ranked("n1", 4, 1000.75, 1000.4))
    assert c.view.moves - moves == 1, "a whole copy of the same progress"
    c.sync(_ranked("n1", 5, 1001.0, 1000.4, pid=8))
    assert c.view.moves - moves == 2, "a new stream (a restarted worker)"
    c.sync(_ranked("n1", 6, 1001.25, 1000.4, pid=8, connected=False))
    assert c.view.moves - moves == 3, "its stream closed"


def test_beats_carry_a_stalled_nodes_own_account_of_its_stall():
    """A stalled node behind a relay goes whole once, then beats: each beat says its ranks
    have not moved as of its sending, so the ranks' reported stall grows with the beats
    (an overloaded coordinator acts on a hang only on that account)."""
    clock = Clock()
    clock.t = 1000.0
    c = Coordinator("n0", incidents=IncidentLog(None), policy=PolicyConfig(), clock=clock,
                    relay=RelayConfig(group_size=2, min_nodes=2))
    c.sync(_ranked("n1", 1, 1000.0, 999.0, last_seen=1000.0))

    def reported() -> float:
        (r,) = c.view.snapshot(clock.t).ranks
        return r.reported_at - r.progress_at

    assert reported() == pytest.approx(1.0)
    for seq, at in enumerate((1002.0, 1004.0, 1006.0), start=2):
        clock.t = at
        beat = pb.NodeBeat(node_id="n1", seq=seq, sent_at=at, latest_progress=999.0)
        c.sync_group(pb.GroupSummary(nodes=[_summary("n9", seq, sent_at=at)], held_seconds=[0.0], beats=[beat]))
    clock.t = 1030.0   # the coordinator's clock runs on; the ranks' own account does not
    assert reported() == pytest.approx(7.0)
    beat = pb.NodeBeat(node_id="n1", seq=5, sent_at=1030.0, latest_progress=1029.0)
    c.sync_group(pb.GroupSummary(nodes=[_summary("n9", 5, sent_at=1030.0)], held_seconds=[0.0], beats=[beat]))
    assert reported() == pytest.approx(1.0), "its ranks moved since the copy: the copy's own word only"


def test_the_coordinator_takes_a_group_and_refuses_a_bad_summary_alone():
    clock = Clock()
    clock.t = 1000.0
    c = Coordinator("n0", incidents=IncidentLog(None), policy=PolicyConfig(), clock=clock,
                    relay=RelayConfig(group_size=2, min_nodes=2))
    group = pb.GroupSummary(nodes=[_summary("n1"), _summary("n2"), _summary("n3", sent_at=float("nan"))],
                            held_seconds=[0.0, 0.5, 0.0])
    refused: list[ValueError] = []
    reply = c.sync_group(group, refused.append)
    assert list(reply.refused) == ["n3"] and len(refused) == 1
    assert set(c.nodes) == {"n1", "n2"}
    assert c.nodes["n2"].received_at == pytest.approx(999.5), "held time moves its arrival back"
    with pytest.raises(Rejected):
        c.sync_group(pb.GroupSummary(nodes=[_summary("n1", 2)], held_seconds=[]))
    for bad in ("h\n1:1", "x" * 301):   # a relay address goes to other nodes: checked like a label
        reply = c.sync_group(pb.GroupSummary(nodes=[pb.NodeSummary(node_id="n1", seq=3, sent_at=clock.t,
                                                                   relay_address=bad)], held_seconds=[0.0]))
        assert list(reply.refused) == ["n1"]
    with pytest.raises(Rejected):
        c.sync_group(pb.GroupSummary(nodes=[_summary(f"x{i}") for i in range(MAX_GROUP + 1)],
                                     held_seconds=[0.0] * (MAX_GROUP + 1)))
    # Beats: a node heard whole moves on; one never heard whole, or a replayed beat, is refused.
    beats = pb.GroupSummary(nodes=[_summary("n1", 2)], held_seconds=[0.0], beats=[
        pb.NodeBeat(node_id="n2", seq=2, sent_at=1000.5, held_seconds=0.25, latest_progress=1000.4),
        pb.NodeBeat(node_id="n9", seq=2, sent_at=1000.5),
        pb.NodeBeat(node_id="n2", seq=2, sent_at=1000.5)])
    clock.t = 1001.0
    reply = c.sync_group(beats, refused.append)
    assert list(reply.refused) == ["n9", "n2"]
    n2 = c.nodes["n2"]
    assert (n2.seq, n2.syncs, n2.received_at) == (2, 2, pytest.approx(1000.75))
    assert n2.latest_progress == pytest.approx(1000.4 + n2.offset)
    assert n2.summary.seq == 1, "a beat keeps the node's last summary"
    for n, addr in (("n1", "h1:1"), ("n2", "h2:1"), ("n3", "h3:1")):
        c.sync(pb.NodeSummary(node_id=n, seq=5, sent_at=clock.t, relay_address=addr))
    c.evaluate()
    assert c.relays == {"n1": "", "n2": "h1:1", "n3": ""}
    assert c.sync(pb.NodeSummary(node_id="n2", seq=6, sent_at=clock.t)).relay == "h1:1"


def test_a_node_new_to_a_grouped_job_is_named_its_relay_in_its_first_reply():
    """Once groups exist, a node's first sync is its only direct one: the reply names the
    group it goes to (one with room, else a new one behind it), and the next assignment
    keeps it there."""
    clock = Clock()
    clock.t = 1000.0
    c = Coordinator("n0", incidents=IncidentLog(None), policy=PolicyConfig(), clock=clock,
                    relay=RelayConfig(group_size=2, min_nodes=3))

    def first(node: str, addr: str = "") -> str:
        return c.sync(pb.NodeSummary(node_id=node, seq=1, sent_at=clock.t, relay_address=addr)).relay

    assert [first(n, f"h{n[1]}:1") for n in ("n1", "n2", "n3")] == ["", "", ""], "no groups yet"
    c.evaluate()
    assert c.relays == {"n1": "", "n2": "h1:1", "n3": ""}
    assert first("n0", "h0:1") == "" and "n0" not in c.relays, "the coordinator's own node is in no group"
    assert first("n4", "h4:1") == "h3:1", "n3's group has room"
    assert first("n5", "h5:1") == "" and c.relays["n5"] == "", "every group full: n5 relays a new one"
    assert first("n6") == "h5:1", "a node without an address joins a group"
    assert first("n7") == "" and "n7" not in c.relays, "all full, and n7 cannot relay: it syncs directly"
    placed = dict(c.relays)
    clock.t += 1.0
    for n in ("n1", "n2", "n3", "n4", "n5", "n6", "n7"):
        c.sync(pb.NodeSummary(node_id=n, seq=2, sent_at=clock.t, relay_address="" if n in ("n6", "n7")
                              else f"h{n[1]}:1"))
    c.evaluate()
    assert {n: c.relays.get(n) for n in placed} == placed, "the assignment keeps the placed nodes"


def test_a_relays_held_time_is_bounded():
    """A relay's word for how long it held each summary moves the node's arrival back, within
    [0, 10] s: a negative time cannot put it in the future, and a huge or NaN one cannot make
    a live node look silent for longer than that."""
    clock = Clock()
    clock.t = 1000.0
    c = Coordinator("n0", incidents=IncidentLog(None), policy=PolicyConfig(), clock=clock)
    held = [-5.0, 1e12, float("nan"), 2.5]
    c.sync_group(pb.GroupSummary(nodes=[_summary(f"n{i}") for i in range(1, 5)], held_seconds=held))
    assert [c.nodes[f"n{i}"].received_at for i in range(1, 5)] == [1000.0, 990.0, 990.0, 997.5]


def test_a_busy_coordinator_takes_a_relays_word_that_a_member_is_gone_and_only_its_relays():
    """While overloaded the coordinator calls no node silent on its own view (it may have
    failed to take the node's syncs).  The relay it sent the node to, listening to the rest
    of its group, can: that word excludes a node gone past the allowance (3 s).  Another
    node's word on it, or a word on a node the same call carried, counts for nothing."""
    clock = Clock()
    clock.t = 1000.0
    c = Coordinator("n0", incidents=IncidentLog(None), policy=PolicyConfig(min_nodes=1), clock=clock,
                    relay=RelayConfig(group_size=3, min_nodes=2))
    addr = {"n1": "h1:1", "n2": "h2:1", "n3": "h3:1", "n4": "h4:1"}
    seqs = dict.fromkeys(addr, 0)

    def node(n: str) -> pb.NodeSummary:
        seqs[n] += 1
        return pb.NodeSummary(node_id=n, seq=seqs[n], sent_at=clock.t, relay_address=addr[n])

    for _ in range(3):
        for n in addr:
            c.sync(node(n))
        clock.t += 0.25
    c.evaluate()
    assert c.relays == {"n1": "", "n2": "h1:1", "n3": "h1:1", "n4": ""}
    gone_at = clock.t - 0.25   # n3's agent is gone from here on
    c.load.quiet = clock.t + 60   # the coordinator is overloaded (its own measure sets this)
    refused: list[ValueError] = []

    def tick(*absent: tuple[str, str, float]) -> None:
        """n1 relays n2's summaries, n4 syncs alone; each says what it has not heard."""
        clock.t += 0.25
        for relay, carried in (("n1", ["n2"]), ("n4", [])):
            nodes = [node(relay)] + [node(n) for n in carried]
            g = pb.GroupSummary(nodes=nodes, held_seconds=[0.0] * len(nodes))
            g.absent.extend(pb.NodeAbsence(node_id=n, unheard_seconds=u) for by, n, u in absent if by == relay)
            c.sync_group(g, refused.append)
        c.evaluate()

    while clock.t < gone_at + 5.0:   # a word from n4 (not n3's relay), and on n2 (carried): nothing
        tick(("n4", "n3", clock.t - gone_at), ("n1", "n2", 9.0))
    assert not c.excluded, "the coordinator's own view, and others' words, are no evidence while overloaded"
    tick(("n1", "n3", float("nan")))
    assert not c.excluded and len(refused) == 1, "a word out of range is refused"
    tick(("n1", "n3", 2.5))
    assert not c.excluded, "unheard for less than the allowance"
    tick(("n1", "n3", clock.t + 0.25 - gone_at))
    assert list(c.excluded) == ["n3"]
    assert c.excluded["n3"].endswith("its agent went silent (its relay had not heard it for 5.8s)")
    with pytest.raises(Rejected):
        c.sync_group(pb.GroupSummary(nodes=[node("n1")], held_seconds=[0.0],
                                     absent=[pb.NodeAbsence(node_id="n3", unheard_seconds=1.0)] * (MAX_GROUP + 1)))


def test_a_node_heard_through_its_relay_has_one_interval_more_before_it_is_silent():
    """A member's summary waits in its relay for the relay's next call: the coordinator hears
    it up to an interval later than a node that syncs itself.  At a 1.1 s interval a node
    syncing itself is silent after 3.3 s; one heard through its relay after 4.4 s."""
    clock = Clock()
    clock.t = 1000.0
    c = Coordinator("n0", incidents=IncidentLog(None), policy=PolicyConfig(min_nodes=1), clock=clock,
                    relay=RelayConfig(group_size=3, min_nodes=2), load_clocks=(lambda: 0.0, lambda: 0.0))
    c.load.interval = 1.1   # as its load measure would ask under load
    seqs = {"n1": 0, "n2": 0, "n3": 0}

    def node(n: str) -> pb.NodeSummary:
        seqs[n] += 1
        return pb.NodeSummary(node_id=n, seq=seqs[n], sent_at=clock.t, relay_address=f"{n}:1")

    for _ in range(3):   # n1 relays n2's summaries; n3 syncs itself
        c.sync_group(pb.GroupSummary(nodes=[node("n1"), node("n2")], held_seconds=[0.0, 0.0]), lambda e: None)
        c.sync(node("n3"))
        c.evaluate()
        clock.t += 1.1
    last = clock.t - 1.1   # both last heard then; only n1 is heard from here on
    while clock.t < last + 3.6:
        c.sync_group(pb.GroupSummary(nodes=[node("n1")], held_seconds=[0.0]), lambda e: None)
        c.evaluate()
        clock.t += 0.25
    assert list(c.excluded) == ["n3"], "the node that syncs itself: silent past three intervals"
    while clock.t < last + 4.3:
        c.sync_group(pb.GroupSummary(nodes=[node("n1")], held_seconds=[0.0]), lambda e: None)
        c.evaluate()
        clock.t += 0.25
    assert list(c.excluded) == ["n3"], "the relayed node: not before four"
    while clock.t < last + 4.9:
        c.sync_group(pb.GroupSummary(nodes=[node("n1")], held_seconds=[0.0]), lambda e: None)
        c.evaluate()
        clock.t += 0.25
    assert sorted(c.excluded) == ["n2", "n3"]


# -- real agents ----------------------------------------------------------------------

def _relayed(agent: AgentProcess) -> float:
    return parse_metrics(agent.metrics()).get(
        ("rankwatch_relayed_summaries_total", frozenset({("node", agent.node)})), 0.0)


def _excluded(agent: AgentProcess) -> list[str]:
    """The nodes excluded by the decisions this agent applied."""
    return [d["node"] for d in agent.status()["decisions"] if d["kind"] == "exclude"]


@contextmanager
def _one_group(tmp_path, *extra: str) -> Iterator[dict[str, AgentProcess]]:
    """Agents n0 (the coordinator) and n1, n2, n3, running: one relay group of three."""
    coord = f"127.0.0.1:{free_port()}"
    common = ("--coordinator", coord, "--relay-group", "3", "--relay-min-nodes", "2", "--min-nodes", "1", *extra)
    agents = {n: AgentProcess(tmp_path / f"{n}.sock", node=n,
                              extra=("--listen", coord if n == "n0" else f"127.0.0.1:{free_port()}", *common))
              for n in ("n0", "n1", "n2", "n3")}
    try:
        for a in agents.values():
            a.start()
        yield agents
    finally:
        for a in agents.values():
            a.stop()


@contextmanager
def _stopped(agent: AgentProcess) -> Iterator[None]:
    """``agent`` SIGSTOPped, and SIGCONTed after."""
    agent.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        agent.proc.send_signal(signal.SIGCONT)


def _the_relay(agents: dict[str, AgentProcess]) -> AgentProcess:
    """The agent of the group that relays (the first the coordinator heard), once it sends on."""
    return wait_for(lambda: next((a for n, a in agents.items() if n != "n0" and _relayed(a) >= 20), None),
                    20, what="a relay sending its group's summaries on")


def _heard_again_through(relay: AgentProcess, n0: AgentProcess) -> None:
    """After a fault at the coordinator: the group is heard through its relay again, and no node
    was excluded."""
    before = _relayed(relay)
    wait_for(lambda: _relayed(relay) >= before + 8, 20, what="the group heard through its relay again")
    assert not n0.status()["excluded_nodes"]


@pytest.mark.e2e
def test_decisions_reach_a_node_through_its_relay_and_a_killed_relay_costs_no_verdict(tmp_path):
    with _one_group(tmp_path) as agents:
        n0 = agents["n0"]
        # n0 coordinates; n1, n2, n3 are one group behind one of them (the first the
        # coordinator heard, as groups form while the job starts).
        wait_for(lambda: parse_metrics(n0.metrics()).get(
            ("rankwatch_sync_relays", frozenset({("node", "n0")}))) == 1.0, 20, what="one relay in use")
        relay = _the_relay(agents)
        first, other = [a for n, a in agents.items() if n != "n0" and a is not relay]

        first.kill(signal.SIGKILL)
        wait_for(lambda: first.node in _excluded(other), 20, what=f"{first.node}'s exclusion reaching {other.node}")
        before = _relayed(relay)
        wait_for(lambda: _relayed(relay) >= before + 4, 10, what=f"{other.node} still syncing through the relay")

        relay.kill(signal.SIGKILL)
        wait_for(lambda: relay.node in _excluded(other), 20, what=f"the relay's exclusion reaching {other.node}")
        # The other node fell silent with its relay; were it not heard directly since, the
        # same silence rule would exclude it within a tick or two of the relay.  Watch 2 s more.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            status = n0.status()
            assert sorted(d["node"] for d in status["decisions"] if d["kind"] == "exclude") == sorted(
                [first.node, relay.node]), f"{other.node}, behind the killed relay, was called dead"
            time.sleep(0.1)
        assert other.node in status["nodes"] and other.node not in status["excluded_nodes"]


@pytest.mark.e2e
def test_nodes_stay_behind_their_relay_while_the_coordinator_is_stopped(tmp_path):
    # The coordinator SIGSTOPped for 6 s: its relay's SyncGroup calls pass their deadline
    # (busy, not gone).  Once the relay's last reply is stale (2 s), it holds its nodes'
    # summaries and has them back off: no node of its group turns to the coordinator, and
    # after the pause the group is heard through the relay again.  With the hold off
    # (--relay-busy-hold-seconds 0) the nodes go to the stopped coordinator themselves.
    with _one_group(tmp_path) as agents:
        n0 = agents["n0"]
        relay = _the_relay(agents)
        behind = [a for n, a in agents.items() if n != "n0" and a is not relay]
        with _stopped(n0):
            wait_for(lambda: all("holds this node's summaries" in a.log.read_text() for a in behind), 15,
                     what="the relay holding its nodes' summaries")
            deadline = time.monotonic() + 3.0   # watched while held, and up to 6 s stopped
            while time.monotonic() < deadline:
                for a in behind:
                    assert "syncing with the coordinator" not in a.log.read_text(), \
                        f"{a.node} left its relay for the stopped coordinator"
                time.sleep(0.2)
        _heard_again_through(relay, n0)


@pytest.mark.e2e
def test_a_relay_names_its_killed_member_while_the_coordinator_stays_overloaded(tmp_path):
    # The coordinator SIGSTOPped 1.4 s of every 2 s: each time its loop wakes over a second
    # late, it takes itself for overloaded, and for the allowance after it calls no node
    # silent on its own view; cycling, that never ends.  A member of the relay's group
    # SIGKILLed meanwhile is excluded on its relay's word that it is gone, and no other node.
    stop = threading.Event()
    with _one_group(tmp_path) as agents:
        n0 = agents["n0"]

        def cycle() -> None:
            while not stop.is_set():
                with _stopped(n0):
                    stop.wait(1.4)
                stop.wait(0.6)

        cycling = threading.Thread(target=cycle, daemon=True)
        try:
            relay = _the_relay(agents)
            gone, other = [a for n, a in agents.items() if n != "n0" and a is not relay]
            cycling.start()
            wait_for(lambda: "coordinator overloaded" in n0.log.read_text(), 15,
                     what="the coordinator taking itself for overloaded")
            gone.kill(signal.SIGKILL)
            wait_for(lambda: gone.node in _excluded(other), 40, what=f"{gone.node}'s exclusion, on its relay's word")
        finally:
            stop.set()
            if cycling.is_alive():
                cycling.join()
        assert n0.status()["excluded_nodes"] == [gone.node]
        reasons = [d["reason"] for d in n0.status()["decisions"] if d["kind"] == "exclude"]
        assert len(reasons) == 1 and "its relay had not heard it" in reasons[0]


@pytest.mark.e2e
def test_a_node_its_relay_refused_and_the_coordinator_failed_tries_its_relay_again(tmp_path):
    # The coordinator SIGSTOPped; its relay holds for 2 s (--relay-busy-hold-seconds 2) and
    # then refuses its nodes, which go to the stopped coordinator and time out.  Each then
    # tries its relay again first, rather than only the coordinator until it answers: a node
    # its relay last heard long ago, while the coordinator heard nothing, is one the relay
    # would vouch is gone.
    with _one_group(tmp_path, "--relay-busy-hold-seconds", "2") as agents:
        n0 = agents["n0"]
        relay = _the_relay(agents)
        behind = [a for n, a in agents.items() if n != "n0" and a is not relay]
        with _stopped(n0):
            wait_for(lambda: all(a.log.read_text().count("did not take this node's summary") >= 3 for a in behind),
                     20, what="each node refused by its relay three times while the coordinator is stopped")
        _heard_again_through(relay, n0)
