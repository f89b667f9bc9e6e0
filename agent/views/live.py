"""What the browser page reads: the ``status --json`` object, and an incident's story.

Nothing here is computed for the page alone: the object is :func:`rankwatch.status.status_dict`
of the agent's ``Status`` answer (:mod:`.answer`, built as the RPC builds it), and a story is the
text ``rankwatch diagnose`` prints (:func:`rankwatch.agent.views.story.tell`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from rankwatch.agent.views.story import tell
from rankwatch.proto import pb
from rankwatch.status import status_dict

__all__ = ["LiveView"]

FRESH_SECONDS = 0.5   # one answer serves every page that polls within this long


class LiveView:
    """Args:
        status: the agent's ``Status`` answer (the server's :meth:`status`, as the RPC calls it).
    """

    def __init__(self, status: Callable[[pb.StatusRequest | None], pb.StatusResponse],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._status, self._clock = status, clock
        self._lock = threading.Lock()
        self._built: tuple[float, bytes] | None = None

    def status(self) -> dict[str, Any]:
        """Exactly what ``rankwatch status --json`` prints for this agent."""
        return status_dict(self._status(None))

    def status_json(self) -> bytes:
        """:meth:`status` as JSON, built at most once per :data:`FRESH_SECONDS` however many pages
        poll (they wait for the one build rather than each making their own)."""
        with self._lock:
            now = self._clock()
            if self._built is None or now - self._built[0] >= FRESH_SECONDS:
                self._built = (now, json.dumps(self.status(), separators=(",", ":")).encode())
            return self._built[1]

    def story(self, incident_id: str) -> str | None:
        """What ``rankwatch diagnose ID`` prints for one of this agent's incidents (None: no such
        incident here), or a decision's reason."""
        now = self.status()
        incidents = now["incidents"]
        found = next((i for i in incidents if i["id"] == incident_id), None)
        if found is not None:
            return tell(found, incidents)
        decision = next((d for d in now["decisions"] if d["id"] == incident_id), None)
        return None if decision is None else _decision(decision)


def _decision(d: dict[str, Any]) -> str:
    step = f" at step {d['step']}" if d.get("step") else ""
    return (f"{d['id']}: {d['kind']} on node {d['node'] or '-'} (generation {d['generation']}){step}\n\n"
            f"  reason:   {d['reason']}")
