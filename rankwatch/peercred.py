"""Who is on the other end of the agent's Unix socket: SO_PEERCRED beside gRPC.

Python's gRPC does not expose the peer's credentials of a Unix-socket call.  So
the agent keeps a second, plain Unix socket beside its gRPC one (``PATH.cred``,
mode 0600 like it).  A rank connects there before it opens its ``Report``
stream and sends a random nonce; the agent reads the connection's SO_PEERCRED,
which the kernel fills in and translates into the agent's pid namespace, and
keeps ``nonce -> (pid, uid)`` for a minute.  The rank then puts the nonce in its
``Hello``.  The agent thereby learns the rank's true pid and uid, even from a
container in another pid namespace, and nobody can borrow another process's
identity: the nonce binds the hello to the process that presented it.

Shared by the agent (:class:`CredListener`) and the ranks (:func:`present`).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta

__all__ = ["CredListener", "PeerCred", "cred_path", "present"]

log = logging.getLogger(__name__)

_NONCE = 16
_KEEP = 60.0          # seconds a presented nonce stays redeemable
_MAX_KEPT = 4096      # nonces kept at most (the oldest go first)
_IO_TIMEOUT = 0.5     # seconds a presenter may take; the listener serves one at a time
_ACK = b"ok"


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def cred_path(socket_path: str) -> str:
    """The credentials socket beside an agent socket."""
    return os.path.abspath(socket_path) + ".cred"


def present(socket_path: str, timeout: timedelta = timedelta(milliseconds=500)) -> bytes:
    """Show this process to the agent at ``socket_path``; the nonce for the Hello, or b""
    when the agent has no credentials socket (an older agent) or does not answer."""
    nonce = secrets.token_bytes(_NONCE)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout.total_seconds())
            s.connect(cred_path(socket_path))
            s.sendall(nonce)
            if s.recv(len(_ACK)) != _ACK:
                return b""
    except OSError:
        return b""
    return nonce


class CredListener:
    """The agent's side: accepts presenters on ``cred_path(socket_path)``."""

    def __init__(self, socket_path: str, clock=time.monotonic) -> None:
        self.path = cred_path(socket_path)
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, tuple[PeerCred, float]] = OrderedDict()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)   # the gRPC socket beside it was checked: no agent is on it
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        s.listen(128)
        s.settimeout(0.2)
        self._sock = s
        self._thread = threading.Thread(target=self._serve, name="rankwatch-peercred", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            if os.path.exists(self.path):
                os.unlink(self.path)

    def take(self, nonce: bytes) -> PeerCred | None:
        """The credentials of the process that presented ``nonce`` (once), or None."""
        if len(nonce) != _NONCE:
            return None
        with self._lock:
            got = self._seen.pop(nonce, None)
        if got is None or self._clock() - got[1] > _KEEP:
            return None
        return got[0]

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with conn:
                try:
                    self._one(conn)
                except OSError as exc:
                    log.debug("credentials socket: %s", exc)

    def _one(self, conn: socket.socket) -> None:
        conn.settimeout(_IO_TIMEOUT)
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                             struct.calcsize("3i")))
        nonce = b""
        while len(nonce) < _NONCE:
            chunk = conn.recv(_NONCE - len(nonce))
            if not chunk:
                return
            nonce += chunk
        now = self._clock()
        with self._lock:
            self._seen[nonce] = (PeerCred(pid, uid, gid), now)
            while len(self._seen) > _MAX_KEPT:
                self._seen.popitem(last=False)
        conn.sendall(_ACK)
