"""Which nodes the coordinator calls dead at each evaluation, and when many fall silent together.

The rule for one node is :func:`~rankwatch.agent.job.node_death.judge` (a pure function);
this keeps what it needs between evaluations: each node's ranks' death time (on its
:class:`~rankwatch.agent.job.global_view.NodeView`), the nodes judged dead for their silence
lately (one burst, though they fall silent one evaluation apart), and whether a burst is on.
What a dead node costs it (an exclusion) is the coordinator's policy; the exits of the ranks it
took with it are :func:`~rankwatch.agent.job.node_lost.lost_exits`' (read here: :meth:`DeathWatch.lost_ranks`).
"""

from __future__ import annotations

import json
import logging

from rankwatch.agent.job import node_death
from rankwatch.agent.job.node_lost import LastSeen, LostExit, lost_exits
from rankwatch.agent.job.global_view import JobView
from rankwatch.agent.job.loadmeter import LoadMeter
from rankwatch.agent.job.policy import PolicyConfig

__all__ = ["DeathWatch"]

log = logging.getLogger(__name__)


class DeathWatch:
    """Args:
        view: the job as the coordinator knows it (its nodes, those dead, their silence).
        policy: the burst rule's and the crash grace's settings.
        load: the coordinator's load meter (until when silence is no evidence of itself).
    """

    def __init__(self, view: JobView, policy: PolicyConfig, load: LoadMeter) -> None:
        self.view = view
        self.policy = policy
        self.load = load
        self.quiet = 0
        """Nodes silent at the last evaluation."""
        self._silent_burst = False   # many nodes silent together (said once per burst)
        self._silenced: dict[str, float] = {}   # node judged dead for its silence -> when (recent ones)

    def check(self, now: float) -> list[tuple[str, str]]:
        """The nodes found dead at ``now``, each with why (they join ``view.dead``)."""
        view = self.view
        with view.lock:
            excluded = view.excluded
            included = [(name, n) for name, n in view.nodes.items() if name not in excluded]
            quiet = {name for name, n in included if view.silent(n, now)}
            self.quiet = len(quiet)
            # Nodes excluded for their silence lately count with those silent now: a burst
            # whose nodes fall silent one evaluation apart is still one burst.
            window = self.policy.silent_burst_seconds
            self._silenced = {k: t for k, t in self._silenced.items() if now - t < window and k in view.nodes}
            gone = [k for k in self._silenced if k in excluded]
            counts = node_death.silence_is_evidence(len(quiet) + len(gone), len(included) + len(gone),
                                                    burst_share=self.policy.silent_burst_share,
                                                    burst_nodes=self.policy.silent_burst_nodes)
            dead = []
            for name, n in included:
                if name in view.dead:
                    continue
                why, n.ranks_dead_since = node_death.judge(
                    now, silent=name in quiet, silence_counts=counts,
                    ranks_died=n.ranks_died, died_since=n.ranks_dead_since,
                    grace=self.policy.crashed_grace_seconds)
                if why is not None:
                    if name in quiet and now < self.load.quiet and n.witness is not None:   # (pacing.node_silent)
                        why += f" (its relay had not heard it for {n.witness[1] - n.witness[0]:.1f}s)"
                    dead.append((name, why))
                    if name in quiet and counts:
                        self._silenced[name] = now
            for name, _ in dead:
                view.dead.add(name)
        self._say_burst(len(quiet) + len(gone) > 1 and not counts, len(quiet) + len(gone),
                        len(included) + len(gone), len(gone))
        return dead

    def lost_ranks(self, name: str, why: str, now: float) -> list[LostExit]:
        """The ``rank_exit`` records of the ranks node ``name``, judged dead at ``now`` for
        ``why``, took with it (:func:`~rankwatch.agent.job.node_lost.lost_exits`), from its
        last summary on this clock."""
        with self.view.lock:
            n = self.view.nodes.get(name)
            if n is None:
                return []
            summary, offset, heard = n.summary, n.offset, n.received_at
        told = set()
        for i in summary.incidents:
            if i.kind == "rank_exit" and i.node == name:
                try:
                    pid = json.loads(i.detail_json or "{}").get("pid")
                except (ValueError, AttributeError):
                    continue
                if isinstance(pid, int):
                    told.add(pid)
        ranks = [LastSeen(rank=r.rank, pid=r.pid, step=r.step, connected=r.connected,
                          exited_cleanly=r.exited_cleanly, last_seen=r.last_seen + offset if r.last_seen > 0 else 0.0)
                 for r in summary.ranks]
        return lost_exits(name, why, heard_at=heard, now=now, ranks=ranks, told_pids=told)

    def _say_burst(self, burst: bool, silent: int, nodes: int, gone: int) -> None:
        """Log once when a burst of silent nodes begins, and once when it is over."""
        if burst != self._silent_burst:
            self._silent_burst = burst
            if burst:
                log.warning("%d of %d nodes went silent together (%d of them already excluded): taken for "
                            "the coordinator's or the network's trouble, not for that many dead nodes; none "
                            "is excluded for its silence while this lasts", silent, nodes, gone)
            else:
                log.info("the burst of silent nodes is over")
