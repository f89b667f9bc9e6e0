"""What an agent shows: its ``Status`` answer and the summary it sends its coordinator.

Readers only: they take what the agent's state, detectors and logs hold, and change
nothing (the summary used to prune old ranks as a side effect; the detector loop
does that now).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rankwatch.agent.wire import bounds, windows as work_windows

from rankwatch.agent.node import oplatency, recoveries

from rankwatch.agent.views import rank_list as status_ranks
from rankwatch.agent.detect.evaluate import STACKS_FRESH_SECONDS
from rankwatch.agent.export import prom_store as storemetrics
from rankwatch.agent.job.uplink import summary_incidents
from rankwatch.agent.node.sweep import process_state
from rankwatch.proto import pb

if TYPE_CHECKING:
    from rankwatch.agent.server import Agent

__all__ = ["node_summary", "status_response"]

DECISIONS_SENT = 64   # the newest decisions a node's summary carries to its coordinator


def status_response(agent: Agent, request: pb.StatusRequest | None = None) -> pb.StatusResponse:
    """The agent's ``Status`` answer: its ranks, and on the coordinator the whole job's (a big
    job's summarised, unless ``request`` asks for every rank: :mod:`.status_ranks`)."""
    st = agent.state
    resp = pb.StatusResponse(node_id=st.node_id, started_at=st.started_at,
                             metrics_port=agent.metrics_port or 0,
                             records_received=sum(st.records.values()),
                             messages_rejected=sum(st.rejected.values()),
                             tokens_per_second=st.tokens_per_second())
    mfu = st.mfu()
    if mfu is not None:
        resp.mfu = mfu
    link = agent.link
    resp.coordinator = agent.is_coordinator()
    resp.coordinator_node = link.coordinator_node
    resp.decisions.extend(d.to_pb() for d in agent.decisions())
    job = resp.coordinator
    now = st.clock()
    breakdown = agent.goodput(now)
    if breakdown is not None:
        resp.goodput = breakdown["productive"] / breakdown["elapsed"]
        resp.time_seconds.update(breakdown)
    if job:
        resp.nodes.extend(sorted(agent.coordinator.nodes))
        resp.excluded_nodes.extend(sorted(agent.coordinator.excluded))
    # Each rank's state first, its full row only if it is listed (status_ranks decides which).
    own = st.snapshot()
    others = [(node, r, excluded) for node, r, excluded in agent.coordinator.rank_summaries()
              if node != st.node_id] if job else []
    states = [r.state for r in own] + ["excluded" if excluded else r.state for _, r, excluded in others]
    keep = status_ranks.chosen(states, status_ranks.rank_limit(
        agent.config.status_max_ranks, request.max_ranks if request else 0,
        request.all_ranks if request else False))
    resp.ranks_total, resp.ranks_left_out = len(states), len(states) - len(keep)
    resp.rank_states.update(status_ranks.by_state(states))
    # A rank's slowdown: the job's score where the coordinator flagged it (with one rank per
    # node, its agent has no neighbour to score it against), else its own node's (1 for
    # another node's rank: the coordinator keeps no score for ranks it did not flag).
    job_slowdown = agent.coordinator.stragglers.slowdown if job else (lambda _rank: None)
    for k in keep:
        if k < len(own):
            r = own[k]
            resp.ranks.append(pb.RankStatus(
                rank=r.rank, node=r.node, pid=r.pid, step=r.step, step_seconds=r.step_seconds,
                state=r.state, restarting=agent.restarting(r.state, r.last_seen, now),
                phase_seconds=r.phase_seconds, mesh_coords=r.mesh_coords,
                backend=r.backend, collectives=int(r.collective_counts.sum()),
                last_collective_seq=r.last_collective_seq, dropped=r.dropped,
                last_seen=r.last_seen, connected=r.connected,
                tokens_per_second=r.tokens_per_second,
                slowdown=job_slowdown(r.rank) or r.slowdown,
                own_work_seconds=r.own_work_seconds, collective_wait_seconds=r.comm_wait_seconds,
                collective_source=r.collective_source, device_uuid=r.device_uuid,
                op_latency=oplatency.to_pb(r.op_latency)))
            continue
        node, rs, excluded = others[k - len(own)]
        windows = work_windows.windows(rs)
        resp.ranks.append(pb.RankStatus(
            rank=rs.rank, node=node, pid=rs.pid, step=rs.step, step_seconds=rs.step_seconds,
            state=states[k], restarting=not excluded and agent.restarting(rs.state, rs.last_seen, now),
            connected=rs.connected,
            last_seen=rs.last_seen, tokens_per_second=rs.tokens_per_second,
            phase_seconds=rs.phase_seconds, mesh_coords=rs.mesh_coords, op_latency=rs.op_latency,
            backend=rs.backend, collectives=rs.collectives,
            slowdown=job_slowdown(rs.rank) or 1.0,
            own_work_seconds=_median(windows[0]), collective_wait_seconds=_median(windows[2])))
    with st.lock:
        incidents = list(st.incidents)
    if job:
        # Other nodes' own incidents; a checkpoint shows once per step however many nodes saved
        # it, an in-process recovery once however many nodes went through it (recoveries.same).
        saved = {i.step for i in incidents if i.kind == "checkpoint"}
        recovered = [i for i in incidents if recoveries.is_in_process(i)]
        for i in sorted(agent.coordinator.job_incidents(), key=lambda i: i.detected_at):
            if i.node == st.node_id or (i.kind == "checkpoint" and i.step in saved):
                continue
            if recoveries.is_in_process(i):
                if any(recoveries.same(i, known) for known in recovered):
                    continue
                recovered.append(i)
            if i.kind == "checkpoint":
                saved.add(i.step)
            incidents.append(i)
    resp.incidents.extend(inc.to_pb() for inc in incidents)
    storemetrics.fill_status(resp, agent)
    return bounds.cap_status(resp)


def node_summary(agent: Agent, seq: int) -> pb.NodeSummary:
    """This node's compact summary for the coordinator (capped well below the message limit)."""
    st = agent.state
    now = st.clock()
    out = pb.NodeSummary(node_id=st.node_id, seq=seq, sent_at=now)
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
            work=work_windows.pack(own, data, wait), state=r.state,
            local_rank=r.local_rank, tokens_per_second=r.tokens_per_second,
            flight_recorder=json.dumps(fr) if fr else "",
            phase_seconds=r.phase_seconds, mesh_coords=r.mesh_coords,
            op_latency=oplatency.to_pb(r.op_latency), backend=r.backend,
            collectives=int(r.collective_counts.sum()), world_size=r.world_size,
            step_period=agent.watch.step_period(r.rank, r.step_seconds))
        if r.world_rank is not None:
            rs.world_rank = r.world_rank
        if inflight:
            rs.inflight.CopyFrom(pb.InFlight(op=inflight["op"], group=inflight["group"],
                                             seq=inflight["seq"], since=inflight["since"]))
        out.ranks.append(rs)
    out.incidents.extend(i.to_pb() for i in incidents)
    out.decisions.extend(d.to_pb() for d in agent.decision_log.items[-DECISIONS_SENT:])
    out.run_id = agent.incidents.run_id
    if agent.relay is not None:
        out.relay_address = agent.relay.address
    return bounds.cap_summary(out)


def _median(values: Any) -> float:
    """The median of a short window (numpy's costs more than the sort at 16 values)."""
    if not len(values):
        return 0.0
    s = sorted(values)
    n = len(s)
    return float(s[n // 2]) if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
