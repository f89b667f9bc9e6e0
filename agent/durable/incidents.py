"""Incidents: typed records kept in memory for ``status`` and appended to a JSONL file.

The file tells the whole story.  A line holding an incident (``id``, ``kind``, ``node``,
``rank``, ``step``, ``detected_at``, ``detail``, ``run_id``) records it when it is raised;
a line ``{"update": id, "detail": {...}, "run_id": ...}`` records each later change of
its detail, its resolution above all.  :func:`replay` folds both back into the
incidents' state, so a post-mortem reader sees what the live ``status`` showed.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from rankwatch.agent.wire import bounds

from rankwatch.agent.durable import jsonl
from rankwatch.proto import pb

__all__ = ["Incident", "IncidentLog", "Replayed", "replay"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Incident:
    """One incident, as ``status --json`` shows it (plus the job's run id).

    ``detail`` is read-only: a change is a new ``Incident`` made by :meth:`IncidentLog.update`,
    which also writes it to the file.
    """

    id: str
    kind: str
    """straggler, hang, gpu_fault, rank_exit, checkpoint or restart."""
    node: str
    rank: int
    step: int
    detected_at: float
    """Unix seconds."""
    detail: Mapping[str, Any]
    run_id: str = ""
    """The job's run id (TORCHELASTIC_RUN_ID); "" until this agent learns it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "detail", MappingProxyType(dict(self.detail)))

    @property
    def resolved_at(self) -> float | None:
        at = self.detail.get("resolved_at")
        return None if at is None else float(at)

    def to_pb(self) -> pb.Incident:
        return pb.Incident(id=self.id, kind=self.kind, node=self.node, rank=self.rank, step=self.step,
                           detected_at=self.detected_at, detail_json=json.dumps(dict(self.detail)),
                           run_id=self.run_id)

    @classmethod
    def from_pb(cls, msg: pb.Incident, *, id: str | None = None, clock_offset: float = 0.0) -> Incident:
        """Args:
            id: the id to keep it under (default: the message's).
            clock_offset: added to ``detected_at`` (the sender's clock onto this one's).

        Raises:
            ValueError: ``detail_json`` is not a JSON object.
        """
        detail = json.loads(msg.detail_json or "{}")
        if not isinstance(detail, dict):
            raise ValueError(f"incident {msg.id!r}: detail_json is not an object")
        return cls(id=msg.id if id is None else id, kind=msg.kind, node=msg.node, rank=msg.rank,
                   step=msg.step, detected_at=msg.detected_at + clock_offset, detail=detail,
                   run_id=msg.run_id)

    def as_status(self) -> dict[str, Any]:
        """The ``status --json`` form."""
        return {"id": self.id, "kind": self.kind, "node": self.node, "rank": self.rank,
                "step": self.step, "detected_at": self.detected_at, "detail": dict(self.detail)}

    def to_json(self) -> dict[str, Any]:
        """The file's form: the status form and the run id."""
        return {**self.as_status(), "run_id": self.run_id}

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> Incident:
        return cls(id=str(record["id"]), kind=str(record["kind"]), node=str(record["node"]),
                   rank=int(record["rank"]), step=int(record["step"]),
                   detected_at=float(record["detected_at"]), detail=record.get("detail") or {},
                   run_id=str(record.get("run_id") or ""))


class Replayed(list):
    """The incidents a file holds (a list), and ``skipped``: its lines that did not parse."""

    skipped = 0


class IncidentLog:
    """Args:
        path: the JSONL file, appended to (never read back into the live view, which shows
            this agent's incidents); None keeps them in memory only.

    ``run_id`` is stamped on every incident :meth:`add` records; the agent sets it once its
    ranks name their job.  ``listeners`` are called with each incident that :meth:`add`
    records (the exporters); what they raise is logged, never passed on to the detector that
    raised the incident.
    """

    def __init__(self, path: Path | None, run_id: str = "") -> None:
        self.path = path
        self.writer = jsonl.Writer(path) if path is not None else None
        self.run_id = run_id
        self.items: list[Incident] = []
        self._sizes: list[int] = []   # each item's detail, in bytes of JSON
        self._count = 0               # incidents added so far (their ids' numbers)
        self._lock = threading.Lock()
        self.listeners: list[Callable[[Incident], None]] = []
        self.dropped = 0              # incidents let go from memory (the bounds in agent/wire/bounds.py)
        self.file_dropped = 0         # records not written: this run's file reached its bound
        self._file_run: str | None = None
        self._file_records = self._file_bytes = 0

    def add(self, *, kind: str, node: str, rank: int, step: int, detected_at: float,
            detail: Mapping[str, Any], tag: str = "") -> Incident:
        """``tag``: put in the id (``<kind>-<tag>-<n>``), so that ids of several nodes' agents
        differ (a rank exit's root cause names one across the job)."""
        tag = re.sub(r"[^A-Za-z0-9_.-]", "_", tag)[:64]
        with self._lock:
            self._count += 1
            name = f"{kind}-{tag}-{self._count}" if tag else f"{kind}-{self._count}"
            incident = Incident(id=name, kind=kind, node=node, rank=rank,
                                step=step, detected_at=detected_at, detail=bounds.cap_detail(detail),
                                run_id=self.run_id)
            self._keep(incident)
            self._write(incident.to_json())
        for listener in list(self.listeners):
            try:
                listener(incident)
            except Exception:  # noqa: BLE001 - an exporter never fails a detector
                log.exception("incident listener %r failed on %s", listener, incident.id)
        return incident

    def merge(self, incident: Incident) -> bool:
        """Keep an incident decided elsewhere (the coordinator) under its own id; False if known."""
        with self._lock:
            if any(i.id == incident.id for i in self.items):
                return False
            incident = replace(incident, detail=bounds.cap_detail(incident.detail))
            self._keep(incident)
            self._write(incident.to_json())
        return True

    def _keep(self, incident: Incident) -> None:
        """Append ``incident``, then let the oldest go over the bounds (per rank, per node)."""
        self.items.append(incident)
        self._sizes.append(bounds.detail_size(incident.detail))
        drop = bounds.incidents_to_drop(self.items, self._sizes)
        for n in reversed(drop):   # in place: NodeState.incidents is this same list
            del self.items[n]
            del self._sizes[n]
        if drop:
            if not self.dropped:
                log.warning("incident bound reached: the oldest incidents leave memory (the file keeps them)")
            self.dropped += len(drop)

    def get(self, incident_id: str) -> Incident | None:
        with self._lock:
            return next((i for i in reversed(self.items) if i.id == incident_id), None)

    def update(self, incident_id: str, **detail: Any) -> Incident | None:
        """Set ``detail`` fields of a known incident and append the change to the file.

        Returns:
            The incident as changed; None if it is unknown or already holds those values.
        """
        with self._lock:
            index = next((n for n in range(len(self.items) - 1, -1, -1)
                          if self.items[n].id == incident_id), None)
            if index is None:
                return None
            old = self.items[index]
            changed = {k: v for k, v in detail.items() if k not in old.detail or old.detail[k] != v}
            if not changed:
                return None
            changed = bounds.cap_detail(changed)
            new = replace(old, detail=bounds.cap_detail({**old.detail, **changed}))
            self.items[index] = new
            self._sizes[index] = bounds.detail_size(new.detail)
            self._write({"update": incident_id, "detail": changed, "run_id": old.run_id})
        return new

    def resolve(self, incident_id: str, at: float, **detail: Any) -> Incident | None:
        """Mark an incident over at ``at`` (the first resolution stands), with more ``detail``.

        Returns:
            The resolved incident; None if it is unknown or was already resolved.
        """
        known = self.get(incident_id)
        if known is None or known.resolved_at is not None:
            return None
        return self.update(incident_id, resolved_at=at, **detail)

    def items_for(self, *, node: str) -> list[Incident]:
        with self._lock:
            return [i for i in self.items if i.node == node]

    def items_for_nodes(self, nodes: set[str]) -> list[Incident]:
        with self._lock:
            return [i for i in self.items if i.node in nodes]

    @staticmethod
    def replay(lines: Iterable[str] | Path) -> Replayed:
        """The incidents an ``incidents.jsonl`` holds, each with its updates applied, in order.

        An id recorded again (an agent restarted on the same state directory counts from 1
        again) starts a new incident; an update applies to the latest incident of its id.
        Lines that do not parse (a write cut short by a crash or a full disk) are skipped
        and counted in the result's ``skipped``.
        """
        if isinstance(lines, Path):
            with open(lines, errors="replace") as f:
                return IncidentLog.replay(f.readlines())
        out = Replayed()
        latest: dict[str, int] = {}
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if "update" in record:
                    index = latest[str(record["update"])]
                    old = out[index]
                    out[index] = replace(old, detail={**old.detail, **record["detail"]})
                else:
                    latest[str(record["id"])] = len(out)
                    out.append(Incident.from_json(record))
            except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
                out.skipped += 1
                if out.skipped <= 5:
                    log.warning("incidents file line %d skipped: %s", n, exc)
        if out.skipped > 5:
            log.warning("incidents file: %d lines skipped in all", out.skipped)
        return out

    def _write(self, record: dict[str, Any]) -> None:
        if self.writer is None:
            return
        if self._file_run != self.run_id:   # the bound is per run
            self._file_run, self._file_records, self._file_bytes = self.run_id, 0, 0
        size = len(json.dumps(record, default=str)) + 1
        if (self._file_records >= bounds.MAX_FILE_RECORDS_PER_RUN
                or self._file_bytes + size > bounds.MAX_FILE_BYTES_PER_RUN):
            if not self.file_dropped:
                log.warning("%s: this run's bound (%d records, %d bytes) reached; later incidents are "
                            "kept in memory only", self.path, bounds.MAX_FILE_RECORDS_PER_RUN,
                            bounds.MAX_FILE_BYTES_PER_RUN)
            self.file_dropped += 1
            return
        self._file_records += 1
        self._file_bytes += size
        if self.writer is not None:
            self.writer.append(record)   # a failed write waits in the writer's spool, retried


replay = IncidentLog.replay
