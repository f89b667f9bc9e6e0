"""Where a new world's state comes from after an in-process recovery, as the decision says.

* The survivors' **own shards** (whole replicas on nodes): each keeps its own, and a rank at
  another step, or a joiner, takes the source replica's (:mod:`state`).
* The **peer snapshots** (``providers``): every shard assembled anew for the new world
  (:mod:`reshard`), from the snapshot's step.
* The **newest complete checkpoint** (``reload``): the loop's own loader, called on every
  member of the new world (DCP reshards for it); the members check that they all loaded
  the same step.

Then the survivors take a snapshot of the new world at once, so that a second loss is
covered too.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rankwatch.hooks.recovery import reshard
from rankwatch.hooks.recovery.decide import Decision, Job, Membership
from rankwatch.hooks.recovery.protocol import RecoveryFailed
from rankwatch.hooks.recovery.snapshot import PeerSnapshots
from rankwatch.hooks.recovery.state import restore, transfer

__all__ = ["ReloadFailed", "put_back"]

Reload = Callable[[Job], int]
"""Loads the newest complete checkpoint into a job (collective) and returns its step."""


class ReloadFailed(RuntimeError):
    """The checkpoint the decision sent the survivors to did not load alike on every one."""


def put_back(job: Job, decision: Decision, rank: int, shards: dict, snaps: PeerSnapshots | None,
             reload: Reload | None, phases: dict[str, float], t0: float) -> int:
    """Put the new job's state in place; return the step the job goes on from."""
    step = decision.step
    if decision.reload:
        if reload is None:
            raise ReloadFailed("the survivors agreed to reload a checkpoint, and this rank has no loader")
        step = _agreed(int(reload(job)))
        phases["reloaded"] = time.perf_counter() - t0
    elif decision.providers and snaps is not None:
        reshard.assemble(job, snaps, decision.providers, decision.members, rank, step)
        phases["resharded"] = time.perf_counter() - t0
    else:
        fresh = decision.members[rank] in decision.fresh
        if not fresh:
            restore(job, shards)
        transfer(job, decision, rank, None if fresh else shards)
    if snaps is not None:   # a second loss finds this world's copies
        snaps.renew(job, step)
    phases["restored"] = time.perf_counter() - t0
    return step


def _agreed(step: int) -> int:
    """``step``, once every member of the new world loaded the same one (one all-reduce)."""
    import torch
    import torch.distributed as dist

    if not 0 <= step < 2**62:
        raise ReloadFailed(f"the checkpoint loader returned step {step}")
    dev = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    both = torch.tensor([step, -step], dtype=torch.int64, device=dev)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if int(both[0]) != -int(both[1]):
        raise ReloadFailed(f"the members loaded checkpoints of steps {-int(both[1])} to {int(both[0])}")
    return step


def placed(old: Membership, decision: Decision, node: str) -> Membership:
    """This rank's membership of the agreed world; :class:`RecoveryFailed` where it has none (its
    node is left out whole, or it arrived after the survivors agreed without it)."""
    me = old.members[old.rank]
    if me not in decision.members:
        if node in decision.dropped_nodes:
            raise RecoveryFailed(f"node {node} lost a worker and is left out whole; its torchrun restarts its workers")
        raise RecoveryFailed("this rank arrived after the survivors had agreed without it")
    return Membership(generation=old.generation + 1, rank=decision.members.index(me),
                      world_size=len(decision.members), members=decision.members,
                      dropped_nodes=old.dropped_nodes + decision.dropped_nodes)
