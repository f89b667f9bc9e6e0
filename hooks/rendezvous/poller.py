"""The rendezvous handler's relay: a thread in each node's torchrun that polls the node's
agent, writes the coordinator's decisions into the rendezvous store (only the agent that is
the coordinator does, and checks in at the round's exit barrier for an excluded node of its
round, :mod:`.exit_barrier`), and SIGKILLs an excluded node's workers (torchrun would wait its
30 s shutdown timeout before it kills a stopped or hung one).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any, Protocol

from rankwatch.address import Address

__all__ = ["DecisionRelay"]

log = logging.getLogger(__name__)

_KILL_GRACE = 1.0
"""Seconds an excluded node's workers live on, so that the healthy nodes restart first."""
_CALL_TIMEOUT = timedelta(seconds=1)


class RelayedHandler(Protocol):
    """What the relay asks of the rendezvous handler (``ExcludingRendezvousHandler``)."""

    @property
    def node(self) -> str: ...

    def write_decision(self, decision: dict[str, Any]) -> None: ...

    def stand_in_for_excluded(self, node: str) -> bool: ...

    def relay_excluded(self) -> Any: ...

    def in_process(self) -> bool: ...


class DecisionRelay:
    """Polls the node's agent: writes the coordinator's decisions, kills an excluded node's workers."""

    def __init__(self, handler: RelayedHandler, agent: Address, interval: float) -> None:
        self._handler = handler
        self._agent = agent
        self._interval = interval
        self._written: set[str] = set()
        self._killed: set[int] = set()
        self._excluded_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rankwatch-rdzv-relay", daemon=True)
            self._thread.start()
            atexit.register(self.stop)

    def stop(self) -> None:
        """Stop polling and wait out a call in flight (at most its 1 s deadline): gRPC can
        crash the interpreter's exit when a daemon thread is inside a call then."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(_CALL_TIMEOUT.total_seconds() + 1.0)

    def _loop(self) -> None:
        from rankwatch.status import AgentUnreachable, fetch_status

        while not self._stop.wait(self._interval):
            try:
                status = fetch_status(self._agent, _CALL_TIMEOUT)
            except AgentUnreachable:
                continue
            try:
                self._apply(status)
            except Exception:  # noqa: BLE001 - never take torchrun down
                log.exception("rankwatch: rendezvous relay error")

    def _apply(self, status: dict[str, Any]) -> None:
        h = self._handler
        for d in status["decisions"]:
            if status["coordinator"] and d["id"] not in self._written:
                h.write_decision(d)
                if d["kind"] == "exclude":
                    h.stand_in_for_excluded(d["node"])
                self._written.add(d["id"])   # last: a store error retries both, both idempotent
        if h.relay_excluded() is None:
            return
        # A grace period first, so the healthy nodes restart their workers on the new
        # generation before this node's dying workers break their collectives.
        self._excluded_at = self._excluded_at or time.monotonic()
        # The others restart on the new generation first, unless they recover in process, which
        # needs these workers gone: that breaks the collectives the others wait in.
        if time.monotonic() - self._excluded_at < _KILL_GRACE and not h.in_process():
            return
        mine = os.getpid()
        for r in status["ranks"]:
            pid = r["pid"]
            if r["node"] == h.node and pid not in self._killed and _child_of(pid, mine):
                log.warning("rankwatch: this node is excluded; killing worker pid %d (rank %d)",
                            pid, r["rank"])
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._killed.add(pid)


def _child_of(pid: int, parent: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).ppid() == parent
    except psutil.Error:
        return False
