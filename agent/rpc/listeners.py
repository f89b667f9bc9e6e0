"""The node agent's servers: gRPC, the credential sockets beside its Unix sockets, HTTP.

gRPC serves the agent's Unix socket(s), made 0600 from the start, and any TCP address
(with TLS when configured).  Beside each Unix socket a credentials socket tells the agent
which process presented a nonce (:mod:`rankwatch.peercred`).  The RPCs themselves are
:mod:`.servicer`'s; who may call them, :mod:`.gate`'s.  The HTTP port serves /metrics and
the routes beside it (the page): :mod:`.wsgi`.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from concurrent import futures
from datetime import timedelta
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, make_wsgi_app

from rankwatch.agent.rpc import wsgi
from rankwatch.agent.rpc.gate import Gate
from rankwatch.peercred import CredListener, PeerCred

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Protocol

    from rankwatch.address import Address
    from rankwatch.agent.rpc.tls import TlsConfig

    class ListenConfig(Protocol):
        """What the listeners read of the agent's configuration."""

        @property
        def listen(self) -> Sequence[Address]: ...
        @property
        def advertise(self) -> str | None: ...
        @property
        def metrics_port(self) -> int | None: ...
        @property
        def metrics_addr(self) -> str: ...
        @property
        def tls(self) -> TlsConfig | None: ...

__all__ = ["Listeners"]

log = logging.getLogger(__name__)

_MAX_MESSAGE = 16 << 20
_MAX_RPCS = 512


class Listeners:
    """Args:
        config: the agent's configuration (its addresses, ports and TLS).
    """

    def __init__(self, config: ListenConfig) -> None:
        self._config = config
        self.metrics_port: int | None = None
        self.tcp_ports: list[int] = []
        self._creds: list[CredListener] = []
        self._grpc: grpc.Server | None = None
        self._http: wsgi.HttpServer | None = None
        self._owns_sockets = False

    def serve_metrics(self, registry: CollectorRegistry,
                      routes: Mapping[str, wsgi.WsgiApp] | None = None) -> None:
        """HTTP /metrics, and ``routes`` beside it, when a port is configured (0: one the system picks).

        The port is taken by the bind itself, never probed first: two agents that start
        together cannot both see it free.  The server binds with ``SO_REUSEADDR``, so the
        previous job's connections in TIME-WAIT leave the port usable.  If another process
        listens on it, the agent takes a port the system picks and says which: it never exits
        over /metrics.  Every path not in ``routes`` serves /metrics, as prometheus_client does."""
        port = self._config.metrics_port
        if port is None:
            return
        addr = self._config.metrics_addr
        app = wsgi.dispatch(make_wsgi_app(registry), routes or {})
        try:
            self._http = wsgi.start(addr, port, app)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or port == 0:
                raise
            self._http = wsgi.start(addr, 0, app)
            log.warning("metrics port %d is taken by another process: /metrics is on port %d instead",
                        port, self._http.server_port)
        self.metrics_port = self._http.server_port

    def serve_grpc(self, handlers: Any, gate: Gate) -> None:
        """Serve ``handlers`` behind ``gate`` on every configured address.

        Raises:
            RuntimeError: another agent listens on one of its Unix sockets.
        """
        server = grpc.server(
            # Streams never take more than limits.total threads: the rest serve control calls.
            futures.ThreadPoolExecutor(max_workers=gate.limits.threads, thread_name_prefix="rankwatch-grpc"),
            interceptors=(gate,),
            maximum_concurrent_rpcs=_MAX_RPCS,
            options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                     ("grpc.max_send_message_length", _MAX_MESSAGE),
                     ("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((handlers,))
        # Sockets are made 0600 from the start (chmod below only confirms it): no moment with
        # the process's default mode (the agent's threads create no other files meanwhile).
        unix = [addr.path for addr in self._config.listen if addr.is_unix and addr.path]
        for path in unix:
            _prepare_socket_path(path)
        umask = os.umask(0o177)
        try:
            self._bind(server)
        finally:
            os.umask(umask)
        for path in unix:
            os.chmod(path, 0o600)
            self._creds.append(CredListener(path))
            self._creds[-1].start()
        self._grpc = server
        self._owns_sockets = True

    def _bind(self, server: grpc.Server) -> None:
        for addr in self._config.listen:
            if addr.is_unix:
                server.add_insecure_port(addr.grpc_target())
            elif self._config.tls is not None:
                self.tcp_ports.append(server.add_secure_port(addr.grpc_target(),
                                                             self._config.tls.server_credentials()))
            else:
                self.tcp_ports.append(server.add_insecure_port(addr.grpc_target()))
        server.start()

    def advertised(self) -> str:
        """This agent's address for the other agents ('' if it serves no TCP address)."""
        if self._config.advertise is not None:
            return self._config.advertise
        tcp = next((a for a in self._config.listen if not a.is_unix), None)
        if tcp is None or not self.tcp_ports:
            return ""
        host = tcp.host if tcp.host not in ("0.0.0.0", "::", "") else socket.getfqdn()
        return f"{host}:{self.tcp_ports[0]}"

    def peer_cred(self, nonce: bytes) -> PeerCred | None:
        """Who presented ``nonce`` on a credentials socket (rankwatch/peercred.py)."""
        for listener in self._creds:
            cred = listener.take(nonce)
            if cred is not None:
                return cred
        return None

    def stop_grpc(self, grace: timedelta) -> None:
        """Stop serving RPCs (streams get ``grace`` to end) and the credential sockets."""
        if self._grpc is not None:
            self._grpc.stop(grace.total_seconds()).wait()
            self._grpc = None
        for listener in self._creds:
            listener.stop()
        self._creds.clear()

    def stop(self) -> None:
        """Stop /metrics and remove this agent's Unix sockets (after :meth:`stop_grpc`)."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._owns_sockets:
            for addr in self._config.listen:
                if addr.is_unix and addr.path and os.path.exists(addr.path):
                    os.unlink(addr.path)
            self._owns_sockets = False


def _prepare_socket_path(path: str) -> None:
    """Make the socket's directory (0700 if we create it) and clear a stale socket.

    Raises:
        RuntimeError: another agent is listening on ``path``.
    """
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody home: a crashed agent's leftover
        else:
            raise RuntimeError(f"an agent is already listening on {path}")
        finally:
            probe.close()
