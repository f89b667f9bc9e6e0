"""In-process recovery: the workers that survive a node's loss train on, without exiting.

torchrun's answer to a lost node is to stop every worker and start new ones: new
Python processes, torch imported again, the model wrapped again, the state read from
disk.  This tier keeps the survivors' processes and their state in memory:

1. **Leave the failed step.**  On NCCL the survivor aborts its communicators.  On gloo,
   the survivor whose collective failed shuts down its own connections of the failed
   process groups (:func:`_shut_group_sockets`).  Gloo cannot
   cancel a pending collective, and only a dead peer's direct neighbours see its
   connections break; shutting ours breaks our neighbours' pending collectives in
   turn, so every survivor leaves the step within milliseconds.  (A hung peer breaks
   nothing: the groups' timeout bounds that wait.)
2. **Agree** on the new membership in the recovery store (:mod:`recovery_store`), under a
   fresh prefix per generation: the first survivor to arrive decides, once every member
   arrived or is proven gone (its liveness port refuses connections), or after ``settle``
   seconds (a host that is down proves nothing).  The decision is :func:`decide`, a pure
   function.
3. **Re-initialise** the default process group among the survivors and call the user's
   ``make(membership)``, which builds the mesh, the model and the optimizer for the new
   world, exactly as it did at the start.
4. **Restore** each survivor's own shards of the parameters and of the optimizer state
   from memory.  That needs every lost rank's shards to have a copy on a survivor:
   replicas (HSDP's ``replicate`` dimension, or plain data parallelism) that lie whole on
   nodes.  A lost node then takes whole replicas with it, and the survivors' layout
   within a replica is unchanged.

Whatever cannot be done in process (a partial node, a broken replica, survivors that
disagree on the step) fails the attempt on every survivor: :class:`RecoveryFailed` is
raised, the workers exit, and torchrun's restart recovers the job as before.

Use from a training loop (the harness does the same)::

    tier = InProcessRecovery(make, monitor=mon)   # make(Membership) -> Job
    job = tier.start()
    step = 0
    while step < total:
        try:
            train_step(job, step)                 # forward, backward, optimizer step
            step += 1
            tier.stepped(step)                    # cheap: reports a recovery's first step
        except Exception as exc:
            job, step = tier.recover(exc, job, completed=step)   # or raises
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rankwatch.address import NODE_ID_ENV
from rankwatch.hooks.recovery_store import CAPABLE_KEY, RESTARTING_KEY, connect, mark_regrouped

__all__ = ["Decision", "InProcessRecovery", "Job", "Membership", "RecoveryFailed", "decide", "is_peer_failure"]

log = logging.getLogger(__name__)

_PEER_FAILURE_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error",
    "Write error", "Timed out waiting", "NCCL communicator was aborted", "ProcessGroupNCCL is aborted",
    "Socket Timeout", "Connection refused",
)
_MAX_MESSAGE = 400


class RecoveryFailed(RuntimeError):
    """The in-process attempt cannot recover this failure; torchrun's restart must."""


_RESTARTING = "torchrun is restarting the round"
_RESTART_GRACE = 60.0
"""Seconds a worker waits to be stopped when torchrun is already restarting the round."""


@dataclass(frozen=True)
class Membership:
    """Who trains in the current generation."""

    generation: int
    """0 at the start, one more per in-process recovery."""
    rank: int
    """This worker's rank in the current world."""
    world_size: int
    members: tuple[int, ...]
    """Each current rank's original rank (its rank at generation 0)."""
    dropped_nodes: tuple[str, ...] = ()
    """Nodes left out so far."""


@dataclass
class Job:
    """What ``make`` builds for a membership, and what the tier carries across a recovery."""

    model: Any
    optimizer: Any
    replica_size: int
    """Ranks holding one whole copy of the model (shards x tensor parallel): consecutive
    ranks ``[i*replica_size, (i+1)*replica_size)`` are one replica.  A job without
    replicas (its world is one replica) cannot recover a lost rank in process."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else of the user's (the mesh, a data loader); the tier does not touch it."""


