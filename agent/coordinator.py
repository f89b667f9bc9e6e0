"""The job's coordinator: a global view built from node agents' summaries.

Every node agent sends its coordinator a compact summary a few times a
second (progress and recent own-work windows per rank, its own incidents, its
goodput accounting): never raw events, so the coordinator's cost grows with
the number of nodes, not with the number of records.  The coordinator

* runs the hang detector over every rank of the job, so a culprit on another
  node is named correctly (a node alone only sees its own ranks waiting);
* runs the straggler detector across nodes;
* calls a node dead when its ranks died or its agent went silent;
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

Times in summaries are the sending node's clock; they are moved onto the
coordinator's clock by the offset seen when the summary arrives.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable

from rankwatch.agent import checkpoint_policy, recoveries, validate
from rankwatch.agent.decisions import Decision, DecisionLog
from rankwatch.agent.hangend import hang_end, steps_at
from rankwatch.agent.gpu.xid import FATAL_ACTIONS
from rankwatch.agent.evaluate import STACKS_FRESH_SECONDS, Snapshot, Verdicts, evaluate, straggler_detail
from rankwatch.agent.hang import HangConfig, RankProgress, hang_possible
from rankwatch.agent.incidents import Incident, IncidentLog
from rankwatch.agent.load_policy import LoadConfig
from rankwatch.agent.loadmeter import LoadMeter
from rankwatch.agent.membership import agentless_nodes
from rankwatch.agent.validate import Rejected, parse_flight_recorder
from rankwatch.agent.straggler import RankWork, StragglerConfig, StragglerDetector
from rankwatch.proto import pb

__all__ = ["Coordinator", "PolicyConfig"]

log = logging.getLogger(__name__)

_DECISION_KINDS = ("exclude", "checkpoint")
_DECISIONS_ADOPTED = 256   # the most decisions taken from one summary


@dataclass(kw_only=True)
class PolicyConfig:
    min_nodes: int = 1
    """Never exclude a node if fewer than this many would remain (torchrun's --nnodes MIN)."""
    node_timeout_seconds: float = 3.0
    """A node whose agent has not synced for this long is silent."""
    exclude_hung: bool = True
    exclude_dead: bool = True
    exclude_gpu_fatal: bool = True
    checkpoint_lead_seconds: float = 2.0
    """A requested checkpoint's step is at least this far ahead of the fastest rank."""
    evict_straggler_speedup: float = 1.25
    """Evict a straggling node at the next checkpoint when the job would step this much
    faster without it (``inf`` never evicts)."""
    restart_quiet_seconds: float = 120.0
    """After an exclusion, no new hang is called for this long or until every node trains
    again: the restart itself stops every rank (its time counts as ``restart`` in goodput)."""
    max_nodes: int = 65536
    """The most node ids the coordinator keeps (a bound on what Sync callers can make it hold)."""
    crashed_grace_seconds: float = 15.0
    """A node whose agent is alive but whose ranks all died is dead only if no rank has come
    back for this long: torchrun restarts workers itself, and every restart (ours included)
    kills all of a node's ranks for a few seconds."""

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ValueError("PolicyConfig.min_nodes must be at least 1")
        if not self.node_timeout_seconds > 0 or not self.checkpoint_lead_seconds > 0:
            raise ValueError("PolicyConfig timeouts must be positive")


@dataclass
class _Node:
    summary: pb.NodeSummary
    received_at: float
    offset: float           # coordinator clock - node clock (plus transit)
    ranks_dead_since: float | None = None
    interval: float = 0.25  # how often the node was last told to sync
    best_offset: float = float("inf")   # its smallest offset: clock skew plus the fastest transit
    latest_progress: float = float("-inf")   # its ranks' latest progress, on the coordinator's clock
    syncs: int = 1          # summaries this coordinator heard from it


@dataclass
class _Restart:
    incident: str
    """The ``restart`` incident's id."""
    started_at: float
    steps_before: dict[str, int] = field(default_factory=dict)
    pids_before: set[int] = field(default_factory=set)
    """The workers connected at the decision: the restart replaces them."""
    node: str = ""
    """The excluded node."""


class Coordinator:
    """Args:
        node_id: the coordinator's own node.
        incidents: the coordinator agent's incident log (job-level incidents go there).
        decisions: the agent's decision log (default: a new one in memory).
        clock: injected for tests.
    """

    def __init__(self, node_id: str, *, incidents: IncidentLog, decisions: DecisionLog | None = None,
                 hang: HangConfig | None = None, straggler: StragglerConfig | None = None,
                 policy: PolicyConfig | None = None, clock=time.time,
                 on_incident: Callable[[Incident], None] | None = None, load: LoadConfig | None = None,
                 tick_seconds: float = 0.25, refusals: Callable[[], int] | None = None) -> None:
        self.node_id = node_id
        self.tick_seconds = tick_seconds
        """How often the agent calls :meth:`evaluate`."""
        self.incidents = incidents
        self.hang = hang or HangConfig()
        self.policy = policy or PolicyConfig()
        self.clock = clock
        self.lock = threading.Lock()
        self.nodes: dict[str, _Node] = {}
        self.log = decisions if decisions is not None else DecisionLog()
        self.dead: set[str] = set()
        self._straggler_cfg = straggler or StragglerConfig()
        self._stragglers = StragglerDetector(self._straggler_cfg)
        self._open_stragglers: dict[int, str] = {}   # flagged rank -> its open incident's id
        self._on_incident = on_incident or (lambda _: None)
        self._refused: set[str] = set()
        self._evictions: dict[str, tuple[int, str]] = {}   # node -> (checkpoint step, reason)
        self._evaluated_steps = 0
        self._open_hang: str | None = None   # the open job hang incident's id
        self._hang_steps: dict[tuple[str, int], int] = {}   # each rank's completed steps at the verdict
        self._restart: _Restart | None = None
        self._flagged: set[tuple[str, int]] = set()
        self.load = LoadMeter(load or LoadConfig(), tick_seconds, self.policy.node_timeout_seconds,
                              refusals or (lambda: 0))
        """Its own load, the interval nodes sync at, and when silence is no evidence."""
        self._encoded: tuple[int, list[pb.Decision]] = (0, [])
        self._stragglers_at = float("-inf")   # when the straggler detector last ran
        self._hang_checked = float("-inf")   # when an open hang was last checked for its end

    # -- intake ---------------------------------------------------------------
    def sync(self, summary: pb.NodeSummary) -> pb.SyncReply:
        """Take one node's summary; reply with every decision and the node's job incidents."""
        now = self.clock()
        if not summary.node_id:
            raise ValueError("summary without node_id")
        validate.check_summary(summary)  # raises Rejected (a ValueError): nothing of it is kept
        with self.lock:
            prev = self.nodes.get(summary.node_id)
            if prev is None and len(self.nodes) >= self.policy.max_nodes:
                raise Rejected("too_many_nodes", f"{summary.node_id!r}: the coordinator keeps "
                                                 f"{self.policy.max_nodes} nodes already")
            # A lower seq with a later clock is the node's agent restarted, not a replay.
            if (prev is not None and summary.seq <= prev.summary.seq
                    and summary.sent_at <= prev.summary.sent_at):
                raise ValueError(f"stale summary {summary.seq} from {summary.node_id} "
                                 f"(have {prev.summary.seq})")
            offset = now - summary.sent_at
            best = min(offset, prev.best_offset if prev else offset)
            self.load.heard(offset - best, len(self.nodes) + (summary.node_id not in self.nodes))
            latest = max((r.progress_at for r in summary.ranks if not r.exited_cleanly), default=float("-inf"))
            self.nodes[summary.node_id] = _Node(summary, now, offset, prev.ranks_dead_since if prev else None,
                                                interval=self.load.reply_interval(), best_offset=best,
                                                latest_progress=latest + offset,
                                                syncs=prev.syncs + 1 if prev else 1)
            if summary.node_id in self.dead and any(r.connected for r in summary.ranks):
                self.dead.discard(summary.node_id)
        if summary.run_id:
            self.incidents.run_id = self.log.run_id = summary.run_id
        self._adopt(summary)
        reply = pb.SyncReply(coordinator=self.node_id, sync_interval_seconds=self.load.reply_interval())
        reply.decisions.extend(self._decisions_pb())
        reply.incidents.extend(inc.to_pb() for inc in self.incidents.items_for(node=summary.node_id))
        return reply

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
        out: dict[str, str] = {}
        for d in self.log.items:
            if d.kind == "exclude":
                out.setdefault(d.node, d.reason)
        return out

    def request_checkpoint(self, reason: str) -> Decision:
        """Decide the step every rank saves at: the fastest rank's step plus a lead."""
        with self.lock:
            ranks = [r for n in self._live_nodes() for r in n.summary.ranks if r.connected]
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
            remaining = len([n for n in self.nodes if n not in excluded and n != node])
            remaining += agentless_nodes(
                ((name, r.world_rank if r.HasField("world_rank") else r.rank, r.world_size)
                 for name, n in self.nodes.items() for r in n.summary.ranks if r.connected),
                rankless_nodes=sum(1 for name, n in self.nodes.items() if name not in excluded and name != node
                                   and not any(r.connected for r in n.summary.ranks)))
            if remaining < self.policy.min_nodes:
                if node not in self._refused:  # said once per node, not on every evaluation
                    self._refused.add(node)
                    log.warning("not excluding node %s (%s): %d node(s) would remain, below the "
                                "minimum of %d", node, reason, remaining, self.policy.min_nodes)
                return None
            d = self._decide("exclude", node=node, reason=reason)
            steps = {n: max((r.step for r in v.summary.ranks), default=-1)
                     for n, v in self.nodes.items()}
            pids = {r.pid for v in self.nodes.values() for r in v.summary.ranks if r.connected}
        inc = self.incidents.add(kind="restart", node=node, rank=-1, step=max(steps.values(), default=-1),
                                 detected_at=d.decided_at,
                                 detail={"generation": d.generation, "excluded": node,
                                         "reason": reason, "decision": d.id,
                                         "started_at": d.decided_at})
        with self.lock:
            prev = self._restart
            self._restart = _Restart(inc.id, d.decided_at, steps, pids, node)
        if prev is not None:  # superseded before it recovered: it lasted until this one
            self.incidents.resolve(prev.incident, d.decided_at, superseded_by=d.id,
                                   recovered_after_seconds=round(d.decided_at - prev.started_at, 3))
        return d

    # -- evaluation -------------------------------------------------------------
    def evaluate(self) -> None:
        """Run the job-wide detectors and the policy once."""
        now = self.clock()
        self.load.measure(now, self.lock, lambda: [n.interval for n in self.nodes.values()])
        self._check_dead(now)
        self._check_gpu(now)
        # Snapshotting every rank is the costly part at thousands of ranks: only while a hang
        # is possible at all, or the straggler detector is due (once per sync interval).
        # An open hang is checked for its end once per interval; a new one only when possible.
        every = max(1.0, self.load.interval)
        if self._open_hang is None:
            hang_due = hang_possible(now, self._latest_progress(), self.hang)
        else:
            hang_due = now - self._hang_checked >= every
        stragglers_due = now - self._stragglers_at >= every
        verdicts = evaluate(now, self.snapshot(now), self.hang) if hang_due or stragglers_due else None
        if verdicts is not None and hang_due and now >= self.load.quiet:
            # (stale summaries after the coordinator's own stall are no evidence)
            self._hang_checked = now
            self._check_hang(now, verdicts)
        if verdicts is not None and stragglers_due:
            self._stragglers_at = now
            self._check_stragglers(now, verdicts.work)
        self._check_evictions()
        self._check_recovered(now)

    def _latest_progress(self) -> float:
        """The latest progress of any included rank, on this clock (-inf: none yet)."""
        with self.lock:
            return max((n.latest_progress for name, n in self.nodes.items() if name not in self.excluded),
                       default=float("-inf"))

    def _silent(self, n: _Node, now: float) -> bool:
        return self.load.silent(now, n.received_at, n.interval, n.syncs)

    def _live_nodes(self) -> list[_Node]:
        excluded = self.excluded
        return [n for name, n in self.nodes.items() if name not in excluded]

    def snapshot(self, now: float) -> Snapshot:
        """Every included rank on the coordinator's clock, as :func:`evaluate` reads it.

        Summaries are replaced whole on each sync, never changed, so the windows are
        referenced here rather than copied, and the lock is held only to collect them.
        """
        with self.lock:
            nodes = [(name, n, self._silent(n, now)) for name, n in self.nodes.items()
                     if name not in self.excluded]
            names = tuple(self.nodes)
        out = []
        for name, n, silent_node in nodes:
            for r in n.summary.ranks:
                fresh = now - (r.stacks_at + n.offset) < STACKS_FRESH_SECONDS
                out.append(RankProgress(
                    rank=r.rank, node=name, step=r.step, step_seconds=r.step_seconds,
                    steps_completed=r.steps_completed, activity=r.activity or "train",
                    progress_at=r.progress_at + n.offset,
                    # A node's report is its ranks' state as of its sending: between syncs (slow
                    # under backpressure), a rank it saw is not silent for the coordinator either.
                    last_seen=min(r.last_seen + n.offset, n.received_at) if silent_node
                    else r.last_seen + n.offset + (now - n.received_at),
                    connected=r.connected and not silent_node, exited_cleanly=r.exited_cleanly,
                    group_seqs=dict(r.group_seqs),
                    inflight=({"op": r.inflight.op, "group": r.inflight.group,
                               "seq": r.inflight.seq, "since": r.inflight.since + n.offset}
                              if r.HasField("inflight") else None),
                    stacks=r.stacks if r.stacks and fresh else None,
                    flight_recorder=_flight_recorder(r), pid=r.pid, alive=r.alive, stopped=r.stopped,
                    own=r.own_work, data=r.data_wait, wait=r.comm_wait))
        return Snapshot(ranks=out, scope="job", nodes=names,
                        silent_nodes=frozenset(name for name, _, silent in nodes if silent))

    def _check_hang(self, now: float, verdicts: Verdicts) -> None:
        r = self._restart
        if r is not None and now - r.started_at < self.policy.restart_quiet_seconds:
            return  # the workers are being restarted
        ranks = verdicts.snapshot.ranks
        if self._open_hang is not None:
            end = hang_end(ranks, self._hang_steps)
            if end is not None:
                log.info("job progress resumed after %s" if end == "resumed" else
                         "the job's ranks ended while %s was open", self._open_hang)
                self.incidents.resolve(self._open_hang, now, outcome=end)
                self._open_hang = None
            return
        found = verdicts.hang
        if found is None:
            return
        hang = self.incidents.add(kind="hang", node=found.node, rank=found.rank, step=found.step,
                                  detected_at=now, detail=found.detail)
        self._open_hang = hang.id
        self._hang_steps = steps_at(ranks)
        self._on_incident(hang)
        v = found.verdict
        log.warning("JOB HANG: rank %d on node %s %s; others wait in %s", found.rank, found.node,
                    v.reason, v.collective)
        if self.policy.exclude_hung and self.exclude(found.node, f"hang: rank {found.rank} {v.reason}"):
            self.incidents.resolve(hang.id, self.clock())  # the restart takes over from here

    def _check_dead(self, now: float) -> None:
        with self.lock:
            dead = []
            for name, n in self.nodes.items():
                if name in self.excluded or name in self.dead:
                    continue
                ranks = n.summary.ranks
                silent = self._silent(n, now)
                all_died = bool(ranks) and all(not r.connected and not r.exited_cleanly and not r.alive
                                               for r in ranks)
                if not all_died:
                    n.ranks_dead_since = None
                elif n.ranks_dead_since is None:
                    n.ranks_dead_since = now
                crashed = (all_died and n.ranks_dead_since is not None
                           and now - n.ranks_dead_since >= self.policy.crashed_grace_seconds)
                others_live = any(not self._silent(m, now) for k, m in self.nodes.items() if k != name)
                if crashed or (silent and others_live):
                    dead.append((name, "its agent went silent" if silent else "all its ranks died"))
            for name, _ in dead:
                self.dead.add(name)
        for name, why in dead:
            log.warning("node %s is dead: %s", name, why)
            if self.policy.exclude_dead:
                self.exclude(name, f"node dead: {why}")

    def _check_gpu(self, now: float) -> None:
        excluded = self.excluded
        faults = [(i.node, i.detail) for i in self.job_incidents()
                  if i.kind == "gpu_fault" and i.node not in excluded]
        fatal = [(name, d) for name, d in faults if d.get("action") in FATAL_ACTIONS]  # takes the node out
        for name, detail in fatal:
            if self.policy.exclude_gpu_fatal:
                self.exclude(name, f"fatal GPU fault on gpu {detail.get('gpu')}: "
                                   f"{detail.get('reason') or detail.get('action')}")

    def _check_stragglers(self, now: float, work: list[RankWork]) -> None:
        if len(work) < 2 or len({w.node for w in work}) < 2:
            return  # one node: its own agent decides
        per_node: dict[str, int] = {}
        for w in work:
            per_node[w.node] = per_node.get(w.node, 0) + 1
        done = min(w.completed for w in work)
        if done <= self._evaluated_steps:
            return
        self._evaluated_steps = done
        for ev in self._stragglers.update(work, done):
            if ev.kind == "cleared":
                self._resolve_straggler(ev.score.rank, now)
                continue
            # A node's own agent compares its ranks with each other; the coordinator adds
            # what no node can see alone: a whole slow node, or a node's only rank.
            if ev.scope != "node" and per_node[ev.work.node] > 1:
                continue
            inc = self.incidents.add(kind="straggler", node=ev.work.node, rank=ev.score.rank,
                                     step=ev.work.step, detected_at=now,
                                     detail=straggler_detail(ev, self._straggler_cfg.window, "job"))
            for rank in ev.ranks or [ev.score.rank]:
                self._open_stragglers[rank] = inc.id
            self._on_incident(inc)
            self._plan_eviction(ev.work.node, ev.score.speedup, ev.score.cause)

    def _resolve_straggler(self, rank: int, now: float) -> None:
        """A rank's flag is lifted; its incident is resolved once none of its ranks is flagged.
        The resolved incident reaches the node with the next sync, which unmarks its ranks."""
        inc = self._open_stragglers.pop(rank, None)
        if inc is None or inc in self._open_stragglers.values():
            return
        resolved = self.incidents.resolve(inc, now)
        if resolved is not None:
            log.info("job straggler %s resolved", inc)
            self._on_incident(resolved)

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

    def _check_evictions(self) -> None:
        if not self._evictions:
            return
        saved = [i.step for i in self.job_incidents() + self.incidents.items
                 if i.kind == "checkpoint" and i.detail.get("ok")]
        for node in checkpoint_policy.evictions_due({n: step for n, (step, _) in self._evictions.items()}, saved):
            _, reason = self._evictions.pop(node)
            self.exclude(node, reason)

    def _check_recovered(self, now: float) -> None:
        """Close a restart once every included node has a new worker that completed a step after it.

        The workers connected at the decision do not count: they still step until the
        restart stops them.
        """
        r = self._restart
        if r is None:
            return
        in_process = recoveries.handled_at(r.node, r.started_at, self.job_incidents())
        if in_process is not None:  # the survivors left the node out in their own processes
            after = round(max(0.0, in_process - r.started_at), 3)
            self.incidents.resolve(r.incident, now, recovered_after_seconds=after, answered_in_process=True)
            log.info("job back to training %.1fs after %s, in process", after, r.incident)
            self._restart = None
            return
        with self.lock:
            nodes = self._live_nodes()
            back = bool(nodes) and all(
                any(x.connected and x.pid not in r.pids_before and x.steps_completed > 0
                    and x.progress_at + n.offset > r.started_at for x in n.summary.ranks)
                for n in nodes)
        if back:
            self.incidents.resolve(r.incident, now, recovered_after_seconds=round(now - r.started_at, 3))
            log.info("job back to training %.1fs after %s", now - r.started_at, r.incident)
            self._restart = None

    # -- views ------------------------------------------------------------------
    def job_incidents(self) -> list[Incident]:
        """Incidents the nodes raised themselves (gpu_fault, checkpoint, rank_exit), on this clock.

        A node speaks for itself only: an incident naming another node is left out, as is
        one that does not parse (logged); a node's bad record never stops the coordinator.
        """
        with self.lock:
            sent = [(i, n.offset) for name, n in self.nodes.items() for i in n.summary.incidents
                    if i.node == name]
        out = []
        for i, offset in sent:
            try:
                out.append(Incident.from_pb(i, clock_offset=offset))
            except ValueError as exc:
                log.debug("node incident %s left out: %s", i.id, exc)
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


def _flight_recorder(r: pb.RankSummary) -> dict | None:
    """A node's rank's Flight Recorder extract; a malformed one is left out of the evidence."""
    try:
        return parse_flight_recorder(r.flight_recorder)
    except ValueError as exc:
        log.debug("rank %d: flight_recorder left out: %s", r.rank, exc)
        return None


