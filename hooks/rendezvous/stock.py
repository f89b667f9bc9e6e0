"""Every use of the stock dynamic rendezvous handler's private API: its state, its round, leaving early.

torch's ``DynamicRendezvousHandler`` keeps what the ``rankwatch`` handler must know (the
round's number, whether it is complete with every node it can hold) and how to leave a
rendezvous at once in private attributes.  Every read of them is here, each falling back
to what the stock handler would do when a torch release moves them.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

__all__ = ["current_round", "expire", "job_full", "leave", "silent_nodes", "state", "stock_round", "this_node"]

log = logging.getLogger(__name__)

_LEAVE_TIMEOUT = timedelta(seconds=10)


def state(inner: Any, sync: bool = True) -> Any:
    """The stock handler's view of the rendezvous (private API), synced with the store."""
    if sync:
        with inner._heartbeat_lock:
            inner._state_holder.sync()
    return inner._state_holder.state


def stock_round(inner: Any) -> int | None:
    """The stock rendezvous's round number, as this node last read it."""
    try:
        return int(state(inner, sync=False).round)
    except Exception:  # noqa: BLE001 - private API: the workers fall back to their own store
        return None


def current_round(inner: Any) -> int | None:
    """The stock rendezvous's round number, synced with the store, when that round is
    complete and open; None otherwise."""
    s = state(inner)
    return int(s.round) if s.complete and not s.closed else None


def job_full(inner: Any, sync: bool = True, spare: bool = True) -> bool:
    """True when the current round is complete with MAX nodes (and, with ``spare``, this
    node is not among them)."""
    try:
        s = state(inner, sync)
        return (s.complete and not s.closed
                and len(s.participants) >= inner._settings.max_nodes
                and not (spare and inner._this_node in s.participants))
    except Exception:  # noqa: BLE001 - private API: behave as the stock handler
        return False


def leave(inner: Any) -> None:
    """Leave the rendezvous now rather than when this node's keep-alive expires."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        inner._stop_heartbeats()
        inner._op_executor.run(_RendezvousExitOp(), inner._get_deadline(_LEAVE_TIMEOUT))
    except Exception as exc:  # noqa: BLE001 - private API; the keep-alive expiry still works
        log.warning("rankwatch: could not leave the rendezvous early (%s); the others wait "
                    "for this node's keep-alive to expire", exc)


def this_node(inner: Any) -> Any:
    """This node's descriptor in the rendezvous (private API)."""
    return inner._this_node


def silent_nodes(inner: Any) -> list[Any]:
    """The nodes whose last keep-alive in the rendezvous state (synced) is older than one
    keep-alive interval: those that may be gone."""
    from datetime import datetime, timezone

    s = state(inner)
    since = datetime.now(timezone.utc) - inner._settings.keep_alive_interval
    return [n for n, beat in s.last_heartbeats.items() if beat < since]


def expire(inner: Any, gone: list[Any], attempts: int = 5) -> None:
    """Set the last keep-alive of each of ``gone`` far in the past and write the state back, so
    that every node's next sync drops them as dead (what the stock handler does once their
    keep-alive expires)."""
    from datetime import datetime, timezone

    for _ in range(attempts):
        with inner._heartbeat_lock:
            holder = inner._state_holder
            holder.sync()
            s = holder.state
            present = [n for n in gone if n in s.last_heartbeats]
            if not present:
                return
            for n in present:
                s.last_heartbeats[n] = datetime(1970, 1, 2, tzinfo=timezone.utc)
            holder.mark_dirty()
            if holder.sync():
                return