@dataclass(frozen=True)
class Decision:
    ok: bool
    members: tuple[int, ...] = ()
    """Original ranks of the new world, in their new rank order."""
    dropped_nodes: tuple[str, ...] = ()
    step: int = 0
    error: str = ""

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "members": list(self.members), "dropped_nodes": list(self.dropped_nodes),
                           "step": self.step, "error": self.error[:_MAX_MESSAGE]})

    @classmethod
    def from_json(cls, text: str, within: Sequence[int]) -> Decision:
        """A decision read from the store, for a world of the original ranks ``within``.

        Raises:
            ValueError: not a decision for that world: members that are not unique ranks of
                it, more dropped nodes than lost ranks, a node name over 64 characters, or
                a step out of range.
        """
        if len(text) > 64 * (len(within) + 16):
            raise ValueError(f"decision of {len(text)} bytes for a world of {len(within)}")
        d = json.loads(text)
        members = tuple(int(r) for r in d["members"])
        dropped = tuple(str(n) for n in d["dropped_nodes"])
        step = int(d["step"])
        if len(set(members)) != len(members) or not set(members) <= set(within):
            raise ValueError(f"decision members {members[:16]} are not unique ranks of the world")
        if len(dropped) > len(within) - len(members) or any(len(n) > 64 for n in dropped):
            raise ValueError(f"decision drops {len(dropped)} nodes of {len(within) - len(members)} lost ranks")
        if not 0 <= step < 2**62:
            raise ValueError(f"decision step {step} out of range")
        return cls(ok=bool(d["ok"]), members=members, dropped_nodes=dropped, step=step,
                   error=str(d["error"])[:_MAX_MESSAGE])


def decide(members: Sequence[int], arrived: Mapping[int, int], node_of: Mapping[int, str],
           replica_size: int) -> Decision:
    """The new membership, from who arrived (original rank -> its last completed step).

    Args:
        members: the current world's original ranks, in current rank order.
        arrived: the survivors that reached the agreement, with their completed step.
        node_of: each original rank's node.
        replica_size: ranks per whole replica, in current rank order.
    """
    lost = [r for r in members if r not in arrived]
    if not lost:
        return Decision(ok=False, error="no rank was lost: the failure is not a lost peer")
    survivors = [r for r in members if r in arrived]
    lost_nodes = sorted({node_of.get(r, "?") for r in lost})
    split = sorted({node_of.get(r, "?") for r in survivors} & set(lost_nodes))
    if split:
        return Decision(ok=False, error=f"node(s) {', '.join(split)} lost some workers and kept others; "
                                        "torchrun restarts such a node")
    if replica_size <= 0 or len(members) % replica_size:
        return Decision(ok=False, error=f"replica size {replica_size} does not divide the world {len(members)}")
    for i in range(0, len(members), replica_size):
        replica = members[i:i + replica_size]
        gone = sum(r not in arrived for r in replica)
        if 0 < gone < len(replica):
            return Decision(ok=False, error=f"the replica of ranks {replica[0]}..{replica[-1]} lost {gone} of "
                                            f"{len(replica)} ranks: no survivor holds their shards")
    if not survivors:
        return Decision(ok=False, error="no survivor")
    steps = {arrived[r] for r in survivors}
    if len(steps) > 1:
        return Decision(ok=False, error=f"the survivors completed different steps ({sorted(steps)})")
    return Decision(ok=True, members=tuple(survivors), dropped_nodes=tuple(lost_nodes), step=steps.pop())


def is_peer_failure(exc: BaseException) -> bool:
    """True for a collective that failed because a peer died or hung (the tier's business)."""
    import torch.distributed as dist

    if isinstance(exc, RecoveryFailed):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _PEER_FAILURE_MARKERS)


