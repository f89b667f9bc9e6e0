"""The workers' side of the in-process recovery protocol, in the recovery store.

One :class:`Round` per worker: the keys of its torchrun round (``<prefix>inproc/...``), every
value sealed with the job's token when it has one (:class:`~rankwatch.hooks.recovery.store.Seal`).
What lives here is what the workers say to each other through the store:

* **members**: each rank's node and liveness address, and the world it started with;
* **agreement** (:meth:`Round.agree`): each survivor posts the step it completed (one key per
  post, numbered by arrival; a node's first rank may post for its whole node,
  :meth:`Round.post_many`); the first to arrive waits for the others (or proof that they are
  gone, or ``settle`` seconds, :func:`~rankwatch.hooks.recovery.tally.gather`), then writes
  the decision of :func:`~rankwatch.hooks.recovery.decide.decide` for every one;
* **joining**: a joiner's request, the survivors' answer (a generation, or why not), and the
  mark that the job finished.

The process side (process groups, the job, the state) is :mod:`rankwatch.hooks.recovery.inprocess`'s.
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import time
from collections.abc import Mapping
from typing import Any

from rankwatch.address import NODE_ID_ENV
from rankwatch.hooks.recovery import net
from rankwatch.hooks.recovery.decide import (
    JOINER_BASE, MAX_MESSAGE, Decision, Joiner, Membership, decide, from_checkpoint, from_snapshots,
    grows_by_resharding, placeable,
)
from rankwatch.hooks.recovery.tally import Entry, encode_post, gather
from rankwatch.hooks.recovery.store import (
    ATTEMPTS_COUNT,
    CAPABLE_KEY,
    DECIDED_COUNT,
    RESTARTING_KEY,
    ForgedValue,
    Seal,
    admitted_key,
    mark_regrouped,
)

__all__ = ["JobFinished", "RecoveryFailed", "Round", "RESTARTING"]

log = logging.getLogger(__name__)

RESTARTING = "torchrun is restarting the round"
"""In a failed decision's error: torchrun stops the workers itself (they wait, not exit)."""
_MAX_JOIN_LOOK = 1024
"""The most recent join requests read per look (a counter in the store is no bound of its own)."""
_FINISHED = "finished"       # a join answer: the survivors finished the job
_DECISION_WAIT = 30.0        # seconds past ``settle`` a survivor waits for the first one's decision


class RecoveryFailed(RuntimeError):
    """The in-process attempt cannot recover this failure; torchrun's restart must."""


class JobFinished(SystemExit):
    """Raised by a joining worker's :meth:`InProcessRecovery.start` when the survivors finished
    the job while it waited: nothing is left to train.  A ``SystemExit`` with status 0, so an
    uncaught one ends the worker cleanly (and its node's torchrun with success); a loop with
    work of its own to do at the end may catch it."""

    def __init__(self, step: int) -> None:
        super().__init__(0)
        self.step = step
        """The job's last step, as the survivors finished it."""


