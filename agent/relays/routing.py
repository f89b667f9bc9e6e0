"""Which agent each node syncs through: the coordinator directly, or its group's relay.

One coordinator's Python gRPC server answers a few thousand calls a second on its
core, and a job of 2,048 nodes syncing 4 times a second asks for 8,192.  In a big
job the nodes are split into groups; one agent of each group, its relay, takes its
group's summaries, answers them from the coordinator's last reply, and sends them on
in one ``SyncGroup`` call per interval.  The coordinator then serves one call per
group, and its cost per node is the summary alone.

The rules (:func:`assign`, pure):

* Relays only in a job of at least ``min_nodes`` nodes; below that the coordinator
  serves every node itself, as before.
* Groups hold at most ``group_size`` nodes and are kept from one assignment to the
  next: a node joining fills a group with room, and a new group starts behind its
  first *eligible* node: one that gave an address to relay on and that the
  coordinator hears now (not silent, dead or excluded), and not the coordinator
  itself.  A coordinator that takes over starts from nothing and groups in node-id
  order.
* A relay that is no longer eligible is replaced at the next assignment by its
  group's first eligible member; meanwhile its nodes, whose syncs through it fail,
  sync with the coordinator directly (``JobLink``), so a dead relay costs its group
  no verdict.
* A relay syncs with the coordinator itself, as does every node of a group without an
  eligible relay.
* Once groups exist, a node new to the coordinator is placed at its first sync
  (:func:`place`, pure), so that the reply to that sync already names its relay: the
  node syncs with the coordinator directly once, not until the next assignment.  In
  the join of a 2,048-node job that cut the direct syncs by a third, and the failed
  ones (direct syncs a busy coordinator did not answer in time) by half.  It goes where :func:`assign` would put it (the first group with
  room, else a new group behind it if it is eligible), and the next assignment keeps it.

What a relay sends on for each node (:func:`send_whole`, pure): the whole summary when
anything the coordinator acts on at once changed since the last one it sent whole (a
rank came, went, died, stopped or changed state; a collective has been in flight for
over ``long_wait_seconds`` and the node's share of ``long_wait_spread_seconds``; its ranks
stopped moving for that long; a new incident or decision), and at least every
``whole_every_seconds`` (stretched to ``whole_every_intervals`` sync intervals when the
coordinator asks for slower syncs) or ``whole_every_steps`` completed steps, whichever
comes first (the straggler detector lines the ranks' own-work windows up by step, and
nodes a whole window apart would leave it nothing to compare); otherwise a beat: the node was heard, and its ranks' latest
progress.  A healthy job's summaries then cost the coordinator a beat fifteen times in
sixteen at 4 Hz, and a hang, whose ranks wait in a collective, is sent whole within about two
seconds of its start, each node at its own point of the second spread: well inside the hang
allowance.  The stretch matters under
backpressure: with a fixed time, every summary would go whole once the coordinator asks
for syncs that far apart or more, and beats would stop saving it work just when it is busiest.

What a relay does with a node's sync (:func:`relay_answer`, pure): it answers from the
coordinator's last reply while that is fresh (``fresh_seconds``, or three of the intervals it
asked for).  Once it is stale, a relay whose own calls the coordinator did not answer because
it was *busy* (deadline passed, cancelled, refused for capacity), or whose call is still on its
way, **holds** the node's summary
for its next ``SyncGroup`` and tells the node to back off and stay (RESOURCE_EXHAUSTED), for
up to ``busy_hold_seconds`` after the last reply.  Refusing there would send the whole group
to the coordinator directly, each node with a whole summary, at the moment it is busiest: in a
2,048-node join, relays refusing stale caused more direct syncs than the nodes' own first
syncs did.  A relay that lost the coordinator (unreachable), or stayed unanswered past the
hold, refuses (UNAVAILABLE), and its nodes sync with the coordinator themselves.

What a relay says of a member it does not hear (:func:`vouched_absence`,
:func:`listening_since`, pure): each ``SyncGroup`` names the members of its group (the
nodes the coordinator's replies sent to it) that it has not heard from for a while, with
how long.  A busy coordinator hears every node late and cannot tell a dead node from one
whose syncs it failed to take, so it calls no node silent while overloaded; a relay,
serving 64 nodes, can.  It vouches only for time it was listening (its agent never woke
over ``listen_gap_seconds`` late, it heard some node of its group at least that often, and
it had the coordinator: a paused or starved relay heard no one, and nodes refused by one
cut off went to the coordinator), and only for nodes
it answered or held: one it refused syncs with the coordinator meanwhile, and is no member
until a reply sends it back.  The coordinator weighs that word
(``pacing.node_silent``).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rankwatch.proto import pb

Signature = tuple[Any, ...]
"""What of a summary the coordinator acts on at once (:func:`signature`)."""

__all__ = ["RelayConfig", "Signature", "assign", "callers", "group_sizes", "listening_since", "place", "relay_answer",
           "send_whole", "signature", "vouched_absence", "wait_spread"]


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    group_size: int = 64
    """Nodes per relay group; 0 turns relaying off."""
    min_nodes: int = 128
    """Relays only in a job of at least this many nodes."""
    every_seconds: float = 1.0
    """How often the coordinator draws the groups again."""
    whole_every_seconds: float = 4.0
    """A relay sends each node's whole summary at least this often (beats between): the
    straggler detector then compares windows at most this old, which its 64-step windows
    absorb.  (Whole summaries are most of a big job's cost to its coordinator: at 2 s, one
    sync in seven went whole at 2,048 nodes, and their range checks alone were a third of
    its time.  What the detectors act on at once goes whole at once whatever this says.)"""
    whole_every_steps: int = 32
    """... or every this many steps its ranks completed: half the 64-step own-work window a
    node sends, so the coordinator's copies of two nodes always share 32 steps, twice the
    straggler detector's 16-step window.  (At 16, every summary went whole once syncs were
    1.6 s apart at 0.1 s steps, and an overloaded coordinator never got out of that; a
    straggler is flagged at most this many steps later than from fresh copies.)"""
    whole_every_intervals: float = 4.0
    """... stretched to this many of the sync intervals the coordinator asks for, when that is
    longer than ``whole_every_seconds`` (0: never stretched)."""
    long_wait_seconds: float = 1.0
    """A collective in flight this long makes a node's summary go whole at once ..."""
    long_wait_spread_seconds: float = 1.0
    """... plus the node's own share of this (:func:`wait_spread`, by its id), as does its
    ranks' progress stopping that long.  A job-wide hang stops every node's ranks in the same
    instant: without a spread every node of the job goes whole in the same sync interval, at
    2,048 nodes four times the coordinator's usual rate of whole summaries in a quarter
    second, and 4 s later their periodic wholes came due together again, in the second its
    verdict was due (the calls over 250 ms of a stall run).  Spread over a second, every node
    is still sent whole within about two seconds and an interval of the stall, well inside
    the shortest hang allowance (5 s)."""
    busy_hold_seconds: float = 10.0
    """A relay whose coordinator answered its last calls busy holds its nodes' summaries (and
    has them back off) for up to this long after its last reply (:func:`relay_answer`); a node
    stays behind such a relay at most this long after its last answer (0: never held)."""

    listen_gap_seconds: float = 1.0
    """A relay whose agent woke this much later than it planned was not listening (paused or
    starved; a node's sync gives up on it after a second): it vouches for no absence from
    before (:func:`listening_since`)."""
    absent_after_seconds: float = 1.0
    """A member unheard for this long (or two sync intervals, if longer) is reported absent
    (:func:`vouched_absence`)."""

    def __post_init__(self) -> None:
        if self.group_size < 0 or self.group_size == 1 or self.min_nodes < 2:
            raise ValueError("RelayConfig needs group_size 0 (off) or >= 2, and min_nodes >= 2")
        if (not self.every_seconds > 0 or not self.whole_every_seconds >= 0 or not self.long_wait_seconds > 0
                or self.whole_every_steps < 1 or not 0 <= self.whole_every_intervals <= 64
                or not 0 <= self.long_wait_spread_seconds <= 60
                or not 0 <= self.busy_hold_seconds <= 600
                or not 0 < self.listen_gap_seconds <= 60 or not 0 < self.absent_after_seconds <= 600):
            raise ValueError("RelayConfig needs every_seconds > 0, whole_every_seconds >= 0, "
                             "whole_every_steps >= 1, long_wait_seconds > 0, 0 <= whole_every_intervals <= 64, "
                             "0 <= long_wait_spread_seconds <= 60, "
                             "0 <= busy_hold_seconds <= 600, 0 < listen_gap_seconds <= 60, "
                             "0 < absent_after_seconds <= 600")


