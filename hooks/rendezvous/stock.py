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

__all__ = ["current_round", "job_full", "leave", "state", "stock_round"]

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
