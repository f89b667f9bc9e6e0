"""What an in-process recovery agrees on, as data: a world's membership (:class:`Membership`), a
job's shape (:class:`Job`), a worker asking to join (:class:`Joiner`), and the decision the
survivors share (:class:`Decision`, with its compact encoding in the recovery store).  Who
decides what is :mod:`.decide`'s.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rankwatch.hooks.recovery.tally import runs, unruns

__all__ = ["JOINER_BASE", "MAX_MESSAGE", "Decision", "Job", "Joiner", "Membership"]

JOINER_BASE = 1 << 20
"""Joiners' ids start here (original ranks are below): ``JOINER_BASE + n`` for the n-th to ask."""
MAX_MESSAGE = 400
_MAX_NODE = 64


@dataclass(frozen=True)
class Membership:
    """Who trains in the current generation."""

    generation: int
    """0 at the start, one more per in-process recovery (or admission)."""
    rank: int
    """This worker's rank in the current world."""
    world_size: int
    members: tuple[int, ...]
    """Each current rank's id: its original rank (its rank at generation 0), or a
    joiner's id (:data:`JOINER_BASE` and up)."""
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
class Joiner:
    """A worker of a joining node that asked to join."""

    id: int
    node: str
    local_rank: int
    local_world: int
    """Its node's worker count: the node joins once all of them asked."""
    standby: bool = False
    """A hot spare's worker, started ahead of any loss: it takes a lost node's place at the
    loss itself (:func:`placeable`), and never grows the world."""
    reload: bool = False
    """Its loop can load a checkpoint in process (:func:`from_checkpoint` may admit it)."""


@dataclass(frozen=True)
class Decision:
    ok: bool
    members: tuple[int, ...] = ()
    """Ids of the new world, in their new rank order."""
    dropped_nodes: tuple[str, ...] = ()
    step: int = 0
    """The step every member goes on from (the optimizer steps applied)."""
    error: str = ""
    fresh: tuple[int, ...] = ()
    """Members that take their state from the source replica (joiners, and survivors at
    another step); the others keep their own."""
    source: int = 0
    """The source replica's index in the new world."""
    refused: tuple[int, ...] = ()
    """Joiners turned away (``note`` says why); they leave it to torchrun."""
    note: str = ""
    finish: tuple[int, ...] = ()
    """Members that apply the step they hold whole gradients for (they failed inside its
    commit, which others passed) before they go on."""
    providers: tuple[tuple[int, int], ...] = ()
    """From peer snapshots (:func:`from_snapshots`): for each old member in rank order, the
    member that provides its snapshot at ``step``; every member's shards are then
    assembled anew for the new world.  Empty: the replicas' own state (above)."""
    reload: bool = False
    """From the newest complete checkpoint (:func:`from_checkpoint`): every member loads it
    in process, resharded for the new world, and goes on from its step (``step`` is 0
    here: the load tells it)."""

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "runs": runs(self.members), "dropped_nodes": list(self.dropped_nodes),
                           "step": self.step, "error": self.error[:MAX_MESSAGE], "fresh": list(self.fresh),
                           "source": self.source, "refused": list(self.refused), "note": self.note[:MAX_MESSAGE],
                           "finish": list(self.finish), "providers": [list(p) for p in self.providers],
                           "reload": self.reload})

    @classmethod
    def from_json(cls, text: str, within: Sequence[int]) -> Decision:
        """A decision read from the store, for a world of the ids ``within`` (the old members
        and every joiner that asked).

        Raises:
            ValueError: not a decision for that world: members that are not unique ids of
                it, fresh members or refused joiners outside it, more dropped nodes than
                ranks left out, a node name over 64 characters, a source replica or a step out of
                range, or more text than such a decision takes.
        """
        if len(text) > 64 * (len(within) + 16):
            raise ValueError(f"decision of {len(text)} bytes for a world of {len(within)}")
        d = json.loads(text)
        members = unruns(d["runs"], len(within)) if "runs" in d else tuple(int(r) for r in d["members"])
        dropped = tuple(str(n) for n in d["dropped_nodes"])
        fresh = tuple(int(r) for r in d.get("fresh", ()))
        refused = tuple(int(r) for r in d.get("refused", ()))
        finish = tuple(int(r) for r in d.get("finish", ()))
        step, source = int(d["step"]), int(d.get("source", 0))
        providers = tuple((int(o), int(p)) for o, p in d.get("providers", ()))
        reload = d.get("reload", False)
        world = set(within)
        if not isinstance(reload, bool) or (reload and (providers or fresh)):
            raise ValueError("decision's checkpoint reload is not a plain flag, or comes with other state")
        if providers and (len({o for o, _ in providers}) != len(providers) or not {o for o, _ in providers} <= world
                          or not {p for _, p in providers} <= set(members)):
            raise ValueError("decision's snapshot providers are not of the world")
        if len(set(members)) != len(members) or not set(members) <= world:
            raise ValueError(f"decision members {members[:16]} are not unique ids of the world")
        if not set(fresh) <= set(members) or not set(finish) <= set(members) \
                or not set(refused) <= world - set(members):
            raise ValueError("decision's fresh or finishing members or refused joiners are not of the world")
        # Left out: lost members, and joiners that wait for a later boundary.  (A joiner
        # admitted earlier is a member like any other: its loss drops its node too.)
        left_out = len(world - set(members) - set(refused))
        if len(dropped) > left_out or any(len(n) > _MAX_NODE for n in dropped):
            raise ValueError(f"decision drops {len(dropped)} nodes for {left_out} ranks left out")
        if not 0 <= step < 2**62:
            raise ValueError(f"decision step {step} out of range")
        if not 0 <= source < max(1, len(members)):
            raise ValueError(f"decision source replica {source} out of range")
        return cls(ok=bool(d["ok"]), members=members, dropped_nodes=dropped, step=step,
                   error=str(d["error"])[:MAX_MESSAGE], fresh=fresh, source=source, refused=refused,
                   note=str(d.get("note", ""))[:MAX_MESSAGE], finish=finish, providers=providers,
                   reload=reload)
