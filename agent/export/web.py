"""The browser page's routes on the agent's HTTP port, beside /metrics.

``/`` is one self-contained file (``page.html``: HTML, CSS, inline SVG and plain JS; it fetches
nothing from outside the agent), ``/status.json`` the ``status --json`` object it polls every
second, ``/story?id=`` an incident's story as ``rankwatch diagnose`` tells it, ``/login`` the
form that sets the session cookie (:mod:`.session`).  A Content-Security-Policy allows only the
page's own script and style (by hash) and requests to the agent itself.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from collections.abc import Callable, Iterable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from rankwatch.agent.export.session import Session
from rankwatch.agent.views.live import LiveView

__all__ = ["page_routes"]

log = logging.getLogger(__name__)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def page_routes(view: LiveView, token: str | None) -> dict[str, WsgiApp]:
    """The page's paths and their apps (every other path stays /metrics').

    Args:
        view: what the page reads (:class:`~rankwatch.agent.views.live.LiveView`).
        token: the job's token (None: the page is open).
    """
    return _Page(view, Session(token)).routes()


class _Page:
    def __init__(self, view: LiveView, session: Session) -> None:
        self._view, self._session = view, session
        self._html = resources.files("rankwatch.agent.export").joinpath("page.html").read_bytes()
        self._csp = _policy(self._html.decode())

    def routes(self) -> dict[str, WsgiApp]:
        return {"/": self._page, "/index.html": self._page, "/status.json": self._status,
                "/story": self._story, "/login": self._session.login}

    def _page(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not self._session.allows(environ):
            return self._session.refuse(start_response, html=True)
        start_response("200 OK", [("Content-Type", "text/html; charset=utf-8"),
                                  ("Content-Length", str(len(self._html))),
                                  ("Content-Security-Policy", self._csp), *_COMMON])
        return [self._html]

    def _status(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not self._session.allows(environ):
            return self._session.refuse(start_response, html=False)
        body = self._view.status_json()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                                  *_COMMON])
        return [body]

    def _story(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not self._session.allows(environ):
            return self._session.refuse(start_response, html=False)
        wanted = (parse_qs(environ.get("QUERY_STRING", "")).get("id") or [""])[0]
        text = self._view.story(wanted) if wanted else None
        status = "200 OK" if text is not None else "404 Not Found"
        body = (text if text is not None else f"no incident {wanted!r} at this agent").encode()
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                                ("Content-Length", str(len(body))), *_COMMON])
        return [body]


_COMMON = [("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
           ("Referrer-Policy", "no-referrer"), ("X-Frame-Options", "DENY")]


def _policy(html: str) -> str:
    """Only the page's own inline script and style run (named by their hashes); it talks only to
    the agent that served it."""
    def hashes(tag: str) -> str:
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in found)

    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
            "img-src data:; connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
