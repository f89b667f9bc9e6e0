"""The agreement's tally: what the survivors post, and what the deciding worker reads of it.

Each post is one store key, ``gen/<g>/post/<n>``, numbered by the arrival counter a poster
increments first (so the decider reads posts ``1..count`` in a single ``multi_get`` and never
scans a key per member).  A post carries one or more members' entries: a worker posts its own,
and a node's first local rank may post its whole node's (:meth:`Round.post_many
<rankwatch.hooks.recovery.protocol.Round.post_many>`): one post per node instead of one per rank.

    {"<member>": [completed_step, ready, holdings_or_null], ...}

The decision's member list, which every survivor reads, travels as runs of consecutive ids
(:func:`runs`): a few hundred bytes for 16,384 members that lost one node, not 100 KB.

:func:`gather` is the deciding worker's wait for the posts; the rest is pure.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rankwatch.hooks.recovery import net
from rankwatch.hooks.recovery.store import ForgedValue

__all__ = ["Entry", "Tally", "encode_post", "gather", "runs", "unruns"]

log = logging.getLogger(__name__)

Entry = tuple[int, bool, dict | None]
"""A member's post: its completed step, whether it is ready to finish the next one, the peer
snapshots it holds (or None)."""

_MAX_HELD = 4096
_MAX_ENTRY = 1 << 16         # bytes of one member's holdings, at most
_MAX_POST = 1 << 22          # bytes of one post (a node's workers' entries)
_COMING = 10.0               # seconds past ``settle`` the first waits for a member that said it left the step
_QUIET = 0.02                # seconds without a new post before the decider looks whether the missing are gone
_PROBES = 8                  # liveness probes per pause in the posts, at most
_ALIVE_FOR = 0.5             # seconds a member whose port accepted is not probed again
_POST_WAIT = 2.0             # seconds a counted arrival's post may lag its count


def encode_post(entries: Mapping[int, Entry]) -> str:
    return json.dumps({str(m): [int(s), bool(r), h] for m, (s, r, h) in entries.items()})


def _holdings(d: Any) -> dict:
    """A member's snapshot holdings, checked (raises ValueError, KeyError or TypeError)."""
    held = {int(o): int(s) for o, s in dict(d["held"]).items()}
    own, now, reload = int(d["own"]), int(d.get("now", -1)), d.get("reload", False)
    if not -1 <= min(own, now) <= max(own, now) < 2**62 or len(held) > _MAX_HELD \
            or not all(0 <= s < 2**62 for s in held.values()):
        raise ValueError(f"steps out of range: {own}, {now}")
    if not isinstance(reload, bool):
        raise ValueError(f"reload is {type(reload).__name__}, not a flag")
    return {"own": own, "now": now, "held": held, "reload": reload}


class Tally:
    """The posts read so far, for the old world's ``members``."""

    def __init__(self, members: Iterable[int]) -> None:
        self.members = frozenset(members)
        self.read = 0
        """Posts read (or given up on): the next to read is ``read + 1``."""
        self.steps: dict[int, int] = {}
        """Each member that posted: its completed step."""
        self.ready: set[int] = set()
        self.holdings: dict[int, dict] = {}

    def missing(self) -> set[int]:
        return set(self.members) - set(self.steps)

    def take(self, text: str | None) -> None:
        """One post's text (None: a post that never came); one that does not parse, or names
        members outside the world or already posted, counts for nothing of what it names."""
        self.read += 1
        if text is None:
            return
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise TypeError("a post is an object")
        except (ValueError, TypeError) as exc:
            log.warning("rankwatch: a post of the agreement does not parse: %s", exc)
            return
        for key, value in d.items():
            try:
                member, (step, ready, held) = int(key), value
                if member not in self.members or member in self.steps or not 0 <= int(step) < 2**62:
                    raise ValueError(f"member {member} is not of the world, posted twice, or its step is out of range")
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("rankwatch: member %s's post does not parse: %s", str(key)[:16], exc)
                continue
            self.steps[member] = int(step)
            if ready is True:
                self.ready.add(member)
            try:   # holdings that do not parse count as none (the step stands)
                if held is not None and len(json.dumps(held)) > _MAX_ENTRY:
                    raise ValueError("holdings too long")
                if held is not None:
                    self.holdings[member] = _holdings(held)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("rankwatch: member %d's snapshot holdings do not parse: %s", member, exc)


