"""torchrun rendezvous backend ``rankwatch``: the stock c10d dynamic rendezvous, plus exclusions.

Registered through the ``torchrun.handlers`` entry point, so torchrun's own
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
* a node of a round whose workers recover in process, whose torchrun restarts its
  workers because one of them failed, waits for the other nodes' workers to leave it
  out in process, and sends its new workers to join them there (as a spare's), so no
  other node restarts.

Exclusions and the generation live in the rendezvous store under
``rankwatch/<run_id>/``.  Only the coordinator's decisions are written: a
relay thread in each node's torchrun (:mod:`.rdzv_relay`) polls its local
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
import socket
import time
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from rankwatch.address import AGENT_ENV, EXIT_NOTE_ENV, NODE_ID_ENV, Address
from rankwatch.hooks.rdzv_relay import DecisionRelay
from rankwatch.hooks.recovery_store import (
    ATTEMPTS_COUNT,
    CAPABLE_KEY,
    DECIDED_COUNT,
    JOIN_ENV,
    JOINED_COUNT,
    REGROUPED_COUNT,
    REGROUPED_NODE,
    RESTARTING_KEY,
    ROUND_ENV,
    STORE_ENV,
    ForgedValue,
    Seal,
    admitted_key,
    etcd_endpoint,
    regrouped_key,
    round_key,
)

__all__ = ["BACKEND", "ETCD_BACKEND", "ExcludingRendezvousHandler", "create_etcd_handler", "create_handler",
           "etcd_handler_factory", "handler_factory"]

log = logging.getLogger(__name__)

BACKEND = "rankwatch"
ETCD_BACKEND = "rankwatch-etcd"
GENERATION_KEY = "generation"
EXCLUDED_PREFIX = "excluded/"
EXCLUSION_PREFIX = "exclusion/"  # exclusion/<generation> -> the node that generation excluded
MEMBER_PREFIX = "rankwatch/member/"  # in a round's own store: one key per member node
_LEAVE_TIMEOUT = timedelta(seconds=10)
# A round whose workers recover in process: how long an exclusion waits for them to leave the
# excluded node out (its relay kills its workers at once, which breaks their collectives)
# before the handler restarts the round through torchrun after all.
_IN_PROCESS_WAIT = 5.0
_SPARE_POLL = 0.5
# A node whose torchrun restarts its workers (one of them failed) waits this long for the
# round's other workers to begin leaving it out in process, before restarting the round.
_REJOIN_GRACE = 1.5
_STORE_TROUBLE_LOG_EVERY = 10.0   # seconds between warnings that the store does not answer


def handler_factory():
    """The ``torchrun.handlers`` entry point: returns the handler creator torchrun registers."""
    return create_handler


def etcd_handler_factory():
    """The ``torchrun.handlers`` entry point of ``rankwatch-etcd``."""
    return create_etcd_handler


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler over torch's c10d backend (its store lives in one node's torchrun)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    return _excluding(params, *create_backend(params))


def create_etcd_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler over torch's etcd-v2 backend (needs python-etcd and an etcd with the v2 API)."""
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

    return _excluding(params, *create_backend(params))


