"""This agent as a relay for its group of nodes (the aggregation tier of a big job).

A node the coordinator sends here (``SyncReply.relay``) calls ``Sync`` on this agent
as it would on the coordinator.  The relay keeps the node's latest summary, answers at
once from the coordinator's last ``GroupReply`` (its decisions, the sync interval,
the node's own incidents, where the node should sync next), and its ``JobLink`` sends
every summary it holds on in one ``SyncGroup`` call with its own, once per interval:
whole, or as a beat when nothing the coordinator acts on at once changed.  Who relays
for whom, and what goes whole, is :mod:`.routing`'s.

A relay that has not heard the coordinator lately never answers with stale decisions:
while the coordinator is only busy it holds the node's summary and has the node back off
(:class:`RelayBusy`, ``RESOURCE_EXHAUSTED``); once it lost the coordinator, or stayed
unanswered past the hold, it refuses (``UNAVAILABLE``), and its nodes sync with the
coordinator directly, so it never hides a node (:func:`~.routing.relay_answer`).
Each ``SyncGroup`` also names the group's members the relay has not heard from lately while
it listened to the others (:func:`~.routing.vouched_absence`): a busy coordinator's
evidence that a node is gone.
Bounds: at most ``max_nodes`` nodes and ``GROUP_BYTES`` held at once, the newest
summary per node, each no bigger than a node agent ever sends (``bounds.MAX_SUMMARY_BYTES``).
"""

from __future__ import annotations

import threading
import time

from rankwatch.agent.wire.bounds import MAX_SUMMARY_BYTES
from rankwatch.agent.relays.routing import (RelayConfig, Signature, listening_since, relay_answer, send_whole, signature,
                                          vouched_absence)
from rankwatch.agent.wire.ranges import Rejected, check_label
from rankwatch.proto import pb

__all__ = ["Relay", "RelayBusy", "RelayUnavailable", "node_reply"]

MAX_GROUP = 256
"""The most summaries one ``SyncGroup`` call may carry (the coordinator refuses more)."""
GROUP_BYTES = 12 << 20
"""The most bytes of summaries a relay holds at once: a group stays under the 16 MiB message."""
_FORGET_SECONDS = 300.0
"""A member unheard this long is no longer reported (it was excluded, or went elsewhere)."""


def node_reply(group: pb.GroupReply, incidents, relay: str) -> pb.SyncReply:
    """What a group's reply says to one of its nodes: ``incidents`` are that node's."""
    out = pb.SyncReply(coordinator=group.coordinator, sync_interval_seconds=group.sync_interval_seconds,
                       relay=relay)
    out.decisions.extend(group.decisions)
    out.incidents.extend(incidents)
    return out


class RelayUnavailable(Exception):
    """This agent cannot relay now (no recent word from the coordinator, or full)."""


class RelayBusy(Exception):
    """The coordinator is busy: this relay holds the node's summary for its next call, and
    the node should back off and stay behind it."""


