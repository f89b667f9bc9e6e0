"""The rendezvous handler's side of in-process recovery: its round's keys in the recovery store.

A round whose workers recover in process (:mod:`rankwatch.hooks.recovery.inprocess`) leaves a node
out without torchrun; the handler in each node's torchrun must then know it, or it would
restart every node's workers for something the workers already did.  :class:`InProcessRound`
is where the handler reads and writes the workers' keys of its round
(:mod:`rankwatch.hooks.recovery.store` names them):

* it names the store and the round to the workers it starts (:meth:`export`);
* it tells whether a node of the round was left out in process (:meth:`regrouped`), and
  checks in for such a node at torchrun's exit barrier (:meth:`check_in_regrouped`);
* it sends a node's workers to join the running round in process, as a spare's, when the
  round lost a node that way (:meth:`join`, :meth:`await_room`), so that no node restarts;
* it marks the round restarting, so the workers do not regroup without a node whose
  torchrun is about to restart them (:meth:`mark_restarting`).

Every value it reads from the workers is opened with the job's :class:`Seal`; a forged one
is treated as absent.  The handler's own rendezvous (:mod:`rankwatch.hooks.rendezvous.handler`)
decides when to ask.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import RendezvousInfo

from rankwatch.hooks.rendezvous.exit_barrier import stand_in
from rankwatch.hooks.recovery.store import (
    ATTEMPTS_COUNT,
    CAPABLE_KEY,
    DECIDED_COUNT,
    JOIN_ENV,
    JOINED_COUNT,
    REGROUPED_COUNT,
    REGROUPED_NODE,
    RESTARTING_KEY,
    ROUND_ENV,
    STANDBY_ENV,
    STORE_ENV,
    ForgedValue,
    Seal,
    admitted_key,
    etcd_endpoint,
    regrouped_key,
    round_key,
)

__all__ = ["InProcessRound"]

log = logging.getLogger(__name__)

# How long the handler waits for the round's workers to leave a node out in process before it
# restarts the round through torchrun after all: a node that would join them there, or an
# exclusion of a member (its relay kills its workers at once, which breaks their collectives).
IN_PROCESS_WAIT = 5.0
_POLL = 0.1
_FORGED_LOGGED_MAX = 64  # distinct forged keys warned about; beyond that, at debug level


class InProcessRound:
    """Args:
        raw: the rendezvous store, unprefixed (the workers' keys are under the run's prefix).
        run_id: the job's run id.
        node: this node's id.
        seal: the job's seal for the workers' values.
        current_round: the stock rendezvous's current round number, when it is complete and
            open (synced with the store); None otherwise.
    """

    def __init__(self, raw: Store, run_id: str, node: str, seal: Seal,
                 current_round: Callable[[], int | None]) -> None:
        self._raw = raw
        self._run = f"rankwatch/{run_id}/"
        self._node = node
        self._seal = seal
        self._current_round = current_round
        self.endpoint = _tcp_endpoint(raw)
        self.prefix: str | None = None     # this round's keys in the raw store, as the workers see them
        self.joined: str | None = None     # the round's prefix, once this node joined it in process
        self._round_store: Store | None = None
        self._round_nodes = 0
        self._checked_in = 0               # nodes left out in process that this node has read
        self._tried_join = False
        self._admitted_at: bytes | None = None  # this node's admission when it last sent workers to join
        self._forged_logged: set[str] = set()

    # -- a round of the stock rendezvous --------------------------------------------
    def export(self, round_: int | None, round_store: Store | None, round_nodes: int) -> None:
        """This node entered ``round_`` of the stock rendezvous: name the store and the round to
        the round's workers (they inherit this process's environment), where their in-process
        recovery agrees.  Without a usable store or round, the workers use their own."""
        self._round_store, self._round_nodes, self._checked_in = round_store, round_nodes, 0
        # A member of a stock round now: a round it once joined in process is over (its
        # restart mark would otherwise restart this node's workers at every check, forever).
        self.joined, self._tried_join = None, False
        os.environ.pop(STANDBY_ENV, None)
        if self.endpoint is None or round_ is None:
            self.prefix = None
            os.environ.pop(STORE_ENV, None)
            os.environ.pop(ROUND_ENV, None)
            return
        self.prefix = self._run + round_key(round_)
        os.environ[STORE_ENV] = self.endpoint
        os.environ[ROUND_ENV] = self.prefix
        os.environ.pop(JOIN_ENV, None)

    def capable(self) -> bool:
        """This round's workers recover in process (they said so in the store)."""
        return self.prefix is not None and self._raw.check([self.prefix + CAPABLE_KEY])

    def regrouped(self, node: str) -> bool:
        """The round's workers left ``node`` out themselves (an in-process recovery)."""
        return self.prefix is not None and self._open(self.prefix + regrouped_key(node)) is not None

    def restarting(self) -> bool:
        """Some node's torchrun restarts this round (the round this node joined in process, if any)."""
        prefix = self.joined or self.prefix
        return prefix is not None and self._raw.check([prefix + RESTARTING_KEY])

    def mark_restarting(self) -> None:
        """This node's torchrun is about to stop its workers: the others' workers, whose
        collectives that breaks, must not take it for a lost node and regroup without it."""
        if self.prefix is not None:
            key = self.prefix + RESTARTING_KEY
            self._raw.set(key, self._seal.seal(key, self._node))

    def check_in_regrouped(self) -> None:
        """Stand in, at torchrun's exit barrier, for each node the workers left out in process.

        torchrun's agents wait at the end of a round until every node of the round checked
        in there (up to 300 s); a node whose workers were left out in process is gone and
        never does.  One survivor checks in for it (whichever gets there first)."""
        if self.prefix is None or self._round_store is None:
            return
        count = int(self._raw.add(self.prefix + REGROUPED_COUNT, 0))
        if count <= self._checked_in:
            return
        for i in range(self._checked_in + 1, count + 1):
            key = f"{self.prefix}{REGROUPED_NODE}{i}"
            if not self._raw.check([key]):
                return  # being written: the next check reads it
            self._checked_in = i
            opened = self._open(key)
            if opened is None:
                continue   # forged: no check-in for a node the workers did not leave out
            node = opened.decode(errors="replace")[:256]
            if stand_in(self._round_store, self._round_nodes, node):
                log.warning("rankwatch: node %s was left out in process; checked in for it at "
                            "torchrun's exit barrier", node)

    # -- joining a round in process -------------------------------------------------
    def room(self) -> str | None:
        """The current round's key prefix when this node can join it in process: its workers
        recover in process, it lost more nodes that way than have joined since, and it is
        not restarting.  None otherwise (and always after one try, unless this node's workers
        were admitted since: a second call then means they could not join)."""
        prefix = self._joinable()
        return prefix if prefix is not None and self._has_room(prefix) else None

    def await_room(self, why: str, unless_idle: float | None = None) -> bool:
        """While the round's workers recover in process (and it is not restarting), wait up
        to ``IN_PROCESS_WAIT`` s for them to leave a node out, so that this node can join
        them in process.  True: there is room.  With ``unless_idle``: stop waiting once that
        many seconds passed with no agreement under way among the round's workers.

        Two nodes wait here: a spare that saw a node leave, and a node of the round whose
        torchrun restarts its workers after one of them failed (its surviving workers are
        left out with it, and the ones it starts again join as a spare's would).  Without
        the wait, either would enter the stock rendezvous, and every node would restart.
        A round that gives up on recovering in process is marked restarting, which ends
        the wait at once."""
        start = time.monotonic()
        while (prefix := self._joinable()) is not None and time.monotonic() - start < IN_PROCESS_WAIT:
            if self._has_room(prefix):
                log.warning("rankwatch: %s; the round's workers left a node out in process", why)
                return True
            if unless_idle is not None and time.monotonic() - start >= unless_idle and not self._agreeing(prefix):
                break
            time.sleep(_POLL)
        return False

    def join(self) -> RendezvousInfo | None:
        """Send this node's workers to join the round's survivors in process; None: join
        through the rendezvous as usual.

        The node does not enter the stock rendezvous, so no node restarts its workers for
        it.  Its torchrun gets a round of its own (one node, a private store) to start the
        workers in; they learn their place in the job from the survivors."""
        prefix = self.room()
        return None if prefix is None else self._claim(prefix, ahead=0)

    def standby(self) -> RendezvousInfo | None:
        """Start this node's workers as a hot spare of a full round whose workers recover in
        process: they ask to join ahead of any loss, and the survivors admit them at the
        next loss itself, into the lost node's place.  One node stands by at a time (it
        claims the next place in advance); None: another does, or the round cannot."""
        prefix = self._joinable()
        return None if prefix is None else self._claim(prefix, ahead=1)

    def _claim(self, prefix: str, ahead: int) -> RendezvousInfo | None:
        """Take a place the round lost (``ahead`` 1: the next one) and send the workers in."""
        raw = self._raw
        if int(raw.add(prefix + JOINED_COUNT, 1)) > int(raw.add(prefix + REGROUPED_COUNT, 0)) + ahead:
            raw.add(prefix + JOINED_COUNT, -1)  # another node took it meanwhile
            return None
        from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
        from torch.distributed.elastic.utils.distributed import get_free_port

        assert self.endpoint is not None
        self._tried_join = True
        self.joined = self.prefix = prefix
        self._admitted_at = self._admission(prefix)
        os.environ[STORE_ENV] = self.endpoint
        os.environ[ROUND_ENV] = prefix
        os.environ[JOIN_ENV] = "1"
        if ahead:
            os.environ[STANDBY_ENV] = "1"
        else:
            os.environ.pop(STANDBY_ENV, None)
        own = PrefixStore(f"{self._run}joining/{self._node}/{time.time_ns()}/", raw)
        log.warning("rankwatch: node %s %s; no node restarts its workers for it", self._node,
                    "stands by to take the next lost node's place in process" if ahead else
                    "joins the running round in process (it lost a node that way)")
        return RendezvousInfo(own, 0, 1, RendezvousStoreInfo(socket.getfqdn(), get_free_port()))

    def _joinable(self) -> str | None:
        """The current round's key prefix when a node could join it in process (its workers
        recover in process and it is not restarting), before it has room; None otherwise."""
        if (self._tried_join and not self._admitted_since()) or self.endpoint is None:
            return None
        try:
            round_ = self._current_round()
            if round_ is None:
                return None
            prefix = self._run + round_key(round_)
            if not self._raw.check([prefix + CAPABLE_KEY]) or self._raw.check([prefix + RESTARTING_KEY]):
                return None
        except Exception as exc:  # noqa: BLE001 - private API or a store hiccup: join the usual way
            log.debug("rankwatch: no in-process join: %s", exc)
            return None
        return prefix

    def _has_room(self, prefix: str) -> bool:
        """The round under ``prefix`` lost more nodes in process than have joined it since."""
        raw = self._raw
        try:
            return int(raw.add(prefix + REGROUPED_COUNT, 0)) > int(raw.add(prefix + JOINED_COUNT, 0))
        except Exception as exc:  # noqa: BLE001 - a store hiccup: join the usual way
            log.debug("rankwatch: no in-process join: %s", exc)
            return False

    def _agreeing(self, prefix: str) -> bool:
        """The round's workers are agreeing on a new membership now."""
        raw = self._raw
        try:
            return int(raw.add(prefix + ATTEMPTS_COUNT, 0)) > int(raw.add(prefix + DECIDED_COUNT, 0))
        except Exception:  # noqa: BLE001 - a store hiccup: do not hold the restart for it
            return False

    def _admitted_since(self) -> bool:
        """This node's workers were admitted in process since it last sent them to join: the
        node is a member of the round like any other, and when a worker of it dies, it joins
        again the same way.  Otherwise a second call means its workers could not join: join
        the usual way."""
        if self.joined is None:
            return False
        try:
            now = self._admission(self.joined)
        except Exception as exc:  # noqa: BLE001 - a store hiccup: join the usual way
            log.debug("rankwatch: no second in-process join: %s", exc)
            return False
        return now is not None and now != self._admitted_at

    def _admission(self, prefix: str) -> bytes | None:
        return self._open(prefix + admitted_key(self._node))

    def _open(self, key: str) -> bytes | None:
        """The workers' value at ``key``; None when there is none, or it is forged."""
        if not self._raw.check([key]):
            return None
        try:
            return self._seal.open(key, self._raw.get(key))
        except ForgedValue as exc:
            # Asked again at every poll: warn once per key, so a forger cannot flood the log.
            if key in self._forged_logged or len(self._forged_logged) >= _FORGED_LOGGED_MAX:
                log.debug("rankwatch: ignored: %s", exc)
            else:
                self._forged_logged.add(key)
                log.warning("rankwatch: ignored: %s", exc)
            return None


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
