"""Incidents: kept in memory for ``status`` and appended to a JSONL file for post-mortems."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["IncidentLog"]

log = logging.getLogger(__name__)


class IncidentLog:
    """Args:
        path: the JSONL file, appended to (never read back into the live
            view, which shows this agent's incidents); None keeps them in memory only.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.items: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, *, kind: str, node: str, rank: int, step: int, detected_at: float,
            detail: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            incident = {"id": f"{kind}-{len(self.items) + 1}", "kind": kind, "node": node,
                        "rank": rank, "step": step, "detected_at": detected_at, "detail": detail}
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
        return incident
