"""The state directory's health: for each durable log, what was written, what waits, what was lost.

An incident or decision that could not be written (a full disk, an unwritable or hijacked
path) waits in its writer's spool (:class:`~rankwatch.agent.durable.jsonl.Writer`) and is
retried.  :func:`storage_report` is the one reading of that, for ``status --json``'s
``storage`` and for the ``rankwatch_state_*`` series alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FileHealth", "storage_report"]


@dataclass(frozen=True)
class FileHealth:
    """One durable file's writes so far."""

    path: str
    last_error: str
    """Why the last write failed ('' while writes succeed)."""
    written: int
    spooled: int
    """Records waiting in memory for the file (retried every second)."""
    failures: int
    spool_dropped: int
    """Records never written because the spool was full."""
    bound_dropped: int
    """Records the run's bound on the file kept out."""

    @property
    def ok(self) -> bool:
        return not self.last_error


def storage_report(incidents: Any, decisions: Any, history: Any = None) -> dict[str, FileHealth]:
    """``{file name: its health}`` of the agent's logs that have a file (none without a state dir).

    Args:
        incidents: the incident log (``IncidentLog``).
        decisions: the decision log (``DecisionLog``).
        history: the ranks' step history (``StepLog``, or None): its rows written, waiting,
            dropped (a full queue or a failed write) and deleted to keep its bound.
    """
    out = {}
    for name, log in (("incidents", incidents), ("decisions", decisions)):
        w = getattr(log, "writer", None)
        if w is not None:
            out[name] = FileHealth(path=str(w.path), last_error=w.last_error, written=w.written,
                                   spooled=w.spooled, failures=w.failures, spool_dropped=w.dropped,
                                   bound_dropped=getattr(log, "file_dropped", 0))
    if history is not None:
        f = history.files
        out["history"] = FileHealth(path=str(history.directory), last_error=f.last_error, written=f.written_rows,
                                    spooled=history.queued, failures=f.failures,
                                    spool_dropped=history.dropped + f.dropped_rows, bound_dropped=f.deleted_rows)
    return out
