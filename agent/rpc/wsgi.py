"""The agent's HTTP port: /metrics as prometheus_client serves it, and the routes beside it.

One small threaded WSGI server (what ``prometheus_client.start_wsgi`` runs), so that the
page (:mod:`rankwatch.agent.export.page_http`) shares the port with /metrics.  Paths named in
``routes`` go to their app; every other path to /metrics' app, as before.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

__all__ = ["HttpServer", "WsgiApp", "dispatch", "start"]

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Quiet(WSGIRequestHandler):
    """Logs no request (a scrape every few seconds would fill the agent's log)."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class HttpServer(ThreadingMixIn, WSGIServer):
    """A thread per request; those threads never hold up the agent's exit.  ``SO_REUSEADDR``
    (``allow_reuse_address``, set by the standard library's HTTP server) keeps the port usable
    while the previous job's connections sit in TIME-WAIT."""

    daemon_threads = True
    allow_reuse_address = True


def dispatch(fallback: WsgiApp, routes: Mapping[str, WsgiApp]) -> WsgiApp:
    """An app that hands each request to ``routes[path]``, else to ``fallback``."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        return routes.get(environ.get("PATH_INFO") or "/", fallback)(environ, start_response)

    return app


def start(addr: str, port: int, app: WsgiApp) -> HttpServer:
    """Bind ``addr:port`` (0: a port the system picks) and serve ``app`` from a daemon thread.

    Raises:
        OSError: the bind failed (``EADDRINUSE``: another process listens on the port).
    """
    family, host = _family(addr, port)
    server_class = type("AgentHttpServer", (HttpServer,), {"address_family": family})
    httpd: HttpServer = make_server(host, port, app, server_class, handler_class=_Quiet)  # type: ignore[assignment]
    threading.Thread(target=httpd.serve_forever, name="rankwatch-http", daemon=True).start()
    return httpd


def _family(addr: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The address family ``addr`` needs (an IPv6 address cannot bind an AF_INET socket)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    return family, str(sockaddr[0])