def assign(nodes: Iterable[tuple[str, str, bool]], cfg: RelayConfig,
           before: dict[str, str] | None = None) -> dict[str, str]:
    """Each node's relay address ('' for a relay itself, which syncs with the coordinator).

    ``nodes``: (node id, the address its agent relays on or '', eligible as a relay now).
    ``before``: the last assignment.  Groups are kept: a node stays behind its relay while
    that relay is eligible; a group whose relay is not is taken over by its first eligible
    member; nodes without a group fill the groups with room, in node-id order, and then
    new groups, each behind its first eligible node.  (Regrouping the whole job whenever a
    node joins would send most nodes to a new relay, which has not heard the coordinator
    yet, and so to the coordinator itself: a burst of direct syncs while a big job starts.)
    A node left out of the result syncs with the coordinator directly.
    """
    known = sorted(nodes)
    if cfg.group_size == 0 or len(known) < cfg.min_nodes:
        return {}
    before = before or {}
    addr = {name: a for name, a, _ in known}
    eligible = {name for name, a, ok in known if ok and a}
    by_addr = {a: name for name, a in addr.items() if a}
    groups: dict[str, list[str]] = {}   # relay node -> its members (the relay first)
    orphans: dict[str, list[str]] = {}  # a relay no longer eligible -> its members
    for name, _, _ in known:
        relay = name if before.get(name) == "" else by_addr.get(before.get(name) or "")
        if relay is None or before.get(relay) != "" or relay not in addr:
            continue
        (groups if relay in eligible else orphans).setdefault(relay, []).append(name)
    for members in orphans.values():   # the first eligible member takes its group over
        heir = next((m for m in members if m in eligible and m not in groups), None)
        if heir is not None:
            groups[heir] = [heir] + [m for m in members if m != heir]
    placed = {m for members in groups.values() for m in members}
    homeless = [name for name, _, _ in known if name not in placed]
    open_groups = [r for r in sorted(groups) if len(groups[r]) < cfg.group_size]
    while homeless:
        if open_groups:
            relay = open_groups[0]
        else:
            relay = next((m for m in homeless if m in eligible), "")
            if not relay:
                break   # no node left that could relay: the rest sync directly
            homeless.remove(relay)
            groups[relay] = [relay]
            open_groups.append(relay)
        while homeless and len(groups[relay]) < cfg.group_size:
            groups[relay].append(homeless.pop(0))
        if len(groups[relay]) >= cfg.group_size:
            open_groups.remove(relay)
    out: dict[str, str] = {}
    for relay, members in groups.items():
        for m in members:
            out[m] = "" if m == relay else addr[relay]
    return out


