"""A node agent's link to the rest of the job: its coordinator.

``JobLink`` sends the node's summary to the coordinator a few times a second
and applies the reply: the coordinator's decisions (checkpoint at a step,
exclusions, restart generations) and the job incidents that concern this node.
The coordinator is the first reachable agent of the ``--coordinator`` list
(in node-rank order), so the death of the coordinator's node hands the role on.
With no list, the agent coordinates its own node alone.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import TYPE_CHECKING

import grpc

from rankwatch.address import Address
from rankwatch.credentials import open_channel
from rankwatch.agent.durable.decisions import Decision
from rankwatch.agent.link.link_parts import RPC_TIMEOUT as _RPC_TIMEOUT
from rankwatch.agent.link.link_parts import LinkParts, forward_checkpoint, summary_incidents
from rankwatch.agent.job.pacing import LoadConfig, first_sync_delay, retry_delay, silence_allowance
from rankwatch.agent.relays.relay import node_reply
from rankwatch.proto import pb, pb_grpc

if TYPE_CHECKING:
    from rankwatch.agent.link.election import Election

__all__ = ["JobLink", "LinkParts", "forward_checkpoint", "summary_incidents"]

log = logging.getLogger(__name__)

_BUSY = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})
"""A coordinator that answers a sync so is busy, not gone: the node backs off (``retry_delay``)."""
_MAX_CHANNELS = 16   # open channels to coordinator candidates and relays
_MAX_INTERVAL = LoadConfig.max_interval   # the slowest sync a coordinator may ask for


class JobLink:
    """Args:
        node: what the link reads from this node and hands the replies to.
        candidates: coordinator agents in node-rank order (may include this agent).
        interval: seconds between summaries.
    """

    def __init__(self, node: LinkParts, candidates: list[Address], interval: float = 0.25,
                 elected: bool = False) -> None:
        self.node = node
        self.candidates = candidates
        self.elected = elected
        self.election: Election | None = None
        """Set before :meth:`start` when ``elected`` (it needs the agent's bound port)."""
        self.base_interval = self.interval = interval
        self.acting = not candidates and not elected
        self.coordinator_node = node.config.node_id if self.acting else ""
        self.coordinator_addr: Address | None = None
        self.relay_addr: Address | None = None
        """The relay the coordinator told this node to sync through (None: the coordinator)."""
        self._home_relay: Address | None = None   # the relay the coordinator's last reply named
        self.last_ok = 0.0
        self.attempts = 0
        """Syncs this node began (answered or not)."""
        self.busy_failures = 0
        """Syncs in a row that a busy coordinator did not answer (see ``pacing.retry_delay``)."""
        self._busy = False
        self._held = False   # its relay is holding its summaries for a busy coordinator (said once)
        self._tried: list[Address | None] = []   # the candidates of the last sync
        self._applied: set[str] = set()   # ids of the decisions this node has acted on
        self._seq = 0
        self._warned: set[str] = set()
        self._channels: dict[str, grpc.Channel] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- lifecycle --------------------------------------------------------------
    @property
    def coordinates_job(self) -> bool:
        """True while this agent is the coordinator of a job of several nodes."""
        if self.elected:   # the lease, checked now: an agent paused past it must not act on
            return self.acting and self.election is not None and self.election.is_leader()
        return self.acting and bool(self.candidates)

    def start(self) -> None:
        if self.election is not None:
            self.election.start()
        self._thread = threading.Thread(target=self._loop, name="rankwatch-sync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        if self.election is not None:
            self.election.stop()
        for ch in self._channels.values():
            ch.close()

    @property
    def generation(self) -> int:
        """The job's restart generation as far as this node knows."""
        return self.node.decision_log.generation

    def coordinated(self, now: float) -> bool:
        """True while another agent coordinates this node and answers."""
        timeout = silence_allowance(self.interval, self.node.config.policy.node_timeout_seconds, LoadConfig())
        return not self.acting and now - self.last_ok < timeout

    # -- the loop ---------------------------------------------------------------
    def _loop(self) -> None:
        first = self.candidates[0] if self.candidates else None
        coordinates = self.acting or (first is not None and self.node.serves(first))
        nodes = max(self.node.config.job_nodes, self.node.config.policy.min_nodes)
        if self._stop.wait(first_sync_delay(random.random(), coordinates, LoadConfig(), nodes)):
            return
        while True:
            last_ok, self._busy = self.last_ok, False
            self.attempts += 1
            began = time.monotonic()
            try:
                self.sync_once()
            except Exception:  # noqa: BLE001 - the agent never dies of a sync bug
                log.exception("sync with the coordinator failed")
            self.busy_failures = 0 if self.last_ok != last_ok or not self._busy else self.busy_failures + 1
            if self._wait_next(time.monotonic() - began):
                return

    def _wait_next(self, took: float = 0.0) -> bool:
        """Wait until the next sync is due (the last took ``took`` s); True when stopped.
        Backing off a busy coordinator, a new one elected meanwhile is tried at the next
        interval, not after the backoff."""
        cfg = LoadConfig()
        allowance = silence_allowance(self.interval, self.node.config.policy.node_timeout_seconds, cfg)
        delay = retry_delay(self.busy_failures, self.interval, random.random(), cfg, allowance, took)
        if delay <= self.interval:
            return self._stop.wait(delay)
        deadline = time.monotonic() + delay
        while (left := deadline - time.monotonic()) > 0:
            if self._stop.wait(min(left, self.interval)):
                return True
            if self.election is not None and self._candidates() != self._tried:
                return False
        return False

    def _candidates(self) -> list[Address | None]:
        """Where to sync, in order; None is this agent itself."""
        election = self.election
        if election is None:
            return list(self.candidates) or [None]
        if election.is_leader():
            return [None]
        if self.acting:   # lost the key: another agent, or nobody yet, coordinates
            self._took_role(False, None)
        leader = election.leader()
        try:
            return [Address.parse(leader)] if leader else []
        except ValueError:
            self._warn_once(f"the coordinator key holds {leader!r}, not an address")
            return []

    def sync_once(self) -> None:
        """Send this node's summary: through its group's relay if the coordinator named one,
        else to the coordinator; as a relay, with the summaries its group sent meanwhile."""
        summary = self.node.summary(self._next_seq())
        relay = self.node.relay()
        group = relay.group(summary) if relay is not None and relay.pending() else None
        candidates = self._tried = self._candidates()
        busy = False   # a candidate answered busy (not that it was unreachable)
        if group is None and self.relay_addr is not None and not self.acting:
            if self._via_relay(self.relay_addr, summary):
                return
            self.relay_addr = None   # the relay failed: the coordinator, at once
        for addr in candidates:
            if addr is None or (self.election is None and self.node.serves(addr)):
                if group is None:
                    reply = self.node.coordinator.sync(summary)
                else:
                    reply = self._own_reply(self.node.coordinator.sync_group(group), summary.node_id)
                self._took_role(True, addr)
            else:
                stub = pb_grpc.AgentStub(self._channel(addr))
                try:
                    if group is None:
                        reply = stub.Sync(summary, timeout=_RPC_TIMEOUT)
                        if relay is not None:
                            relay.answered_directly(reply)
                    else:
                        group_reply = stub.SyncGroup(group, timeout=_RPC_TIMEOUT)
                        relay.answered(group_reply)   # type: ignore[union-attr]
                        reply = self._own_reply(group_reply, summary.node_id)
                except grpc.RpcError as exc:
                    busy = busy or exc.code() in _BUSY
                    self._busy = self._busy or busy
                    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                        self._warn_once(f"coordinator {addr} refused this node's token: {exc.details()}")
                    log.debug("coordinator candidate %s: %s", addr, exc.code().name)
                    continue
                self._took_role(False, addr)
            self.last_ok = time.time()
            self.apply(reply)
            return
        if relay is not None:   # its group's nodes go to the coordinator themselves, unless it is only busy
            relay.unanswered(group, busy=busy)
        # Its relay failed it, and so did the coordinator: the relay again next time.  (A node
        # that left its relay for a busy coordinator would otherwise never be heard by either,
        # and its relay would vouch for its absence: ``routing.vouched_absence``.)
        self.relay_addr = self._home_relay
        if self.last_ok and time.time() - self.last_ok > 5:
            log.warning("no coordinator answers (%s)", ", ".join(map(str, candidates)) or "none elected")

    def _via_relay(self, addr: Address, summary: pb.NodeSummary) -> bool:
        """Sync through the group's relay; False if it did not answer (the coordinator next).

        A relay that answers RESOURCE_EXHAUSTED holds the summary while the coordinator is
        busy (:func:`~rankwatch.agent.relays.routing.relay_answer`): the node backs off and stays
        behind it, for at most ``busy_hold_seconds`` after its last answer."""
        try:
            reply = pb_grpc.AgentStub(self._channel(addr)).Sync(summary, timeout=_RPC_TIMEOUT)
        except grpc.RpcError as exc:
            if (exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    and time.time() - self.last_ok < self.node.config.relay.busy_hold_seconds):
                self._busy = True
                if not self._held:
                    log.info("relay %s holds this node's summaries while the coordinator is busy: "
                             "backing off behind it", addr)
                self._held = True
                return True
            log.info("relay %s did not take this node's summary (%s): syncing with the coordinator",
                     addr, exc.code().name)
            return False
        self.last_ok = time.time()
        self._held = False
        self.apply(reply)
        return True

    @staticmethod
    def _own_reply(group: pb.GroupReply, node: str) -> pb.SyncReply:
        """What a group's reply says to the relay's own node."""
        return node_reply(group, [i for i in group.incidents if i.node == node], group.relays.get(node, ""))

    def _warn_once(self, text: str) -> None:
        if text not in self._warned:
            self._warned.add(text)
            log.error("%s", text)

    def _took_role(self, acting: bool, addr: Address | None) -> None:
        if acting != self.acting:
            log.warning("this agent %s the job's coordinator", "is now" if acting else "is no longer")
            if acting and self.election is not None:   # go on from the job's log in etcd
                try:
                    taken = self.node.decision_log.adopt(self.election.decisions.load())
                    log.info("took over %d decision(s) from the job's log in etcd", len(taken))
                except Exception as exc:  # noqa: BLE001 - the nodes' summaries carry them too
                    log.warning("could not read the job's decision log in etcd: %s", exc)
        self.acting, self.coordinator_addr = acting, addr

    def _relay(self, named: str) -> Address | None:
        """The relay a reply names, if it is another agent's valid TCP address."""
        if not named or self.acting:
            return None
        try:
            addr = Address.parse(named)
        except ValueError:
            self._warn_once(f"the coordinator named relay {named[:256]!r}, not an address")
            return None
        relay = self.node.relay()
        if addr.is_unix or self.node.serves(addr) or (relay is not None and relay.address == named):
            return None
        return addr

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _channel(self, addr: Address) -> grpc.Channel:
        key = str(addr)
        if key not in self._channels:
            if len(self._channels) >= _MAX_CHANNELS:   # relays come and go: keep a bounded few
                stale = next(iter(self._channels))
                self._channels.pop(stale).close()
            self._channels[key] = open_channel(addr, self.node.config.client_credentials())
        return self._channels[key]

    # -- applying the coordinator's reply ---------------------------------------
    def apply(self, reply: pb.SyncReply) -> None:
        """Keep the coordinator's decisions in this agent's log (the coordinator's own node
        already holds them there) and act on each once."""
        self.coordinator_node = reply.coordinator
        self.relay_addr = self._home_relay = self._relay(reply.relay)
        asked = reply.sync_interval_seconds
        if asked > 0:   # the coordinator's backpressure, within sane bounds (NaN fails both tests)
            interval = min(_MAX_INTERVAL, max(self.base_interval, asked)) if asked == asked else self.base_interval
            if interval != self.interval:
                log.info("the coordinator asks for a sync every %.2fs", interval)
                self.interval = interval
        decisions = [Decision.from_pb(d) for d in reply.decisions]
        self.node.decision_log.adopt(decisions)
        for d in decisions:
            if d.id in self._applied:
                continue
            self._applied.add(d.id)
            if d.kind == "checkpoint":
                self.node.on_checkpoint(d)
            elif d.kind == "exclude":
                self.node.on_exclusion(d)
        if not self.acting:
            for inc in reply.incidents:
                self.node.on_job_incident(reply.coordinator, inc)
