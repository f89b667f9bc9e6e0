"""Bounds on what an agent keeps: rank ids, incidents, a node's summary.

Pure helpers: each takes what the agent holds and returns what to drop, or a copy cut to
size, so the bound is decided in one place and tested without an agent.

- At most :data:`MAX_RANK_IDS` rank ids per agent: a new rank id over the bound takes the
  place of the disconnected rank seen longest ago; with every kept rank still connected,
  the new one is refused.
- An incident's detail is at most :data:`MAX_INCIDENT_BYTES` of JSON (its longest strings
  are cut first: stacks, errors); an agent keeps at most :data:`MAX_INCIDENTS_PER_RANK`
  incidents per rank and :data:`MAX_INCIDENTS` (and :data:`MAX_INCIDENT_TOTAL_BYTES`) per
  node, dropping the oldest.
- A node's summary is at most :data:`MAX_SUMMARY_BYTES`, far below gRPC's 16 MiB message
  limit: over it, the least needed content goes first (:func:`cap_summary`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

from rankwatch.agent.wire import windows
from rankwatch.proto import pb

__all__ = [
    "MAX_INCIDENTS", "MAX_INCIDENTS_PER_RANK", "MAX_INCIDENT_BYTES", "MAX_RANK_IDS", "MAX_SUMMARY_BYTES",
    "RecentSet", "cap_detail", "cap_summary", "incidents_to_drop", "rank_to_evict",
]

MAX_RANK_IDS = 256
MAX_INCIDENT_BYTES = 64 << 10
MAX_INCIDENTS_PER_RANK = 64
MAX_INCIDENTS = 1024
MAX_INCIDENT_TOTAL_BYTES = 8 << 20
MAX_SUMMARY_BYTES = 2 << 20
MAX_STATUS_BYTES = 12 << 20
"""A Status answer stays below gRPC's 16 MiB: over it, the oldest incidents are left out."""
MAX_FILE_RECORDS_PER_RUN = 16384
"""Lines one run may append to ``incidents.jsonl`` (incidents and their updates)."""
MAX_FILE_BYTES_PER_RUN = 64 << 20
_CUT_TO = 4096   # a long string of an oversized detail keeps this many characters


class _Rank(Protocol):
    rank: int
    connected: bool
    last_seen: float


def rank_to_evict(ranks: Mapping[int, _Rank], new_rank: int, limit: int = MAX_RANK_IDS) -> int | None:
    """The rank id to forget so that ``new_rank`` fits, None if it fits already.

    Raises:
        LookupError: ``limit`` ranks are kept and all of them are connected.
    """
    if new_rank in ranks or len(ranks) < limit:
        return None
    gone = [r for r in ranks.values() if not r.connected]
    if not gone:
        raise LookupError(f"{len(ranks)} ranks are connected to this agent (at most {limit})")
    return min(gone, key=lambda r: r.last_seen).rank


class RecentSet:
    """A set that keeps only its ``maxlen`` most recently added keys."""

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Hashable) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.maxlen:
            self._keys.popitem(last=False)


def detail_size(detail: Mapping[str, Any]) -> int:
    return len(json.dumps(dict(detail), default=str))


def cap_detail(detail: Mapping[str, Any], limit: int = MAX_INCIDENT_BYTES) -> dict[str, Any]:
    """``detail`` with its JSON at most ``limit`` bytes (``detail`` itself if it fits).

    The longest strings are cut to :data:`_CUT_TO` characters first (stacks keep their
    innermost frames, at the end), then the largest values are dropped; the keys cut or
    dropped are listed under ``"truncated"``.
    """
    size = detail_size(detail)
    if size <= limit:
        return dict(detail)
    out = dict(detail)
    cut: list[str] = []
    for key in sorted(out, key=lambda k: -len(json.dumps(out[k], default=str))):
        if size <= limit:
            break
        value = out[key]
        if isinstance(value, str) and len(value) > _CUT_TO:
            out[key] = ("…" + value[-_CUT_TO:]) if key == "stacks" else (value[:_CUT_TO] + "…")
        else:
            out[key] = None
        cut.append(key)
        size = detail_size({**out, "truncated": cut})
    out["truncated"] = cut
    return out


def incidents_to_drop(items: Sequence[Any], sizes: Sequence[int], per_rank: int = MAX_INCIDENTS_PER_RANK,
                      per_node: int = MAX_INCIDENTS, total_bytes: int = MAX_INCIDENT_TOTAL_BYTES) -> list[int]:
    """Indices of ``items`` (oldest first; ``sizes``: each one's detail in bytes) to drop so
    that no (node, rank) holds more than ``per_rank``, and all of them together at most
    ``per_node`` and ``total_bytes``: the oldest go."""
    drop: set[int] = set()
    seen: dict[tuple[str, int], int] = {}
    for n in range(len(items) - 1, -1, -1):   # newest first: the oldest over the bound go
        key = (items[n].node, items[n].rank)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > per_rank:
            drop.add(n)
    count = len(items) - len(drop)
    size = sum(sizes[n] for n in range(len(items)) if n not in drop)
    for n in range(len(items)):
        if count <= per_node and size <= total_bytes:
            break
        if n not in drop:
            drop.add(n)
            count -= 1
            size -= sizes[n]
    return sorted(drop)


# -- the node summary --------------------------------------------------------------

def cap_summary(s: pb.NodeSummary, limit: int = MAX_SUMMARY_BYTES) -> pb.NodeSummary:
    """``s`` cut to at most ``limit`` bytes, in place; returns it.

    What goes first is what the coordinator can best do without: the ranks' stacks and
    Flight Recorder extracts (largest first), then the oldest incidents, the oldest
    decisions beyond the newest 16, the per-step windows beyond the newest 8 steps, and
    last the disconnected ranks seen longest ago.
    """
    if s.ByteSize() <= limit:
        return s
    for r in sorted(s.ranks, key=lambda r: -(len(r.stacks) + len(r.flight_recorder))):
        if s.ByteSize() <= limit or not (r.stacks or r.flight_recorder):
            break
        r.stacks = ""
        r.flight_recorder = ""
    while s.ByteSize() > limit and len(s.incidents):
        del s.incidents[0]
    while s.ByteSize() > limit and len(s.decisions) > 16:
        del s.decisions[0]
    if s.ByteSize() > limit:
        for r in s.ranks:
            if r.work:
                r.work = windows.pack(*(w[-8:] for w in windows.windows(r)))
            for window in (r.own_work, r.data_wait, r.comm_wait):
                del window[:-8]
    if s.ByteSize() > limit:
        gone = sorted((n for n, r in enumerate(s.ranks) if not r.connected), key=lambda n: s.ranks[n].last_seen)
        drop: list[int] = []
        size = s.ByteSize()
        for n in gone:
            if size <= limit:
                break
            size -= s.ranks[n].ByteSize() + 4
            drop.append(n)
        for n in sorted(drop, reverse=True):
            del s.ranks[n]
    return s


def cap_status(resp: pb.StatusResponse, limit: int = MAX_STATUS_BYTES) -> pb.StatusResponse:
    """``resp`` without its oldest incidents while over ``limit`` bytes, in place; returns it."""
    size = resp.ByteSize()
    if size <= limit:
        return resp
    drop = 0
    for inc in resp.incidents:
        if size <= limit:
            break
        size -= inc.ByteSize() + 4
        drop += 1
    del resp.incidents[:drop]
    return resp