class Round:
    """Args:
        store: a client of the recovery store (:func:`~rankwatch.hooks.recovery.store.connect`).
        prefix: this round's prefix in it.
        env: the worker's environment (node id, the job's token).
        settle: seconds the agreement waits for a member that neither arrived nor is proven gone.

    Raises:
        ValueError: the job's token file is named but unreadable.
    """

    def __init__(self, store: Any, prefix: str, env: Mapping[str, str], settle: float) -> None:
        self.store = store
        self.prefix = prefix
        self.node = env.get(NODE_ID_ENV) or socket.gethostname()
        self.seal = Seal.from_env(env)
        self._settle = settle

    # -- values ----------------------------------------------------------------------
    def key(self, suffix: str) -> str:
        return self.prefix + "inproc/" + suffix

    def _put(self, key: str, value: str) -> None:
        self.store.set(key, self.seal.seal(key, value))

    def _read(self, key: str, store: Any = None, cap: int = MAX_MESSAGE) -> str:
        """The value at ``key``, opened; raises :class:`ForgedValue` for one that does not open."""
        return self.seal.open(key, (store or self.store).get(key)).decode(errors="replace")[:cap]

    def put(self, suffix: str, value: str) -> None:
        self._put(self.key(suffix), value)

    def read(self, suffix: str, store: Any = None, cap: int = MAX_MESSAGE) -> str:
        return self._read(self.key(suffix), store, cap)

    def has(self, suffix: str, store: Any = None) -> bool:
        return bool((store or self.store).check([self.key(suffix)]))

    def said(self, suffix: str, store: Any = None) -> bool:
        """A worker of the job said it: the key is there and opens under the job's token (a
        value written without the token counts as nothing, and is logged)."""
        if not self.has(suffix, store):
            return False
        try:
            self.read(suffix, store, cap=64)
            return True
        except ForgedValue as exc:
            log.warning("rankwatch: %s", exc)
            return False

    # -- members ---------------------------------------------------------------------
    def register(self, rank: int, world: int, live_address: str) -> None:
        """A member of generation 0: its node, its liveness port; rank 0 the world's size.
        Then the node's rendezvous handler defers its restarts to the workers."""
        self.put(f"node/{rank}", self.node)
        self.put(f"live/{rank}", live_address)
        if rank == 0:
            self.put("world0", str(world))
        self.store.set(self.prefix + CAPABLE_KEY, "1")

    def live_address(self, rank: int) -> str:
        """Where member ``rank``'s liveness port listens; "" when unknown (or forged)."""
        try:
            return self.read(f"live/{rank}", cap=64) if self.has(f"live/{rank}") else ""
        except ForgedValue as exc:
            log.warning("rankwatch: %s", exc)
            return ""

    def process_group_store(self, generation: int) -> Any:
        import torch.distributed as dist

        return dist.PrefixStore(self.key(f"gen/{generation}/pg/"), self.store)

    # -- joining ---------------------------------------------------------------------
    def ask_to_join(self, live_address: str, local_rank: int, local_world: int, standby: bool = False,
                    reload: bool = False) -> int:
        """Post a join request (``standby``: a hot spare's, for a lost node's place only;
        ``reload``: its loop can load a checkpoint); returns this worker's id (``JOINER_BASE + n``)."""
        n = int(self.store.add(self.key("join/seq"), 1))
        me = JOINER_BASE + n
        self.put(f"node/{me}", self.node)
        self.put(f"live/{me}", live_address)
        self.put(f"join/{n}", json.dumps({"node": self.node, "local_rank": local_rank, "local_world": local_world,
                                          "standby": standby, "reload": reload}))
        return me

    def await_admission(self, me: int, timeout: float) -> tuple[int, Decision]:
        """Wait until the survivors answer joiner ``me``; its generation and their decision.

        Raises:
            JobFinished: the survivors finished the job meanwhile.
            RecoveryFailed: not admitted in time, turned away, or a forged answer.
        """
        # Asked first, then looked: the survivors' rank 0 marks the job finished first, then
        # answers whoever asked, so one of the two sees the other (:meth:`tell_finished`).
        self.raise_if_finished()
        try:
            self.store.wait([self.key(f"joined/{me}")], datetime.timedelta(seconds=timeout))
        except Exception as exc:  # noqa: BLE001 - the store's timeout error varies by backend
            raise RecoveryFailed(f"not admitted within {timeout:.0f} s: {exc}") from exc
        try:
            answer = self.read(f"joined/{me}")
            if answer.startswith(_FINISHED):
                self.raise_if_finished()
            if not answer.isdigit():
                raise RecoveryFailed(f"the survivors turned this worker away: {answer}")
            gen = int(answer)
            key = f"gen/{gen}/decision"
            self.store.wait([self.key(key)], datetime.timedelta(seconds=60))
            world0 = int(self.read("world0", cap=16))
            within = tuple(range(world0)) + self._joiner_ids()
            return gen, Decision.from_json(self.read(key, cap=1 << 20), within)
        except ForgedValue as exc:
            raise RecoveryFailed(str(exc)) from exc

    def raise_if_finished(self, store: Any = None) -> None:
        if not self.has("finished", store):
            return
        try:
            text = self.read("finished", store, cap=32)
        except ForgedValue as exc:
            log.warning("rankwatch: %s", exc)
            return
        step = int(text) if text.isdigit() else -1
        log.warning("rankwatch: the job finished at step %d while this worker asked to join; it exits", step)
        raise JobFinished(step)

    def mark_admitted(self, generation: int) -> None:
        """The node's rendezvous handler reads it: its workers are members now, so when one of
        them dies, the node joins the same way again."""
        key = self.prefix + admitted_key(self.node)
        self.store.set(key, self.seal.seal(key, str(generation)))

    def joiners_asked(self, store: Any = None) -> int:
        return int((store or self.store).add(self.key("join/seq"), 0))  # add(0) reads

    def _joiner_ids(self) -> tuple[int, ...]:
        return tuple(range(JOINER_BASE + 1, JOINER_BASE + self.joiners_asked() + 1))

    def waiting_joiners(self, store: Any, settled: set[int]) -> list[Joiner]:
        """Workers that asked to join and were neither admitted nor turned away yet (one that
        does not parse, or is forged, is settled as ignored)."""
        out = []
        asked = self.joiners_asked(store)
        for n in range(max(1, asked - _MAX_JOIN_LOOK + 1), asked + 1):  # a bound on what the store can make us read
            if JOINER_BASE + n in settled or not self.has(f"join/{n}", store):
                continue  # settled, or asking now: seen at the next look
            try:
                d = json.loads(self.read(f"join/{n}", store, cap=512))
                standby, reload = d.get("standby", False), d.get("reload", False)
                if not isinstance(standby, bool) or not isinstance(reload, bool):
                    raise ValueError("standby and reload must be flags")
                out.append(Joiner(id=JOINER_BASE + n, node=str(d["node"])[:64], local_rank=int(d["local_rank"]),
                                  local_world=int(d["local_world"]), standby=standby, reload=reload))
            except (ValueError, KeyError, TypeError) as exc:   # ForgedValue is a ValueError
                log.warning("rankwatch: a join request that does not parse is ignored: %s", exc)
                settled.add(JOINER_BASE + n)
        return out

    def joiners_waiting(self, settled: set[int]) -> bool:
        """Some worker asks to join and was not answered yet (False on a store hiccup)."""
        try:
            return bool(self.waiting_joiners(self.store, set(settled)))
        except Exception as exc:  # noqa: BLE001 - the recovery goes on without them
            log.debug("rankwatch: looking for join requests: %s", exc)
            return False

    def tell_finished(self, step: int, settled: set[int]) -> int:
        """Mark the job finished at ``step`` and answer every waiting joiner so; how many."""
        self.put("finished", str(step))   # first: a joiner asking now looks
        waiting = self.waiting_joiners(self.store, settled)
        for j in waiting:
            self.put(f"joined/{j.id}", f"{_FINISHED} at step {step}")
            settled.add(j.id)
        return len(waiting)

    # -- agreement -------------------------------------------------------------------
    def post(self, old: Membership, member: int, completed: int, ready: bool = False,
             holdings: dict | None = None) -> int:
        """Post ``member``'s completed step (whether it is ready to finish the next, the peer
        snapshots it holds); its arrival number: 1 decides for all."""
        return self.post_many(old, {member: (completed, ready, holdings)})

    def post_many(self, old: Membership, entries: Mapping[int, Entry]) -> int:
        """One post for several members (a node's first rank for its node's workers): one
        arrival, one key (:mod:`~rankwatch.hooks.recovery.tally`); its arrival number."""
        gen = f"gen/{old.generation + 1}/"
        n = int(self.store.add(self.key(f"{gen}arrived"), 1))
        self.put(f"{gen}post/{n}", encode_post(entries))
        return n

    def collect(self, old: Membership) -> Decision:
        """The decision of generation ``old.generation + 1``, once the first to arrive wrote it."""
        key = f"gen/{old.generation + 1}/decision"
        self.store.wait([self.key(key)], datetime.timedelta(seconds=self._settle + _DECISION_WAIT))
        try:
            text = self.read(key, cap=1 << 20)
        except ForgedValue as exc:
            return Decision(ok=False, error=str(exc)[:MAX_MESSAGE])
        return Decision.from_json(text, tuple(old.members) + self._joiner_ids())

    def agree(self, old: Membership, completed: int, replica_size: int, ready: bool,
              settled: set[int], holdings: dict | None = None,
              node_entries: Mapping[int, Entry] | None = None) -> Decision:
        """Post this survivor's step (and the peer snapshots it holds; with ``node_entries``,
        those of its node's other workers, in the same post); the first to arrive decides for
        all (see the module).  A forged value read on the way fails the decision (torchrun's
        restart recovers)."""
        gen = f"gen/{old.generation + 1}/"
        entries = {**(node_entries or {}), old.members[old.rank]: (completed, ready, holdings)}
        if self.post_many(old, entries) != 1:
            return self.collect(old)
        store = self.store
        # torchrun may be stopping this worker right now (its node lost another): the
        # others wait on this decision, so it is written before a SIGTERM takes effect.
        with net.deferred_termination():
            store.add(self.prefix + ATTEMPTS_COUNT, 1)   # a restarting node waits while one is under way
            joiners = self.waiting_joiners(store, settled)
            try:
                decision = self._decide(old, gen, replica_size, joiners)
            except ForgedValue as exc:
                decision = Decision(ok=False, error=str(exc)[:MAX_MESSAGE])
            if decision.ok:
                for node in decision.dropped_nodes:  # the round goes on without it: no restart
                    mark_regrouped(store, self.prefix, node, old.generation + 1, self.seal)
            else:
                self.mark_restarting()
            self.put(f"{gen}decision", decision.to_json())
            store.add(self.prefix + DECIDED_COUNT, 1)
            # Joiners wait on their own key: admitted ones read this generation's decision.
            before = set(old.members)   # a set: a world of 16,384 made this loop quadratic
            for j in (r for r in decision.members if r not in before):
                self.put(f"joined/{j}", str(old.generation + 1))
            turned = set(decision.refused) | ({j.id for j in joiners} if not decision.ok else set())
            for j in turned:
                self.put(f"joined/{j}", f"refused: {decision.note or decision.error}"[:MAX_MESSAGE])
            return decision

    def mark_restarting(self) -> None:
        """Every worker exits for torchrun's restart (a failed decision, or a failure after an
        agreed one): no restarted worker may wait to join this round in process."""
        key = self.prefix + RESTARTING_KEY
        self.store.set(key, self.seal.seal(key, self.node))

    def _decide(self, old: Membership, gen: str, replica_size: int, joiners: list[Joiner]) -> Decision:
        tally = gather(self, gen, old.members, self._settle)
        arrived = tally.steps
        node_of = self._nodes(old.members)
        joiners = placeable(joiners, old.members, arrived, node_of)
        restarting = self.prefix + RESTARTING_KEY
        if self.store.check([restarting]):  # torchrun stops the workers itself
            by = self._read(restarting, cap=64)
            return Decision(ok=False, error=f"{RESTARTING}: node {by} restarts its workers")
        decision = decide(old.members, arrived, node_of, replica_size, joiners, tally.ready)
        holdings = tally.holdings
        if not holdings or (decision.ok and not grows_by_resharding(replica_size, old.members, joiners)):
            return decision
        again = from_snapshots(old.members, arrived, node_of, holdings, joiners)
        if again.ok:
            return again
        last = from_checkpoint(old.members, arrived, node_of, {r for r, h in holdings.items() if h["reload"]}, joiners)
        return last if last.ok else Decision(
            ok=False, error=f"{decision.error}; {again.error}; {last.error}"[:MAX_MESSAGE])

    def values(self, suffixes: list[str], cap: int) -> list[str]:
        """The values at ``suffixes`` (all present), opened, in one ``multi_get`` where the
        store has it; raises :class:`ForgedValue` for one that does not open."""
        keys = [self.key(s) for s in suffixes]
        try:
            raw = self.store.multi_get(keys) if keys else []
        except (AttributeError, NotImplementedError, RuntimeError):   # a store without multi_get
            raw = [self.store.get(k) for k in keys]
        return [self.seal.open(k, v).decode(errors="replace")[:cap] for k, v in zip(keys, raw)]

    def _nodes(self, members: tuple[int, ...]) -> dict[int, str]:
        return dict(zip(members, self.values([f"node/{r}" for r in members], 64)))
