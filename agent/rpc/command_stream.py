"""A node agent's command streams to its ranks (the ``Commands`` RPC).

``CommandHub`` holds one stream per rank: a checkpoint decision is sent to every
rank, and replayed to a rank that connects later while its step is still ahead.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from rankwatch.agent.durable.decisions import Decision
from rankwatch.proto import pb

__all__ = ["CommandHub"]


class CommandHub:
    """Per-rank command queues; checkpoint decisions fan out to every rank."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[int, queue.Queue] = {}
        self._checkpoints: dict[str, pb.Command] = {}

    def publish_checkpoint(self, decision: Decision) -> None:
        cmd = pb.Command(id=decision.id, checkpoint=pb.CheckpointCommand(
            step=decision.step, reason=decision.reason))
        with self._lock:
            if decision.id in self._checkpoints:
                return
            self._checkpoints[decision.id] = cmd
            targets = list(self._queues.values())
        for q in targets:
            q.put(cmd)

    def done(self, command_id: str) -> None:
        """A rank of this node saved for ``command_id``: ranks connecting later need not."""
        with self._lock:
            self._checkpoints.pop(command_id, None)

    def stream(self, rank: int, context: grpc.ServicerContext,
               current_step: Callable[[], int]) -> Iterator[pb.Command]:
        """Yield commands for ``rank`` until its stream closes."""
        q: queue.Queue = queue.Queue()
        with self._lock:
            old = self._queues.get(rank)
            self._queues[rank] = q
            backlog = list(self._checkpoints.values())
        if old is not None:
            old.put(None)  # a restarted rank replaces its old stream
        step = current_step()
        for cmd in backlog:
            if cmd.checkpoint.step > step:
                q.put(cmd)
        try:
            while context.is_active():
                try:
                    cmd = q.get(timeout=0.5)
                except queue.Empty:
                    continue
                if cmd is None:
                    return
                yield cmd
        finally:
            with self._lock:
                if self._queues.get(rank) is q:
                    del self._queues[rank]
