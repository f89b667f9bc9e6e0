"""Rank exits: a rank whose stream ended without a clean close, and whose process is gone.

A rank closes its stream cleanly on ``Monitor.close()`` (also run at interpreter exit): it
sends a ``Goodbye`` last.  A stream that ends without one is a rank that died (killed,
crashed, ``os._exit``), or a live rank whose connection dropped, which reconnects.  So
such a stream is judged until one of these holds:

* its process is gone: a ``rank_exit`` incident, with the evidence the agent kept,
  unless a restart was decided just before the stream broke (the restart stops every
  worker: those exits are its effect, not news).  The incident waits until the evidence
  of how it ended is in (torchrun's report, or the rank's own exit record), at most
  ``evidence_seconds`` after the process was first seen gone;
* the same process streams again (it reconnected): nothing;
* neither within ``wait_seconds``: nothing (logged), since a live process did not exit.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rankwatch.knobs import require_positive

__all__ = ["BrokenStream", "ExitConfig", "ExitWatch", "Verdict", "exit_detail", "judge"]

log = logging.getLogger(__name__)

Verdict = Literal["exit", "wait", "drop"]


@dataclass(kw_only=True)
class ExitConfig:
    wait_seconds: float = 60.0
    """How long a broken stream whose process is alive is watched for its exit."""
    restart_seconds: float = 30.0
    """A stream that breaks this soon after a restart decision was stopped by the restart."""
    evidence_seconds: float = 3.0
    """How long a gone rank's exit waits for torchrun's report of it, when its own stream
    did not say how it ended."""

    def __post_init__(self) -> None:
        require_positive(self, "wait_seconds", "restart_seconds", "evidence_seconds")


@dataclass(frozen=True, kw_only=True)
class BrokenStream:
    """What the agent knew of a rank when its stream broke (agent clock, Unix seconds)."""

    rank: int
    node: str
    pid: int
    stream: int
    """The agent's id of the stream that broke."""
    step: int
    activity: str
    last_seen: float
    ended_at: float
    error: str
    """How the stream ended without a goodbye: ``closed`` (the iteration stopped) or
    ``cancelled`` (the call was cancelled); gRPC reports a dead peer either way."""
    inflight: dict[str, Any] | None = None
    said_goodbye: bool = False
    """It closed its stream, but had said its main thread dies of an exception."""


def judge(now: float, broken: BrokenStream, *, alive: bool, reconnected: bool,
          restarts: Iterable[float], cfg: ExitConfig, settled: bool = True,
          gone_for: float = float("inf")) -> Verdict:
    """``exit`` once the process is gone (and its end's evidence is in: ``settled``, or it has
    been gone ``evidence_seconds``); ``drop`` once it streams again, outlives the wait, or died
    of a restart decided (at one of ``restarts``) shortly before its stream broke."""
    if reconnected:
        return "drop"
    if not alive:
        restarting = any(0 <= broken.ended_at - at <= cfg.restart_seconds for at in restarts)
        if restarting:
            return "drop"
        return "exit" if settled or gone_for >= cfg.evidence_seconds else "wait"
    return "drop" if now - broken.ended_at > cfg.wait_seconds else "wait"


def exit_detail(broken: BrokenStream, now: float) -> dict[str, Any]:
    """The ``rank_exit`` incident's evidence."""
    return {"pid": broken.pid, "alive": False, "stream": "ended without a goodbye", "error": broken.error,
            "activity": broken.activity, "inflight": broken.inflight,
            "last_seen": broken.last_seen, "stream_ended_at": broken.ended_at,
            "silent_seconds": round(max(0.0, broken.ended_at - broken.last_seen), 3),
            "gone_after_seconds": round(max(0.0, now - broken.ended_at), 3),
            "reason": "its stream ended without a clean close and its process is gone"}


class ExitWatch:
    """The broken streams being judged, at most ``limit`` (the oldest go first), whatever
    a peer does."""

    def __init__(self, cfg: ExitConfig, limit: int = 1024) -> None:
        self.cfg = cfg
        self._limit = limit
        self._lock = threading.Lock()
        self._broken: dict[int, BrokenStream] = {}   # stream id -> what broke
        self._gone_at: dict[int, float] = {}         # stream id -> when its process was first seen gone
        self.decided: deque[int] = deque(maxlen=limit)
        """The pids judged (exited, or dropped), newest last."""

    def broke(self, stream: BrokenStream) -> None:
        with self._lock:
            while len(self._broken) >= self._limit:
                self._gone_at.pop(oldest := next(iter(self._broken)), None)
                del self._broken[oldest]
            self._broken[stream.stream] = stream

    def pending_pids(self) -> set[int]:
        with self._lock:
            return {b.pid for b in self._broken.values()}

    def review(self, now: float, *, alive: Callable[[int], bool], streaming: Mapping[int, int],
               restarts: Iterable[float],
               settled: Callable[[BrokenStream], bool] = lambda _: True) -> list[BrokenStream]:
        """Judge every broken stream; forget the settled ones; return those whose rank exited.

        Args:
            alive: whether a pid's process is alive.
            streaming: pid -> the stream it streams on now.
            restarts: when restarts were decided.
            settled: whether the evidence of a broken stream's end is in.
        """
        with self._lock:
            pending = list(self._broken.values())
        if not pending:
            return []
        restarts = list(restarts)
        exited = []
        for b in pending:
            living = alive(b.pid)
            gone_at = self._gone_at.setdefault(b.stream, now) if not living else now
            verdict = judge(now, b, alive=living, restarts=restarts, settled=not living and settled(b),
                            reconnected=streaming.get(b.pid, b.stream) != b.stream, cfg=self.cfg,
                            gone_for=now - gone_at)
            if verdict == "wait":
                continue
            with self._lock:
                self._broken.pop(b.stream, None)
                self._gone_at.pop(b.stream, None)
                self.decided.append(b.pid)
            if verdict == "exit":
                exited.append(b)
            else:
                log.info("rank %d (pid %d): its stream broke (%s); not an exit to report (it "
                         "reconnected, lives on, or a restart stopped it)", b.rank, b.pid, b.error)
        return exited
