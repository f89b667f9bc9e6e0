"""What an agent shows: its ``Status`` answer and the summary it sends its coordinator.

Readers only: they take the node's state, what the agent knows of the job
(:class:`~rankwatch.agent.link.known.JobKnowledge`) and the storage report, and change
nothing.  No exporter is read here: ``/metrics`` and ``Status`` read the same sources.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rankwatch.agent.detect.evaluate import STACKS_FRESH_SECONDS
from rankwatch.agent.link.uplink import summary_incidents
from rankwatch.agent.node import makeup as stepmix, oplatency, recoveries
from rankwatch.agent.node.rank_snapshot import process_state
from rankwatch.agent.views import rank_list
from rankwatch.agent.wire import bounds, inflight as in_flight, windows
from rankwatch.proto import pb

if TYPE_CHECKING:
    from rankwatch.agent.detect.bottleneck import Part
    from rankwatch.agent.durable.incidents import Incident
    from rankwatch.agent.durable.storage import FileHealth
    from rankwatch.agent.link.known import JobShown
    from rankwatch.agent.durable.decisions import Decision
    from rankwatch.agent.link.known import JobKnowledge
    from rankwatch.agent.node.intake import NodeState

__all__ = ["node_summary", "status_response"]

DECISIONS_SENT = 64   # the newest decisions a node's summary carries to its coordinator
_CONFLICTS_SHOWN = 64   # the most rank conflicts a Status answer lists


def status_response(state: NodeState, job: JobKnowledge, storage: dict[str, FileHealth], *,
                    metrics_port: int | None, max_ranks: int,
                    request: pb.StatusRequest | None = None,
                    bottleneck: pb.Bottleneck | None = None,
                    balance: tuple[pb.PipelineBalance | None, pb.ExpertSkew | None] = (None, None)
                    ) -> pb.StatusResponse:
    """The agent's ``Status`` answer: its ranks, and on the coordinator the whole job's (a big
    job's summarised, unless ``request`` asks for every rank: :mod:`.rank_list`).

    Args:
        state: this node's ranks and incidents.
        job: what this agent knows of the job (the coordinator's view while it coordinates).
        storage: the state directory's health (:func:`~rankwatch.agent.durable.storage.storage_report`).
        metrics_port: where /metrics serves (None: not served).
        max_ranks: the agent's default bound on the ranks listed (``--status-max-ranks``).
        bottleneck: what bounds the steps now (the job's on the coordinator; None: not known yet).
        balance: the pipeline stages' balance and the experts' skew (:mod:`.work_spread`; None: none).
    """
    st = state
    resp = pb.StatusResponse(node_id=st.node_id, started_at=st.started_at,
                             metrics_port=metrics_port or 0,
                             records_received=sum(st.records.values()),
                             messages_rejected=sum(st.rejected.values()),
                             tokens_per_second=st.tokens_per_second())
    mfu = st.mfu()
    if mfu is not None:
        resp.mfu = mfu
    coordinator = job.view()
    resp.coordinator = coordinator is not None
    resp.coordinator_node = job.coordinator_node()
    resp.decisions.extend(d.to_pb() for d in job.decisions())
    now = st.clock()
    breakdown = job.goodput(now)
    if breakdown is not None:
        resp.goodput = breakdown["productive"] / breakdown["elapsed"]
        resp.time_seconds.update(breakdown)
    if coordinator is not None:
        resp.nodes.extend(sorted(coordinator.nodes))
        resp.excluded_nodes.extend(sorted(coordinator.excluded))
        resp.rank_conflicts.extend(pb.RankConflict(rank=c.rank, node=c.holder, claimed_by=c.claimant, since=c.since,
                                                   last_at=c.last, refused=c.refused)
                                   for c in coordinator.rank_conflicts(now)[:_CONFLICTS_SHOWN])
    _add_ranks(resp, st, coordinator, job.restarting, now,
               rank_list.rank_limit(max_ranks, request.max_ranks if request else 0,
                                    request.all_ranks if request else False))
    resp.incidents.extend(inc.to_pb() for inc in _shown_incidents(st, coordinator))
    _add_storage(resp, storage)
    if bottleneck is not None:
        resp.bottleneck.CopyFrom(bottleneck)
    pipeline, experts = balance
    if pipeline is not None:
        resp.pipeline.CopyFrom(pipeline)
    if experts is not None:
        resp.experts.CopyFrom(experts)
    return bounds.cap_status(resp)


def _add_ranks(resp: pb.StatusResponse, st: NodeState, coordinator: JobShown | None,
               restarting: Callable[[str, float, float], bool], now: float, limit: int | None) -> None:
    """Each rank's state first, its full row only if it is listed (:mod:`.rank_list` decides which)."""
    own = st.snapshot()
    others = [(node, r, excluded) for node, r, excluded in coordinator.rank_summaries()
              if node != st.node_id] if coordinator is not None else []
    states = [r.state for r in own] + ["excluded" if excluded else r.state for _, r, excluded in others]
    keep = rank_list.chosen(states, limit)
    resp.ranks_total, resp.ranks_left_out = len(states), len(states) - len(keep)
    resp.rank_states.update(rank_list.by_state(states))
    # A rank's slowdown: the job's score where the coordinator flagged it (with one rank per
    # node, its agent has no neighbour to score it against), else its own node's (1 for
    # another node's rank: the coordinator keeps no score for ranks it did not flag).
    job_slowdown = coordinator.slowdown if coordinator is not None else (lambda _rank: None)
    for k in keep:
        if k < len(own):
            r = own[k]
            resp.ranks.append(pb.RankStatus(
                rank=r.rank, node=r.node, pid=r.pid, step=r.step, step_seconds=r.step_seconds,
                state=r.state, restarting=restarting(r.state, r.last_seen, now),
                phase_seconds=r.phase_seconds, mesh_coords=r.mesh_coords,
                backend=r.backend, collectives=int(r.collective_counts.sum()),
                last_collective_seq=r.last_collective_seq, dropped=r.dropped,
                last_seen=r.last_seen, connected=r.connected,
                tokens_per_second=r.tokens_per_second,
                slowdown=job_slowdown(r.rank) or r.slowdown,
                own_work_seconds=r.own_work_seconds, collective_wait_seconds=r.comm_wait_seconds,
                collective_source=r.collective_source, device_uuid=r.device_uuid,
                instrumentation=r.instrumentation, op_latency=oplatency.to_pb(r.op_latency)))
            continue
        node, rs, excluded = others[k - len(own)]
        work = windows.windows(rs)
        resp.ranks.append(pb.RankStatus(
            rank=rs.rank, node=node, pid=rs.pid, step=rs.step, step_seconds=rs.step_seconds,
            state=states[k], restarting=not excluded and restarting(rs.state, rs.last_seen, now),
            connected=rs.connected,
            last_seen=rs.last_seen, tokens_per_second=rs.tokens_per_second,
            phase_seconds=rs.phase_seconds, mesh_coords=rs.mesh_coords, op_latency=rs.op_latency,
            backend=rs.backend, collectives=rs.collectives,
            slowdown=job_slowdown(rs.rank) or 1.0,
            own_work_seconds=_median(work[0]), collective_wait_seconds=_median(work[2])))


def _shown_incidents(st: NodeState, coordinator: JobShown | None) -> list[Incident]:
    """This node's incidents, and on the coordinator the other nodes' own: a checkpoint shows
    once per step however many nodes saved it, an in-process recovery once however many nodes
    went through it (:func:`~rankwatch.agent.node.recoveries.same`)."""
    with st.lock:
        incidents = list(st.incidents)
    if coordinator is None:
        return incidents
    saved = {i.step for i in incidents if i.kind == "checkpoint"}
    recovered = [i for i in incidents if recoveries.is_in_process(i)]
    for i in sorted(coordinator.job_incidents(), key=lambda i: i.detected_at):
        if i.node == st.node_id or (i.kind == "checkpoint" and i.step in saved):
            continue
        if recoveries.is_in_process(i):
            if any(recoveries.same(i, known) for known in recovered):
                continue
            recovered.append(i)
        if i.kind == "checkpoint":
            saved.add(i.step)
        incidents.append(i)
    return incidents


def _add_storage(resp: pb.StatusResponse, storage: dict[str, FileHealth]) -> None:
    for name, h in storage.items():
        resp.storage[name].CopyFrom(pb.StorageStatus(
            path=h.path, ok=h.ok, written=h.written, spooled=h.spooled, failures=h.failures,
            dropped=h.spool_dropped + h.bound_dropped, last_error=h.last_error))


def node_summary(state: NodeState, seq: int, *, decisions: list[Decision], run_id: str,
                 relay_address: str | None, step_period: Callable[[int, float], float],
                 makeup: Part | None = None, instance: str = "") -> pb.NodeSummary:
    """This node's compact summary for the coordinator (capped well below the message limit).

    Args:
        state: this node's ranks and incidents.
        decisions: the job's decisions this agent holds (the newest go along).
        run_id: the job's run id.
        relay_address: this agent's address as a relay for its group (None: it relays nothing).
        step_period: a rank's step period as the node's detectors see it (rank, step seconds).
        makeup: the node's ranks' step make-up, for the job's bottleneck (None: not enough steps).
        instance: this agent's instance id (:mod:`~rankwatch.agent.job.claims`).
    """
    st = state
    now = st.clock()
    out = pb.NodeSummary(node_id=st.node_id, seq=seq, sent_at=now, agent_instance=instance)
    with st.lock:
        ranks = list(st.ranks.values())
        rows = [(r, dict(r.group_seqs), r.inflight, list(r.own_work), list(r.data_wait),
                 list(r.comm_wait)) for r in ranks]
        incidents = summary_incidents(list(st.incidents), st.node_id)
    for r, seqs, inflight, own, data, wait in rows:
        alive, stopped = process_state(r.pid)
        recent = now - r.stacks_at < STACKS_FRESH_SECONDS
        fresh = r.stacks if r.stacks and recent else ""
        fr = r.flight_recorder if r.flight_recorder and recent else None
        rs = pb.RankSummary(
            rank=r.rank, pid=r.pid, step=r.step, step_seconds=r.step_seconds,
            steps_completed=r.steps_completed, activity=r.activity, progress_at=r.progress_at,
            last_seen=r.last_seen, connected=r.connected, exited_cleanly=r.exited_cleanly,
            group_seqs=seqs, stacks=fresh, stacks_at=r.stacks_at, alive=alive, stopped=stopped,
            work=windows.pack(own, data, wait), state=r.state,
            local_rank=r.local_rank, tokens_per_second=r.tokens_per_second,
            flight_recorder=json.dumps(fr) if fr else "",
            phase_seconds=r.phase_seconds, mesh_coords=r.mesh_coords,
            op_latency=oplatency.to_pb(r.op_latency), backend=r.backend,
            collectives=int(r.collective_counts.sum()), world_size=r.world_size,
            expert_tokens=r.expert_tokens_per_step if r.expert_tokens else None,
            step_period=step_period(r.rank, r.step_seconds))
        if r.world_rank is not None:
            rs.world_rank = r.world_rank
        if inflight:
            rs.inflight.CopyFrom(in_flight.to_pb(inflight))
        out.ranks.append(rs)
    out.incidents.extend(i.to_pb() for i in incidents)
    out.decisions.extend(d.to_pb() for d in decisions[-DECISIONS_SENT:])
    out.run_id = run_id
    if relay_address is not None:
        out.relay_address = relay_address
    if makeup is not None:
        out.step_makeup.CopyFrom(stepmix.to_pb(makeup))
    return bounds.cap_summary(out)


def _median(values: Any) -> float:
    """The median of a short window (numpy's costs more than the sort at 16 values)."""
    if not len(values):
        return 0.0
    s = sorted(values)
    n = len(s)
    return float(s[n // 2]) if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
