"""Who gets a stream's seat when the agent is full: the admission rule, as pure functions.

A ``Report`` or ``Commands`` stream holds a *seat* while it is served.  Seats are capped in
all (``--max-streams``), per TCP host (``--max-streams-per-peer``), per process on the Unix
socket (``--max-streams-per-process``, the process known from SO_PEERCRED), and, for Unix
streams whose process is not known (no credentials nonce), together as one peer
(``--max-streams-per-peer``).  At a cap, the newcomer is not simply refused: it takes the
seat of the stream that stands lowest under that cap, if that one does not stand above it.

How a stream stands, lowest first (:func:`standing`, :func:`order`):

1. ``SILENT``: it has sent nothing yet (no hello, no request);
2. ``STRANGER``: it has, but it is not a rank of the job's current world;
3. ``RANK``: a ``Report`` stream that holds its rank id (:mod:`.identity` accepted it) with
   credentials (SO_PEERCRED on the socket; the job's token over TCP), whose rank id is in the
   job's current world, and the ``Commands`` stream of that rank and pid.

Within one standing, the stream that has sent no step for longest goes first, and one that
has sent none at all (hello-only) before any that has.  A newcomer of the same standing
takes the seat (the stalest stream goes, not the newcomer); a ``RANK`` newcomer never takes
a ``RANK`` seat (two ranks of the world are both the job's: the newcomer is refused).

*The job's current world* is ``(job_id, world_size)`` of the credentialed rank stream that
began stepping first among those served now (:func:`current_world`): the world the node's
ranks train in.  A stream claiming another world, or a rank id outside it, is a stranger.

Why this rule: idle or buggy streams (a leaked client, a forked dataloader worker) and
streams that send a plausible step now and then can fill every seat, but they stand below a
real rank, so they can never keep one out; among themselves they give way to newcomers, so
they cannot hold seats for ever either.  The per-process cap keeps one process from
holding more than a rank needs (a ``Report`` and a ``Commands`` stream, and their
reconnects).  What it does not stop: a process of the agent's own uid that knows the job
and starts streaming before it, claiming the world's rank ids first; such a process could
ptrace the ranks anyway (the uid is the trust boundary on the node, docs/security.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["RANK", "SILENT", "STRANGER", "Seat", "World", "current_world", "order", "standing", "victim"]

SILENT, STRANGER, RANK = 0, 1, 2
NAMES = {SILENT: "silent", STRANGER: "stranger", RANK: "rank"}

World = tuple[str, int]
"""(job_id, world_size) a rank's hello names."""


@dataclass(frozen=True)
class Seat:
    """What the rule reads of one served stream."""

    key: int
    opened: float
    """When it was opened (monotonic seconds)."""
    method: str = "Report"
    identified: bool = False
    """It sent its hello (Report) or its request (Commands)."""
    rank: int = -1
    pid: int = 0
    verified: bool = False
    """Its credentials: SO_PEERCRED on the socket, the job's token over TCP."""
    holds: bool = False
    """(Report) :mod:`.identity` gave it its rank id."""
    world: World | None = None
    first_step: float | None = None
    last_step: float | None = None


def current_world(seats: Iterable[Seat]) -> World | None:
    """The world of the credentialed rank stream that began stepping first (None: none has)."""
    stepping = [s for s in seats if s.method == "Report" and s.verified and s.holds
                and s.world is not None and s.first_step is not None]
    return min(stepping, key=lambda s: (s.first_step, s.key)).world if stepping else None


def _in_world(s: Seat, world: World | None) -> bool:
    return (world is not None and s.world == world and 0 <= s.rank < world[1]
            and s.verified and s.holds and s.method == "Report")


def standing(s: Seat, world: World | None, ranks: frozenset[tuple[int, int]]) -> int:
    """``s``'s standing; ``ranks``: (rank, pid) of the ``Report`` seats that stand as ``RANK``."""
    if not s.identified:
        return SILENT
    if s.method == "Report":
        return RANK if _in_world(s, world) else STRANGER
    return RANK if (s.rank, s.pid) in ranks else STRANGER


def standings(seats: list[Seat]) -> dict[int, int]:
    """Every seat's standing, by key."""
    world = current_world(seats)
    ranks = frozenset((s.rank, s.pid) for s in seats if _in_world(s, world))
    return {s.key: standing(s, world, ranks) for s in seats}


def order(s: Seat, stands: int) -> tuple[int, int, float, int]:
    """Sort key: the seat that goes first sorts first."""
    stepped = s.last_step is not None
    return (stands, int(stepped), s.last_step if s.last_step is not None else s.opened, s.key)


def victim(newcomer: int, seats: list[Seat], stands: dict[int, int]) -> Seat | None:
    """The seat a newcomer of standing ``newcomer`` takes among ``seats`` (those under the cap
    it met), or None: the newcomer is refused."""
    if not seats:
        return None
    low = min(seats, key=lambda s: order(s, stands[s.key]))
    low_stands = stands[low.key]
    if low_stands > newcomer or (low_stands == RANK and newcomer == RANK):
        return None
    return low
