"""Where the pipeline-stage and expert findings come from, and how ``Status`` shows them.

:class:`BalanceWatch` gathers the ranks' work windows (this node's from its intake, the job's
from the nodes' summaries on the coordinator), has :mod:`rankwatch.agent.detect.imbalance`
decide, and keeps the latest findings for ``Status`` (:meth:`BalanceWatch.shown`) and
``/metrics`` (:meth:`BalanceWatch.findings`).  Readers only: it changes no state it reads.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rankwatch.agent.detect.imbalance import BalanceConfig, ExpertSkew, Pipeline, experts, pipeline
from rankwatch.agent.wire import windows
from rankwatch.proto import pb

if TYPE_CHECKING:
    from rankwatch.agent.job.global_view import JobView
    from rankwatch.agent.node.intake import NodeState

__all__ = ["BalanceWatch", "Findings", "experts_pb", "pipeline_pb"]

_TOKENS_SHOWN = 4096   # ranks whose tokens a Status answer lists (the wire's summary cap)
_STAGES_SHOWN = 1024   # stages a Status answer lists (a coordinator's peers claim their mesh coordinates)

Findings = tuple[str, Pipeline | None, ExpertSkew | None]
"""(scope, the pipeline's balance, the experts' skew): ``node`` or ``job``."""


def _node_ranks(state: NodeState) -> tuple[list[tuple[int, list[float], list[float]]], dict[int, float]]:
    with state.lock:
        live = [r for r in state.ranks.values() if r.connected and not r.exited_cleanly]
        staged = [(int(r.mesh_coords["pp"]), list(r.own_work), list(r.comm_wait))
                  for r in live if "pp" in r.mesh_coords]
        tokens = {r.rank: r.expert_tokens_per_step for r in live}
    return staged, tokens


def _job_ranks(view: JobView) -> tuple[list[tuple[int, object, object]], dict[int, float]]:
    staged: list[tuple[int, object, object]] = []
    tokens: dict[int, float] = {}
    for _node, r, excluded in view.rank_summaries():
        if excluded or not r.connected:
            continue
        if "pp" in r.mesh_coords:
            own, _data, wait = windows.windows(r)
            staged.append((int(r.mesh_coords["pp"]), own, wait))
        if r.HasField("expert_tokens"):
            tokens[r.world_rank if r.HasField("world_rank") else r.rank] = r.expert_tokens
    return staged, tokens


class BalanceWatch:
    """The latest findings of this node's ranks and, while coordinating, of the job's."""

    def __init__(self, cfg: BalanceConfig | None = None) -> None:
        self.cfg = cfg or BalanceConfig()
        self._lock = threading.Lock()
        self._node: Findings = ("node", None, None)
        self._job: Findings | None = None

    def update(self, state: NodeState, view: JobView | None) -> None:
        """Decide again from this node's ranks, and the job's where ``view`` is the coordinator's."""
        staged, tokens = _node_ranks(state)
        node: Findings = ("node", pipeline(staged, self.cfg), experts(tokens))
        job: Findings | None = None
        if view is not None:
            jstaged, jtokens = _job_ranks(view)
            job = ("job", pipeline(jstaged, self.cfg), experts(jtokens))   # type: ignore[arg-type]
        with self._lock:
            self._node, self._job = node, job

    def findings(self) -> Iterator[Findings]:
        """This node's findings, then the job's while coordinating."""
        with self._lock:
            yield from (self._node,) if self._job is None else (self._node, self._job)

    def shown(self) -> tuple[pb.PipelineBalance | None, pb.ExpertSkew | None]:
        """What ``Status`` shows: the job's findings on the coordinator, else this node's."""
        with self._lock:
            scope, pipe, skew = self._job if self._job is not None else self._node
        return (pipeline_pb(pipe, scope) if pipe else None, experts_pb(skew, scope) if skew else None)


def pipeline_pb(p: Pipeline, scope: str) -> pb.PipelineBalance:
    ratio = p.imbalance
    return pb.PipelineBalance(
        stages=[pb.StageLoad(stage=s.stage, ranks=s.ranks, compute_seconds=s.compute, step_seconds=s.step,
                             bubble=s.bubble) for s in p.stages[:_STAGES_SHOWN]],
        imbalance=ratio if math.isfinite(ratio) else 0.0, heaviest_stage=p.heaviest, lightest_stage=p.lightest,
        idle=p.idle, text=p.text(), scope=scope)


def experts_pb(e: ExpertSkew, scope: str) -> pb.ExpertSkew:
    shown = sorted(e.tokens)[:_TOKENS_SHOWN]
    return pb.ExpertSkew(skew=e.skew, hottest_rank=e.hottest, tokens_per_step={r: e.tokens[r] for r in shown},
                         scope=scope)
