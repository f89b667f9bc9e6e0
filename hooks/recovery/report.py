"""What the in-process tier tells its monitor: each recovery's report, delivered before a failed worker exits."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from rankwatch.hooks.recovery.decide import Membership

__all__ = ["activity", "deliver", "send", "snapshot"]

log = logging.getLogger(__name__)


def activity(monitor: Any, name: str) -> Any:
    """The monitor's ``activity(name)`` scope (the agent's allowance for it), or a no-op."""
    mark = getattr(monitor, "activity", None)
    return mark(name) if mark is not None else contextlib.nullcontext()


def send(monitor: Any, caught: float, step: int, old: Membership, new: Membership, phases: dict[str, float],
         ok: bool, error: str = "", failed_at: int | None = None) -> None:
    """Report one recovery attempt (``monitor.recovered``; ``failed_at``: the step the failure
    cut short, when training goes on from an earlier one); never raises."""
    recovered = getattr(monitor, "recovered", None)
    if recovered is None:
        return
    try:
        more = {} if failed_at is None else {"failed_at": failed_at}
        recovered(started_at=caught, step=step, old_world_size=old.world_size, new_world_size=new.world_size,
                  dropped_nodes=list(new.dropped_nodes[len(old.dropped_nodes):]), phases=dict(phases),
                  ok=ok, error=error, rank_after=new.rank, **more)
    except Exception as exc:  # noqa: BLE001 - reporting never breaks training
        log.warning("rankwatch: could not report the recovery: %s", exc)


def snapshot(monitor: Any, stats: Any) -> None:
    """Report the peer snapshots' latest stats (``monitor.peer_snapshot``); never raises."""
    taken = getattr(monitor, "peer_snapshot", None)
    if taken is None:
        return
    try:
        taken(stats)
    except Exception as exc:  # noqa: BLE001 - reporting never breaks training
        log.warning("rankwatch: could not report the snapshot: %s", exc)


def deliver(monitor: Any) -> None:
    """Send what the monitor holds and end its stream, waiting (boundedly) for the agent to
    read it: the worker exits next, and a report still buffered would die with it.  The
    monitor reports nothing after this."""
    close = getattr(monitor, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception as exc:  # noqa: BLE001 - reporting never breaks the exit
        log.warning("rankwatch: could not deliver the recovery report: %s", exc)