def _excluding(params: RendezvousParameters, backend: Any, store: Store) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as stock

    inner = stock(store, backend, params)
    node = os.environ.get(NODE_ID_ENV) or socket.gethostname()
    agent = os.environ.get(AGENT_ENV)
    return ExcludingRendezvousHandler(inner, store, node, Address.parse(agent) if agent else None,
                                      backend=params.backend)


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
        self._store = PrefixStore(f"rankwatch/{inner.get_run_id()}/", store)
        self._node = node
        self._joined_generation = 0
        self._round_store: Store | None = None
        self._raw_store = store
        self._round_nodes = 0
        self._checked_in = 0  # nodes left out in process that this handler has read
        self._deferred: dict[int, float] = {}  # generation -> when a restart for it was first held
        self._round_prefix: str | None = None  # this round's keys in the raw store, as the workers see them
        self._endpoint = _tcp_endpoint(store)
        self._excluded: str | None = None
        self._store_trouble_logged = float("-inf")
        self._relay = DecisionRelay(self, agent, relay_interval) if agent is not None else None
        self._tried_join = False
        self._joined_in_process: str | None = None  # the round's prefix, once joined in process
        self._admitted_at: bytes | None = None  # when this node last joined in process: its workers' last admission
        try:
            self._seal = Seal.from_env(os.environ)   # the workers' values are sealed with the job's token
        except ValueError as exc:
            log.warning("rankwatch: %s: the workers' marks in the recovery store will not open here; this "
                        "node restarts its workers through torchrun instead", exc)
            self._seal = Seal("\0unreadable token file")

    # -- the store ------------------------------------------------------------------
    @property
    def node(self) -> str:
        """This node's id."""
        return self._node

    def generation(self) -> int:
        return int(self._store.add(GENERATION_KEY, 0))  # add(0) reads without blocking

    def excluded(self) -> str | None:
        if self._excluded is None:
            key = EXCLUDED_PREFIX + self._node
            if self._store.check([key]):
                self._excluded = self._store.get(key).decode(errors="replace") or "excluded"
        return self._excluded

    def write_decision(self, decision: dict[str, Any]) -> None:
        """Apply a coordinator decision to the store (idempotent)."""
        if decision["kind"] != "exclude":
            return
        key = EXCLUDED_PREFIX + decision["node"]
        if not self._store.check([key]):
            self._store.set(key, decision["reason"] or "excluded")
        self._store.set(f"{EXCLUSION_PREFIX}{decision['generation']}", decision["node"])
        current = self.generation()
        if decision["generation"] > current:
            self._store.add(GENERATION_KEY, decision["generation"] - current)
        log.warning("rankwatch: wrote %s (node %s, generation %d) to the rendezvous store",
                    decision["id"], decision["node"], decision["generation"])

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
            self._leave()
            why = f"node {self._node} is excluded from the job: {reason}"
            _write_exit_note(why)
            raise RendezvousGracefulExitError(why)
        generation = self.generation()  # read before joining: a later exclusion is checked
        rejoin = self._round_prefix is not None   # this node's torchrun restarts its workers
        while True:
            joined = self._join_in_process()
            if joined is not None:
                self._joined_generation = generation
                return joined
            if self._wait_as_spare():
                continue  # the round lost a node in process: join it the same way
            if rejoin:
                rejoin = False
                if self._round_nodes > 1 and self._await_room(f"node {self._node} restarts its workers",
                                                              unless_idle=_REJOIN_GRACE):
                    continue  # the others left this node out in process: join them there
            try:
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
        self._checked_in = 0
        self._export_recovery_store()
        try:
            self._round_store.set(MEMBER_PREFIX + self._node, "1")
        except Exception as exc:  # noqa: BLE001 - without it every exclusion restarts this round
            log.warning("rankwatch: could not record this node in the round (%s)", exc)
            self._round_store = None
        return info

    def _export_recovery_store(self) -> None:
        """Name the rendezvous store and this round to the round's workers (they inherit this
        process's environment): their in-process recovery agrees there."""
        try:
            round_ = int(self._inner._state_holder.state.round)
        except Exception:  # noqa: BLE001 - private API: the workers fall back to their own store
            round_ = None
        if self._endpoint is None or round_ is None:
            self._round_prefix = None
            os.environ.pop(STORE_ENV, None)
            os.environ.pop(ROUND_ENV, None)
            return
        self._round_prefix = f"rankwatch/{self.get_run_id()}/{round_key(round_)}"
        os.environ[STORE_ENV] = self._endpoint
        os.environ[ROUND_ENV] = self._round_prefix
        os.environ.pop(JOIN_ENV, None)

    # -- joining a round in process -----------------------------------------------------
    def _join_room(self) -> str | None:
        """The current round's key prefix when this node can join it in process: its workers
        recover in process, it lost more nodes that way than have joined since, and it is
        not restarting.  None otherwise (and always after one try: a second call for the
        next rendezvous means this node's workers could not join, so join the usual way)."""
        prefix = self._in_process_round()
        return prefix if prefix is not None and self._has_room(prefix) else None

    def _has_room(self, prefix: str) -> bool:
        """The round under ``prefix`` lost more nodes in process than have joined it since."""
        raw = self._raw_store
        try:
            return int(raw.add(prefix + REGROUPED_COUNT, 0)) > int(raw.add(prefix + JOINED_COUNT, 0))
        except Exception as exc:  # noqa: BLE001 - a store hiccup: join the usual way
            log.debug("rankwatch: no in-process join: %s", exc)
            return False

    def _in_process_round(self) -> str | None:
        """The current round's key prefix when a node could join it in process (its workers
        recover in process and it is not restarting), before it has room; None otherwise."""
        if (self._tried_join and not self._admitted_since()) or self._endpoint is None:
            return None
        inner = self._inner
        try:
            with inner._heartbeat_lock:
                inner._state_holder.sync()
            state = inner._state_holder.state
            if not state.complete or state.closed:
                return None
            prefix = f"rankwatch/{self.get_run_id()}/{round_key(int(state.round))}"
            raw = self._raw_store
            if not raw.check([prefix + CAPABLE_KEY]) or raw.check([prefix + RESTARTING_KEY]):
                return None
        except Exception as exc:  # noqa: BLE001 - private API or a store hiccup: join the usual way
            log.debug("rankwatch: no in-process join: %s", exc)
            return None
        return prefix

    def _join_in_process(self) -> RendezvousInfo | None:
        """Send this node's workers to join the round's survivors in process (see
        :mod:`rankwatch.hooks.recovery`); None: join through the rendezvous as usual.

        The node does not enter the stock rendezvous, so no node restarts its workers for
        it.  Its torchrun gets a round of its own (one node, a private store) to start the
        workers in; they learn their place in the job from the survivors."""
        prefix = self._join_room()
        if prefix is None:
            return None
        raw = self._raw_store
        if int(raw.add(prefix + JOINED_COUNT, 1)) > int(raw.add(prefix + REGROUPED_COUNT, 0)):
            raw.add(prefix + JOINED_COUNT, -1)  # another node took the room meanwhile
            return None
        from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
        from torch.distributed.elastic.utils.distributed import get_free_port

        assert self._endpoint is not None
        self._tried_join = True
        self._joined_in_process = prefix
        self._admitted_at = self._admission(prefix)
        self._round_prefix = prefix
        os.environ[STORE_ENV] = self._endpoint
        os.environ[ROUND_ENV] = prefix
        os.environ[JOIN_ENV] = "1"
        own = PrefixStore(f"rankwatch/{self.get_run_id()}/joining/{self._node}/{time.time_ns()}/", raw)
        log.warning("rankwatch: node %s joins the running round in process (it lost a node that way); "
                    "no node restarts its workers for it", self._node)
        return RendezvousInfo(own, 0, 1, RendezvousStoreInfo(socket.getfqdn(), get_free_port()))

    def _opened(self, key: str) -> bytes | None:
        """The workers' value at ``key``; None when there is none, or it is forged."""
        if not self._raw_store.check([key]):
            return None
        try:
            return self._seal.open(key, self._raw_store.get(key))
        except ForgedValue as exc:
            log.warning("rankwatch: ignored: %s", exc)
            return None

    def _admission(self, prefix: str) -> bytes | None:
        return self._opened(prefix + admitted_key(self._node))

    def _admitted_since(self) -> bool:
        """This node's workers were admitted in process since it last sent them to join: the
        node is a member of the round like any other, and when a worker of it dies, it joins
        again the same way.  Otherwise a second call means its workers could not join: join
        the usual way."""
        prefix = self._joined_in_process
        if prefix is None:
            return False
        try:
            now = self._admission(prefix)
        except Exception as exc:  # noqa: BLE001 - a store hiccup: join the usual way
            log.debug("rankwatch: no second in-process join: %s", exc)
            return False
        return now is not None and now != self._admitted_at

    def _regrouped(self, node: str) -> bool:
        """The round's workers left ``node`` out themselves (an in-process recovery)."""
        return self._round_prefix is not None and self._opened(self._round_prefix + regrouped_key(node)) is not None

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

    def _check_in_regrouped(self) -> None:
        """Stand in, at torchrun's exit barrier, for each node the workers left out in process.

        torchrun's agents wait at the end of a round until every node of the round checked
        in there (up to 300 s); a node whose workers were left out in process is gone and
        never does.  One survivor checks in for it (whichever gets there first)."""
        if self._round_prefix is None or self._round_store is None:
            return
        count = int(self._raw_store.add(self._round_prefix + REGROUPED_COUNT, 0))
        if count <= self._checked_in:
            return
        from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
        from torch.distributed.elastic.utils.store import _barrier_nonblocking

        for i in range(self._checked_in + 1, count + 1):
            key = f"{self._round_prefix}{REGROUPED_NODE}{i}"
            if not self._raw_store.check([key]):
                return  # being written: the next check reads it
            self._checked_in = i
            opened = self._opened(key)
            if opened is None:
                continue   # forged: no check-in for a node the workers did not leave out
            node = opened.decode(errors="replace")[:256]
            if self._round_store.add(f"rankwatch/exit_check_in/{node}", 1) == 1:
                _barrier_nonblocking(self._round_store, self._round_nodes, _TERMINAL_STATE_SYNC_ID)
                log.warning("rankwatch: node %s was left out in process; checked in for it at "
                            "torchrun's exit barrier", node)

    def _num_nodes_waiting(self) -> int:
        if self._joined_in_process is not None:
            # Not in the stock round: nobody waits on this node.  It restarts only to leave
            # (excluded) or with the round (torchrun restarts it to admit a node).
            restarting = self._raw_store.check([self._joined_in_process + RESTARTING_KEY])
            return 1 if self.excluded() is not None or restarting else 0
        waiting = self._nodes_waiting()
        if not waiting and self._round_prefix is not None and self.excluded() is None \
                and self._raw_store.check([self._round_prefix + RESTARTING_KEY]):
            # Another node of the round restarts its workers (to admit a node): this one's
            # workers wait to be stopped rather than regroup without it, so restart with it.
            return 1
        if waiting and self._round_prefix is not None and self.excluded() is None:
            # Before torchrun stops this node's workers: the others' workers, whose collectives
            # that breaks, must not take it for a lost node and regroup without this one.  (An
            # excluded node's restart is its leaving: the others do regroup without it.)
            key = self._round_prefix + RESTARTING_KEY
            self._raw_store.set(key, self._seal.seal(key, self._node))
        return waiting

    def _nodes_waiting(self) -> int:
        self._check_in_regrouped()
        if self.excluded() is not None or self._restart_needed():
            return max(1, self._inner.num_nodes_waiting())
        waiting = self._inner.num_nodes_waiting()  # syncs the state _job_full reads
        if waiting and self._job_full(sync=False, spare=False):
            return 0  # a restart cannot admit them: they are spares until a round has room
        return waiting

    def _job_full(self, sync: bool = True, spare: bool = True) -> bool:
        """True when the current round is complete with MAX nodes (and, with ``spare``, this
        node is not among them)."""
        inner = self._inner
        try:
            if sync:
                with inner._heartbeat_lock:
                    inner._state_holder.sync()
            state = inner._state_holder.state
            return (state.complete and not state.closed
                    and len(state.participants) >= inner._settings.max_nodes
                    and not (spare and inner._this_node in state.participants))
        except Exception:  # noqa: BLE001 - private API: behave as the stock handler
            return False

    def _wait_as_spare(self) -> bool:
        """Wait, outside the stock join loop, while the job is full.  True: the round lost a
        node in process meanwhile, so this node can join it in process."""
        if not self._job_full():
            return False
        log.warning("rankwatch: the job is full; node %s waits as a hot spare", self._node)
        while self._job_full():
            if self.excluded() is not None:
                return False  # next_rendezvous's caller refuses it on its next call
            if self._join_room() is not None:
                return True
            time.sleep(_SPARE_POLL)
        # A node left the round.  If its workers recover in process, the survivors are
        # leaving it out now (an excluded node may leave the rendezvous before they say so):
        # join them there rather than restart every node's workers through the rendezvous.
        if self._await_room(f"hot spare {self._node} sees room"):
            return True
        log.warning("rankwatch: a round has room; hot spare %s joins", self._node)
        return False

    def _await_room(self, why: str, unless_idle: float | None = None) -> bool:
        """While the round's workers recover in process (and it is not restarting), wait up
        to ``_IN_PROCESS_WAIT`` s for them to leave a node out, so that this node can join
        them in process.  True: there is room.  With ``unless_idle``: stop waiting once that
        many seconds passed with no agreement under way among the round's workers.

        Two nodes wait here: a spare that saw a node leave, and a node of the round whose
        torchrun restarts its workers after one of them failed (its surviving workers are
        left out with it, and the ones it starts again join as a spare's would).  Without
        the wait, either would enter the stock rendezvous, and every node would restart.
        A round that gives up on recovering in process is marked restarting, which ends
        the wait at once."""
        start = time.monotonic()
        while (prefix := self._in_process_round()) is not None and time.monotonic() - start < _IN_PROCESS_WAIT:
            if self._has_room(prefix):
                log.warning("rankwatch: %s; the round's workers left a node out in process", why)
                return True
            if unless_idle is not None and time.monotonic() - start >= unless_idle and not self._agreeing(prefix):
                break
            time.sleep(_SPARE_POLL / 5)
        return False

    def _agreeing(self, prefix: str) -> bool:
        """The round's workers are agreeing on a new membership now."""
        raw = self._raw_store
        try:
            return int(raw.add(prefix + ATTEMPTS_COUNT, 0)) > int(raw.add(prefix + DECIDED_COUNT, 0))
        except Exception:  # noqa: BLE001 - a store hiccup: do not hold the restart for it
            return False

    def _restart_needed(self) -> bool:
        """True when an exclusion since this node joined concerns a member of its round."""
        current = self.generation()
        if current <= self._joined_generation:
            return False
        for g in range(self._joined_generation + 1, current + 1):
            node = self._excluded_by(g)
            if node is None or self._round_store is None:
                return True  # unknown: restart, as is always safe
            if self._round_store.check([MEMBER_PREFIX + node]) and not self._regrouped(node):
                if not self._awaiting_in_process(g):
                    return True
                return False  # asked again at torchrun's next check
            log.warning("rankwatch: node %s was excluded (generation %d) but is not in this "
                        "round (or its workers already left it out); no restart needed", node, g)
        self._joined_generation = current
        return False

    def in_process(self) -> bool:
        """This round's workers recover in process (they said so in the store)."""
        return self._round_prefix is not None and self._raw_store.check([self._round_prefix + CAPABLE_KEY])

    def _awaiting_in_process(self, generation: int) -> bool:
        """Hold the restart for ``generation``'s exclusion while the workers may still leave the
        excluded node out in process (then no restart is needed); give up after a while."""
        if not self.in_process():
            return False
        first = self._deferred.setdefault(generation, time.monotonic())
        if time.monotonic() - first < _IN_PROCESS_WAIT:
            return True
        log.warning("rankwatch: the workers did not leave the excluded node out in process within "
                    "%.0f s; restarting the round", _IN_PROCESS_WAIT)
        return False

    def _excluded_by(self, generation: int) -> str | None:
        key = f"{EXCLUSION_PREFIX}{generation}"
        if not self._store.check([key]):
            return None
        return self._store.get(key).decode(errors="replace")

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        if self._relay is not None:
            self._relay.stop()
        if self._joined_in_process is not None:
            return True  # never in the stock round: closing it would close it for the others
        if self._excluded is not None:
            # Leave now (a torchrun that gives up on its workers, --max-restarts 0, never asks
            # for the next round, where an excluded node leaves), so that a spare finds room
            # without waiting for this node's keep-alive to expire; and do not close the
            # rendezvous for every node, as the stock shutdown would.
            self._leave()
            return True
        return self._inner.shutdown()

    def _leave(self) -> None:
        """Leave the rendezvous now rather than when this node's keep-alive expires."""
        try:
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

            self._inner._stop_heartbeats()
            self._inner._op_executor.run(_RendezvousExitOp(),
                                         self._inner._get_deadline(_LEAVE_TIMEOUT))
        except Exception as exc:  # noqa: BLE001 - private API; the keep-alive expiry still works
            log.warning("rankwatch: could not leave the rendezvous early (%s); the others wait "
                        "for this node's keep-alive to expire", exc)


def _write_exit_note(why: str) -> None:
    """Tell ``rankwatch run`` (through ``RANKWATCH_EXIT_NOTE``) that this node was refused."""
    path = os.environ.get(EXIT_NOTE_ENV)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(why[:1000])
    except OSError as exc:  # the refusal stands; only the wrapper's exit code depends on it
        log.warning("rankwatch: could not write the exit note %s (%s)", path, exc)


def _tcp_endpoint(store: Store) -> str | None:
    """Where the workers reach the rendezvous store: ``HOST:PORT`` of a TCPStore (the c10d
    backend's), ``etcd://HOST:PORT/PREFIX`` of an EtcdStore (etcd-v2's), else None."""
    from torch.distributed import TCPStore

    if not isinstance(store, TCPStore):
        return etcd_endpoint(store)
    try:
        return f"{store.host}:{store.port}"
    except Exception:  # noqa: BLE001
        return None