class InProcessRecovery:
    """Args:
        make: builds the job for a membership; called after the default process group
            exists, by every member, with the same arguments.
        backend: the process groups' backend (``gloo``, ``nccl``).
        monitor: a rankwatch Monitor (its ``recovered`` reports each attempt), or None.
        settle: seconds the agreement waits for a member that neither arrived nor is proven
            gone (a hung process, a host that is down).
        timeout: the process groups' timeout: how long a collective waits for a hung peer.
        max_recoveries: in-process recoveries before the tier leaves it to torchrun.
    """

    def __init__(self, make: Callable[[Membership], Job], *, backend: str = "gloo", monitor: Any = None,
                 settle: float = 1.0, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                 max_recoveries: int = 8, env: Mapping[str, str] = os.environ) -> None:
        self._make = make
        self._backend = backend
        self._monitor = monitor
        self._settle = settle
        self._timeout = timeout
        self._max = max_recoveries
        self._env = env
        self._store: Any = None
        self._prefix = ""
        self._baseline: set[tuple] = set()
        self._excluded_endpoints: set[tuple[str, int]] = set()
        self.membership: Membership | None = None
        self._report: dict[str, Any] | None = None
        self._liveness: _Liveness | None = None

    # -- the start ------------------------------------------------------------------
    def start(self) -> Job:
        """Join the default process group (collective) and build the job for generation 0."""
        import torch.distributed as dist

        try:
            self._store, self._prefix = connect(self._env)
            self._excluded_endpoints = _store_endpoints(self._env)
        except Exception as exc:  # noqa: BLE001 - training goes on; only this tier is off
            log.warning("rankwatch: in-process recovery is off: no recovery store (%s)", exc)
            self._store = None
        # Connections opened from here on are the process groups' (and the worker store's,
        # used only to create them): a failure shuts them.
        self._baseline = _tcp_sockets()
        if not dist.is_initialized():
            dist.init_process_group(self._backend, timeout=self._timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
        self.membership = Membership(generation=0, rank=rank, world_size=world, members=tuple(range(world)))
        if self._store is not None:
            self._store.set(self._key(f"node/{rank}"), self._node())
            self._liveness = _Liveness()
            self._store.set(self._key(f"live/{rank}"), self._liveness.address)
            self._store.set(self._prefix + CAPABLE_KEY, "1")  # the handler defers its restarts to us
        return self._make(self.membership)

    # -- the hot path ---------------------------------------------------------------
    def stepped(self, step: int) -> dict[str, float] | None:
        """Call after each completed step.  After a recovery's first step, reports the
        recovery and returns its phases; else None."""
        if self._report is None:
            return None
        return self._finish_report(step)

    # -- a failure ------------------------------------------------------------------
    def recover(self, exc: BaseException, job: Job, completed: int) -> tuple[Job, int]:
        """Recover from ``exc`` in process and return the new job and the step to go on from.

        Raises ``exc`` itself when it is not a lost peer, and :class:`RecoveryFailed` when
        the survivors cannot go on in process (then the worker should exit, so that
        torchrun restarts it).
        """
        if not is_peer_failure(exc):
            raise exc
        caught = time.time()
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        try:
            if self._backend == "nccl":  # NCCL cancels its pending collectives itself
                _abort_nccl()
            shut = _shut_group_sockets(self._baseline, self._excluded_endpoints)
        except Exception as err:  # noqa: BLE001 - the groups' timeout still bounds the others' wait
            log.warning("rankwatch: could not abort the failed groups: %s", err)
            shut = 0
        assert self.membership is not None
        old = self.membership
        log.warning("rankwatch: rank %d: a collective failed at step %d (%s); shut %d connection(s) of "
                    "the failed groups; recovering in process", old.rank, completed + 1,
                    str(exc).splitlines()[0][:_MAX_MESSAGE], shut)
        try:
            if self._store is None:
                raise RecoveryFailed("no recovery store")
            if old.generation >= self._max:
                raise RecoveryFailed(f"{self._max} in-process recoveries already; leaving it to torchrun")
            shards = _local_state(job)
            _destroy_groups()
            phases["left_step"] = time.perf_counter() - t0
            decision = self._agree(old, completed, job.replica_size)
            phases["agreed"] = time.perf_counter() - t0
            if not decision.ok:
                raise RecoveryFailed(decision.error)
            me = old.members[old.rank]
            if me not in decision.members:
                raise RecoveryFailed("this rank arrived after the survivors had agreed without it")
            new = Membership(generation=old.generation + 1, rank=decision.members.index(me),
                             world_size=len(decision.members), members=decision.members,
                             dropped_nodes=old.dropped_nodes + decision.dropped_nodes)
            self._init_group(new)
            job = self._make(new)
            phases["reinitialised"] = time.perf_counter() - t0
            _restore(job, shards)
            phases["restored"] = time.perf_counter() - t0
        except Exception as failure:  # noqa: BLE001 - reported, then torchrun's restart takes over
            error = f"{type(failure).__name__}: {failure}"[:_MAX_MESSAGE]
            log.error("rankwatch: in-process recovery failed (%s); the worker exits for torchrun's restart",
                      error)
            self._send(caught, completed, old, old, phases, ok=False, error=error)
            if _RESTARTING in error:
                # torchrun stops this worker itself: exiting first would read as a failure of
                # its own (and spend one of --max-restarts).
                log.warning("rankwatch: waiting for torchrun to stop this worker")
                time.sleep(_RESTART_GRACE)
            if isinstance(failure, RecoveryFailed):
                raise
            raise RecoveryFailed(error) from failure
        self.membership = new
        self._report = {"caught": caught, "t0": t0, "step": decision.step, "old": old, "phases": phases}
        log.warning("rankwatch: recovered in process: rank %d -> %d of %d, without node(s) %s, from step %d "
                    "(%.3f s so far)", old.rank, new.rank, new.world_size, ", ".join(decision.dropped_nodes),
                    decision.step, phases["restored"])
        return job, decision.step

    # -- parts ----------------------------------------------------------------------
    def _key(self, suffix: str) -> str:
        return self._prefix + "inproc/" + suffix

    def _node(self) -> str:
        return self._env.get(NODE_ID_ENV) or socket.gethostname()

    def set_monitor(self, monitor: Any) -> None:
        """The Monitor that reports each recovery (made after the first generation's mesh)."""
        self._monitor = monitor

    def _agree(self, old: Membership, completed: int, replica_size: int) -> Decision:
        """Post this survivor's step; the first to arrive decides for all."""
        gen = f"gen/{old.generation + 1}/"
        me = old.members[old.rank]
        store = self._store
        store.set(self._key(f"{gen}alive/{me}"), str(completed))
        if store.add(self._key(f"{gen}arrived"), 1) == 1:
            keys = {r: self._key(f"{gen}alive/{r}") for r in old.members}
            self._await_survivors(keys, self._key(f"{gen}arrived"))
            arrived = {r: int(store.get(k)) for r, k in keys.items() if store.check([k])}
            node_of = {r: store.get(self._key(f"node/{r}")).decode(errors="replace") for r in old.members}
            if store.check([self._prefix + RESTARTING_KEY]):  # torchrun stops the workers itself
                by = store.get(self._prefix + RESTARTING_KEY).decode(errors="replace")[:64]
                decision = Decision(ok=False, error=f"{_RESTARTING}: node {by} restarts its workers")
            else:
                decision = decide(old.members, arrived, node_of, replica_size)
            if decision.ok:
                for node in decision.dropped_nodes:  # the round goes on without it: no restart
                    mark_regrouped(store, self._prefix, node, old.generation + 1)
            store.set(self._key(f"{gen}decision"), decision.to_json())
            return decision
        store.wait([self._key(f"{gen}decision")], datetime.timedelta(seconds=self._settle + 30))
        return Decision.from_json(store.get(self._key(f"{gen}decision")).decode(errors="replace"), old.members)

    def _await_survivors(self, keys: dict[int, str], arrived_key: str) -> None:
        """Until every member arrived, or every one missing is proven dead (its liveness
        port refuses connections: the process is gone), or ``settle`` seconds passed."""
        store, deadline = self._store, time.monotonic() + self._settle
        dead: set[int] = set()
        while True:
            count = int(store.add(arrived_key, 0))
            if count == len(keys) or time.monotonic() >= deadline:
                return
            for r, k in keys.items():
                if r not in dead and not store.check([k]) and _refused(self._live_address(r)):
                    dead.add(r)
            if count + len(dead) >= len(keys) and int(store.add(arrived_key, 0)) == count:
                return  # all that are alive arrived; the rest are gone
            time.sleep(0.005)

    def _live_address(self, rank: int) -> str:
        key = self._key(f"live/{rank}")
        return self._store.get(key).decode() if self._store.check([key]) else ""

    def _init_group(self, new: Membership) -> None:
        import torch.distributed as dist

        store = dist.PrefixStore(self._key(f"gen/{new.generation}/pg/"), self._store)
        dist.init_process_group(self._backend, store=store, rank=new.rank, world_size=new.world_size,
                                timeout=self._timeout)

    def _finish_report(self, step: int) -> dict[str, float]:
        r, self._report = self._report, None
        assert r is not None and self.membership is not None
        r["phases"]["first_step"] = time.perf_counter() - r["t0"]
        log.warning("rankwatch: first step after the in-process recovery: step %d, %.3f s after the failure "
                    "(%s)", step, r["phases"]["first_step"],
                    ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items()))
        self._send(r["caught"], r["step"], r["old"], self.membership, r["phases"], ok=True)
        return r["phases"]

    def _send(self, caught: float, step: int, old: Membership, new: Membership, phases: dict[str, float],
              ok: bool, error: str = "") -> None:
        recovered = getattr(self._monitor, "recovered", None)
        if recovered is None:
            return
        try:
            recovered(started_at=caught, step=step, old_world_size=old.world_size, new_world_size=new.world_size,
                      dropped_nodes=list(new.dropped_nodes[len(old.dropped_nodes):]), phases=dict(phases),
                      ok=ok, error=error, rank_after=new.rank)
        except Exception as exc:  # noqa: BLE001 - reporting never breaks training
            log.warning("rankwatch: could not report the recovery: %s", exc)

    @property
    def last_phases(self) -> dict[str, float] | None:
        """The phases of the recovery whose first step is still to come (for tests, logs)."""
        return dict(self._report["phases"]) if self._report else None


