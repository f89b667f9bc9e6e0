"""The job's coordinator: it wires the job-wide decisions together; each is made elsewhere.

Every node agent sends its coordinator a compact summary a few times a second (progress and
recent own-work windows per rank, its own incidents, its goodput accounting): never raw
events, so the coordinator's cost grows with the number of nodes, not with the number of
records.  It hands its decisions to every node in the sync reply.  Decisions are
append-only and idempotent by id; the rendezvous handler writes them to the rendezvous
store, where every node's torchrun reads them.  The log (:class:`DecisionLog`) is shared
with this agent's link to the job, and every summary carries the decisions its node
applied: a coordinator that takes over continues the log, its ids and the restart
generation after them.

Which question is answered where (``job/`` unless named):

* what the coordinator knows of the job (the nodes' summaries, on its clock):
  :class:`~rankwatch.agent.job.global_view.JobView`;
* is the job hung now, and who is the culprit: ``detect/evaluate.py``
  :func:`~rankwatch.agent.detect.evaluate.evaluate` (``detect/hang_verdict.py``
  :func:`~rankwatch.agent.detect.hang_verdict.detect_hang`), the same on every node;
* when is a look at every rank worth it: ``hang_watch.py`` :meth:`HangWatch.due`
  (``hang_possible``, ``hang_end.end_possible``, ``pacing.detector_due``);
* may a verdict be acted on while the coordinator is overloaded: ``pacing.hang_shown_by_reports``;
* has an open hang ended: ``detect/hang_end.py`` :func:`~rankwatch.agent.detect.hang_end.hang_end`;
* what a hang verdict records (its incident, its end): ``hang_watch.py`` :meth:`HangWatch.look`;
* is a node dead: ``node_death.judge``, evaluation after evaluation ``death_watch.py``
  :meth:`DeathWatch.check`; the exits of the ranks it took with it: ``node_lost.py``;
* is a node silent, how often do nodes sync, when does the straggler pass run: ``pacing.py``
  (its counters: ``loadmeter.py``);
* which nodes straggle: ``slow_nodes.py``; when one is evicted: ``evictions.py``
  (``checkpoint_due.wants_eviction``, ``evictions_due``);
* does the job train again after an exclusion: ``restartwatch.py``;
* which relay a node syncs through: ``assignments.py`` (``routing.assign``, ``place``);
* the policy, here: exclude a dead node, a hung culprit's node, a node with a fatal GPU
  fault, an evicted straggler, unless the job would fall below its minimum
  (:meth:`Coordinator.exclude`); the step a checkpoint is saved at
  (:meth:`Coordinator.request_checkpoint`, ``checkpoint_due.save_step``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from rankwatch.agent.detect.hang_verdict import HangConfig
from rankwatch.agent.detect.straggler import StragglerConfig
from rankwatch.agent.durable.incidents import Incident, IncidentLog
from rankwatch.agent.gpu.xid import FATAL_ACTIONS
from rankwatch.agent.detect import checkpoint_due
from rankwatch.agent.job import node_death, pacing
from rankwatch.agent.job.death_watch import DeathWatch
from rankwatch.agent.durable.decisions import Decision, DecisionLog
from rankwatch.agent.job.evictions import Evictions
from rankwatch.agent.job.global_view import JobView
from rankwatch.agent.job.hang_watch import HangWatch
from rankwatch.agent.job.loadmeter import LoadMeter
from rankwatch.agent.job.pacing import LoadConfig
from rankwatch.agent.job.policy import PolicyConfig
from rankwatch.agent.job.assignments import RelayGroups, check_group, held_for
from rankwatch.agent.job.restartwatch import RestartWatch
from rankwatch.agent.detect.root_cause import job_roots
from rankwatch.agent.relays.routing import RelayConfig
from rankwatch.agent.job.slow_nodes import JobStragglers
from rankwatch.agent.wire.ranges import Rejected
from rankwatch.proto import pb

__all__ = ["Coordinator", "PolicyConfig"]

log = logging.getLogger(__name__)

_DECISION_KINDS = ("exclude", "checkpoint")
_DECISIONS_ADOPTED = 256   # the most decisions taken from one summary


class Coordinator:
    """Args:
        node_id: the coordinator's own node.
        incidents: the coordinator agent's incident log (job-level incidents go there).
        decisions: the agent's decision log (default: a new one in memory).
        clock: injected for tests.
        load_clocks: ``(wall, cpu)``: the monotonic and CPU clocks its load is measured on
            (injected for tests; :class:`LoadMeter`).
    """

    def __init__(self, node_id: str, *, incidents: IncidentLog, decisions: DecisionLog | None = None,
                 hang: HangConfig | None = None, straggler: StragglerConfig | None = None,
                 policy: PolicyConfig | None = None, clock=time.time,
                 on_incident: Callable[[Incident], None] | None = None, load: LoadConfig | None = None,
                 tick_seconds: float = 0.25, refusals: Callable[[], int] | None = None,
                 relay: RelayConfig | None = None,
                 load_clocks: tuple[Callable[[], float], Callable[[], float]] | None = None) -> None:
        self.node_id = node_id
        self.tick_seconds = tick_seconds
        """How often the agent calls :meth:`evaluate`."""
        self.incidents = incidents
        self.hang = hang or HangConfig()
        self.policy = policy or PolicyConfig()
        self.clock = clock
        self.log = decisions if decisions is not None else DecisionLog()
        self._on_incident = on_incident or (lambda _: None)
        self.stragglers = JobStragglers(straggler or StragglerConfig(), incidents, self._on_incident)
        self._refused: set[str] = set()
        self.load = LoadMeter(load or LoadConfig(), tick_seconds, self.policy.node_timeout_seconds,
                              refusals or (lambda: 0),
                              lambda n: node_death.burst_size(n, burst_share=self.policy.silent_burst_share,
                                                              burst_nodes=self.policy.silent_burst_nodes),
                              load_clocks)
        """Its own load, the interval nodes sync at, and when silence is no evidence."""
        self.view = JobView(self.log, self.load, self.policy.max_nodes)
        """The nodes' summaries, on this clock."""
        self.lock, self.nodes, self.dead = self.view.lock, self.view.nodes, self.view.dead
        self.snapshot = self.view.snapshot
        self.node_states, self.rank_summaries = self.view.node_states, self.view.rank_summaries
        self.rank_conflicts = self.view.rank_conflicts
        self.restarts = RestartWatch(incidents, self.view)
        """The open restart incident, from an exclusion until the job trains again."""
        self._monotonic = load_clocks[0] if load_clocks else time.monotonic
        self.hangs = HangWatch(self.view, incidents, self.hang, self.load, self._monotonic, self._on_incident)
        """The open job hang: when a look at every rank is due, what a verdict records."""
        self.deaths = DeathWatch(self.view, self.policy, self.load)
        """Which nodes are dead, and bursts of silence."""
        self.evictions = Evictions(self.policy)
        """Straggling nodes to exclude once their checkpoint is saved."""
        self.relay = relay or RelayConfig()
        self.groups = RelayGroups(node_id, self.view, self.relay, self.load)
        """Which relay each node syncs through."""
        self._encoded: tuple[int, list[pb.Decision]] = (0, [])
        self._stragglers_at = float("-inf")   # when the straggler detector last ran
        self._straggler_cost = 0.0   # how long its last pass took (monotonic seconds)

    def slowdown(self, rank: int) -> float | None:
        """A rank's slowdown while the job's detector flags it (None otherwise)."""
        return self.stragglers.slowdown(rank)

    def job_incidents(self) -> list[Incident]:
        """The incidents the nodes raised themselves (:meth:`JobView.job_incidents`), each rank
        exit linked to the job's root cause (:func:`.root_cause.job_roots`); this agent's own
        rank exits are updated to it in its log (and file)."""
        reported = self.view.job_incidents()
        roots = job_roots(reported, self.incidents.items, self.log.run_id)
        if not roots:
            return reported
        for i in [i for i in self.incidents.items if i.kind == "rank_exit" and i.id in roots]:
            if i.detail.get("root_cause") != roots[i.id]:
                self.incidents.update(i.id, root_cause=roots[i.id], consequence=roots[i.id] != i.id,
                                      root_cause_scope="job")
        return [replace(i, detail={**i.detail, "root_cause": roots[i.id], "consequence": roots[i.id] != i.id,
                                   "root_cause_scope": "job"}) if i.id in roots else i for i in reported]

    # -- intake ---------------------------------------------------------------
    def sync(self, summary: pb.NodeSummary,
             refused: Callable[[ValueError], None] = lambda _: None) -> pb.SyncReply:
        """Take one node's summary; reply with every decision and the node's job incidents
        (``refused`` is told of its rank claims left out: :mod:`.claims`)."""
        now = self.clock()
        self._take(summary, now, refused=refused)
        relay = self.groups.relay_of(summary)
        reply = pb.SyncReply(coordinator=self.node_id, sync_interval_seconds=self.load.reply_interval(),
                             relay=relay or "")
        reply.decisions.extend(self._decisions_pb())
        reply.incidents.extend(inc.to_pb() for inc in self.incidents.items_for(node=summary.node_id))
        return reply

    def sync_group(self, group: pb.GroupSummary,
                   refused: Callable[[ValueError], None] = lambda _: None) -> pb.GroupReply:
        """Take a relay's summaries (each as :meth:`sync` would) and beats; one reply for the group.

        A summary or beat that fails its checks is left out alone (``refused`` is told why,
        and the reply names its node); the others are kept.

        Raises:
            Rejected: more summaries (or absent nodes) than a group may carry, or a held time
                for each missing (:func:`check_group`).
        """
        check_group(group)
        now = self.clock()
        reply = pb.GroupReply(coordinator=self.node_id, sync_interval_seconds=self.load.reply_interval())
        names = set()
        for i, (summary, held) in enumerate(zip(group.nodes, group.held_seconds)):
            try:   # (the first is the relay's own)
                self._take(summary, now - held_for(held), relayed=i > 0, refused=refused)
            except ValueError as exc:
                reply.refused.append(summary.node_id[:256])
                refused(exc)
                continue
            names.add(summary.node_id)
        for beat in group.beats:
            try:
                self.view.beat(beat, now - held_for(beat.held_seconds))
            except ValueError as exc:   # the relay sends this node whole next time
                reply.refused.append(beat.node_id[:256])
                refused(exc)
                continue
            names.add(beat.node_id)
        if group.absent:
            self.groups.absent(group, names, now, refused)
        reply.decisions.extend(self._decisions_pb())
        reply.incidents.extend(inc.to_pb() for inc in self.incidents.items_for_nodes(names))
        relays = self.relays
        for name in names:
            reply.relays[name] = relays.get(name, "")
        return reply

    def _take(self, summary: pb.NodeSummary, at: float, relayed: bool = False,
              refused: Callable[[ValueError], None] = lambda _: None) -> None:
        """One node's summary, as of ``at`` on this clock (raises ValueError if refused whole;
        ``refused`` is told of the rank claims it makes that another node holds)."""
        conflicts = self.view.take(summary, at, relayed)
        if conflicts:
            refused(Rejected("rank_conflict", f"node {summary.node_id[:128]!r} claims ranks {conflicts[:8]} "
                                              "that other live nodes hold"))
        if summary.run_id:
            self.incidents.run_id = self.log.run_id = summary.run_id
        self._adopt(summary)

    def _decisions_pb(self) -> list[pb.Decision]:
        """Every decision, encoded once (the log only grows)."""
        count, encoded = self._encoded
        if count != len(self.log):
            items = self.log.items
            encoded = [d.to_pb() for d in items]
            self._encoded = (len(items), encoded)
        return encoded

    def _adopt(self, summary: pb.NodeSummary) -> None:
        """Take the decisions a node applied that this log lacks (an earlier coordinator's)."""
        sent = [Decision.from_pb(d) for d in summary.decisions[-_DECISIONS_ADOPTED:]
                if d.id and not self.log.knows(d.id) and d.kind in _DECISION_KINDS and d.generation >= 0]
        if not sent:
            return
        for d in self.log.adopt(sent):
            log.warning("decision %s (%s%s, generation %d) taken over from node %s's log", d.id, d.kind,
                        f" node {d.node}" if d.node else "", d.generation, summary.node_id)

    # -- decisions --------------------------------------------------------------
    @property
    def decisions(self) -> list[Decision]:
        return self.log.items

    @property
    def generation(self) -> int:
        return self.log.generation

    @property
    def excluded(self) -> dict[str, str]:
        """Excluded node -> why (the first exclusion's reason)."""
        return self.log.excluded

    @property
    def relays(self) -> dict[str, str]:
        """Node -> the relay it syncs through ('' or absent: this coordinator; :class:`RelayGroups`)."""
        return self.groups.relays

    def request_checkpoint(self, reason: str) -> Decision:
        """Decide the step every rank saves at: the fastest rank's step plus a lead."""
        with self.lock:
            ranks = [r for n in self.view.live_nodes() for r in n.summary.ranks if r.connected]
            if not ranks:
                raise LookupError("no rank is connected to any node of this job")
            checkpoints = [d for d in self.log.items if d.kind == "checkpoint"]
            step, new = checkpoint_due.save_step(
                max(r.step for r in ranks), max((r.step_seconds for r in ranks), default=0.0),
                self.policy.checkpoint_lead_seconds, pending=(d.step for d in checkpoints))
            if not new:  # a duplicate: the pending request already covers it
                return next(d for d in reversed(checkpoints) if d.step == step)
            return self._decide("checkpoint", step=step, reason=reason)

    def _decide(self, kind: str, *, node: str = "", step: int = 0, reason: str) -> Decision:
        d = self.log.decide(kind, now=self.clock(), node=node, step=step, reason=reason)
        log.warning("DECISION %s: %s%s%s (generation %d)", d.id, kind, f" node {node}" if node else "",
                    f" at step {step}" if kind == "checkpoint" else f" ({reason})", d.generation)
        return d

    def exclude(self, node: str, reason: str) -> Decision | None:
        """Exclude ``node`` and request a restart, unless the job would fall below its minimum."""
        with self.lock:
            excluded = self.excluded
            if node in excluded:
                return None
            remaining = self.view.remaining_without(node)
            if remaining < self.policy.min_nodes:
                if node not in self._refused:  # said once per node, not on every evaluation
                    self._refused.add(node)
                    log.warning("not excluding node %s (%s): %d node(s) would remain, below the "
                                "minimum of %d", node, reason, remaining, self.policy.min_nodes)
                return None
            d = self._decide("exclude", node=node, reason=reason)
        self.restarts.started(d)
        return d

    # -- evaluation -------------------------------------------------------------
    def evaluate(self) -> None:
        """Run the job-wide detectors and the policy once."""
        now = self.clock()
        excluded = self.excluded   # summaries are due from the nodes neither excluded nor dead
        self.load.measure(now, self.lock, lambda: [n.interval for name, n in self.nodes.items()
                                                   if name not in excluded and name not in self.dead])
        self._check_dead(now)
        reported = self.job_incidents()   # parsed from every node's summary: once a tick
        self._check_gpu(reported)
        self._check_hang(now)
        self._check_stragglers(now)
        for node, reason in self.evictions.due(lambda: reported + self.incidents.items):
            self.exclude(node, reason)
        self.restarts.check(now, reported)
        self.groups.update(now)

    def _check_hang(self, now: float) -> None:
        """Look for a job hang or the open one's end (:meth:`HangWatch.look`, which paces its
        passes); the policy excludes a new hang's culprit's node."""
        restarting = self.restarts.restarting(now, self.policy.restart_quiet_seconds)
        opened = self.hangs.look(now, self.snapshot, restarting=restarting, quiet_nodes=self.deaths.quiet)
        if opened is None:
            return
        hang, found = opened
        if self.policy.exclude_hung and self.exclude(found.node, f"hang: rank {found.rank} {found.verdict.reason}"):
            self.incidents.resolve(hang.id, self.clock())  # the restart takes over from here

    def _check_stragglers(self, now: float) -> None:
        """The straggler detector, once per sync interval (less often while overloaded:
        :func:`pacing.straggler_due`), over each node's latest whole summary, kept between
        runs (:meth:`JobView.straggler_work`); a costly straggler is evicted (:class:`Evictions`)."""
        if not pacing.straggler_due(now, self._stragglers_at, self.load.interval,
                                         self.load.overloaded is not None, self.load.cfg, self._straggler_cost):
            return
        self._stragglers_at, began = now, self._monotonic()
        flagged = self.stragglers.update(now, self.view.straggler_work(now))
        self._straggler_cost = self._monotonic() - began
        for f in flagged:
            self.evictions.plan(f.node, f.speedup, f.cause, self.excluded, self.request_checkpoint)

    def _check_dead(self, now: float) -> None:
        for name, why in self.deaths.check(now):
            log.warning("node %s is dead: %s", name, why)
            for x in self.deaths.lost_ranks(name, why, now):   # its ranks ended with it (node_lost.py)
                self.incidents.add(kind="rank_exit", node=name, rank=x.rank, step=x.step, detected_at=now,
                                   detail={**x.detail, "root_cause": None}, tag=self.node_id)
            if self.policy.exclude_dead:
                self.exclude(name, f"node dead: {why}")

    def _check_gpu(self, reported: list[Incident]) -> None:
        excluded = self.excluded
        faults = [(i.node, i.detail) for i in reported
                  if i.kind == "gpu_fault" and i.node not in excluded]
        fatal = [(name, d) for name, d in faults if d.get("action") in FATAL_ACTIONS]  # takes the node out
        for name, detail in fatal:
            if self.policy.exclude_gpu_fatal:
                self.exclude(name, f"fatal GPU fault on gpu {detail.get('gpu')}: "
                                   f"{detail.get('reason') or detail.get('action')}")
