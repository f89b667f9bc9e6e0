"""The in-process recovery's decision: who trains on, from which step, with whose state.

A pure function of what the survivors posted in the recovery store, so that every
survivor, whichever arrives first and decides, would decide the same.

* **Survivors** go on if every replica (``replica_size`` consecutive ranks: one whole
  copy of the model) is either whole or gone: a lost rank's shards exist nowhere else.
  A node that lost only some of its workers (one crashed, its torchrun stops the others
  to restart them) is left out whole: its surviving workers are told so and exit, and
  the workers its torchrun starts again join the round in process, as a spare's do.
* **The step** is the newest one that some whole replica completed on all its ranks
  (its *source*).  A survivor at another step (a rank that applied one more optimizer
  step than its peers, or one fewer, when the failure cut a step short) takes its state
  from the source replica's rank at its own position, as joiners do.
* **Joiners** (a spare or a returning node whose workers ask to join, :data:`JOINER_BASE`
  ids) are admitted at the step boundary when their node's workers have all asked and
  make whole replicas.  They take their state from the source replica too, and the
  world grows back.

Without whole replicas, :func:`from_snapshots` decides from the peer snapshots the
survivors hold; when no survivor holds a lost rank's snapshot either (the node and its
buddy lost together), :func:`from_checkpoint` sends every survivor to the newest complete
checkpoint, loaded in process.  Failing all three, torchrun's restart recovers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from rankwatch.hooks.recovery.membership import JOINER_BASE, MAX_MESSAGE, Decision, Job, Joiner, Membership

__all__ = ["JOINER_BASE", "MAX_MESSAGE", "Decision", "Job", "Joiner", "Membership", "admissible", "decide", "from_checkpoint",
           "from_snapshots", "grows_by_resharding", "placeable"]

def _fail(error: str) -> Decision:
    return Decision(ok=False, error=error[:MAX_MESSAGE])


def placeable(joiners: Sequence[Joiner], members: Sequence[int], arrived: Mapping[int, int],
              node_of: Mapping[int, str]) -> list[Joiner]:
    """The joiners a recovery may take: every one that asked to join, and standby ones of as
    many nodes as were lost (the first to ask first); the other standby nodes wait on."""
    lost, _ = _whole_nodes_left(members, arrived, node_of)
    standing = list(dict.fromkeys(j.node for j in sorted(joiners, key=lambda j: j.id) if j.standby))
    taken = set(standing[:len(lost)])
    return [j for j in joiners if not j.standby or j.node in taken]


def admissible(joiners: Sequence[Joiner], replica_size: int) -> tuple[list[int], list[int], str]:
    """Joiners of whole nodes that make whole replicas, in order (node by node, by the order
    they first asked; local rank within); those of whole nodes that do not; and why."""
    by_node: dict[str, list[Joiner]] = {}
    for j in sorted(joiners, key=lambda j: j.id):
        by_node.setdefault(j.node, []).append(j)
    admitted, refused, notes = [], [], []
    for node, js in by_node.items():
        world = js[0].local_world
        if sorted(j.local_rank for j in js) != list(range(world)) or any(j.local_world != world for j in js):
            continue  # not all of the node's workers asked yet: it waits for the next boundary
        if replica_size <= 0 or world % replica_size:
            refused += [j.id for j in js]
            notes.append(f"node {node}'s {world} workers do not make whole replicas of {replica_size}")
            continue
        admitted += [j.id for j in sorted(js, key=lambda j: j.local_rank)]
    return admitted, refused, "; ".join(notes)


def decide(members: Sequence[int], arrived: Mapping[int, int], node_of: Mapping[int, str],
           replica_size: int, joiners: Sequence[Joiner] = (), ready: Collection[int] = ()) -> Decision:
    """The new membership, from who arrived (id -> its last completed step) and who asks to join.

    Args:
        members: the current world's ids, in current rank order.
        arrived: the survivors that reached the agreement, with their completed step.
        node_of: each member's node.
        replica_size: ranks per whole replica, in current rank order.
        joiners: workers of joining nodes that asked so far.
        ready: survivors that failed inside the commit of the step after their completed one
            (the all-reduce before each optimizer step).  If another survivor completed that
            step, the commit had every rank's part: the ready ones hold whole gradients for
            it, and they finish it rather than leave their shards a step behind.
    """
    top = max(arrived.values(), default=0)
    finish = tuple(r for r in members if r in ready and r in arrived and arrived[r] + 1 == top)
    arrived = {**arrived, **{r: top for r in finish}}
    joining, refused, note = admissible(joiners, replica_size)
    lost = [r for r in members if r not in arrived]
    if not lost and not joining:
        return _fail("no rank was lost and no node joins: the failure is not a lost peer")
    lost_nodes = sorted({node_of.get(r, "?") for r in lost})
    split = sorted({node_of.get(r, "?") for r in members if r in arrived} & set(lost_nodes))
    if split:   # its torchrun restarts the node's workers: leave the whole node out
        arrived = {r: s for r, s in arrived.items() if node_of.get(r, "?") not in split}
        lost = [r for r in members if r not in arrived]
        note = "; ".join(filter(None, [f"node(s) {', '.join(split)} lost some workers: left out whole "
                                       "(their torchrun restarts them)", note]))
    survivors = [r for r in members if r in arrived]
    if replica_size <= 0 or len(members) % replica_size:
        return _fail(f"replica size {replica_size} does not divide the world {len(members)}")
    replicas = []
    for i in range(0, len(members), replica_size):
        replica = members[i:i + replica_size]
        gone = sum(r not in arrived for r in replica)
        if 0 < gone < len(replica):
            return _fail(f"the replica of ranks {replica[0]}..{replica[-1]} lost {gone} of {len(replica)} ranks: "
                         "no survivor holds their shards")
        if not gone:
            replicas.append(replica)
    if not survivors:
        return _fail("no survivor")
    whole = [rep for rep in replicas if len({arrived[r] for r in rep}) == 1]
    if not whole:
        return _fail(f"no replica completed the same step on all its ranks "
                     f"({sorted({arrived[r] for r in survivors})})")
    step = max(arrived[rep[0]] for rep in whole)
    source = next(i for i, rep in enumerate(replicas) if rep in whole and arrived[rep[0]] == step)
    fresh = tuple(r for r in survivors if arrived[r] != step) + tuple(joining)
    return Decision(ok=True, members=tuple(survivors) + tuple(joining), dropped_nodes=tuple(lost_nodes), step=step,
                    fresh=fresh, source=source, refused=tuple(refused), note=note,
                    finish=tuple(r for r in finish if r in survivors and step == top))


def grows_by_resharding(replica_size: int, members: Sequence[int], joiners: Sequence[Joiner]) -> bool:
    """Workers ask to join a world that is one replica (plain FSDP2 sharded over every rank,
    down to a lone survivor): each joiner takes a share of that replica's shards, which
    :func:`from_snapshots` assembles anew, not a whole replica's copy that :func:`decide`
    would send it (a lone survivor is a whole replica of one rank, yet the job's next mesh
    shards over two).  Asked only of a job that takes peer snapshots."""
    return bool(joiners) and replica_size >= len(members)


def from_snapshots(members: Sequence[int], arrived: Mapping[int, int], node_of: Mapping[int, str],
                   holdings: Mapping[int, Mapping[str, Any]], joiners: Sequence[Joiner] = ()) -> Decision:
    """The new membership when the replicas cannot recover (no whole replicas on nodes):
    from the peer snapshots the survivors hold (:mod:`rankwatch.hooks.recovery.snapshot`).

    Args:
        members, arrived, node_of: as for :func:`decide`.
        holdings: each survivor's ``{"own": step, "now": step, "held": {owner id: step}}``
            (``now``: its state of the step it completed, posted when joiners wait).
        joiners: workers of joining nodes that asked so far; whole nodes are admitted.

    The step is the newest one at which some survivor provides every old member's
    snapshot: its own, or a copy it holds of a lost member's.  A node that lost only some
    workers is left out whole, as :func:`decide` does.  Every member goes on from that
    step, its shards assembled anew for the new world.  A joining node takes a lost node's
    place in the rank order when it has as many workers (the world keeps its layout: each
    member's shards are the old ones at its position); other joiners are appended, and the
    world grows (the survivors then post a snapshot of the step they completed).
    """
    lost, survivors = _whole_nodes_left(members, arrived, node_of)
    joining, _, _ = admissible(joiners, 1)
    if not survivors or not (lost or joining):
        return _fail("no node was lost and none joins, or no survivor: nothing to recover from snapshots")
    own = {r: {int(holdings.get(r, {}).get(k, -1)) for k in ("own", "now")} for r in survivors}
    held = {r: {int(o): int(s) for o, s in dict(holdings.get(r, {}).get("held", {})).items()} for r in survivors}
    for step in sorted({s for steps in own.values() for s in steps if s >= 0}, reverse=True):
        providers = []
        for m in members:
            by = m if step in own.get(m, ()) else next((h for h in survivors if held[h].get(m) == step), None)
            if by is None:
                break
            providers.append((m, by))
        else:
            new = _in_place(members, node_of, lost, joiners, joining)
            return Decision(ok=True, members=new, dropped_nodes=tuple(sorted(lost)), step=step,
                            providers=tuple(providers),
                            note=f"resharded from the peer snapshots of step {step}"
                                 + (f"; {len(joining)} joining worker(s) in" if joining else ""))
    return _fail("no snapshot step at which the survivors hold every rank's shards "
                 f"(own: {sorted({s for steps in own.values() for s in steps})})")


def _in_place(members: Sequence[int], node_of: Mapping[int, str], lost: set[str], joiners: Sequence[Joiner],
              joining: Sequence[int]) -> tuple[int, ...]:
    """The new rank order: the old one, each lost node's ranks taken by a joining node of as
    many workers (the first to ask first) or left out; the joiners left over at the end."""
    node_of_joiner = {j.id: j.node for j in joiners}
    nodes: dict[str, list[int]] = {}
    for j in joining:   # node by node already
        nodes.setdefault(node_of_joiner[j], []).append(j)
    spare = list(nodes.values())
    out: list[int] = []
    done: set[str] = set()
    for r in members:
        node = node_of.get(r, "?")
        if node not in lost:
            out.append(r)
        elif node not in done:
            done.add(node)
            count = sum(node_of.get(m, "?") == node for m in members)
            fit = next((s for s in spare if len(s) == count), None)
            if fit is not None:
                spare.remove(fit)
                out += fit
    return tuple(out) + tuple(j for s in spare for j in s)


def from_checkpoint(members: Sequence[int], arrived: Mapping[int, int], node_of: Mapping[int, str],
                    can_reload: Collection[int], joiners: Sequence[Joiner] = ()) -> Decision:
    """The new membership when neither a replica nor a peer snapshot holds a lost rank's
    shards: every survivor (of the nodes that lost none) loads the newest complete
    checkpoint in process, resharded for the new world.

    Args:
        members, arrived, node_of: as for :func:`decide`.
        can_reload: the survivors whose loop gave the tier a way to load a checkpoint; all
            of them must have one, or none reloads (torchrun's restart recovers).
        joiners: as for :func:`from_snapshots`; whole nodes whose workers can load the
            checkpoint too are placed the same way (a spare standing by keeps the world's size).
    """
    lost, survivors = _whole_nodes_left(members, arrived, node_of)
    if not lost or not survivors:
        return _fail("no node was lost, or no survivor: nothing to reload a checkpoint for")
    unable = [r for r in survivors if r not in can_reload]
    if unable:
        return _fail(f"{len(unable)} survivor(s) cannot load a checkpoint in process (rank {unable[0]} first)")
    able = [j for j in joiners if j.reload]
    joining, _, _ = admissible(able, 1)
    return Decision(ok=True, members=_in_place(members, node_of, lost, able, joining),
                    dropped_nodes=tuple(sorted(lost)), reload=True,
                    note="reloaded from the newest complete checkpoint: no survivor holds every lost rank's "
                         "shards" + (f"; {len(joining)} joining worker(s) in" if joining else ""))


def _whole_nodes_left(members: Sequence[int], arrived: Mapping[int, int],
                      node_of: Mapping[int, str]) -> tuple[set[str], list[int]]:
    """The nodes that lost a member, and the members of the others, in rank order (a node
    that lost only some workers is left out whole, as :func:`decide` does)."""
    lost = {node_of.get(r, "?") for r in members if r not in arrived}
    return lost, [r for r in members if r in arrived and node_of.get(r, "?") not in lost]
