"""Leaving a failed step: every survivor out of its pending collective, and none left behind.

* :func:`leave_step` is what a survivor does as it leaves: it aborts its NCCL communicators
  or shuts its own connections of the process groups
  (:func:`~rankwatch.hooks.recovery.net.shut_group_sockets`), which fails its neighbours'
  pending collectives in turn.
* That chain can miss a survivor: one waiting in a collective on a member that is alive but
  gone to the recovery, or one whose gloo op a peer's closed connection did not wake (seen
  about once in six node kills during an asynchronous save).  The first survivor to leave
  a step therefore posts ``gen/<g+1>/leave`` in the recovery store (:meth:`BreakWatch.announce`),
  and every worker's :class:`BreakWatch` looks for that key every ``_POLL`` s with a store
  client of its own (a blocking wait would print c10d's warning at every timeout).
  Unless its own worker is recovering already, it runs :func:`leave_step` in its own
  process: the stuck collective fails at once, and the worker arrives at the agreement
  within its ``settle`` wait instead of being left out as hung.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable, Mapping

from rankwatch.hooks.recovery import net
from rankwatch.hooks.recovery.protocol import Round
from rankwatch.hooks.recovery.store import connect

__all__ = ["BreakWatch", "leave_step"]

log = logging.getLogger(__name__)

_POLL = 0.25          # seconds between looks: well inside the agreement's settle (1 s by default)
_STOP_SECONDS = 5.0   # the longest a process's exit waits for the watch's store call


def leave_step(backend: str, baseline: set[tuple], keep: set[tuple[str, int]]) -> int:
    """Break this process out of its pending collectives; returns the connections shut."""
    if backend == "nccl":  # NCCL cancels its pending collectives itself
        try:
            net.abort_nccl()
        except Exception as err:  # noqa: BLE001 - the watchdog's timeout still bounds the wait
            log.warning("rankwatch: could not abort the NCCL communicators: %s", err)
    try:   # a gloo group beside NCCL's (object collectives, the CPU side) too
        return net.shut_group_sockets(baseline, keep)
    except Exception as err:  # noqa: BLE001 - the groups' timeout still bounds the others' wait
        log.warning("rankwatch: could not shut the failed groups' connections: %s", err)
        return 0


class BreakWatch:
    """Args:
        round_: this worker's view of the round in the recovery store.
        env: the worker's environment (names the store the watch connects to).
        leave: leaves this worker's step (:func:`leave_step` with its baseline).
    """

    def __init__(self, round_: Round, env: Mapping[str, str], leave: Callable[[], int]) -> None:
        self._round = round_
        self._env = env
        self._leave = leave
        self._lock = threading.Lock()
        self._generation: int | None = None   # None: recovering (or not started)
        self._stop = threading.Event()
        self.broke = 0
        """Times this watch broke its worker out of a step (for logs and tests)."""

    def announce(self, generation: int, member: int) -> None:
        """This worker (``member``) leaves generation ``generation``'s step: every other
        worker's watch breaks its own out, and the agreement waits for this one past its
        ``settle`` (:meth:`~rankwatch.hooks.recovery.protocol.Round.agree`).  Never raises:
        the connections shut still do most of it."""
        try:
            self._round.put(f"gen/{generation + 1}/leaving/{member}", "1")
            self._round.put(f"gen/{generation + 1}/leave", self._round.node)
        except Exception as exc:  # noqa: BLE001 - a store hiccup: the chain of shut connections remains
            log.warning("rankwatch: could not tell the other workers to leave the step: %s", exc)

    def follow(self, generation: int) -> None:
        """This worker trains in ``generation`` (after each (re)build)."""
        with self._lock:
            self._generation = generation

    def recovering(self) -> None:
        """This worker leaves the step itself: the watch keeps off its (new) process groups
        until :meth:`follow` names the next generation."""
        with self._lock:
            self._generation = None

    def start(self) -> None:
        thread = threading.Thread(target=self._watch, name="rankwatch-break-watch", daemon=True)
        thread.start()
        atexit.register(self._halt, thread)   # not ended inside a store call (see joins.JoinWatch.start)

    def _halt(self, thread: threading.Thread) -> None:
        self._stop.set()
        thread.join(_STOP_SECONDS)

    def _watch(self) -> None:
        store = None
        while not self._stop.wait(_POLL):
            generation = self._generation
            if generation is None:
                continue
            try:
                if store is None:
                    store, _ = connect(self._env)
                left = self._round.said(f"gen/{generation + 1}/leave", store)   # a forged one breaks nothing
            except Exception as exc:  # noqa: BLE001 - a store hiccup: connect again at the next look
                log.debug("rankwatch: looking for a step left: %s", exc)
                store = None
                continue
            if left:
                self._break(generation)

    def _break(self, generation: int) -> None:
        with self._lock:   # never the next generation's groups: recovering() takes the same lock
            if self._generation != generation:
                return
            self._generation = None   # once per generation; follow() arms it again
            self.broke += 1   # before the shut: the worker's collective fails as the first connection closes
            shut = self._leave()
        log.warning("rankwatch: another worker left generation %d's step; shut %d connection(s) of this "
                    "worker's process groups so that its pending collective fails too", generation, shut)

