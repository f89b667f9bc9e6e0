"""torchrun rendezvous backend ``rankwatch``: the stock c10d dynamic rendezvous, plus exclusions.

Registered through the ``torchrun.handlers`` entry point (:mod:`.entry`), so torchrun's own
elastic agent does every restart; rankwatch only decides *who* and *when*:

* ``next_rendezvous()`` refuses a node the coordinator excluded with
  ``RendezvousGracefulExitError``: that node's torchrun leaves cleanly (and
  first leaves the rendezvous, so the others need not wait for its keep-alive
  to expire);
* ``num_nodes_waiting()`` reports a waiting node when the restart generation
  in the store moved past the one this node joined *and* a newly excluded
  node is a member of this node's round, so every healthy node restarts its
  workers at once, without spending ``--max-restarts``.  An exclusion of a
  node that is already gone from the round (a dead node, whose peers' workers
  failed and re-formed the round without it) restarts nothing: a second
  restart there would race the healthy nodes' fresh workers against each
  other and could spend their last ``--max-restarts``;
* ``shutdown()`` of an excluded node does not close the rendezvous for the
  others (the stock handler's does);
* a node that finds the job full (``--nnodes MIN:MAX`` with MAX nodes in the
  round) waits as a hot spare until a round has room, and its wait neither
  restarts the others nor times out.  (The stock handler leaves a node that
  was in the wait list when a round filled up there: every healthy node then
  sees a waiting node, restarts, and the same happens again, a restart storm;
  and the stranded node times out after ``join_timeout``.)
* a round whose workers recover in process (:mod:`.round_keys`) is not restarted for
  a node they already left out, and a spare, or a node whose torchrun restarts its workers,
  sends its workers to join that round in process, so no other node restarts.

Exclusions and the generation live in the rendezvous store under
``rankwatch/<run_id>/`` (:mod:`.exclusions`).  Only the coordinator's decisions are written: a
relay thread in each node's torchrun (:mod:`.poller`) polls its local
agent, and the one whose agent is the coordinator writes them.  The relay also
SIGKILLs this node's workers once the node is excluded, because torchrun waits
its 30 s shutdown timeout before it kills a stopped (SIGSTOP) or hung worker.

``rankwatch run`` selects this backend in place of ``c10d`` (same
parameters); use ``--rdzv-backend rankwatch`` with plain torchrun.

``rankwatch-etcd`` is the same handler over torch's ``etcd-v2`` backend (an
``EtcdRendezvousBackend`` and its ``EtcdStore``, against a real etcd with the
v2 API on): the rendezvous, the exclusions and the generation then live in
etcd, so no node's loss takes the store with it -- the first node included,
whose torchrun hosts the c10d store.  ``rankwatch run`` selects it in place of
``etcd-v2``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousTimeoutError,
)

from rankwatch.address import Address
from rankwatch.hooks.rendezvous import stock
from rankwatch.hooks.rendezvous.exclusions import Exclusions
from rankwatch.hooks.rendezvous.exit_note import write_exit_note
from rankwatch.hooks.rendezvous.lifeline import Lifeline
from rankwatch.hooks.rendezvous.round_keys import IN_PROCESS_WAIT, InProcessRound
from rankwatch.hooks.rendezvous.exit_barrier import MEMBER_PREFIX, check_in_leaving, own_client, stand_in_for_excluded
from rankwatch.hooks.rendezvous.poller import DecisionRelay
from rankwatch.hooks.recovery.store import Seal

__all__ = ["BACKEND", "ETCD_BACKEND", "ExcludingRendezvousHandler"]

log = logging.getLogger(__name__)

BACKEND = "rankwatch"
ETCD_BACKEND = "rankwatch-etcd"
_SPARE_POLL = 0.5
# A node whose torchrun restarts its workers (one of them failed) waits this long for the
# round's other workers to begin leaving it out in process, before restarting the round.
_REJOIN_GRACE = 1.5
_STORE_TROUBLE_LOG_EVERY = 10.0   # seconds between warnings that the store does not answer


class ExcludingRendezvousHandler(RendezvousHandler):
    """Args:
        inner: the stock dynamic rendezvous handler.
        store: the rendezvous store.
        node: this node's id (``RANKWATCH_NODE_ID``), as the coordinator names it.
        agent: this node's agent; None runs without a relay.
        relay_interval: seconds between the relay's polls of the agent.
        backend: the backend name torchrun registered this handler under.
    """

    def __init__(self, inner: Any, store: Store, node: str, agent: Address | None,
                 relay_interval: float = 0.25, backend: str = BACKEND) -> None:
        self._inner = inner
        self._backend = backend  # the name torchrun asked for: rankwatch or rankwatch-etcd
        self._store = store
        self._exclusions = Exclusions(store, inner.get_run_id(), node)
        self._writer: Exclusions | None = None   # the relay's, on a client of its own
        self._node = node
        self._joined_generation = 0
        self._round_store: Store | None = None
        self._round_nodes = 0
        self._deferred: dict[int, float] = {}  # generation -> when a restart for it was first held
        self._store_trouble_logged = float("-inf")
        self._relay = DecisionRelay(self, agent, relay_interval) if agent is not None else None
        try:
            seal = Seal.from_env(os.environ)   # the workers' values are sealed with the job's token
        except ValueError as exc:
            log.warning("rankwatch: %s: the workers' marks in the recovery store will not open here; this "
                        "node restarts its workers through torchrun instead", exc)
            seal = Seal.unusable()
        self._round = InProcessRound(store, inner.get_run_id(), node, seal, lambda: stock.current_round(inner))
        self._lifeline = Lifeline(store, inner)   # a lost node out of the next round on proof

    # -- the store ------------------------------------------------------------------
    @property
    def node(self) -> str:
        """This node's id."""
        return self._node

    def generation(self) -> int:
        return self._exclusions.generation()

    def excluded(self) -> str | None:
        """Why this node is excluded; None while it is not."""
        return self._exclusions.excluded()

    def relay_excluded(self) -> str | None:
        """:meth:`excluded`, for the relay's thread: on the client of its own once it writes
        decisions (this node's agent coordinates), so that the next exclusion is written, and
        stood in for, while this node's torchrun waits at its exit barrier."""
        return (self._writer or self._exclusions).excluded()

    def write_decision(self, decision: dict[str, Any]) -> None:
        """Apply a coordinator decision to the store (idempotent), through a client of the
        store of its own: the relay's thread calls it, and it must not wait behind a blocking
        call of torchrun's on the shared one (its exit barrier)."""
        if self._writer is None:
            self._writer = Exclusions(own_client(self._store), self._inner.get_run_id(), self._node)
        self._writer.write(decision)

    def stand_in_for_excluded(self, node: str) -> bool:
        """Check in at this round's exit barrier for ``node``, just excluded (:mod:`.exit_barrier`)."""
        return stand_in_for_excluded(self._round_store, self._round_nodes, node, self._node)

    # -- RendezvousHandler ----------------------------------------------------------
    def get_backend(self) -> str:
        return self._backend

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        if self._relay is not None:
            self._relay.start()
        reason = self.excluded()
        if reason is not None:
            check_in_leaving(self._round_store, self._round_nodes, self._node)
            stock.leave(self._inner)
            why = f"node {self._node} is excluded from the job: {reason}"
            write_exit_note(why)
            raise RendezvousGracefulExitError(why)
        generation = self.generation()  # read before joining: a later exclusion is checked
        rejoin = self._round.prefix is not None   # this node's torchrun restarts its workers
        while True:
            joined = self._round.join() or (self._round.standby() if self._job_full() else None)
            if joined is not None:
                self._joined_generation = generation
                return joined
            if self._wait_as_spare():
                continue  # the round lost a node in process: join it the same way
            if rejoin:
                rejoin = False
                if self._round_nodes > 1 and self._round.await_room(f"node {self._node} restarts its workers",
                                                                    unless_idle=_REJOIN_GRACE):
                    continue  # the others left this node out in process: join them there
            try:
                self._lifeline.drop_lost()
                info = self._inner.next_rendezvous()
                break
            except RendezvousTimeoutError:
                if not self._job_full():
                    raise
                log.warning("rankwatch: node %s timed out in the wait list of a full job; it "
                            "waits on as a hot spare", self._node)
        self._joined_generation = generation
        self._round_store = info.store  # this round's own (prefixed) store
        self._round_nodes = info.world_size
        try:
            self._round_store.set(MEMBER_PREFIX + self._node, "1")
        except Exception as exc:  # noqa: BLE001 - without it every exclusion restarts this round
            log.warning("rankwatch: could not record this node in the round (%s)", exc)
            self._round_store = None
        self._round.export(stock.stock_round(self._inner), self._round_store, info.world_size)
        return info

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join, as torchrun's agent asks between its worker checks.

        A store that does not answer now (etcd electing a new leader after a member died, a
        store under load) counts as no node waiting: torchrun asks again at its next
        monitor interval, and its workers train on.  An exception here would end torchrun,
        and the job with it.
        """
        try:
            return self._num_nodes_waiting()
        except Exception as exc:  # noqa: BLE001 - the store's errors vary by backend
            now = time.monotonic()
            if now - self._store_trouble_logged >= _STORE_TROUBLE_LOG_EVERY:
                self._store_trouble_logged = now
                log.warning("rankwatch: the rendezvous store did not answer (%s: %s); training goes "
                            "on, asking again", type(exc).__name__, exc)
            return 0

    def _num_nodes_waiting(self) -> int:
        if self._round.joined is not None:
            # Not in the stock round: nobody waits on this node.  It restarts only to leave
            # (excluded) or with the round (torchrun restarts it to admit a node).
            return 1 if self.excluded() is not None or self._round.restarting() else 0
        waiting = self._nodes_waiting()
        if not waiting and self.excluded() is None and self._round.restarting():
            # Another node of the round restarts its workers (to admit a node): this one's
            # workers wait to be stopped rather than regroup without it, so restart with it.
            return 1
        if waiting and self.excluded() is None:
            # (An excluded node's restart is its leaving: the others do regroup without it.)
            self._round.mark_restarting()
        return waiting

    def _nodes_waiting(self) -> int:
        self._round.check_in_regrouped()
        if self.excluded() is not None or self._restart_needed():
            return max(1, self._inner.num_nodes_waiting())
        waiting = self._inner.num_nodes_waiting()  # syncs the state _job_full reads
        if waiting and self._job_full(sync=False, spare=False):
            return 0  # a restart cannot admit them: they are spares until a round has room
        return waiting

    def _job_full(self, sync: bool = True, spare: bool = True) -> bool:
        """True when the current round is complete with MAX nodes (:func:`stock.job_full`)."""
        return stock.job_full(self._inner, sync, spare)

    def _wait_as_spare(self) -> bool:
        """Wait, outside the stock join loop, while the job is full.  True: the round lost a
        node in process meanwhile, so this node can join it in process."""
        if not self._job_full():
            return False
        log.warning("rankwatch: the job is full; node %s waits as a hot spare", self._node)
        while self._job_full():
            if self.excluded() is not None:
                return False  # next_rendezvous's caller refuses it on its next call
            if self._round.room() is not None:
                return True
            time.sleep(_SPARE_POLL)
        # A node left the round.  If its workers recover in process, the survivors are
        # leaving it out now (an excluded node may leave the rendezvous before they say so):
        # join them there rather than restart every node's workers through the rendezvous.
        if self._round.await_room(f"hot spare {self._node} sees room"):
            return True
        log.warning("rankwatch: a round has room; hot spare %s joins", self._node)
        return False

    def _restart_needed(self) -> bool:
        """True when an exclusion since this node joined concerns a member of its round."""
        current = self.generation()
        if current <= self._joined_generation:
            return False
        for g in range(self._joined_generation + 1, current + 1):
            node = self._exclusions.node_of(g)
            if node is None or self._round_store is None:
                return True  # unknown: restart, as is always safe
            if self._round_store.check([MEMBER_PREFIX + node]) and not self._round.regrouped(node):
                if not self._awaiting_in_process(g):
                    return True
                return False  # asked again at torchrun's next check
            log.warning("rankwatch: node %s was excluded (generation %d) but is not in this "
                        "round (or its workers already left it out); no restart needed", node, g)
        self._joined_generation = current
        return False

    def in_process(self) -> bool:
        """This round's workers recover in process (they said so in the store)."""
        return self._round.capable()

    def _awaiting_in_process(self, generation: int) -> bool:
        """Hold the restart for ``generation``'s exclusion while the workers may still leave the
        excluded node out in process (then no restart is needed); give up after a while."""
        if not self.in_process():
            return False
        first = self._deferred.setdefault(generation, time.monotonic())
        if time.monotonic() - first < IN_PROCESS_WAIT:
            return True
        log.warning("rankwatch: the workers did not leave the excluded node out in process within "
                    "%.0f s; restarting the round", IN_PROCESS_WAIT)
        return False

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        self._lifeline.close()
        if self._relay is not None:
            self._relay.stop()
        if self._round.joined is not None:
            return True  # never in the stock round: closing it would close it for the others
        if self._exclusions.reason is not None:
            # Leave now (a torchrun that gives up on its workers, --max-restarts 0, never asks
            # for the next round, where an excluded node leaves), so that a spare finds room
            # without waiting for this node's keep-alive to expire; and do not close the
            # rendezvous for every node, as the stock shutdown would.
            stock.leave(self._inner)
            return True
        return self._inner.shutdown()