def group_sizes(assigned: dict[str, str], addresses: dict[str, str]) -> dict[str, int]:
    """Each relay node's group size (the relay included) in an assignment of :func:`assign`;
    ``addresses``: node -> the address it relays on."""
    by_addr = {addresses.get(relay, ""): relay for relay, a in assigned.items() if a == ""}
    sizes = {relay: 1 for relay in by_addr.values()}
    for a in assigned.values():
        if a and (relay := by_addr.get(a)) is not None:
            sizes[relay] += 1
    return sizes


def place(name: str, eligible: bool, sizes: dict[str, int], cfg: RelayConfig) -> str | None:
    """The relay node for a node new to the coordinator, between two :func:`assign` runs:
    ``name`` itself when it starts a new group (it relays), None when it syncs with the
    coordinator directly (no groups yet, or all full and it cannot relay).

    ``sizes``: each current relay's group size (:func:`group_sizes`; updated by the caller
    as it places nodes); ``eligible``: the node could relay (it gave an address, and the
    coordinator hears it).  The first group with room is filled first, in relay order, as
    :func:`assign` fills them.
    """
    if cfg.group_size == 0 or not sizes:
        return None
    relay = min((r for r, n in sizes.items() if n < cfg.group_size), default=None)
    if relay is not None:
        return relay
    return name if eligible else None


def callers(assigned: dict[str, str], nodes: int) -> int:
    """Calls the coordinator serves per sync round: the nodes not sent to a relay."""
    return nodes - sum(1 for addr in assigned.values() if addr)


