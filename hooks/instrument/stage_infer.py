"""Which pipeline stage a rank runs, when the script passed no DeviceMesh with a ``pp`` dimension.

The agent compares a rank's own work only with the ranks of its role, its pipeline stage
(``mesh_coords["pp"]``); without a stage every rank of a pipeline is one role, and the
heavier stage looks like a straggler.  Two sources tell the stage without a mesh:

* **The pipelining library's own objects** (:func:`stage_of`).  A ``PipelineStage`` knows its
  ``stage_index`` and ``num_stages``, and its pipeline group's rank and size.  One stage a
  rank (GPipe, 1F1B): the stage is its index.  Several stages a rank (interleaved and looped
  schedules, V-schedules): the rank's place in the pipeline group, as a ``pp`` mesh dimension
  would give it, out of the group's size.
* **The direction of P2P traffic** (:func:`stage_from_traffic`), for a hand-rolled pipeline.
  A stage's first exchange with the stage after it is a send (the activations go forward;
  the gradients come back), and its first exchange with the stage before it a receive.  So
  a rank whose first exchange with every peer is a send is the first stage, one whose first
  exchange with every peer is a receive the last, and stages are a fixed rank stride apart.

Pure functions: the callers read the objects and the traffic (``chunk_watch``).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["stage_from_traffic", "stage_of", "with_stage"]


def stage_of(stage_index: int, num_stages: int, group_rank: int, group_size: int) -> tuple[int, int] | None:
    """``(stage, stages)`` of a rank from one of its ``PipelineStage`` objects; None when the
    figures do not make a pipeline (fewer than two stages, an index out of range)."""
    if not (1 < num_stages and 0 <= stage_index < num_stages and 0 < group_size <= num_stages
            and 0 <= group_rank < group_size):
        return None
    if group_size == num_stages:   # one stage a rank
        return stage_index, num_stages
    return (group_rank, group_size) if group_size > 1 else None


def stage_from_traffic(rank: int, world: int, ops: Iterable[tuple[str, int]]) -> tuple[int, int] | None:
    """``(stage, stages)`` of ``rank`` from its P2P operations in the order it issued them
    (``("send" | "recv", peer world rank)``, a step's or more); None when the traffic does not
    say (no peer, a peer both before and after this rank, peers at unequal strides).

    Stages are ``k`` ranks apart, ``k`` the stride to the nearest peer, stage-major: stage
    ``s`` holds ranks ``s*k .. s*k+k-1`` (a pipeline of ``world // k`` stages).  The
    direction of the first exchange with each peer must agree with that layout: peers after
    this rank are sent to first, peers before it received from first; the first stage has
    no peer before it, the last none after, every other stage both.
    """
    first: dict[int, str] = {}
    for op, peer in ops:
        if op in ("send", "recv") and 0 <= peer < world and peer != rank:
            first.setdefault(peer, op)
    if not first:
        return None
    strides = {abs(peer - rank) for peer in first}
    if len(strides) != 1:
        return None
    k = strides.pop()
    if world % k or world // k < 2:
        return None
    for peer, op in first.items():
        if (op == "send") != (peer > rank):   # a gradient sent to a later rank: not a pipeline's
            return None
    stage, stages = rank // k, world // k
    before, after = any(p < rank for p in first), any(p > rank for p in first)
    if before != (stage > 0) or after != (stage < stages - 1):   # not laid out stage-major
        return None
    return stage, stages


def with_stage(coords: dict[str, int], shape: dict[str, int],
               stage: tuple[int, int] | None) -> tuple[dict[str, int], dict[str, int]]:
    """A mesh's coordinates and sizes with a found ``(stage, stages)`` as ``pp``, unless the
    mesh has a ``pp`` dimension of its own (the script's word wins)."""
    if stage is None or "pp" in coords:
        return coords, shape
    return {**coords, "pp": stage[0]}, {**shape, "pp": stage[1]}
