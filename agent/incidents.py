"""Incidents: kept in memory for ``status`` and appended to a JSONL file for post-mortems."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["IncidentLog"]

log = logging.getLogger(__name__)


class IncidentLog:
    """Args:
        path: the JSONL file, appended to (never read back into the live
            view, which shows this agent's incidents); None keeps them in memory only.

    ``listeners`` are called with each incident that :meth:`add` records (the exporters);
    what they raise is logged, never passed on to the detector that raised the incident.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.items: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def add(self, *, kind: str, node: str, rank: int, step: int, detected_at: float,
            detail: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            incident = {"id": f"{kind}-{len(self.items) + 1}", "kind": kind, "node": node,
                        "rank": rank, "step": step, "detected_at": detected_at, "detail": detail}
            self._append(incident)
        for listener in list(self.listeners):
            try:
                listener(incident)
            except Exception:  # noqa: BLE001 - an exporter never fails a detector
                log.exception("incident listener %r failed on %s", listener, incident["id"])
        return incident

    def merge(self, incident: dict[str, Any]) -> bool:
        """Keep an incident decided elsewhere (the coordinator) under its own id; False if known."""
        with self._lock:
            if any(i["id"] == incident["id"] for i in self.items):
                return False
            self._append(incident)
        return True

    def items_for(self, *, node: str) -> list[dict[str, Any]]:
        with self._lock:
            return [i for i in self.items if i["node"] == node]

    def _append(self, incident: dict[str, Any]) -> None:
        self.items.append(incident)
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a") as f:
                    f.write(json.dumps(incident) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                log.warning("could not persist incident %s: %s", incident["id"], exc)
