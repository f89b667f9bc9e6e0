"""The seats of the agent's streams: who holds one, under which caps, and who gives way.

:class:`Seats` is the bookkeeping; the rule it applies is :mod:`.admission`'s.  A stream is
seated when it opens (:meth:`Seats.open`), before anyone knows who sent it.  When a cap is
reached then, it waits on a *spare* seat (an eighth of the reserve, twice that with the
streams it evicted on their way out, so the control calls keep the rest of their threads), and is decided once it identifies itself
(:meth:`Seats.identify`: a ``Report`` hello, a ``Commands`` request): it takes the seat of
the stream that stands lowest under the cap it met, or is refused.  A silent stream waiting
on a spare seat gives way to a newer one (the oldest first), so silent streams cannot keep
newcomers from identifying.  An evicted stream is closed with RESOURCE_EXHAUSTED and a
message that says why, and counted (``evicted``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc

from rankwatch.agent.rpc import admission
from rankwatch.agent.rpc.admission import Seat, World
from rankwatch.agent.rpc.limits import StreamLimits

__all__ = ["Seats", "close_with"]

log = logging.getLogger(__name__)


def close_with(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End another thread's call with ``code`` and ``details`` (grpc's public API can only
    cancel it from outside, which tells the peer nothing)."""
    try:
        from grpc._cython import cygrpc
        context._rpc_event.call.cancel(getattr(cygrpc.StatusCode, code.name.lower()), details)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an older or newer grpc: cancel it plainly
        context.cancel()


@dataclass
class _Held:
    seat: Seat
    context: Any
    bucket: str
    """Which peer cap it counts under: a TCP host, ``pid:N``, ``unix`` (process unknown) or
    ``unix?`` (not identified yet: no peer cap)."""
    trusted: bool
    spare: bool = False
    leaving: bool = False


class Seats:
    """Args:
        limits: the caps.
        refuse: ``(reason, detail)``: count and log a refusal or an eviction.
    """

    def __init__(self, limits: StreamLimits, refuse: Callable[[str, str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._refuse = refuse
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}
        self._keys = itertools.count(1)

    # -- a stream's life ----------------------------------------------------------
    def open(self, method: str, context: grpc.ServicerContext, host: str, trusted: bool) -> int:
        """Seat a new stream (``host``: its TCP host, or ``unix``); its key.  Aborts the call
        when even a spare seat cannot be had."""
        lim = self.limits
        evict: _Held | None = None
        with self._lock:
            key = next(self._keys)
            tcp = host != "unix"
            regular = [h for h in self._held.values() if not h.spare and not h.leaving]
            host_full = tcp and sum(1 for h in regular if h.bucket == host) >= lim.per_peer
            full = host_full or len(regular) >= lim.total
            held = _Held(Seat(key, self._clock(), method), context, host if tcp else "unix?", trusted, spare=full)
            if full and self._spare_used() >= 2 * lim.spare:
                key = 0
                reason = "streams_per_peer" if host_full else "streams_total"
                why = "newcomers wait for a seat"
            elif full and self._spare_used() >= lim.spare:
                silent = [h for h in self._held.values() if h.spare and not h.leaving and not h.seat.identified]
                if not silent:
                    reason = "streams_per_peer" if host_full else "streams_total"
                    why = f"{host} holds {lim.per_peer} streams" if host_full else f"the agent serves {lim.total} streams"
                    key = 0
                else:
                    evict = min(silent, key=lambda h: (h.seat.opened, h.seat.key))
                    evict.leaving = True
            if key:
                self._held[key] = held
        if evict is not None:
            self._evict(evict, "it sent nothing while newer streams waited for a seat")
        if not key:
            self._refuse(reason, f"{method} from {context.peer()}: {why} already, and none stands below a newcomer")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method} refused: {why} already")
        return key

    def identify(self, key: int, context: grpc.ServicerContext, *, rank: int, pid: int, bucket: str | None = None,
                 verified: bool | None = None, holds: bool = False, world: World | None = None) -> None:
        """The stream said who it is (``bucket``: its peer cap, when it is known better than
        at open; ``verified`` None: as trusted as its TCP token).  Under a cap it now meets,
        it takes the lowest seat there or is refused (the call is aborted)."""
        refused: tuple[str, str] | None = None
        evict: list[tuple[_Held, str]] = []
        with self._lock:
            me = self._held.get(key)
            if me is None or me.leaving:
                return
            me.seat = replace(me.seat, identified=True, rank=rank, pid=pid, holds=holds, world=world,
                              verified=me.trusted if verified is None else verified)
            if bucket is not None:
                me.bucket = bucket
            elif me.bucket == "unix?":
                me.bucket = "unix"
            seated = [h for h in self._held.values() if not h.leaving and (not h.spare or h is me)]
            stands = admission.standings([h.seat for h in seated])
            mine = stands[key]
            cap = self.limits.per_process if me.bucket.startswith("pid:") else self.limits.per_peer
            peers = [h for h in seated if h.bucket == me.bucket and h is not me and not h.spare]
            if len(peers) >= cap:
                refused = self._take(mine, peers, stands, evict, "streams_per_peer", f"{me.bucket} holds {cap} streams")
            if refused is None and me.spare:
                regular = [h for h in seated if not h.spare and not h.leaving]
                if len(regular) >= self.limits.total:
                    refused = self._take(mine, regular, stands, evict, "streams_total",
                                         f"the agent serves {self.limits.total} streams")
                if refused is None:
                    me.spare = False
        for h, why in evict:
            self._evict(h, why)
        if refused is not None:
            reason, why = refused
            self._refuse(reason, f"{me.seat.method} from {context.peer()}: {why} already, none below this "
                                 f"{admission.NAMES[mine]} stream")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{me.seat.method} refused: {why} already, and none stands below yours "
                          f"({admission.NAMES[mine]})")

    def _take(self, mine: int, among: list[_Held], stands: dict[int, int], evict: list, reason: str,
              why: str) -> tuple[str, str] | None:
        """Evict the lowest of ``among`` for a newcomer of standing ``mine`` (call with the lock);
        (reason, why) when the newcomer is refused instead."""
        by_key = {h.seat.key: h for h in among}
        low = admission.victim(mine, [h.seat for h in among], stands)
        if low is None:
            return reason, why
        h = by_key[low.key]
        h.leaving = True
        stood = admission.NAMES[stands[low.key]]
        stale = ("has sent no step" if low.last_step is None
                 else f"sent no step for {self._clock() - low.last_step:.1f}s")
        evict.append((h, f"{why}: this {stood} stream {stale}, the longest of those below a newcomer"))
        return None

    def stepped(self, key: int) -> None:
        """The stream sent a step."""
        with self._lock:
            h = self._held.get(key)
            if h is not None:
                now = self._clock()
                h.seat = replace(h.seat, last_step=now,
                                 first_step=h.seat.first_step if h.seat.first_step is not None else now)

    def release(self, key: int) -> None:
        with self._lock:
            self._held.pop(key, None)

    def _spare_used(self) -> int:
        return sum(1 for h in self._held.values() if h.spare or h.leaving)

    def _evict(self, h: _Held, why: str) -> None:
        self._refuse("evicted", f"{h.seat.method} from {h.context.peer()} evicted: {why}")
        close_with(h.context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"evicted by the agent: {why}")

    # -- views --------------------------------------------------------------------
    def open_count(self) -> int:
        """Streams holding a seat (not those waiting on a spare one, nor those leaving)."""
        with self._lock:
            return sum(1 for h in self._held.values() if not h.spare and not h.leaving)
