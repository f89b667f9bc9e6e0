"""Rank 0's watch for workers asking to join the training in process.

A spare or returning node that the rendezvous handler sends to a round which lost nodes in
process (``RANKWATCH_RECOVERY_JOIN``) does not make torchrun restart anyone: its workers
first pay a fresh process's one-time imports (:func:`warm_up`), then ask to join, and take
their state from a live replica or the survivors' snapshots, point to point, not from disk.
A hot spare that arrives while the job is full stands by (``RANKWATCH_RECOVERY_STANDBY``):
its workers ask ahead of any loss and are admitted at the next loss itself, into the lost
node's place (:func:`~rankwatch.hooks.recovery.decide.placeable`); this watch leaves them be.

A spare or returning node's workers ask to join in the recovery store
(:meth:`~rankwatch.hooks.recovery.protocol.Round.ask_to_join`) and wait.  The survivors must
admit them at a step boundary, all at once, without the training thread ever touching the
store on its hot path:

* a background thread of rank 0, with its own store client, looks every ``_POLL`` s for
  requests that :func:`~rankwatch.hooks.recovery.decide.admissible` would answer (whole
  nodes; whole replicas admitted, the rest refused) and raises a flag;
* at the next step boundary, :meth:`JoinWatch.due` sees the flag, checks once more that
  the joiners still wait (a recovery may have let them in meanwhile), and tells the tier to
  leave the step on purpose: every survivor's next collective fails, and the recovery that
  follows agrees with the joiners in;
* the joiners a decision admitted or refused are settled, and never asked about again;
* at the job's end, :meth:`JoinWatch.finish` tells those still waiting that the job finished.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import threading
from collections.abc import Iterator, Mapping

from rankwatch.hooks.recovery.decide import JOINER_BASE, Decision, Joiner, admissible
from rankwatch.hooks.recovery.protocol import Round
from rankwatch.hooks.recovery.store import connect

__all__ = ["JoinWatch", "warm_up"]

log = logging.getLogger(__name__)

_POLL = 0.5
"""Seconds between rank 0's looks for workers asking to join."""
_STOP_SECONDS = 5.0   # the longest a process's exit waits for the watch's store call


def warm_up() -> None:
    """A joiner pays a fresh process's one-time costs before it asks, not while the survivors
    wait for it: torch imports its compiler stack (``torch._dynamo``, about a second) on the
    first use of a meta-device initialiser or of FSDP2's lazy paths."""
    try:
        importlib.import_module("torch._dynamo")
    except Exception as exc:  # noqa: BLE001 - only a cost moved, nothing lost
        log.debug("rankwatch: warm-up import failed: %s", exc)


class JoinWatch:
    """Args:
        round_: this worker's view of the round in the recovery store.
        env: the worker's environment (names the store the watch connects to).
        total_steps: the loop's last step, if known: no joiner is let in after it.
    """

    def __init__(self, round_: Round, env: Mapping[str, str], total_steps: int | None) -> None:
        self._round = round_
        self._env = env
        self._total_steps = total_steps
        self._rank = -1
        self._replica_size = 0
        self._due = threading.Event()
        self._stop = threading.Event()
        self._paused = False
        self.settled: set[int] = set()
        """Joiners a decision admitted or refused: never asked about again."""

    def follow(self, rank: int, replica_size: int) -> None:
        """This worker's rank and the job's replica size, after each (re)build: only rank 0
        looks, and only whole replicas are admitted."""
        self._rank, self._replica_size = rank, replica_size

    def settle(self, decision: Decision) -> None:
        """The joiners ``decision`` admitted or refused are answered."""
        self.settled |= {r for r in decision.members if r >= JOINER_BASE} | set(decision.refused)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No look while a recovery runs; a request seen meanwhile is the recovery's, or the
        next look's."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self._due.clear()

    def start(self) -> None:
        thread = threading.Thread(target=self._poll, name="rankwatch-join-poll", daemon=True)
        thread.start()
        # Stopped before the interpreter finalises: a daemon thread still inside a store call
        # then would be ended by pthread_exit in the middle of C++ code, which aborts the
        # process ("terminate called without an active exception") after training ended.
        atexit.register(self._halt, thread)

    def due(self, step: int) -> bool:
        """At the boundary after ``step``: True when the survivors should leave the step now
        to admit joiners (rank 0 only; the flag is the background look's, checked again)."""
        if not self._due.is_set() or (self._total_steps is not None and step >= self._total_steps):
            return False
        self._due.clear()
        if self._rank != 0:
            return False
        try:
            admitted, refused, _ = admissible(_growing(self._round.waiting_joiners(self._round.store, self.settled)),
                                              self._replica_size)
        except Exception as exc:  # noqa: BLE001 - a store hiccup: the watch looks again
            log.debug("rankwatch: checking join requests: %s", exc)
            return False
        return bool(admitted or refused)

    def finish(self, step: int) -> None:
        """The loop is done: rank 0 tells the workers still asking to join that the job
        finished, so they exit cleanly instead of waiting out their join timeout.  Never
        raises: the job's end does not depend on it."""
        self._stop.set()
        if self._rank != 0:
            return
        try:
            told = self._round.tell_finished(step, self.settled)
            if told:
                log.warning("rankwatch: the job finished at step %d; %d worker(s) asking to join "
                            "were told to exit", step, told)
        except Exception as exc:  # noqa: BLE001 - a joiner then times out, as without this call
            log.warning("rankwatch: could not tell joining workers the job finished: %s", exc)

    def _halt(self, thread: threading.Thread) -> None:
        self._stop.set()
        thread.join(_STOP_SECONDS)

    def _poll(self) -> None:
        store = None
        while not self._stop.wait(_POLL):
            if self._rank != 0 or self._due.is_set() or self._paused or self._replica_size <= 0:
                continue
            try:
                if store is None:
                    store, _ = connect(self._env)
                admitted, refused, _ = admissible(_growing(self._round.waiting_joiners(store, self.settled)),
                                                  self._replica_size)
            except Exception as exc:  # noqa: BLE001 - a store hiccup: connect again at the next look
                log.debug("rankwatch: looking for join requests: %s", exc)
                store = None
                continue
            if admitted or refused:
                log.warning("rankwatch: %d worker(s) ask to join; admitting them at the next step boundary",
                            len(admitted) + len(refused))
                self._due.set()


def _growing(joiners: list[Joiner]) -> list[Joiner]:
    """The joiners that grow the world; a standby one waits for a loss (see :mod:`decide`)."""
    return [j for j in joiners if not j.standby]
