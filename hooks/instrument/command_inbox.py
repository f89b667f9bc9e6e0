"""A rank's command stream from its agent: checkpoint requests, kept until a save serves them.

The agent streams commands on ``Commands`` (a checkpoint at a step, for a reason); the stream
is reopened with backoff while the agent is away, and a command replayed after a reconnect is
taken once.  The training loop asks :meth:`CommandInbox.requested_checkpoint` at each step and
tells :meth:`CommandInbox.serve_requests` which step a save began at.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc

from rankwatch.proto import pb, pb_grpc

__all__ = ["CommandInbox"]

log = logging.getLogger(__name__)

RECONNECT_MIN = timedelta(milliseconds=100)
RECONNECT_MAX = timedelta(seconds=2)


class CommandInbox:
    """Args:
        request: this rank's ``CommandRequest`` (its rank and pid).
        open_channel: a channel to the agent; ``stub`` makes a stub on it unless the client is
            closing; ``shut`` closes it (and is called on every exit).
        stop: set when the rank's client closes.
    """

    def __init__(self, request: pb.CommandRequest, open_channel: Callable[[], Any],
                 stub: Callable[[Any], pb_grpc.AgentStub], shut: Callable[[Any], None],
                 stop: threading.Event) -> None:
        self._request, self._open, self._stub, self._shut, self._stop = request, open_channel, stub, shut, stop
        self._cmd_lock = threading.Lock()
        self._requests_pending: dict[str, tuple[int, str]] = {}   # command id -> (step, reason)
        self._requests_seen: set[str] = set()

    def requested_checkpoint(self) -> tuple[int, str, str] | None:
        """The earliest pending checkpoint request: (step, command id, reason), or None."""
        with self._cmd_lock:
            if not self._requests_pending:
                return None
            cid, (step, reason) = min(self._requests_pending.items(), key=lambda kv: kv[1][0])
            return step, cid, reason

    def serve_requests(self, step: int) -> str:
        """A save of ``step`` began: requests at or before it are served by it (a failed save
        is reported, not retried every step).  Returns the earliest served request's id, or ""."""
        with self._cmd_lock:
            served = sorted((s, c) for c, (s, _) in self._requests_pending.items() if s <= step)
            for _, cid in served:
                del self._requests_pending[cid]
        return served[0][1] if served else ""

    def run(self) -> None:
        delay = RECONNECT_MIN.total_seconds()
        while not self._stop.is_set():
            channel = self._open()
            try:
                for cmd in self._stub(channel).Commands(self._request):
                    delay = RECONNECT_MIN.total_seconds()
                    self._take(cmd)
                    if self._stop.is_set():
                        break
            except grpc.RpcError:
                pass  # absent or restarting agent (or close()): the sender logs that; retry quietly
            except Exception:  # noqa: BLE001
                log.exception("rankwatch: command stream error")
            finally:
                self._shut(channel)
            self._stop.wait(delay * (0.5 + random.random()))
            delay = min(delay * 2, RECONNECT_MAX.total_seconds())

    def _take(self, cmd: pb.Command) -> None:
        if cmd.WhichOneof("body") != "checkpoint":
            log.warning("rankwatch: ignoring unknown command %r", cmd.id)
            return
        with self._cmd_lock:
            if cmd.id in self._requests_seen:
                return  # a duplicate (replayed after a reconnect)
            self._requests_seen.add(cmd.id)
            self._requests_pending[cmd.id] = (cmd.checkpoint.step, cmd.checkpoint.reason)
        log.info("rankwatch: checkpoint %s requested at step %d (%s)", cmd.id,
                 cmd.checkpoint.step, cmd.checkpoint.reason)
