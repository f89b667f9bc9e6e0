"""The job's coordinator: a global view built from node agents' summaries.

Every node agent sends its coordinator a compact summary a few times a
second (progress and recent own-work windows per rank, its own incidents, its
goodput accounting): never raw events, so the coordinator's cost grows with
the number of nodes, not with the number of records.  The coordinator

* runs the hang detector over every rank of the job, so a culprit on another
  node is named correctly (a node alone only sees its own ranks waiting);
* runs the straggler detector across nodes;
* calls a node dead when its ranks died or its agent went silent (:mod:`.node_death`);
* decides (the policy): exclude a dead node, a hung culprit's node or a node
  with a fatal GPU fault, and bump the restart generation, unless that would
  take the job below its minimum node count; checkpoint requests name the step
  every rank saves at;
* hands its decisions to every node in the sync reply.  Decisions are
  append-only and idempotent by id; the rendezvous handler writes them to the
  rendezvous store, where every node's torchrun reads them.  The log
  (:class:`DecisionLog`) is shared with this agent's link to the job, and every
  summary carries the decisions its node applied: a coordinator that takes over
  continues the log, its ids and the restart generation after them.

What the coordinator knows of the job (the nodes' summaries, on its clock) is
:class:`~rankwatch.agent.job.global_view.JobView`; this module holds the policy that reads it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rankwatch.agent.job import checkpoint_due as checkpoint_policy, pacing as load_policy, node_death
from rankwatch.agent.job.decisions import Decision, DecisionLog
from rankwatch.agent.detect.hang_end import end_possible, hang_end, steps_at
from rankwatch.agent.gpu.xid import FATAL_ACTIONS
from rankwatch.agent.detect.evaluate import Verdicts, evaluate
from rankwatch.agent.detect.hang_verdict import HangConfig, hang_possible
from rankwatch.agent.durable.incidents import Incident, IncidentLog
from rankwatch.agent.job.global_view import JobView
from rankwatch.agent.job.restartwatch import RestartWatch
from rankwatch.agent.job.pacing import LoadConfig
from rankwatch.agent.job.policy import PolicyConfig
from rankwatch.agent.job.loadmeter import LoadMeter
from rankwatch.agent.job.slow_nodes import JobStragglers
from rankwatch.agent.job import routing as relay_policy
from rankwatch.agent.job.relay import MAX_GROUP
from rankwatch.agent.job.routing import RelayConfig
from rankwatch.agent.wire.ranges import Rejected
from rankwatch.agent.detect.straggler import StragglerConfig
from rankwatch.proto import pb

__all__ = ["Coordinator", "PolicyConfig"]

log = logging.getLogger(__name__)

_DECISION_KINDS = ("exclude", "checkpoint")
_DECISIONS_ADOPTED = 256   # the most decisions taken from one summary
_MAX_HELD = 10.0   # seconds a relay may say it held a summary (more is taken as this)


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
        self._evictions: dict[str, tuple[int, str]] = {}   # node -> (checkpoint step, reason)
        self._open_hang: str | None = None   # the open job hang incident's id
        self._hang_steps: dict[tuple[str, int], int] = {}   # each rank's completed steps at the verdict
        self.load = LoadMeter(load or LoadConfig(), tick_seconds, self.policy.node_timeout_seconds,
                              refusals or (lambda: 0),
                              lambda n: node_death.burst_size(n, burst_share=self.policy.silent_burst_share,
                                                              burst_nodes=self.policy.silent_burst_nodes),
                              load_clocks)
        """Its own load, the interval nodes sync at, and when silence is no evidence."""
        self.view = JobView(self.log, self.load, self.policy.max_nodes)
        """The nodes' summaries, on this clock."""
        self.lock, self.nodes, self.dead = self.view.lock, self.view.nodes, self.view.dead
        self.snapshot, self.job_incidents = self.view.snapshot, self.view.job_incidents
        self.node_states, self.rank_summaries = self.view.node_states, self.view.rank_summaries
        self.restarts = RestartWatch(incidents, self.view)
        """The open restart incident, from an exclusion until the job trains again."""
        self._encoded: tuple[int, list[pb.Decision]] = (0, [])
        self._stragglers_at = float("-inf")   # when the straggler detector last ran
        self._straggler_cost = 0.0   # how long its last pass took (monotonic seconds)
        self._hang_checked = float("-inf")   # when an open hang was last checked for its end
        self._hang_pass = (float("-inf"), 0.0)   # the hang detector's last pass: (began, took), monotonic
        self._monotonic = load_clocks[0] if load_clocks else time.monotonic
        self.relay = relay or RelayConfig()
        self.relays: dict[str, str] = {}
        """Node -> the relay it syncs through ('' or absent: this coordinator; relay_policy)."""
        self._groups: dict[str, tuple[str, int]] = {}
        """Relay node -> (its address, its group's size): where a new node is placed."""
        self._relay_lock = threading.Lock()   # the assignment, the groups and placements
        self._relays_at = float("-inf")
        self._silent_burst = False   # many nodes silent together (said once per burst)
        self._quiet_count = 0   # nodes silent at the last evaluation
        self._hang_seen: tuple[int, int, int] | None = None   # _hang_changes() at the last look at an open hang
        self._silenced: dict[str, float] = {}   # node judged dead for its silence -> when (recent ones)

    # -- intake ---------------------------------------------------------------
    def sync(self, summary: pb.NodeSummary) -> pb.SyncReply:
        """Take one node's summary; reply with every decision and the node's job incidents."""
        now = self.clock()
        self._take(summary, now)
        relay = self.relays.get(summary.node_id)
        if relay is None and self._groups and summary.node_id != self.node_id:
            relay = self._place(summary)
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
                for each missing.
        """
        if len(group.nodes) + len(group.beats) > MAX_GROUP:
            raise Rejected("oversized", f"{len(group.nodes) + len(group.beats)} nodes in one group "
                                        f"(at most {MAX_GROUP})")
        if len(group.held_seconds) != len(group.nodes):
            raise Rejected("malformed", "a group needs one held time per summary")
        if len(group.absent) > MAX_GROUP:
            raise Rejected("oversized", f"{len(group.absent)} absent nodes in one group (at most {MAX_GROUP})")
        now = self.clock()
        reply = pb.GroupReply(coordinator=self.node_id, sync_interval_seconds=self.load.reply_interval())
        names = set()
        for i, (summary, held) in enumerate(zip(group.nodes, group.held_seconds)):
            try:   # (the first is the relay's own)
                self._take(summary, now - _held(held), relayed=i > 0)
            except ValueError as exc:
                reply.refused.append(summary.node_id[:256])
                refused(exc)
                continue
            names.add(summary.node_id)
        for beat in group.beats:
            try:
                self.view.beat(beat, now - _held(beat.held_seconds))
            except ValueError as exc:   # the relay sends this node whole next time
                reply.refused.append(beat.node_id[:256])
                refused(exc)
                continue
            names.add(beat.node_id)
        if group.absent:
            self._absent(group, names, now, refused)
        reply.decisions.extend(self._decisions_pb())
        reply.incidents.extend(inc.to_pb() for inc in self.incidents.items_for_nodes(names))
        relays = self.relays
        for name in names:
            reply.relays[name] = relays.get(name, "")
        return reply

    def _absent(self, group: pb.GroupSummary, taken: set[str], now: float,
                refused: Callable[[ValueError], None]) -> None:
        """A relay's word on the members of its group it has not heard lately
        (``load_policy.node_silent`` weighs it).  Taken only from the relay this coordinator
        sent each node to, and only for nodes the same call did not carry."""
        relay = group.nodes[0].node_id if group.nodes else ""
        with self._relay_lock:
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

    def _take(self, summary: pb.NodeSummary, at: float, relayed: bool = False) -> None:
        """One node's summary, as of ``at`` on this clock (raises ValueError if refused)."""
        self.view.take(summary, at, relayed)
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

    def request_checkpoint(self, reason: str) -> Decision:
        """Decide the step every rank saves at: the fastest rank's step plus a lead."""
        with self.lock:
            ranks = [r for n in self.view.live_nodes() for r in n.summary.ranks if r.connected]
            if not ranks:
                raise LookupError("no rank is connected to any node of this job")
            checkpoints = [d for d in self.log.items if d.kind == "checkpoint"]
            step, new = checkpoint_policy.save_step(
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
        # Snapshotting every rank is the costly part at thousands of ranks: only while a hang
        # is possible at all.  An open hang is checked for its end once per interval, and only
        # once something that can end it changed; a new one only when possible.  The straggler
        # detector (once per sync interval, less often while overloaded:
        # load_policy.straggler_due) reads its inputs from each node's latest whole summary,
        # kept between runs (JobView.straggler_work).
        # While an exclusion's restart is under way its workers are stopped, as a hang would
        # look, and :meth:`_check_hang` acts on nothing: no pass at all (at 16,384 ranks a
        # discarded pass a third of the time, for up to ``restart_quiet_seconds``, slowed the
        # syncs' calls).
        every = max(1.0, self.load.interval)
        if self._restarting(now):
            hang_due = False
        elif self._open_hang is None:
            hang_due = hang_possible(now, self.view.latest_progress(), self.hang)
        else:   # only once something that can end it changed (hangend.end_possible)
            hang_due = (now - self._hang_checked >= every
                        and end_possible(now, self._hang_changes(), self._hang_seen, self._hang_checked))
        began, took = self._hang_pass
        verdicts, seen = None, self._hang_changes()   # (as of the snapshot)
        if hang_due and load_policy.detector_due(self._monotonic(), began, took, self.load.cfg):
            began = self._monotonic()
            verdicts = evaluate(now, self.snapshot(now), self.hang)
            self._hang_pass = (began, self._monotonic() - began)
        if verdicts is not None and self._hang_evidence(now, verdicts):
            self._hang_checked = now
            self._check_hang(now, verdicts, seen)
        if load_policy.straggler_due(now, self._stragglers_at, self.load.interval,
                                     self.load.overloaded is not None, self.load.cfg, self._straggler_cost):
            self._stragglers_at, began = now, self._monotonic()
            flagged = self.stragglers.update(now, self.view.straggler_work(now))
            self._straggler_cost = self._monotonic() - began
            for f in flagged:
                self._plan_eviction(f.node, f.speedup, f.cause)
        self._check_evictions(reported)
        self.restarts.check(now, reported)
        # Nodes not in any group yet (a big job starting) are placed at the next tick.
        ungrouped = len(self.nodes) > self.relay.min_nodes and len(self.nodes) - 1 > len(self.relays)
        if ungrouped or now - self._relays_at >= self.relay.every_seconds:
            self._relays_at = now
            self._assign_relays(now)

    def _assign_relays(self, now: float) -> None:
        """Draw the relay groups again (:func:`relay_policy.assign`)."""
        with self.lock:
            excluded = self.excluded
            # (this coordinator's own node never syncs over the wire: it is in no group)
            nodes = [(name, n.summary.relay_address, name not in excluded and name not in self.dead
                      and not self.view.silent(n, now))
                     for name, n in self.nodes.items() if name != self.node_id]
        addresses = {name: addr for name, addr, _ in nodes}
        with self._relay_lock:
            relays = relay_policy.assign(nodes, self.relay, self.relays)
            if bool(relays) != bool(self.relays):
                log.warning("nodes now sync %s", f"through {sum(1 for a in relays.values() if not a)} relay(s)"
                            if relays else "with the coordinator directly")
            self.relays = relays
            self._groups = {r: (addresses[r], size)
                            for r, size in relay_policy.group_sizes(relays, addresses).items()}
        self.load.callers = relay_policy.callers(relays, len(nodes) + 1) if relays else None

    def _place(self, summary: pb.NodeSummary) -> str:
        """A node new to the coordinator (not its own), put in a group at its first sync
        (:func:`relay_policy.place`); the address of the relay it syncs through next, or ''."""
        name = summary.node_id
        eligible = bool(summary.relay_address) and name not in self.excluded and name not in self.dead
        with self._relay_lock:
            if name in self.relays or not self._groups:
                return self.relays.get(name, "")
            relay = relay_policy.place(name, eligible, {r: n for r, (_, n) in self._groups.items()}, self.relay)
            if relay is None:
                return ""
            addr, size = self._groups.get(relay, (summary.relay_address, 0))
            self._groups[relay] = (addr, size + 1)
            self.relays[name] = "" if relay == name else addr
            return self.relays[name]

    def _hang_evidence(self, now: float, verdicts: Verdicts) -> bool:
        """Whether this evaluation may open or close a hang: summaries that arrived late
        after the coordinator's own overload are no evidence, except a new verdict the ranks'
        own reports show (:func:`load_policy.hang_shown_by_reports`)."""
        if now >= self.load.quiet:
            return True
        found = verdicts.hang
        if self._open_hang is not None or found is None:
            return False
        v = found.verdict
        return load_policy.hang_shown_by_reports(now, self.load.quiet, v.reported_for, v.allowance, v.by_silence)

    def _hang_changes(self) -> tuple[int, int, int]:
        """What alone can end an open hang, counted (:func:`hangend.end_possible`)."""
        return self.view.moves, len(self.excluded), self._quiet_count

    def _restarting(self, now: float) -> bool:
        """An exclusion's restart is under way: no hang is opened or ended meanwhile."""
        return self.restarts.restarting(now, self.policy.restart_quiet_seconds)

    def _check_hang(self, now: float, verdicts: Verdicts, seen: tuple[int, int, int]) -> None:
        """``seen``: :meth:`_hang_changes` when the verdicts' snapshot was taken."""
        ranks = verdicts.snapshot.ranks
        if self._open_hang is not None:
            end = hang_end(ranks, self._hang_steps)
            self._hang_seen = seen
            if end is not None:
                log.info("job progress resumed after %s" if end == "resumed" else
                         "the job's ranks ended while %s was open", self._open_hang)
                self.incidents.resolve(self._open_hang, now, outcome=end)
                self._open_hang = None
                self._hang_seen = None
            return
        found = verdicts.hang
        if found is None:
            return
        hang = self.incidents.add(kind="hang", node=found.node, rank=found.rank, step=found.step,
                                  detected_at=now, detail=found.detail)
        self._open_hang = hang.id
        self._hang_steps = steps_at(ranks)
        self._hang_seen = seen
        self._on_incident(hang)
        v = found.verdict
        log.warning("JOB HANG: rank %d on node %s %s; others wait in %s%s", found.rank, found.node,
                    v.reason, v.collective, f" (named while overloaded: the heard ranks reported themselves "
                                            f"stalled {v.reported_for:.1f}s)" if now < self.load.quiet else "")
        if self.policy.exclude_hung and self.exclude(found.node, f"hang: rank {found.rank} {v.reason}"):
            self.incidents.resolve(hang.id, self.clock())  # the restart takes over from here

    def _check_dead(self, now: float) -> None:
        with self.lock:
            excluded = self.excluded
            included = [(name, n) for name, n in self.nodes.items() if name not in excluded]
            quiet = {name for name, n in included if self.view.silent(n, now)}
            self._quiet_count = len(quiet)
            # Nodes excluded for their silence lately count with those silent now: a burst
            # whose nodes fall silent one evaluation apart is still one burst.
            window = self.policy.silent_burst_seconds
            self._silenced = {k: t for k, t in self._silenced.items() if now - t < window and k in self.nodes}
            gone = [k for k in self._silenced if k in excluded]
            counts = node_death.silence_is_evidence(len(quiet) + len(gone), len(included) + len(gone),
                                                    burst_share=self.policy.silent_burst_share,
                                                    burst_nodes=self.policy.silent_burst_nodes)
            dead = []
            for name, n in included:
                if name in self.dead:
                    continue
                why, n.ranks_dead_since = node_death.judge(
                    now, silent=name in quiet, silence_counts=counts,
                    ranks_died=n.ranks_died, died_since=n.ranks_dead_since,
                    grace=self.policy.crashed_grace_seconds)
                if why is not None:
                    if name in quiet and now < self.load.quiet and n.witness is not None:   # (load_policy.node_silent)
                        why += f" (its relay had not heard it for {n.witness[1] - n.witness[0]:.1f}s)"
                    dead.append((name, why))
                    if name in quiet and counts:
                        self._silenced[name] = now
            for name, _ in dead:
                self.dead.add(name)
        burst = len(quiet) + len(gone) > 1 and not counts
        if burst != self._silent_burst:
            self._silent_burst = burst
            if burst:
                log.warning("%d of %d nodes went silent together (%d of them already excluded): taken for "
                            "the coordinator's or the network's trouble, not for that many dead nodes; none "
                            "is excluded for its silence while this lasts", len(quiet) + len(gone),
                            len(included) + len(gone), len(gone))
            else:
                log.info("the burst of silent nodes is over")
        for name, why in dead:
            log.warning("node %s is dead: %s", name, why)
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

    def _plan_eviction(self, node: str, speedup: float, cause: str) -> None:
        """A costly straggling node: checkpoint now, exclude it once that checkpoint is complete."""
        if (not checkpoint_policy.wants_eviction(speedup, self.policy.evict_straggler_speedup)
                or node in self._evictions or node in self.excluded):
            return
        reason = f"straggler: the job would step {speedup:.2f}x faster without node {node} ({cause})"
        try:
            d = self.request_checkpoint(f"before evicting {node}")
        except LookupError:
            return
        self._evictions[node] = (d.step, reason)
        log.warning("%s; evicting it after the checkpoint at step %d", reason, d.step)

    def _check_evictions(self, reported: list[Incident]) -> None:
        if not self._evictions:
            return
        saved = [i.step for i in reported + self.incidents.items
                 if i.kind == "checkpoint" and i.detail.get("ok")]
        for node in checkpoint_policy.evictions_due({n: step for n, (step, _) in self._evictions.items()}, saved):
            _, reason = self._evictions.pop(node)
            self.exclude(node, reason)


def _held(seconds: float) -> float:
    """A relay's word for how long it held a summary: within [0, _MAX_HELD]; NaN as the most."""
    return min(max(seconds, 0.0), _MAX_HELD) if seconds == seconds else _MAX_HELD
