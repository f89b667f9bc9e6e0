"""What the in-process tier tells its monitor: each recovery's report, delivered before a failed worker exits."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from rankwatch.hooks.recovery import net
from rankwatch.hooks.recovery.decide import MAX_MESSAGE, Membership
from rankwatch.hooks.recovery.protocol import RESTARTING, RecoveryFailed

__all__ = ["activity", "deliver", "failed", "send", "snapshot"]

RESTART_GRACE = 60.0   # seconds a worker waits to be stopped when torchrun already restarts the round

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


def failed(monitor: Any, failure: Exception, caught: float, completed: int, old: Membership,
           phases: dict[str, float], mark_restarting: Callable[[], None] | None = None) -> Exception:
    """Report a failed attempt before the worker exits for torchrun's restart; the exception
    to raise.  ``mark_restarting``: a member failed after the world was rebuilt, so no worker
    rejoins it in process."""
    error = f"{type(failure).__name__}: {failure}"[:MAX_MESSAGE]
    log.error("rankwatch: in-process recovery failed (%s); the worker exits for torchrun's restart", error)
    # torchrun may stop this worker any moment now (another survivor's exit starts its
    # restart): the report reaches the agent first, a SIGTERM waiting meanwhile.
    with net.deferred_termination():
        if mark_restarting is not None:
            with contextlib.suppress(Exception):
                mark_restarting()
        send(monitor, caught, completed, old, old, phases, ok=False, error=error)
        deliver(monitor)
    if RESTARTING in error:
        # torchrun stops this worker itself: exiting first would read as a failure of
        # its own (and spend one of --max-restarts).
        log.warning("rankwatch: waiting for torchrun to stop this worker")
        time.sleep(RESTART_GRACE)
    return failure if isinstance(failure, RecoveryFailed) else RecoveryFailed(error)