# -- liveness ------------------------------------------------------------------------------
class _Liveness:
    """A listening socket that lives exactly as long as this process: a peer's connection to
    it is refused once the process is gone, even when the node lives on.  A daemon thread
    accepts and closes probes, so the backlog never fills while the process runs."""

    def __init__(self) -> None:
        import threading

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.listen(128)
        self.address = f"{socket.gethostname()}:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._drain, name="rankwatch-liveness", daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.close()

    def close(self) -> None:
        """Stop answering (as the process's end does); wakes the accepting thread."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _refused(address: str, timeout: float = 0.05) -> bool:
    """True when ``address`` refuses a connection: proof that its process is gone.  A timeout
    (a host down, a partition) proves nothing."""
    host, _, port = address.rpartition(":")
    if not host:
        return False
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


# -- the failed groups' connections -------------------------------------------------------
def _tcp_sockets() -> set[tuple]:
    import psutil

    try:
        return {(c.fd, c.laddr, c.raddr) for c in psutil.Process().net_connections(kind="tcp") if c.raddr}
    except psutil.Error:
        return set()


def _store_endpoints(env: Mapping[str, str]) -> set[tuple[str, int]]:
    """Connections that must survive: the stores' and the agent's."""
    from rankwatch.hooks.recovery_store import STORE_ENV

    out = set()
    for host, port in ((env.get("MASTER_ADDR"), env.get("MASTER_PORT")),
                       tuple((env.get(STORE_ENV) or ":").rpartition(":")[::2]),
                       tuple((env.get("RANKWATCH_AGENT") or ":").rpartition(":")[::2])):
        if host and port and port.isdigit():
            for info in _resolve(host, int(port)):
                out.add(info)
    return out


def _resolve(host: str, port: int) -> set[tuple[str, int]]:
    try:
        return {(ai[4][0], port) for ai in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
    except OSError:
        return {(host, port)}


def _shut_group_sockets(baseline: set[tuple], keep: set[tuple[str, int]]) -> int:
    """Shut down this process's TCP connections opened since the tier started (the process
    groups'), but the stores' and the agent's.  Each peer's pending collective on them then
    fails at once, and so does that peer's, and so on: every survivor leaves the step."""
    import psutil

    shut = 0
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except psutil.Error:
        return 0
    for c in conns:
        if not c.raddr or c.fd < 0 or (c.fd, c.laddr, c.raddr) in baseline:
            continue
        if (c.raddr.ip, c.raddr.port) in keep or c.status != psutil.CONN_ESTABLISHED:
            continue
        try:
            s = socket.socket(fileno=c.fd)
        except OSError:  # closed meanwhile (its group tore it down)
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError:
            pass
        finally:
            s.detach()  # the fd stays the group's to close
    return shut


