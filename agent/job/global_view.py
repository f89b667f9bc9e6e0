"""The coordinator's view of the job: each node's latest summary, on the coordinator's clock.

Node agents send summaries; :meth:`JobView.take` checks one and keeps it whole in
place of the node's previous one (a summary is never changed after it arrived).  The
readers below turn them into what the detectors and the surfaces need: the
:class:`Snapshot` that :func:`~rankwatch.agent.detect.evaluate.evaluate` reads, the incidents
the nodes raised, each node's state.  Nothing here decides: the coordinator's policy
(``job/coordinator.py``) reads this view and the decision log.

Times in summaries are the sending node's clock; they are moved onto the coordinator's
clock by the offset seen when the summary arrives.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from rankwatch.agent.job import claims, node_death

from rankwatch.agent.wire import inflight as in_flight, summary as validate_sync
from rankwatch.agent.durable.decisions import DecisionLog
from rankwatch.agent.detect.evaluate import STACKS_FRESH_SECONDS, Snapshot
from rankwatch.agent.detect.hang_verdict import RankProgress
from rankwatch.agent.durable.incidents import Incident
from rankwatch.agent.job.loadmeter import LoadMeter
from rankwatch.agent.job.node_copy import NodeView, flight_recorder, node_incidents, rank_id, rank_work, without
from rankwatch.agent.job.node_floor import agentless_nodes
from rankwatch.agent.detect.straggler import RankWork
from rankwatch.agent.detect.work_scores import role_of
from rankwatch.agent.detect.bottleneck import Part
from rankwatch.agent.node import makeup
from rankwatch.agent.wire.ranges import Rejected
from rankwatch.proto import pb

__all__ = ["JobView", "NodeView"]

log = logging.getLogger(__name__)


class JobView:
    """Args:
        log: the decision log (which nodes are excluded).
        load: the coordinator's load meter (sync intervals; when silence is evidence).
        max_nodes: the most node ids kept (a bound on what Sync callers can make it hold).
    """

    def __init__(self, log: DecisionLog, load: LoadMeter, max_nodes: int) -> None:
        self.lock = threading.Lock()
        self.nodes: dict[str, NodeView] = {}
        self.dead: set[str] = set()
        self.log = log
        self.load = load
        self.max_nodes = max_nodes
        # node -> (the summary its straggler inputs were read from, those inputs): only the
        # detector loop reads and writes it.
        self._work: dict[str, tuple[pb.NodeSummary, list[RankWork]]] = {}
        # node -> (its summary, the incidents it raised), kept between reads (:meth:`job_incidents`).
        self._incidents: dict[str, tuple[pb.NodeSummary, list[Incident]]] = {}
        self._incidents_lock = threading.Lock()
        self.claims = claims.RankClaims()
        """Which node holds each rank id; the conflicts (:mod:`.claims`)."""
        self.moves = 0
        """Summaries and beats that showed a node's ranks progressed, its streams open or
        close, or a new node (a counter: :func:`~rankwatch.agent.detect.hang_end.end_possible`)."""

    @property
    def excluded(self) -> dict[str, str]:
        return self.log.excluded

    # -- intake -----------------------------------------------------------------
    def take(self, summary: pb.NodeSummary, now: float, relayed: bool = False) -> list[int]:
        """Keep ``summary`` as its node's latest (``relayed``: a relay sent it on); the rank ids
        another live node holds are left out of it, and returned (:mod:`.claims`).

        Raises:
            ValueError: no node id, a stale or replayed summary, one out of range, or one from
                another agent instance while the node's holds it (:class:`Rejected`, a
                ValueError): nothing of it is kept.
        """
        if not summary.node_id:
            raise ValueError("summary without node_id")
        validate_sync.check_summary(summary)
        node = summary.node_id
        with self.lock:
            prev = self.nodes.get(node)
            if prev is None and len(self.nodes) >= self.max_nodes:
                raise Rejected("too_many_nodes", f"{node!r}: the coordinator keeps "
                                                 f"{self.max_nodes} nodes already")
            if prev is not None and claims.takeover_refused(prev.instance, summary.agent_instance,
                                                            self._holds(node, now)):
                raise Rejected("node_taken", f"node {node!r} is held by a live agent's summaries")
            # A lower seq with a later clock is the node's agent restarted, not a replay.
            if prev is not None and summary.seq <= prev.seq and summary.sent_at <= prev.sent_at:
                raise ValueError(f"stale summary {summary.seq} from {node} (have {prev.seq})")
            claimed = claims.claimed_ranks((rank_id(r), r.connected, r.exited_cleanly) for r in summary.ranks)
            refused = self.claims.settle(node, claimed, prev.claims if prev else (),
                                         lambda holder: self._holds(holder, now), now)
            if refused:
                summary = without(summary, {claimed[r] for r in refused})
            self._keep(summary, prev, now, relayed, tuple(r for r in claimed if r not in refused))
        return sorted(refused)

    def _keep(self, summary: pb.NodeSummary, prev: NodeView | None, now: float, relayed: bool,
              held: tuple[int, ...]) -> None:
        """Keep an accepted summary as its node's view (call with the lock held)."""
        offset = now - summary.sent_at
        best = min(offset, prev.best_offset if prev else offset)
        self.load.heard(offset - best, len(self.nodes) + (summary.node_id not in self.nodes))
        latest = max((r.progress_at for r in summary.ranks if not r.exited_cleanly), default=float("-inf"))
        streams = tuple(r.pid for r in summary.ranks if r.connected and not r.exited_cleanly)
        if prev is None or latest > prev.progressed or streams != prev.streams:
            self.moves += 1
        self.nodes[summary.node_id] = NodeView(summary, now, offset, prev.ranks_dead_since if prev else None,
                                               interval=self.load.reply_interval(), best_offset=best,
                                               latest_progress=latest + offset,
                                               syncs=prev.syncs + 1 if prev else 1,
                                               seq=summary.seq, sent_at=summary.sent_at, relayed=relayed,
                                               ranks_died=node_death.all_ranks_died(summary.ranks),
                                               progressed=latest, streams=streams, claims=held,
                                               instance=summary.agent_instance)
        if summary.node_id in self.dead and any(r.connected for r in summary.ranks):
            self.dead.discard(summary.node_id)

    def _holds(self, node: str, now: float) -> bool:
        """Whether ``node`` still holds its node id and its ranks (call with the lock held)."""
        n = self.nodes.get(node)
        return (n is not None and node not in self.dead and node not in self.excluded
                and claims.holding(now, n.received_at, n.interval))

    def rank_conflicts(self, now: float) -> list[claims.Conflict]:
        """The rank ids two live nodes claim now: the first holder keeps each (:mod:`.claims`)."""
        with self.lock:
            return self.claims.open(lambda node: self._holds(node, now))

    def beat(self, b: pb.NodeBeat, now: float) -> None:
        """A relay heard a node whose summary changed in nothing the detectors act on at once:
        the node is heard now, its ranks' latest progress moves; its last summary stays.

        Raises:
            ValueError: a beat out of range, stale, or from a node not yet heard whole.
        """
        validate_sync.check_beat(b)
        with self.lock:
            prev = self.nodes.get(b.node_id)
            if prev is None:
                raise Rejected("malformed", f"a beat from node {b.node_id!r}, never heard whole")
            if b.seq <= prev.seq and b.sent_at <= prev.sent_at:
                raise ValueError(f"stale beat {b.seq} from {b.node_id} (have {prev.seq})")
            offset = now - b.sent_at
            best = min(offset, prev.best_offset)
            self.load.heard(offset - best, len(self.nodes))
            latest = b.latest_progress + offset if b.latest_progress > 0 else prev.latest_progress
            moved = prev.moved_since_copy or b.latest_progress > prev.summary.sent_at   # (the node's clock)
            if b.latest_progress > prev.progressed:
                self.moves += 1
            self.nodes[b.node_id] = replace(prev, received_at=now, offset=offset, interval=self.load.reply_interval(),
                                            best_offset=best, latest_progress=latest, syncs=prev.syncs + 1,
                                            seq=b.seq, sent_at=b.sent_at, moved_since_copy=moved, witness=None,
                                            relayed=True, progressed=max(prev.progressed, b.latest_progress))

    # -- readers ------------------------------------------------------------------
    def absent(self, a: pb.NodeAbsence, now: float) -> bool:
        """The node's relay (the caller checked it is) has not heard it for
        ``a.unheard_seconds``, said ``now``; False if the node is not known.

        Raises:
            Rejected: a word out of range."""
        validate_sync.check_absence(a)
        with self.lock:
            n = self.nodes.get(a.node_id)
            if n is None:
                return False
            n.witness = (now - a.unheard_seconds, now)
        return True

    def silent(self, n: NodeView, now: float) -> bool:
        return self.load.silent(now, n.received_at, n.interval, n.syncs, n.witness, n.relayed)

    def live_nodes(self) -> list[NodeView]:
        """The nodes not excluded (call with the lock held)."""
        excluded = self.excluded
        return [n for name, n in self.nodes.items() if name not in excluded]

    def remaining_without(self, node: str) -> int:
        """Nodes the job would keep without ``node`` and those already excluded, counting the
        nodes that run ranks but no agent (call with the lock held)."""
        excluded = self.excluded
        gone = set(excluded) | {node}
        remaining = len([n for n in self.nodes if n not in gone])
        return remaining + agentless_nodes(
            ((name, rank_id(r), r.world_size)
             for name, n in self.nodes.items() for r in n.summary.ranks if r.connected),
            rankless_nodes=sum(1 for name, n in self.nodes.items() if name not in gone
                               and not any(r.connected for r in n.summary.ranks)))

    def latest_progress(self) -> float:
        """The latest progress of any included rank, on this clock (-inf: none yet)."""
        with self.lock:
            return max((n.latest_progress for n in self.live_nodes()), default=float("-inf"))

    def snapshot(self, now: float) -> Snapshot:
        """Every included rank on the coordinator's clock, as :func:`evaluate` reads it.

        Summaries are replaced whole on each sync, never changed, so what it reads of them is
        referenced here rather than copied, and the lock is held only to collect them.  The
        ranks' work windows are left out: the job's straggler detector reads them from
        :meth:`straggler_work` (at 16,384 ranks, reading them here was a third of a hang pass,
        which runs up to once a second while a hang is possible).
        """
        with self.lock:
            nodes = [(name, n, self.silent(n, now)) for name, n in self.nodes.items()
                     if name not in self.excluded]
            names = tuple(self.nodes)
        out = []
        for name, n, silent_node in nodes:
            for r in n.summary.ranks:
                fresh = now - (r.stacks_at + n.offset) < STACKS_FRESH_SECONDS
                fr = r.flight_recorder
                out.append(RankProgress(
                    rank=r.rank, node=name, step=r.step, step_seconds=r.step_seconds,
                    steps_completed=r.steps_completed, activity=r.activity or "train",
                    progress_at=r.progress_at + n.offset,
                    # A node's report is its ranks' state as of its sending: between syncs (slow
                    # under backpressure), a rank it saw is not silent for the coordinator either.
                    last_seen=min(r.last_seen + n.offset, n.received_at) if silent_node
                    else r.last_seen + n.offset + (now - n.received_at),
                    # The rank's own last word: its last message, carried on to the node's
                    # latest beat while no beat said its ranks moved (a beat goes only while
                    # nothing else about them changed).
                    reported_at=r.last_seen + n.offset + (0.0 if n.moved_since_copy
                                                          else max(0.0, n.sent_at - n.summary.sent_at)),
                    connected=r.connected and not silent_node, exited_cleanly=r.exited_cleanly,
                    role=role_of(r.mesh_coords),
                    group_seqs=r.group_seqs,   # read only: no copy (16,384 of them)
                    inflight=in_flight.to_dict(r.inflight, n.offset) if r.HasField("inflight") else None,
                    stacks=r.stacks if r.stacks and fresh else None,
                    flight_recorder=flight_recorder(r.rank, fr) if fr else None, pid=r.pid, alive=r.alive,
                    stopped=r.stopped, current=not n.moved_since_copy))
        return Snapshot(ranks=out, scope="job", nodes=names,
                        silent_nodes=frozenset(name for name, _, silent in nodes if silent))

    def straggler_work(self, now: float) -> list[RankWork]:
        """The straggler detector's inputs: the connected ranks of every included node still
        heard, as :attr:`Verdicts.work <rankwatch.agent.detect.evaluate.Verdicts.work>` reads them
        from a :meth:`snapshot`, without building one.

        A node's inputs are read once per summary it sends whole (beats change nothing in
        them) and kept: at 16,384 ranks, building the whole snapshot for them took a fifth of
        a 2,048-node coordinator's time, in the thread that holds the GIL its syncs need.
        The windows are the summaries' own, not copies (the detector only reads them).
        """
        with self.lock:
            nodes = [(name, n.summary) for name, n in self.nodes.items()
                     if name not in self.excluded and not self.silent(n, now)]
        kept, out = self._work, []
        for name, summary in nodes:
            held = kept.get(name)
            if held is None or held[0] is not summary:
                held = kept[name] = (summary, [rank_work(name, r) for r in summary.ranks if r.connected])
            out.extend(held[1])
        if len(kept) > 2 * len(nodes) + 64:   # nodes excluded, silent or gone: read again if back
            listed = {name for name, _ in nodes}
            self._work = {name: held for name, held in kept.items() if name in listed}
        return out

    def makeups(self, now: float) -> list[Part]:
        """The step make-up of every included node still heard that sent one (the job's
        bottleneck combines them: :mod:`~rankwatch.agent.detect.bottleneck`); one per node."""
        with self.lock:
            sent = [n.summary.step_makeup for name, n in self.nodes.items()
                    if name not in self.excluded and not self.silent(n, now) and n.summary.HasField("step_makeup")]
        return [p for p in map(makeup.from_pb, sent) if p is not None]

    def job_incidents(self) -> list[Incident]:
        """Incidents the nodes raised themselves (gpu_fault, checkpoint, rank_exit), on this clock.

        A node speaks for itself only: an incident naming another node is left out, as is
        one that does not parse (logged); a node's bad record never stops the coordinator.
        Each summary's are read once, on the node's clock offset as of that read, and kept:
        the evaluation loop reads them four times a second, and a beat changes none.
        """
        with self.lock:
            nodes = [(name, n.summary, n.offset) for name, n in self.nodes.items()]
        out = []
        with self._incidents_lock:   # (status and the relays' answers read them too)
            kept = self._incidents
            for name, summary, offset in nodes:
                held = kept.get(name)
                if held is None or held[0] is not summary:
                    held = kept[name] = (summary, node_incidents(name, summary, offset))
                out.extend(held[1])
            if len(kept) > len(nodes):
                listed = {name for name, _, _ in nodes}
                self._incidents = {name: held for name, held in kept.items() if name in listed}
        return out

    def node_states(self) -> dict[str, str]:
        with self.lock:
            excluded = self.excluded
            return {n: "excluded" if n in excluded else "dead" if n in self.dead else "ok"
                    for n in self.nodes}

    def rank_summaries(self) -> list[tuple[str, pb.RankSummary, bool]]:
        """(node, rank summary, node excluded) for every rank the coordinator knows."""
        with self.lock:
            excluded = self.excluded
            return [(name, r, name in excluded) for name, n in sorted(self.nodes.items())
                    for r in n.summary.ranks]
