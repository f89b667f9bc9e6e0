"""The make-up of the node's ranks' steps, as the bottleneck rule reads it and the wire carries it.

:func:`node_part` reads each connected rank's own-work, data-wait and collective-wait
windows (the intake's lockstep deques) and combines them into the node's make-up
(:mod:`rankwatch.agent.detect.bottleneck` decides how); the node's summary carries it to the
coordinator as one :class:`~rankwatch.proto.pb.StepMakeup` (:func:`to_pb`, :func:`from_pb`),
and a verdict goes into ``Status`` as a :class:`~rankwatch.proto.pb.Bottleneck` (:func:`verdict_pb`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rankwatch.agent.detect.bottleneck import BottleneckConfig, Part, Verdict, combine, rank_part
from rankwatch.proto import pb

if TYPE_CHECKING:
    from rankwatch.agent.node.intake import NodeState

__all__ = ["from_pb", "node_part", "to_pb", "verdict_pb"]


def node_part(state: NodeState, cfg: BottleneckConfig,
              gpu_utilization: Callable[[], float | None] = lambda: None) -> Part | None:
    """The node's make-up over its connected ranks' recent steps (None: none has enough), with
    the utilisation of their GPUs beside it."""
    with state.lock:
        windows = [(list(r.own_work), list(r.data_wait), list(r.comm_wait))
                   for r in state.ranks.values() if r.connected and not r.exited_cleanly]
    part = combine((rank_part(own, data, wait, cfg) for own, data, wait in windows), cfg)
    if part is None:
        return None
    gpu = gpu_utilization()
    return Part(step=part.step, data=part.data, wait=part.wait, own=part.own, ranks=part.ranks,
                seen=part.seen, steps=part.steps,
                gpu_utilization=None if gpu is None else min(1.0, max(0.0, gpu)))


def to_pb(part: Part) -> pb.StepMakeup:
    msg = pb.StepMakeup(step_seconds=part.step, data_seconds=part.data, wait_seconds=part.wait,
                        own_seconds=part.own, ranks=part.ranks, ranks_seen=part.seen, steps=part.steps)
    if part.gpu_utilization is not None:
        msg.gpu_utilization = part.gpu_utilization
    return msg


def from_pb(msg: pb.StepMakeup) -> Part | None:
    """A node's make-up from its summary (checked by :func:`~rankwatch.agent.wire.summary.check_summary`);
    None for one of no critical rank."""
    if msg.ranks == 0 or msg.ranks_seen == 0:
        return None
    return Part(step=msg.step_seconds, data=msg.data_seconds, wait=msg.wait_seconds, own=msg.own_seconds,
                ranks=msg.ranks, seen=msg.ranks_seen, steps=msg.steps,
                gpu_utilization=msg.gpu_utilization if msg.HasField("gpu_utilization") else None)


def verdict_pb(v: Verdict, scope: str) -> pb.Bottleneck:
    """A verdict as ``Status`` shows it (``scope``: node or job)."""
    p = v.part
    msg = pb.Bottleneck(kind=v.kind, share=v.share, input_share=v.shares["input"],
                        communication_share=v.shares["communication"], compute_share=v.shares["compute"],
                        since=v.since, step_seconds=p.step, ranks=p.ranks, ranks_seen=p.seen, scope=scope)
    if p.gpu_utilization is not None:
        msg.gpu_utilization = p.gpu_utilization
    return msg
