"""The node's own detectors, run over its ranks: hang, straggler, rank exit.

:class:`NodeWatch` holds what the detectors remember between ticks (the open
hang, the straggler detector's windows, broken streams under watch) and turns
their verdicts into incidents and rank states.  What is a hang, and what its
incident says, is decided in :mod:`rankwatch.agent.detect.evaluate` (shared with the
coordinator); how a rank's state changes, in :mod:`rankwatch.agent.node.transitions`.
The agent's loop (:meth:`Agent._detect_loop`) only sequences the ticks.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rankwatch.agent.detect.evaluate import evaluate, straggler_detail
from rankwatch.agent.detect.hang_verdict import HangConfig
from rankwatch.agent.detect.hang_end import hang_end, steps_at
from rankwatch.agent.durable.incidents import Incident, IncidentLog
from rankwatch.agent.detect.root_cause import exit_view, root_causes
from rankwatch.agent.node.exit_cause import HOWS, classify
from rankwatch.agent.node.exit_evidence import ExitEvidence, KernelLog
from rankwatch.agent.node.rankexit import BrokenStream, ExitConfig, ExitWatch, exit_detail
from rankwatch.agent.node.transitions import next_state
from rankwatch.agent.node.starvation import StarvationTracker
from rankwatch.agent.node.intake import NodeState, RankState, _pid_alive
from rankwatch.agent.node.arrivals import Arrivals
from rankwatch.agent.node.rank_snapshot import process_state, snapshot
from rankwatch.agent.node.stepstarts import StepStarts
from rankwatch.agent.detect.straggler import StragglerConfig, StragglerDetector, period_of, score
from rankwatch.agent.detect.work_scores import CAUSES
from rankwatch.agent.wire.ranges import MAX_DURATION

__all__ = ["NodeWatch", "process_state", "snapshot"]

log = logging.getLogger(__name__)

_FORGET_AFTER = 5.0   # seconds a gone worker of an earlier generation is kept


class NodeWatch:
    """Args:
        state: the node's ranks.
        incidents: where verdicts are recorded.
        gpu_throttle: a rank's active GPU slowdown reasons (for the straggler cause).
    """

    def __init__(self, state: NodeState, incidents: IncidentLog, *, hang: HangConfig,
                 straggler: StragglerConfig, exits: ExitConfig,
                 gpu_throttle: Callable[[int], list[str]]) -> None:
        self.state = state
        self.incidents = incidents
        self.hang = hang
        self.straggler = straggler
        self._gpu_throttle = gpu_throttle
        self._open_hang: Incident | None = None
        self._hang_steps: dict[tuple[str, int], int] = {}   # each rank's completed steps at the verdict
        self._exits = ExitWatch(exits)
        self.exit_evidence = ExitEvidence(KernelLog())
        """How its workers ended: exit records, fault files, OOM counts, torchrun's reports."""
        self.exit_counts = dict.fromkeys(HOWS, 0)
        """Rank exits recorded, by how they ended (a counter, for /metrics)."""
        self._exit_pids: deque[int] = deque(maxlen=1024)   # pids a rank_exit was recorded for
        self.stragglers = StragglerDetector(straggler, gpu_throttle=gpu_throttle)
        self._starvation = StarvationTracker()
        self._step_starts = StepStarts()
        state.step_listeners.append(self._step_starts.on_steps)
        self._arrivals = Arrivals()   # who the node's ranks wait for in their collectives
        state.step_listeners.append(self._arrivals.on_steps)
        state.collective_listeners.append(self._arrivals.on_collectives)
        self._evaluated_steps = 0
        self._local_view: tuple[dict[int, str], float] = ({}, 1.0)   # this node's own detector's
        self._marked_at: dict[int, float] = {}   # rank -> when a job verdict marked it hung
        # Ranks the coordinator flags as stragglers: (cause, the job's speed-up without them).
        self._job_stragglers: dict[int, tuple[str, float]] = {}

    def step_period(self, rank: int, step_seconds: float) -> float:
        """The rank's step time from start to start (its summary carries it to the coordinator,
        whose straggler hold is counted in it; :func:`.straggler.period_of`), within the
        coordinator's range for a duration (a job paused for days must not void the summary)."""
        return min(period_of(self._step_starts.latest(rank), step_seconds, self.straggler.window), MAX_DURATION)

    # -- hang -------------------------------------------------------------------
    def check_hang(self, now: float) -> Incident | None:
        """Run the hang detector once over the node; record a ``hang`` incident per stall,
        and how an open one ended (:func:`hang_end`: resumed, or the ranks are gone)."""
        snap = snapshot(self.state, now)
        if self._open_hang is not None:
            end = hang_end(snap.ranks, self._hang_steps)
            if end is not None:
                log.info("progress resumed after hang %s" if end == "resumed" else
                         "the job's ranks ended while hang %s was open", self._open_hang.id)
                self.incidents.resolve(self._open_hang.id, now, outcome=end)
                if end == "resumed":
                    self._set_all("progressed")
                self._open_hang = None
            return None
        found = evaluate(now, snap, self.hang).hang
        if found is None:
            return None
        st = self.state
        with st.lock:
            r = st.ranks.get(found.rank)
            if r is not None:
                r.state = next_state(r.state, "hang")
        self._open_hang = self.incidents.add(kind="hang", node=found.node, rank=found.rank,
                                             step=found.step, detected_at=now, detail=found.detail)
        self._hang_steps = steps_at(snap.ranks)
        v, d = found.verdict, found.detail
        log.warning("HANG: rank %d (pid %d, %s) %s; stalled %.1fs (allowance %.1fs); "
                    "others wait in %s", found.rank, v.culprit.pid,
                    "stopped" if d["stopped"] else "alive" if d["alive"] else "gone", v.reason,
                    v.stalled_for, v.allowance, v.collective)
        return self._open_hang

    def _set_all(self, event: str) -> None:
        with self.state.lock:
            for r in self.state.ranks.values():
                r.state = next_state(r.state, event)  # type: ignore[arg-type]

    # -- rank exits -------------------------------------------------------------
    def stream_broke(self, rank: RankState, error: str, said_goodbye: bool = False) -> None:
        """Keep what the agent knew of a rank whose stream broke (or closed after its exit
        record said it dies), for :meth:`check_exits`."""
        with self.state.lock:
            broken = BrokenStream(
                rank=rank.rank, node=rank.node, pid=rank.pid, stream=rank.stream, step=rank.step,
                activity=rank.activity, last_seen=rank.last_seen, ended_at=self.state.clock(),
                error=error, inflight=dict(rank.inflight) if rank.inflight else None,
                said_goodbye=said_goodbye)
        self._exits.broke(broken)

    def check_exits(self, now: float, restarts: Iterable[float] = (), final: bool = False) -> list[Incident]:
        """Judge each broken stream once more; record a ``rank_exit`` incident per dead rank.

        ``restarts``: when restarts were decided (a restart's exits are not news).  ``final``:
        the agent stops; a gone rank's exit waits for no more evidence.
        """
        st = self.state
        with st.lock:
            streaming = {r.pid: r.stream for r in st.ranks.values() if r.connected}
        evidence = self.exit_evidence
        exited = self._exits.review(now, alive=lambda pid: process_state(pid)[0], streaming=streaming,
                                    restarts=restarts, settled=lambda b: final or evidence.settled(b.stream, b.pid))
        made = []
        for b in exited:
            with st.lock:
                r = st.ranks.get(b.rank)
                if r is not None and r.stream == b.stream:
                    r.state = next_state(r.state, "exited")
            found = evidence.gather(b.stream, b.pid)
            rec = found["record"] or {}
            step = rec["step"] if rec.get("step", -1) >= 0 else b.step
            ended = min(b.ended_at, rec["at"]) if rec.get("at", 0) > b.ended_at - 3600 else b.ended_at
            made.append(self._record_exit(now, b.node, b.rank, step, b.pid, {
                **exit_detail(b, now), **classify(**found), "started_at": ended,
                "last_collective": b.inflight}))
        made += self._torchrun_only(now, streaming)
        if made:
            self._assign_roots()
        return made

    def _record_exit(self, now: float, node: str, rank: int, step: int, pid: int,
                     detail: dict[str, Any]) -> Incident:
        self._exit_pids.append(pid)
        self.exit_counts[detail["how"]] = self.exit_counts.get(detail["how"], 0) + 1
        incident = self.incidents.add(kind="rank_exit", node=node, rank=rank, step=step, detected_at=now,
                                      detail={**detail, "root_cause": None}, tag=node)   # set next (_assign_roots)
        log.warning("RANK EXIT: rank %d (pid %d) at step %d: %s", rank, pid, step, detail["reason"])
        return incident

    def _torchrun_only(self, now: float, streaming: Mapping[int, int]) -> list[Incident]:
        """Workers only torchrun saw end (uninstrumented, or closed cleanly then exited nonzero):
        a ``rank_exit`` each, once no stream of theirs is open or judged."""
        judged = set(self._exit_pids) | set(self._exits.decided) | self._exits.pending_pids() | set(streaming)
        made = []
        for rep in self.exit_evidence.reports():
            pid = rep["pid"]
            if pid in judged or now - rep["at"] < 1.0 or process_state(pid)[0]:
                continue
            with self.state.lock:
                r = next((r for r in self.state.ranks.values() if r.pid == pid), None)
                step = r.step if r is not None else -1
                clean = r is not None and r.exited_cleanly
            if clean and not rep["failed"]:
                self._exit_pids.append(pid)   # it finished; torchrun only stopped the rest
                continue
            made.append(self._record_exit(now, self.state.node_id, rep["rank"], step, pid, {
                "pid": pid, "alive": False, "stream": "none" if r is None else "closed",
                **classify(record=None, fault=None, torchrun=rep, oom=self.exit_evidence.gather(None, pid)["oom"]),
                "started_at": min(rep["at"], now), "instrumented": r is not None}))
        return made

    def _assign_roots(self) -> None:
        """Link this node's rank exits to their root cause (:mod:`.job.root_cause`); the
        coordinator links them across the job."""
        run = self.incidents.run_id
        exits = [i for i in self.incidents.items if i.kind == "rank_exit" and i.run_id == run
                 and "/" not in i.id]
        exits_linked_by_job = {i.id for i in exits if i.detail.get("root_cause_scope") == "job"}
        roots = root_causes(exit_view(i.id, i.detected_at, i.detail) for i in exits)
        for i in exits:
            root = roots.get(i.id, i.id)
            if i.detail.get("root_cause") != root and i.id not in exits_linked_by_job:
                self.incidents.update(i.id, root_cause=root, consequence=root != i.id)

    # -- stragglers -------------------------------------------------------------
    def check_stragglers(self, now: float) -> list[Incident]:
        """Score the ranks once per completed step of the slowest; record incidents.

        Each rank's run delay (CPU starvation of its training thread and, apart, of its
        collective threads) is sampled here, and its step starts come from a step
        listener, so the detector can tell a starved host or late collectives from slow
        compute, and count what a starved rank costs.
        """
        st = self.state
        with st.lock:
            ranks = [r for r in st.ranks.values() if r.connected]
            tokens = {r.rank: r.expert_tokens_per_step for r in ranks}
            done = min((r.steps_completed for r in ranks), default=0)
            if done == self._evaluated_steps or len(ranks) < 2:
                return []
            self._evaluated_steps = done
        work = evaluate(now, snapshot(st, now), self.hang).work
        pids = {r.rank: r.pid for r in ranks}
        self._starvation.retain(set(pids))
        self._arrivals.forget(set(pids))
        self._arrivals.settle(now)
        for w in work:
            self._starvation.sample(w.rank, pids.get(w.rank, 0), w.completed)
            w.delay = self._starvation.per_step(w.rank)
            w.comm_delay = self._starvation.collective_per_step(w.rank)
            w.start = self._step_starts.for_rank(w.rank, w.completed)
            w.gap = self._step_starts.gaps_for_rank(w.rank, w.completed)
            w.late = self._arrivals.for_rank(w.rank, w.completed)
            w.tokens = tokens.get(w.rank, math.nan)
        events = self.stragglers.update(work, done)
        scores = {s.rank: s for s in score(work, self.straggler, self._gpu_throttle)}
        flagged = self.stragglers.flagged
        with st.lock:
            for r in ranks:
                if r.rank in scores:
                    r.slowdown = scores[r.rank].slowdown
                job = r.rank in self._job_stragglers   # the coordinator's flag, kept until lifted
                r.state = next_state(r.state, "flagged" if r.rank in flagged or job else "cleared")
        job_step = max(w.step_seconds for w in work)
        self._local_view = ({rank: s.cause for rank, s in flagged.items()}, self.stragglers.cost_ratio(job_step))
        made = []
        for ev in events:
            s = ev.score
            if ev.kind == "cleared":
                log.info("rank %d is no longer a straggler (slowdown %.2f)", s.rank, s.slowdown)
                continue
            made.append(self.incidents.add(kind="straggler", node=ev.work.node, rank=s.rank,
                                           step=ev.work.step, detected_at=now,
                                           detail=straggler_detail(ev, self.straggler.window, "node")))
            log.warning("STRAGGLER: %s at step %d, %.0f%% slower own work (%s); "
                        "the job would step %.2fx faster without it",
                        f"node {ev.work.node} (ranks {ev.ranks})" if ev.scope == "node" else f"rank {s.rank}",
                        ev.work.step, (s.slowdown - 1) * 100, s.cause, s.speedup)
        return made

    @property
    def straggler_view(self) -> tuple[dict[int, str], float]:
        """(flagged rank -> cause, the job's step-time cost ratio), for /metrics: this node's
        own detector's flags, and the coordinator's verdicts on this node's ranks (the only
        flags a node of one rank, or a rank slow against other nodes, ever gets)."""
        own, cost = self._local_view
        with self.state.lock:
            job = dict(self._job_stragglers)
        causes = {**{rank: cause for rank, (cause, _) in job.items()}, **own}
        return causes, max([cost, *(speedup for _, speedup in job.values())])

    # -- the coordinator's verdicts about this node's ranks --------------------------
    def mark(self, incident: Incident) -> None:
        """A job verdict sets the rank's state.  A hung rank returns to ok once it progresses
        again (:meth:`unmark_progressed`); a job straggler once the coordinator resolves the
        incident (:meth:`lift`)."""
        event = {"hang": "hang", "straggler": "flagged"}.get(incident.kind)
        if event is None or (event == "flagged" and incident.resolved_at is not None):
            return
        with self.state.lock:
            for rank in incident.detail.get("ranks") or [incident.rank]:
                if event == "flagged":
                    self._job_stragglers[rank] = _job_flag(incident.detail)
                r = self.state.ranks.get(rank)
                if r is not None:
                    r.state = next_state(r.state, event)  # type: ignore[arg-type]
                    if event == "hang":
                        self._marked_at[rank] = self.state.clock()

    def lift(self, incident: Incident) -> None:
        """The coordinator lifted a job straggler flag: its ranks are ok again (unless this
        node's own detector flags them)."""
        if incident.kind != "straggler":
            return
        with self.state.lock:
            for rank in incident.detail.get("ranks") or [incident.rank]:
                self._job_stragglers.pop(rank, None)
                r = self.state.ranks.get(rank)
                if r is not None and rank not in self.stragglers.flagged:
                    r.state = next_state(r.state, "cleared")

    def unmark_progressed(self) -> None:
        """A rank the coordinator marked hung that progressed since: the hang is over."""
        with self.state.lock:
            for k, at in list(self._marked_at.items()):
                r = self.state.ranks.get(k)
                if r is None or r.state != "hung" or r.progress_at > at:
                    if r is not None:
                        r.state = next_state(r.state, "progressed")
                    del self._marked_at[k]

    def exclude_all(self) -> None:
        """The coordinator excluded this node."""
        self._set_all("excluded")

    def forget_gone(self, now: float) -> None:
        """After a restart: forget workers of earlier generations once they are gone."""
        st = self.state
        with st.lock:
            for k in [k for k, r in st.ranks.items()
                      if not r.connected and not r.exited_cleanly and now - r.last_seen > _FORGET_AFTER
                      and not _pid_alive(r.pid)]:
                del st.ranks[k]


def _job_flag(detail: Mapping[str, Any]) -> tuple[str, float]:
    """A job straggler verdict's cause and the job's speed-up without the rank, as exported
    (values from the wire: an unknown cause or a speed-up out of range is not passed on)."""
    cause = detail.get("cause")
    cost = detail.get("cost")
    speedup = cost.get("speedup_if_removed") if isinstance(cost, dict) else None
    if not isinstance(speedup, (int, float)) or isinstance(speedup, bool) or not 1.0 <= speedup <= 1e6:
        speedup = 1.0
    return (cause if cause in CAUSES else "unknown"), float(speedup)
