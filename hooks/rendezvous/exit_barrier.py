"""Standing in at torchrun's exit barrier for a node that left the round for good.

When a round's workers succeed, each node's torchrun waits at the end, up to 300 s
(the elastic agent's ``exit_barrier_timeout``), until every node of the
round has checked in there, so that the store's host does not leave while the others still
use it.  A node that left the round for good never checks in: one whose workers the others
left out in process (:meth:`.round_keys.InProcessRound.check_in_regrouped`), or one the
coordinator excluded once the others' workers had finished (a fatal XID in the last steps),
when no restart or regroup ever comes.  One survivor checks in for it, whichever gets there
first, or the node itself as its torchrun leaves (refused by the next round: its own relay
cannot tell whether that torchrun is at the barrier already); a node stood in for twice is
counted once.

A check-in for a node of a round that then restarts is harmless: each round has its own
barrier keys, and a round that restarts never reaches its barrier.

The exit barrier is a blocking ``wait`` on the round's store client, and a TCPStore client
serves one call at a time: any other call on it, from the relay's thread, waits until the
barrier ends.  A check-in made while this node's own torchrun waits there (the coordinator's
node finished too) goes through a client of its own (:func:`own_client`).
"""

from __future__ import annotations

import logging

from torch.distributed import Store

__all__ = ["MEMBER_PREFIX", "check_in_leaving", "own_client", "stand_in", "stand_in_for_excluded"]

log = logging.getLogger(__name__)

_KEY = "rankwatch/exit_check_in/"
MEMBER_PREFIX = "rankwatch/member/"  # in a round's own store: one key per member node


def stand_in(round_store: Store, round_nodes: int, node: str) -> bool:
    """Check in for ``node`` at the exit barrier of the round whose (prefixed) store is
    ``round_store`` and whose size is ``round_nodes``.  True: this call did; False: another
    survivor (or an earlier call) already had."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import _barrier_nonblocking

    if round_store.add(_KEY + node[:256], 1) != 1:
        return False
    _barrier_nonblocking(round_store, round_nodes, _TERMINAL_STATE_SYNC_ID)
    return True


def own_client(store: Store) -> Store:
    """A new client of ``store``'s server, with the same key prefix; ``store`` itself where it
    cannot make one (etcd's store makes an HTTP request per call and blocks nothing)."""
    try:
        return store.clone()
    except Exception:  # noqa: BLE001 - not every store clones
        return store


def stand_in_for_excluded(round_store: Store | None, round_nodes: int, node: str, me: str) -> bool:
    """Check in at this round's exit barrier for ``node``, just excluded, when it is a member of
    the round: its torchrun leaves and never does, and once the others' workers have finished
    (an exclusion in the job's last steps) nothing else would, so the others would wait out
    torchrun's 300 s.  The relay that writes the exclusion calls it; a node (``me``) never stands
    in for itself here (its own torchrun may be at the barrier), it checks in as it leaves
    (:func:`check_in_leaving`).  True: this call checked in for ``node``."""
    if node == me or round_store is None:
        return False
    own = own_client(round_store)
    if own.check([MEMBER_PREFIX + node]) and stand_in(own, round_nodes, node):
        log.warning("rankwatch: node %s was excluded; checked in for it at torchrun's exit barrier", node)
        return True
    return False


def check_in_leaving(round_store: Store | None, round_nodes: int, node: str) -> None:
    """Check in at this round's exit barrier for ``node``, which leaves the job for good
    (excluded) and so never reaches it.  The coordinator's relay stands in for the other nodes
    it excludes; this covers the one it cannot: its own node, when its agent coordinates, and
    any excluded node whose exclusion reached it first."""
    if round_store is None:
        return
    try:
        if stand_in(round_store, round_nodes, node):
            log.warning("rankwatch: node %s leaves the job; checked in for it at torchrun's exit barrier", node)
    except Exception as exc:  # noqa: BLE001 - the round's store may be gone with its host
        log.warning("rankwatch: could not check in at the exit barrier on leaving (%s)", exc)