def _read_posts(rnd: Any, gen: str, tally: Tally, count: int) -> None:
    """Posts ``tally.read + 1 .. count``; one whose poster died between its arrival and
    its post (not there within ``_POST_WAIT``) counts for nothing."""
    suffixes = [f"{gen}post/{n}" for n in range(tally.read + 1, count + 1)]
    try:
        rnd.store.wait([rnd.key(s) for s in suffixes], datetime.timedelta(seconds=_POST_WAIT))
        texts: list[str | None] = list(rnd.values(suffixes, _MAX_POST))
    except ForgedValue:
        raise
    except Exception:  # noqa: BLE001 - the store's timeout error varies by backend
        texts = [rnd.read(s, cap=_MAX_POST) if rnd.has(s) else None for s in suffixes]
    for text in texts:
        tally.take(text)


def gather(rnd: Any, gen: str, members: Sequence[int], settle: float) -> Tally:
    """The posts of the agreement on ``gen`` (``rnd``: the deciding worker's ``Round``), once
    every member posted, or every one missing is proven dead (its liveness port refuses
    connections: the process is gone; looked at only once the posts pause), or ``settle``
    seconds passed; up to ``_COMING`` s more for a member that said it left the step and is
    on its way (:meth:`~rankwatch.hooks.recovery.breakout.BreakWatch.announce`)."""
    start = last_post = time.monotonic()
    tally, dead, arrived_key = Tally(members), set(), rnd.key(f"{gen}arrived")
    seen_alive: dict[int, float] = {}   # member -> when its port last accepted
    while True:
        count = int(rnd.store.add(arrived_key, 0))
        if count > tally.read:
            _read_posts(rnd, gen, tally, count)
            last_post = time.monotonic()
        missing = tally.missing() - dead
        waited = time.monotonic() - start
        if not missing or waited >= settle + _COMING:
            return tally
        if time.monotonic() - last_post >= _QUIET:
            dead |= _probe(rnd, missing, seen_alive)
            if not missing - dead and int(rnd.store.add(arrived_key, 0)) == count:
                return tally  # all that are alive arrived; the rest are gone
        if waited >= settle and not any(rnd.said(f"{gen}leaving/{r}") for r in missing - dead):
            return tally  # the rest neither arrived nor said they are coming: hung, or a host down
        time.sleep(0.005)


def _probe(rnd: Any, missing: set[int], seen_alive: dict[int, float]) -> set[int]:
    """Those of ``missing`` proven gone, probing at most ``_PROBES`` of them, none that
    accepted within ``_ALIVE_FOR`` s (so a pass stays short while thousands are still on
    their way)."""
    now = time.monotonic()
    due = sorted(r for r in missing if now - seen_alive.get(r, -_ALIVE_FOR) >= _ALIVE_FOR)[:_PROBES]
    gone = set()
    for r in due:
        if net.refused(rnd.live_address(r)):
            gone.add(r)
        else:
            seen_alive[r] = now
    return gone


def runs(ids: Sequence[int]) -> list[list[int]]:
    """``ids`` as ``[first, length]`` runs of consecutive ids, in order."""
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([int(i), 1])
    return out


def unruns(encoded: Any, cap: int) -> tuple[int, ...]:
    """The ids of :func:`runs`' output.

    Raises:
        ValueError: not runs, or more than ``cap`` ids (a forged length).
    """
    out: list[int] = []
    for first, length in encoded:
        first, length = int(first), int(length)
        if length < 1 or len(out) + length > cap:
            raise ValueError(f"runs of more than {cap} ids, or an empty run")
        out.extend(range(first, first + length))
    return tuple(out)