def signature(s: pb.NodeSummary, cfg: RelayConfig) -> tuple[Signature, float, int]:
    """(what of ``s`` must reach the coordinator at once, its ranks' latest progress, the
    most steps one of its ranks completed)."""
    waiting_since = s.sent_at - cfg.long_wait_seconds - wait_spread(s.node_id, cfg)
    ranks = []
    progress, steps = 0.0, 0
    for r in s.ranks:   # one pass: a relay reads every node's summary 4 times a second
        clean = r.exited_cleanly
        ranks.append((r.rank, r.pid, r.connected, r.alive, r.stopped, clean, r.state, r.activity,
                      r.HasField("inflight") and r.inflight.since <= waiting_since))
        if not clean and r.progress_at > progress:
            progress = r.progress_at
        steps = max(steps, r.steps_completed)
    incidents = (len(s.incidents), s.incidents[-1].id if s.incidents else "")
    decisions = (len(s.decisions), s.decisions[-1].id if s.decisions else "")
    # A node whose ranks stopped moving goes whole once: the hang detector names a culprit
    # only from current copies of every node (one behind the others may wait in nothing).
    stalled = progress > 0 and progress <= waiting_since
    return (tuple(ranks), incidents, decisions, s.run_id, stalled), progress, steps


def wait_spread(node: str, cfg: RelayConfig) -> float:
    """The part of ``long_wait_spread_seconds`` node ``node`` waits (the same on every relay
    and in every run: a node's stall goes whole once, not again when it moves to another
    group), spread evenly over the job's nodes."""
    return cfg.long_wait_spread_seconds * (zlib.crc32(node.encode()) / 2**32)


def send_whole(now: float, sig: Signature, steps: int, last: tuple[float, Signature, int] | None,
               cfg: RelayConfig, interval: float = 0.0) -> bool:
    """Whether a relay sends a node's summary whole (else a beat).

    ``last``: (when, signature, steps) of the last summary it sent whole for the node
    (None: none yet, or the coordinator asked for one).  ``interval``: the sync interval
    the coordinator last asked for (seconds).
    """
    if last is None:
        return True
    at, last_sig, last_steps = last
    every = max(cfg.whole_every_seconds, cfg.whole_every_intervals * min(max(interval, 0.0), 60.0))
    return (now - at >= every or sig != last_sig
            or not 0 <= steps - last_steps < cfg.whole_every_steps)


def relay_answer(age: float, interval: float, busy: bool, fresh_seconds: float, cfg: RelayConfig) -> str:
    """What a relay does with a node's sync when its last coordinator reply is ``age`` seconds
    old and asked for syncs ``interval`` apart; ``busy``: the coordinator left the relay's
    calls since then unanswered only for being busy, or one is still waiting for its answer.

    ``"answer"`` from that reply, ``"hold"`` the summary for the next ``SyncGroup`` and have
    the node back off behind this relay, or ``"refuse"`` (the node syncs with the coordinator
    itself)."""
    fresh = max(fresh_seconds, 3 * interval)
    if age <= fresh:
        return "answer"
    if busy and age <= max(fresh, cfg.busy_hold_seconds):
        return "hold"
    return "refuse"


def listening_since(now: float, since: float, late: float, last_take: float, interval: float,
                    cfg: RelayConfig) -> float:
    """When a relay's unbroken listening began, seen at ``now``: ``since``, or ``now`` if its
    agent woke ``late`` by over ``listen_gap_seconds`` (paused or starved), or it took no
    node's sync since ``last_take`` for longer than that or 1.5 sync intervals (``interval``).

    Either way its nodes' syncs may have failed meanwhile, and a node that then comes back a
    little later than the others is not gone.  (In a 2,048-node run whose load generator
    made no call for 2 s, relays that only watched their own pauses came out of it vouching
    for 39 live nodes' absence.)  A relay of a small group whose few nodes back off syncs
    apart for longer than the gap stops vouching: it then leaves them to the coordinator."""
    if late > cfg.listen_gap_seconds or now - last_take > max(cfg.listen_gap_seconds, 1.5 * interval):
        return now
    return since


def vouched_absence(now: float, heard: float | None, member_since: float, listening: float, interval: float,
                    cfg: RelayConfig) -> float | None:
    """Seconds a relay vouches that a member of its group has gone unheard, or None (too few
    to report).  ``heard``: when it last answered or held the member's sync (None: not since
    it became a member at ``member_since``); ``listening``: :func:`listening_since`;
    ``interval``: the sync interval the coordinator asks for."""
    unheard = now - max(member_since if heard is None else heard, member_since, listening)
    return unheard if unheard > max(cfg.absent_after_seconds, 2 * interval) else None
