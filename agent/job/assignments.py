"""The coordinator's relay groups: which relay each node syncs through, and what a relay's call may carry.

The rules are :mod:`~rankwatch.agent.relays.routing`'s (pure functions: :func:`assign`,
:func:`place`); this keeps the assignment they read and change between calls, draws it
again, places a node new to the coordinator at its first sync, and takes a relay's word on
the members of its group it has not heard.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from rankwatch.agent.relays import routing
from rankwatch.agent.job.global_view import JobView
from rankwatch.agent.job.loadmeter import LoadMeter
from rankwatch.agent.relays.relay import MAX_GROUP
from rankwatch.agent.relays.routing import RelayConfig
from rankwatch.agent.wire.ranges import Rejected
from rankwatch.proto import pb

__all__ = ["RelayGroups", "check_group", "held_for"]

log = logging.getLogger(__name__)

_MAX_HELD = 10.0   # seconds a relay may say it held a summary (more is taken as this)


def check_group(group: pb.GroupSummary) -> None:
    """Raise :class:`Rejected` for more summaries (or absent nodes) than a group may carry,
    or a held time for each missing."""
    if len(group.nodes) + len(group.beats) > MAX_GROUP:
        raise Rejected("oversized", f"{len(group.nodes) + len(group.beats)} nodes in one group "
                                    f"(at most {MAX_GROUP})")
    if len(group.held_seconds) != len(group.nodes):
        raise Rejected("malformed", "a group needs one held time per summary")
    if len(group.absent) > MAX_GROUP:
        raise Rejected("oversized", f"{len(group.absent)} absent nodes in one group (at most {MAX_GROUP})")


def held_for(seconds: float) -> float:
    """A relay's word for how long it held a summary: within [0, _MAX_HELD]; NaN as the most."""
    return min(max(seconds, 0.0), _MAX_HELD) if seconds == seconds else _MAX_HELD


class RelayGroups:
    """Args:
        own: the coordinator's own node (it never syncs over the wire: it is in no group).
        view: the job as the coordinator knows it (its nodes, those excluded, dead or silent).
        cfg: the relay rules' settings.
        load: the coordinator's load meter (told how many callers the groups leave it).
    """

    def __init__(self, own: str, view: JobView, cfg: RelayConfig, load: LoadMeter) -> None:
        self.own = own
        self.view = view
        self.cfg = cfg
        self.load = load
        self.relays: dict[str, str] = {}
        """Node -> the relay it syncs through ('' or absent: this coordinator; routing)."""
        self._groups: dict[str, tuple[str, int]] = {}
        """Relay node -> (its address, its group's size): where a new node is placed."""
        self._lock = threading.Lock()   # the assignment, the groups and placements
        self._drawn_at = float("-inf")

    def relay_of(self, summary: pb.NodeSummary) -> str | None:
        """The relay the summary's node syncs through next (None or '': this coordinator),
        a node new to the groups placed in one first."""
        relay = self.relays.get(summary.node_id)
        if relay is None and self._groups and summary.node_id != self.own:
            relay = self._place(summary)
        return relay

    def update(self, now: float) -> None:
        """Draw the groups again when due: every ``every_seconds``, and at once while nodes of a
        big job are in no group yet (a big job starting: they are placed at the next tick)."""
        nodes = self.view.nodes
        ungrouped = len(nodes) > self.cfg.min_nodes and len(nodes) - 1 > len(self.relays)
        if ungrouped or now - self._drawn_at >= self.cfg.every_seconds:
            self._drawn_at = now
            self._assign(now)

    def absent(self, group: pb.GroupSummary, taken: set[str], now: float,
               refused: Callable[[ValueError], None]) -> None:
        """A relay's word on the members of its group it has not heard lately
        (``pacing.node_silent`` weighs it).  Taken only from the relay this coordinator
        sent each node to, and only for nodes the same call did not carry."""
        relay = group.nodes[0].node_id if group.nodes else ""
        with self._lock:
            relays = self.relays
        if relay not in taken or relays.get(relay) != "":
            return   # the caller relays for no group now
        own = self.view.nodes.get(relay)
        address = own.summary.relay_address if own is not None else ""
        if not address:
            return
        for a in group.absent:
            if a.node_id in taken or relays.get(a.node_id) != address:
                continue
            try:
                self.view.absent(a, now)
            except ValueError as exc:
                refused(exc)

    def _assign(self, now: float) -> None:
        """Draw the relay groups again (:func:`routing.assign`)."""
        view = self.view
        with view.lock:
            excluded = view.excluded
            # (this coordinator's own node never syncs over the wire: it is in no group)
            nodes = [(name, n.summary.relay_address, name not in excluded and name not in view.dead
                      and not view.silent(n, now))
                     for name, n in view.nodes.items() if name != self.own]
        addresses = {name: addr for name, addr, _ in nodes}
        with self._lock:
            relays = routing.assign(nodes, self.cfg, self.relays)
            if bool(relays) != bool(self.relays):
                log.warning("nodes now sync %s", f"through {sum(1 for a in relays.values() if not a)} relay(s)"
                            if relays else "with the coordinator directly")
            self.relays = relays
            self._groups = {r: (addresses[r], size)
                            for r, size in routing.group_sizes(relays, addresses).items()}
        self.load.callers = routing.callers(relays, len(nodes) + 1) if relays else None

    def _place(self, summary: pb.NodeSummary) -> str:
        """A node new to the coordinator (not its own), put in a group at its first sync
        (:func:`routing.place`); the address of the relay it syncs through next, or ''."""
        name = summary.node_id
        eligible = bool(summary.relay_address) and name not in self.view.excluded and name not in self.view.dead
        with self._lock:
            if name in self.relays or not self._groups:
                return self.relays.get(name, "")
            relay = routing.place(name, eligible, {r: n for r, (_, n) in self._groups.items()}, self.cfg)
            if relay is None:
                return ""
            addr, size = self._groups.get(relay, (summary.relay_address, 0))
            self._groups[relay] = (addr, size + 1)
            self.relays[name] = "" if relay == name else addr
            return self.relays[name]
