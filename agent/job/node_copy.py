"""What the coordinator holds of one node (:class:`NodeView`), and how it reads a node's summary:
a rank's id, the straggler detector's view of a rank, the node's own incidents on the
coordinator's clock, a rank's Flight Recorder extract.  The job's view of all its nodes is
:mod:`.global_view`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from rankwatch.agent.detect.step_window import RankWork
from rankwatch.agent.detect.work_scores import role_of
from rankwatch.agent.durable.incidents import Incident
from rankwatch.agent.wire import windows as work_windows
from rankwatch.agent.wire.ranges import parse_flight_recorder
from rankwatch.proto import pb

__all__ = ["NodeView", "flight_recorder", "node_incidents", "rank_id", "rank_work", "without"]

log = logging.getLogger(__name__)


@dataclass
class NodeView:
    """One node's latest summary and what the coordinator saw of its arrival."""

    summary: pb.NodeSummary
    received_at: float
    offset: float           # coordinator clock - node clock (plus transit)
    ranks_dead_since: float | None = None
    interval: float = 0.25  # how often the node was last told to sync
    best_offset: float = float("inf")   # its smallest offset: clock skew plus the fastest transit
    latest_progress: float = float("-inf")   # its ranks' latest progress, on the coordinator's clock
    syncs: int = 1          # summaries this coordinator heard from it (beats too)
    seq: int = 0            # its latest summary's or beat's seq and sending time
    sent_at: float = 0.0
    moved_since_copy: bool = False   # a beat said its ranks progressed after ``summary`` was sent
    witness: tuple[float, float] | None = None   # its relay's word: (unheard since, said at)
    relayed: bool = False   # its latest summary or beat came through a relay
    ranks_died: bool = False   # node_death.all_ranks_died of its summary (read once per summary)
    progressed: float = float("-inf")   # its ranks' latest progress on its own clock (summary or beat)
    streams: tuple[int, ...] = ()   # pids of its ranks that stream (connected, not exited cleanly)
    claims: tuple[int, ...] = ()   # the rank ids it holds (:mod:`.claims`)
    instance: str = ""      # the agent instance its summaries come from


def rank_id(r: pb.RankSummary) -> int:
    """A rank's id in its job's world (its own rank where it reports no other)."""
    return r.world_rank if r.HasField("world_rank") else r.rank


def without(summary: pb.NodeSummary, left_out: set[int]) -> pb.NodeSummary:
    """A copy of ``summary`` without its ranks at the indices ``left_out``."""
    out = pb.NodeSummary()
    out.CopyFrom(summary)
    del out.ranks[:]
    out.ranks.extend(r for i, r in enumerate(summary.ranks) if i not in left_out)
    return out


def rank_work(node: str, r: pb.RankSummary) -> RankWork:
    """What the straggler detector reads of a rank's summary (its windows not copied)."""
    own, data, wait = work_windows.windows(r)
    return RankWork(rank=r.rank, node=node, step=r.step, own=own, data=data, wait=wait,
                    step_seconds=r.step_seconds, completed=r.steps_completed, period=r.step_period,
                    role=role_of(r.mesh_coords),
                    tokens=r.expert_tokens if r.HasField("expert_tokens") else math.nan)


def node_incidents(name: str, summary: pb.NodeSummary, offset: float) -> list[Incident]:
    """The incidents a node's summary raises of itself, on the coordinator's clock."""
    out = []
    for i in summary.incidents:
        if i.node != name:
            continue
        try:
            out.append(Incident.from_pb(i, clock_offset=offset))
        except ValueError as exc:
            log.debug("node incident %s left out: %s", i.id, exc)
    return out


def flight_recorder(rank: int, text: str) -> dict | None:
    """A node's rank's Flight Recorder extract; a malformed one is left out of the evidence."""
    try:
        return parse_flight_recorder(text)
    except ValueError as exc:
        log.debug("rank %d: flight_recorder left out: %s", rank, exc)
        return None
