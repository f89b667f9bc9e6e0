"""A lost node out of the rendezvous at once, on proof, instead of after its keep-alive expires.

Each node's torchrun listens on a port of its own (:class:`Lifeline`) and names it in the
rendezvous store under its rendezvous node descriptor.  When a node's torchrun is asked for the
next round (its workers failed), it first tries the port of every other node of the stock
rendezvous state that missed a keep-alive: one that *refuses* the connection has no torchrun behind it any more (the
process is gone; the host answered), so its last keep-alive is set far in the past
(:func:`~rankwatch.hooks.rendezvous.stock.expire`), and every node's next read of the state drops
it, as the stock handler would once ``keep_alive_interval x keep_alive_max_attempt`` passed.  A
port that accepts, or does not answer (a host down, a partition), proves nothing: the stock
keep-alive expiry still decides then.

This is the same proof the in-process tier uses for a lost worker (its liveness port).
``RANKWATCH_LIFELINE=0`` turns it off (torch's keep-alive expiry alone, as before).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from rankwatch.hooks.recovery.net import refused
from rankwatch.hooks.rendezvous import stock

__all__ = ["OFF_ENV", "Lifeline"]

log = logging.getLogger(__name__)

_KEY = "rankwatch/{run_id}/lifeline/{node}"
OFF_ENV = "RANKWATCH_LIFELINE"


def _listening() -> socket.socket:
    """A port on every address, IPv6 and IPv4 both where the host has IPv6: a name that
    resolves to either must reach it (a refusal on one family is no proof)."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", 0))
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("0.0.0.0", 0))
    sock.listen(64)
    return sock


class Lifeline:
    """Args:
        store: the rendezvous store.
        inner: the stock dynamic rendezvous handler (its node descriptor names this node).
    """

    def __init__(self, store: Any, inner: Any) -> None:
        self._store, self._inner = store, inner
        self._run_id = inner.get_run_id()
        self._sock: socket.socket | None = None
        self.on = os.environ.get(OFF_ENV, "1") != "0"
        if not self.on:
            return
        try:
            me = stock.this_node(inner)
            sock = _listening()
            self._sock = sock
            threading.Thread(target=self._accept, name="rankwatch-lifeline", daemon=True).start()
            store.set(self._key(me), f"{me.addr}:{sock.getsockname()[1]}")
        except Exception as exc:  # noqa: BLE001 - without it the keep-alive expiry decides, as in torch
            log.warning("rankwatch: no lifeline for this node (%s); a lost node leaves the rendezvous when its "
                        "keep-alive expires", exc)

    def _key(self, node: Any) -> str:
        return _KEY.format(run_id=self._run_id, node=repr(node))

    def _accept(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                sock.accept()[0].close()
            except OSError:
                return

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def drop_lost(self) -> list[str]:
        """Expire every other node of the rendezvous whose torchrun is proven gone (looking only
        at those that missed a keep-alive); their names.  Never raises."""
        if not self.on:
            return []
        try:
            me = stock.this_node(self._inner)
            others = [n for n in stock.silent_nodes(self._inner) if n != me]
            gone = []
            for node in others:
                key = self._key(node)
                if self._store.check([key]) and refused(self._store.get(key).decode(errors="replace")):
                    gone.append(node)
            if gone:
                stock.expire(self._inner, gone)
                log.warning("rankwatch: node(s) %s left the rendezvous at once: their torchrun is gone "
                            "(its port refuses)", ", ".join(map(repr, gone)))
            return [repr(n) for n in gone]
        except Exception as exc:  # noqa: BLE001 - private API or a store hiccup: the keep-alive decides
            log.warning("rankwatch: could not look for lost nodes (%s); their keep-alive expires", exc)
            return []