def _abort_nccl() -> None:
    """Abort every NCCL communicator: a collective stuck on a dead peer returns at once.
    (Gloo has no such call: :func:`_shut_group_sockets` does its part.)"""
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group()


def _destroy_groups() -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a broken group may not tear down cleanly
        log.warning("rankwatch: tearing down the failed process groups: %s", exc)
        from torch.distributed import distributed_c10d as c10d

        c10d._world.default_pg = None  # the next init_process_group starts clean


# -- state ---------------------------------------------------------------------------------
def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _local_state(job: Job) -> dict[str, Any]:
    """This rank's shards of the parameters and the optimizer state, as plain tensors (no
    process group referenced), by parameter name."""
    from torch.distributed.fsdp import FSDPModule

    for module in job.model.modules():  # a step cut short may leave parameters unsharded
        if isinstance(module, FSDPModule):
            module.reshard()
    opt_state = job.optimizer.state
    params, optim = {}, {}
    for name, p in job.model.named_parameters():
        params[name] = _local(p).detach()
        if p in opt_state:
            optim[name] = {k: _local(v).detach() if hasattr(v, "detach") else v for k, v in opt_state[p].items()}
    return {"params": params, "optim": optim}


def _restore(job: Job, shards: dict[str, Any]) -> None:
    """Copy this rank's shards into the job just built (same layout within a replica)."""
    import torch
    from torch.distributed.tensor import DTensor

    params, optim = shards["params"], shards["optim"]
    names = [n for n, _ in job.model.named_parameters()]
    if set(names) != set(params):
        raise RecoveryFailed("the rebuilt model's parameters differ from the failed one's")
    with torch.no_grad():
        for name, p in job.model.named_parameters():
            local, saved = _local(p), params[name]
            if local.shape != saved.shape:
                raise RecoveryFailed(f"{name}: this rank's shard changed shape {tuple(saved.shape)} -> "
                                     f"{tuple(local.shape)} in the new world")
            local.copy_(saved)
            if name not in optim:
                continue
            state = {}
            for k, v in optim[name].items():
                if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == local.shape and v.dim():
                    v = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                           run_check=False)
                state[k] = v
            job.optimizer.state[p] = state