class Relay:
    """Args:
        address: the address this agent relays on (a node new to this relay is told to
            keep syncing here until the coordinator's next reply names its relay).
        max_nodes: the most nodes whose summaries it holds at once.
        max_bytes: the most bytes of summaries it holds at once.
        fresh_seconds: a coordinator reply older than this (or older than three of the
            intervals it asked for) is stale, and nodes are refused.
        clock: injected for tests (monotonic seconds).
    """

    def __init__(self, address: str, *, max_nodes: int = MAX_GROUP - 1, max_bytes: int = GROUP_BYTES,
                 fresh_seconds: float = 2.0, cfg: RelayConfig | None = None, clock=time.monotonic) -> None:
        self.address = address
        self.cfg = cfg or RelayConfig()
        self.max_nodes = max_nodes
        self.max_bytes = max_bytes
        self.fresh_seconds = fresh_seconds
        self.clock = clock
        self._lock = threading.Lock()
        # node -> (summary, taken at, sent whole, its signature, its ranks' latest progress, steps, bytes)
        self._pending: dict[str, tuple[pb.NodeSummary, float, bool, Signature, float, int, int]] = {}
        self._bytes = 0
        self._whole: dict[str, tuple[float, Signature, int]] = {}   # node -> the last sent whole
        self._reply: pb.GroupReply | None = None
        self._reply_at = float("-inf")
        self._busy = False   # the calls since the last reply went unanswered for a busy coordinator
        self._asking = False   # a SyncGroup is on its way to the coordinator, not answered yet
        self._incidents: dict[str, list[pb.Incident]] = {}
        # Its group's members (node -> since when: the coordinator sent it here), when it last
        # answered or held each one's sync, and since when it has been listening unbroken.
        self._members: dict[str, float] = {}
        self._heard: dict[str, float] = {}
        self._last_take = float("-inf")
        self._listening = float("-inf")
        self.relayed = 0
        """Summaries sent on (a counter)."""

    # -- a node's Sync ------------------------------------------------------------
    def take(self, summary: pb.NodeSummary) -> pb.SyncReply:
        """Hold ``summary`` for the next ``SyncGroup``; answer from the coordinator's last reply.

        Raises:
            Rejected: the summary names no valid node.
            RelayBusy: the coordinator's last reply is stale because it is busy: the summary
                is held all the same.
            RelayUnavailable: no fresh coordinator reply (and not only busy), or the relay
                holds its most nodes.
        """
        check_label(summary.node_id, "node_id", "malformed")
        if not summary.node_id:
            raise Rejected("malformed", "summary without node_id")
        size = summary.ByteSize()
        if size > MAX_SUMMARY_BYTES:
            raise Rejected("oversized", f"a summary of {size} bytes (a node agent sends at most {MAX_SUMMARY_BYTES})")
        now = self.clock()
        sig, progress, steps = signature(summary, self.cfg)
        node = summary.node_id
        with self._lock:
            reply = self._reply
            # (a call still waiting for its answer is as good as one the busy coordinator let pass)
            answer = "refuse" if reply is None else relay_answer(
                now - self._reply_at, reply.sync_interval_seconds, self._busy or self._asking, self.fresh_seconds,
                self.cfg)
            self._listen(now)
            self._last_take = now
            held = self._pending.get(node)
            held_bytes = self._bytes - (held[6] if held is not None else 0)
            why = None
            if reply is None or answer == "refuse":
                why = "this relay has not heard the coordinator lately"
            elif held is None and len(self._pending) >= self.max_nodes:
                why = f"this relay holds {self.max_nodes} nodes already"
            elif held_bytes + size > self.max_bytes:
                why = f"this relay holds {held_bytes} bytes of summaries already"
            if why is not None or reply is None:
                # Sent to the coordinator: no word on its absence until a reply sends it back.
                self._members.pop(node, None)
                raise RelayUnavailable(why)
            self._heard[node] = now
            self._bytes = held_bytes + size
            # A whole summary not sent yet stays whole (the newer one in its place).
            whole = (held is not None and held[2]) or send_whole(now, sig, steps, self._whole.get(node), self.cfg,
                                                                 reply.sync_interval_seconds)
            self._pending[node] = (summary, now, whole, sig, progress, steps, size)
            incidents = self._incidents.get(summary.node_id, ())
        if answer == "hold":
            raise RelayBusy(f"the coordinator is busy: this relay holds the summary for its next call "
                            f"(last answered {now - self._reply_at:.1f}s ago)")
        return node_reply(reply, incidents, reply.relays.get(summary.node_id, self.address))

    # -- the relay's own sync -------------------------------------------------------
    def pending(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def group(self, own: pb.NodeSummary) -> pb.GroupSummary:
        """``own`` and every summary held (whole or as a beat), each with how long it was
        held; the relay is emptied, and waits for the call's answer (:meth:`answered` or
        :meth:`unanswered`): meanwhile a stale reply makes it hold its nodes, not refuse them."""
        now = self.clock()
        with self._lock:
            held, self._pending, self._bytes = self._pending, {}, 0
            self._asking = True
            absent = self._absent(now, held, own.node_id)
            if len(self._whole) > 4 * self.max_nodes:   # nodes long gone: each goes whole once more
                self._whole.clear()
            for node, (_, at, whole, sig, _, steps, _) in held.items():
                if whole:
                    self._whole[node] = (at, sig, steps)
        group = pb.GroupSummary()
        group.nodes.append(own)
        group.held_seconds.append(0.0)
        for summary, at, whole, _, progress, _, _ in held.values():
            if summary.node_id == own.node_id:
                continue
            if whole:
                group.nodes.append(summary)
                group.held_seconds.append(max(0.0, now - at))
            else:
                group.beats.append(pb.NodeBeat(node_id=summary.node_id, seq=summary.seq, sent_at=summary.sent_at,
                                               held_seconds=max(0.0, now - at), latest_progress=progress))
        group.absent.extend(pb.NodeAbsence(node_id=node, unheard_seconds=unheard) for node, unheard in absent)
        self.relayed += len(group.nodes) + len(group.beats) - 1
        return group

    def _absent(self, now: float, held: dict, own: str) -> list[tuple[str, float]]:
        """The members not in ``held`` the relay vouches it has not heard (call with the lock)."""
        listening = self._listen(now)
        if len(self._heard) > 2 * self.max_nodes:   # nodes that passed through: members' times kept
            self._heard = {n: t for n, t in self._heard.items() if n in self._members or n in held}
        interval = self._reply.sync_interval_seconds if self._reply is not None else 0.0
        out = []
        for node, since in list(self._members.items()):
            if node in held or node == own:
                continue
            unheard = vouched_absence(now, self._heard.get(node), since, listening, interval, self.cfg)
            if unheard is not None:
                if now - max(self._heard.get(node, since), since) > _FORGET_SECONDS:
                    del self._members[node]   # long gone (excluded, or moved while unheard)
                    self._heard.pop(node, None)
                    continue
                out.append((node, unheard))
        return out

    def answered(self, reply: pb.GroupReply) -> None:
        """The coordinator's reply to the last ``SyncGroup``: what the group's nodes are told next."""
        by_node: dict[str, list[pb.Incident]] = {}
        for inc in reply.incidents:
            by_node.setdefault(inc.node, []).append(inc)
        with self._lock:
            now = self.clock()
            self._reply, self._reply_at, self._incidents = reply, now, by_node
            self._busy = self._asking = False
            for node, relay in reply.relays.items():   # its group: the nodes sent here
                if relay == self.address:
                    self._members.setdefault(node, now)
                else:
                    self._members.pop(node, None)
                    self._heard.pop(node, None)
            while len(self._members) > self.max_nodes:   # bounded: the longest unheard go first
                oldest = min(self._members, key=lambda n: self._heard.get(n, self._members[n]))
                del self._members[oldest]
                self._heard.pop(oldest, None)
            for node in reply.refused:   # (a beat of a node the coordinator does not know)
                self._whole.pop(node, None)

    def answered_directly(self, reply: pb.SyncReply) -> None:
        """The coordinator's own reply to this agent's ``Sync`` (not a relay's): as fresh."""
        group = pb.GroupReply(coordinator=reply.coordinator, sync_interval_seconds=reply.sync_interval_seconds)
        group.decisions.extend(reply.decisions)
        group.incidents.extend(reply.incidents)
        self.answered(group)

    def unanswered(self, group: pb.GroupSummary | None, busy: bool) -> None:
        """The coordinator did not answer this relay's last call (``group``: its ``SyncGroup``,
        None for a plain ``Sync``).

        The summaries ``group`` carried whole go whole again next time: the coordinator may
        never have taken them, and beats would only move a copy it lacks.  A *busy*
        coordinator (the call's deadline passed, it was cancelled or refused for capacity) is
        still there: the relay goes on answering its nodes from the last reply until that is
        stale, and then holds their summaries and has them back off (:meth:`take`), rather
        than sending its whole group to the coordinator directly at the moment the
        coordinator is busiest.  One that could not be reached at all:
        the group's nodes are refused at once (:meth:`lost_coordinator`).
        """
        with self._lock:
            for summary in group.nodes[1:] if group is not None else ():
                self._whole.pop(summary.node_id, None)
            self._busy, self._asking = busy, False
        if not busy:
            self.lost_coordinator()

    def lost_coordinator(self) -> None:
        """The coordinator cannot be reached: refuse the group's nodes until it answers."""
        with self._lock:
            self._reply = None
            self._listening = self.clock()

    def woke_late(self, seconds: float) -> None:
        """This agent's loop woke ``seconds`` later than it planned: past a bound, the relay
        was paused or starved, and vouches for no absence from before
        (:func:`~.routing.listening_since`)."""
        with self._lock:
            self._listen(self.clock(), seconds)

    def _listen(self, now: float, late: float = 0.0) -> float:
        """Since when the relay has listened unbroken (call with the lock held)."""
        interval = self._reply.sync_interval_seconds if self._reply is not None else 0.0
        self._listening = listening_since(now, self._listening, late, self._last_take, interval, self.cfg)
        return self._listening
