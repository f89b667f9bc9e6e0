"""The job's first failure: which ``rank_exit`` is the root cause, and which followed from it.

A pure decision over the exits known (a node agent's own, or every node's on the
coordinator), each with when it ended and how:

* exits are cut into **episodes**: an exit that ends more than ``window`` seconds after the
  previous one begins a new episode (a job restarted by torchrun can fail again later, for
  another reason);
* in an episode, an exit that reads as a **consequence** of another rank's end -- a gloo or
  NCCL peer error ("Connection closed by peer", "Connection reset", "Broken pipe", a
  collective's timeout, an aborted communicator), or a worker torchrun stopped (SIGTERM)
  because another had failed -- is never the root while the episode holds an exit that
  does not: the first of those, by the time it ended, is the **root cause**;
* a rank that ended with its node (``how: node_lost``, recorded by the coordinator when it
  judged the node dead: :mod:`.node_lost`) is never a consequence, and is its own root; it
  ended when it was last heard, so it comes before the survivors' peer errors that the
  coordinator recorded while the node's silence was still being confirmed;
* an episode of consequences only (the root's node was lost with its agent, and this view
  does not hold its exit: a node agent's) is rooted at its earliest exit, which the story
  tells as a consequence of a lost peer (:mod:`rankwatch.agent.views.postmortem`).

Every exit of an episode gets ``root_cause`` = its root's incident id (the root's own
id for the root, and for every ``node_lost`` exit).  The node watch
(:mod:`rankwatch.agent.node.sweep`) and the coordinator (:mod:`rankwatch.agent.job.coordinator`)
apply it each time an exit is added, so a root named before the lost node's exits were
known is replaced; the CLI tells the story (:mod:`rankwatch.agent.views.postmortem`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CONSEQUENCE", "ExitView", "exit_view", "is_consequence", "root_causes"]

WINDOW = 120.0
CONSEQUENCE = re.compile(
    r"connection closed by peer|connection reset|broken pipe|socket timeout|timed out|timeout"
    r"|communicator was aborted|nccl error|ncclRemoteError|remote process exited|peer .* (?:died|exited)"
    r"|recvBytes|sendBytes|read error|no route to host|connection refused|DistBackendError"
    r"|ProcessGroupGloo|gloo/transport|watchdog caught collective", re.I)


@dataclass(frozen=True, kw_only=True)
class ExitView:
    """What the decision reads of one ``rank_exit`` incident."""

    id: str
    ended_at: float
    consequence: bool
    lost: bool = False
    """It ended with its node (``how: node_lost``): never a consequence, its own root."""


def is_consequence(detail: Mapping[str, Any]) -> bool:
    """A rank exit that reads as another rank's doing (see the module docstring)."""
    if detail.get("how") == "node_lost":
        return False
    if detail.get("stopped_by") == "torchrun":
        return True
    if detail.get("how") != "exception":
        return False
    text = f"{detail.get('type') or ''}: {detail.get('message') or ''}"
    return bool(CONSEQUENCE.search(text[:4000]))


def exit_view(incident_id: str, detected_at: float, detail: Mapping[str, Any]) -> ExitView:
    """An incident as the decision reads it: it ended at ``detail.started_at`` (the exit
    record's time, or when its stream ended), else when it was detected."""
    ended = detail.get("started_at")
    ok = isinstance(ended, (int, float)) and not isinstance(ended, bool) and 0 < ended <= detected_at + 1.0
    return ExitView(id=incident_id, ended_at=float(ended) if ok and ended is not None else float(detected_at),
                    consequence=is_consequence(detail), lost=detail.get("how") == "node_lost")


def root_causes(exits: Iterable[ExitView], window: float = WINDOW) -> dict[str, str]:
    """Each exit's id -> the id of its episode's root cause (itself for the root)."""
    ordered = sorted(exits, key=lambda e: (e.ended_at, e.id))
    out: dict[str, str] = {}
    episode: list[ExitView] = []
    for e in ordered + [None]:   # type: ignore[list-item]
        if episode and (e is None or e.ended_at - episode[-1].ended_at > window):
            root = next((x for x in episode if not x.consequence), episode[0])
            out.update({x.id: x.id if x.lost else root.id for x in episode})
            episode = []
        if e is not None:
            episode.append(e)
    return out


def job_roots(reported: Iterable[Any], own: Iterable[Any], run_id: str) -> dict[str, str]:
    """Across the job: each ``rank_exit`` incident's id -> its root cause's id, over the nodes'
    own incidents (``reported``, from their summaries) and this agent's (``own``), of the run."""
    seen: dict[str, ExitView] = {}
    for i in [*own, *reported]:
        if i.kind == "rank_exit" and "/" not in i.id and (not run_id or i.run_id in (run_id, "")):
            seen.setdefault(i.id, exit_view(i.id, i.detected_at, i.detail))
    return root_causes(seen.values()) if seen else {}
