"""Talking to an agent: reachability and its ``status`` view.

Shared by the node side (the CLI, ``rankwatch run``) and the training side (the
rendezvous relay in torchrun), so it imports neither.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import grpc

from rankwatch.address import Address
from rankwatch.credentials import ClientCredentials, open_channel
from rankwatch.proto import pb, pb_grpc

__all__ = ["AgentUnreachable", "fetch_status", "reachable"]


class AgentUnreachable(RuntimeError):
    """No agent answered at the address."""


def reachable(addr: Address, timeout: timedelta = timedelta(milliseconds=500),
              creds: ClientCredentials | None = None) -> bool:
    try:
        fetch_status(addr, timeout, creds)
        return True
    except AgentUnreachable:
        return False


def fetch_status(addr: Address, timeout: timedelta = timedelta(seconds=3),
                 creds: ClientCredentials | None = None, all_ranks: bool = False) -> dict[str, Any]:
    """The agent's live view, in the ``status --json`` schema.

    Args:
        creds: the job's credentials (default: from the ``RANKWATCH_*`` environment).
        all_ranks: list every rank of a big job, not the agent's summarised view (the ranks
            not ok first, up to its limit).

    Raises:
        AgentUnreachable: nothing answered in time, or the answer was an error.
    """
    if creds is None:
        try:
            creds = ClientCredentials.from_env()
        except ValueError as exc:
            raise AgentUnreachable(f"cannot call the agent at {addr}: {exc}") from None
    with open_channel(addr, creds) as channel:
        try:
            resp = pb_grpc.AgentStub(channel).Status(pb.StatusRequest(all_ranks=all_ranks),
                                                     timeout=timeout.total_seconds())
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise AgentUnreachable(f"agent at {addr} refused: {exc.details()}") from None
            raise AgentUnreachable(f"no agent at {addr}: {exc.code().name}") from None
    return status_dict(resp)


def status_dict(resp: pb.StatusResponse) -> dict[str, Any]:
    return {
        "node": resp.node_id,
        "agent_started_at": resp.started_at,
        "metrics_port": resp.metrics_port or None,
        "ranks": [{
            "rank": r.rank, "node": r.node, "pid": r.pid, "step": r.step,
            "step_seconds": r.step_seconds, "state": r.state, "restarting": r.restarting,
            "phase_seconds": dict(r.phase_seconds), "mesh": dict(r.mesh_coords),
            "backend": r.backend, "collectives": r.collectives,
            "last_collective_seq": r.last_collective_seq, "dropped": r.dropped,
            "connected": r.connected, "last_seen": r.last_seen,
            "tokens_per_second": r.tokens_per_second, "slowdown": r.slowdown,
            "own_work_seconds": r.own_work_seconds,
            "collective_wait_seconds": r.collective_wait_seconds,
            "collective_source": r.collective_source, "device_uuid": r.device_uuid,
            "instrumentation": r.instrumentation or None,
            "op_latency": {op: {"count": v.count, "p50_seconds": v.p50_seconds,
                                "p99_seconds": v.p99_seconds, "window": v.window}
                           for op, v in sorted(r.op_latency.items())},
        } for r in resp.ranks],
        "incidents": [{
            "id": i.id, "kind": i.kind, "node": i.node, "rank": i.rank, "step": i.step,
            "detected_at": i.detected_at, "detail": json.loads(i.detail_json or "{}"),
        } for i in resp.incidents],
        "ranks_total": resp.ranks_total,
        "ranks_left_out": resp.ranks_left_out,
        "rank_states": dict(sorted(resp.rank_states.items())),
        "goodput": resp.goodput if resp.HasField("goodput") else None,
        "time_seconds": dict(resp.time_seconds),
        "coordinator": resp.coordinator,
        "coordinator_node": resp.coordinator_node or None,
        "nodes": list(resp.nodes),
        "excluded_nodes": list(resp.excluded_nodes),
        "rank_conflicts": [{"rank": c.rank, "node": c.node, "claimed_by": c.claimed_by, "since": c.since,
                            "last_at": c.last_at, "refused": c.refused} for c in resp.rank_conflicts],
        "decisions": [{"id": d.id, "kind": d.kind, "node": d.node, "generation": d.generation,
                       "step": d.step, "reason": d.reason, "decided_at": d.decided_at}
                      for d in resp.decisions],
        "tokens_per_second": resp.tokens_per_second,
        "mfu": resp.mfu if resp.HasField("mfu") else None,
        "bottleneck": _bottleneck(resp.bottleneck) if resp.HasField("bottleneck") else None,
        "pipeline": _pipeline(resp.pipeline) if resp.HasField("pipeline") else None,
        "experts": ({"skew": resp.experts.skew, "hottest_rank": resp.experts.hottest_rank,
                     "tokens_per_step": {str(r): t for r, t in sorted(resp.experts.tokens_per_step.items())},
                     "scope": resp.experts.scope} if resp.HasField("experts") else None),
        "records_received": resp.records_received,
        "messages_rejected": resp.messages_rejected,
        "storage": {name: {"path": f.path, "ok": f.ok, "written": f.written, "spooled": f.spooled,
                           "failures": f.failures, "dropped": f.dropped, "last_error": f.last_error or None}
                    for name, f in sorted(resp.storage.items())},
    }


def pipeline_dict(p: pb.PipelineBalance) -> dict[str, Any]:
    """A pipeline finding as ``status --json`` shows it (``rankwatch analyze`` prints the same)."""
    return _pipeline(p)


def _bottleneck(b: pb.Bottleneck) -> dict[str, Any]:
    """What bounds the steps now: ``{kind, share}`` (the contract), each kind's share, the GPUs'
    utilisation where read, and whose steps (``scope``: node or job)."""
    return {"kind": b.kind, "share": b.share,
            "shares": {"input": b.input_share, "communication": b.communication_share,
                       "compute": b.compute_share},
            "gpu_utilization": b.gpu_utilization if b.HasField("gpu_utilization") else None,
            "scope": b.scope, "since": b.since, "step_seconds": b.step_seconds,
            "ranks": b.ranks, "ranks_seen": b.ranks_seen}


def _pipeline(p: pb.PipelineBalance) -> dict[str, Any]:
    """How the work falls over the pipeline's stages (stages differ by design: not stragglers)."""
    return {"imbalance": p.imbalance, "heaviest_stage": p.heaviest_stage, "lightest_stage": p.lightest_stage,
            "idle": p.idle, "text": p.text, "scope": p.scope,
            "stages": [{"stage": s.stage, "ranks": s.ranks, "compute_seconds": s.compute_seconds,
                        "step_seconds": s.step_seconds, "bubble": s.bubble} for s in p.stages]}
