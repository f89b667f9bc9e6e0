"""The coordinator's exclusions in the rendezvous store, where every node's torchrun reads them.

Under ``rankwatch/<run_id>/`` in the rendezvous store (a TCPStore, or etcd):

* ``generation``: the restart generation, a counter that is only ever raised;
* ``excluded/<node>``: why the node was excluded (written once);
* ``exclusion/<generation>``: the node that generation excluded.

Only the coordinator's decisions are written, by the relay of the coordinator's node
(:mod:`.poller`); writing a decision again changes nothing.  The rendezvous handler
(:mod:`.rendezvous`) reads them to refuse an excluded node and to restart a round that
lost a member.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed import PrefixStore, Store

__all__ = ["Exclusions"]

log = logging.getLogger(__name__)

_GENERATION = "generation"
_EXCLUDED = "excluded/"
_EXCLUSION = "exclusion/"   # exclusion/<generation> -> the node that generation excluded


class Exclusions:
    """Args:
        store: the rendezvous store, unprefixed.
        run_id: the job's run id.
        node: this node's id, as the coordinator names it.
    """

    def __init__(self, store: Store, run_id: str, node: str) -> None:
        self._store = PrefixStore(f"rankwatch/{run_id}/", store)
        self._node = node
        self.reason: str | None = None
        """Why this node is excluded, once :meth:`excluded` has seen it (never unset)."""

    def generation(self) -> int:
        return int(self._store.add(_GENERATION, 0))  # add(0) reads without blocking

    def excluded(self) -> str | None:
        """Why this node is excluded; None while it is not."""
        if self.reason is None:
            key = _EXCLUDED + self._node
            if self._store.check([key]):
                self.reason = self._store.get(key).decode(errors="replace") or "excluded"
        return self.reason

    def node_of(self, generation: int) -> str | None:
        """The node ``generation`` excluded; None when the store does not say."""
        key = f"{_EXCLUSION}{generation}"
        if not self._store.check([key]):
            return None
        return self._store.get(key).decode(errors="replace")

    def write(self, decision: dict[str, Any]) -> None:
        """Apply a coordinator decision to the store (idempotent; only exclusions are written)."""
        if decision["kind"] != "exclude":
            return
        key = _EXCLUDED + decision["node"]
        if not self._store.check([key]):
            self._store.set(key, decision["reason"] or "excluded")
        self._store.set(f"{_EXCLUSION}{decision['generation']}", decision["node"])
        current = self.generation()
        if decision["generation"] > current:
            self._store.add(_GENERATION, decision["generation"] - current)
        log.warning("rankwatch: wrote %s (node %s, generation %d) to the rendezvous store",
                    decision["id"], decision["node"], decision["generation"])
