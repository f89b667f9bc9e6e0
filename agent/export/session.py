"""Who may read the browser page: the job's token, as a bearer header or a session cookie.

With a token configured (``--token-file``), the page and its JSON answer only a request that
carries ``Authorization: Bearer <token>``, or the cookie ``/login`` sets once the token is
posted to it (HttpOnly, SameSite=Strict).  The cookie holds a secret drawn when the agent
starts, never the token: it is good until the agent exits.  Without a token, everyone may.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable, Iterable
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs

__all__ = ["COOKIE", "Session"]

COOKIE = "rankwatch_session"
_MAX_FORM = 4096   # bytes of a login form read at most

_FORM = b"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>rankwatch: sign in</title>
</head><body style="font:14px sans-serif;margin:3em">
<form method="post" action="/login"><p>This agent needs the job's token (its <code>--token-file</code>).</p>
<p><input type="password" name="token" autocomplete="current-password" autofocus size="40">
<button type="submit">Open the page</button></p></form></body></html>"""


class Session:
    """Args:
        token: the job's token (None: the page is open to whoever reaches the port).
    """

    def __init__(self, token: str | None) -> None:
        self._token = token
        self._secret = secrets.token_urlsafe(32)

    def allows(self, environ: dict[str, Any]) -> bool:
        """True if the request may read the page: no token is set, or it carries the token or
        this agent's session cookie."""
        if self._token is None:
            return True
        auth = environ.get("HTTP_AUTHORIZATION", "")
        if auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].strip().encode(), self._token.encode()):
            return True
        try:
            jar = SimpleCookie(environ.get("HTTP_COOKIE", ""))
        except CookieError:
            return False
        held = jar.get(COOKIE)
        return held is not None and hmac.compare_digest(held.value.encode(), self._secret.encode())

    def refuse(self, start_response: Callable[..., Any], *, html: bool) -> Iterable[bytes]:
        """401: the login form for a person, a line of JSON for a script."""
        body = _FORM if html else b'{"error":"this agent needs the job\'s token"}'
        kind = "text/html; charset=utf-8" if html else "application/json"
        start_response("401 Unauthorized", [("Content-Type", kind), ("Content-Length", str(len(body))),
                                            ("WWW-Authenticate", 'Bearer realm="rankwatch"'),
                                            ("Cache-Control", "no-store")])
        return [body]

    def login(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """``/login``: GET shows the form; POST the token to get the cookie and go to the page."""
        if environ.get("REQUEST_METHOD") != "POST":
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8"), ("Cache-Control", "no-store")])
            return [_FORM]
        try:
            size = min(int(environ.get("CONTENT_LENGTH") or 0), _MAX_FORM)
        except ValueError:
            size = 0
        form = parse_qs(environ["wsgi.input"].read(size).decode("utf-8", "replace"))
        given = (form.get("token") or [""])[0].strip()
        if self._token is not None and not hmac.compare_digest(given.encode(), self._token.encode()):
            return self.refuse(start_response, html=True)
        start_response("303 See Other", [
            ("Location", "/"), ("Cache-Control", "no-store"),
            ("Set-Cookie", f"{COOKIE}={self._secret}; Path=/; HttpOnly; SameSite=Strict")])
        return [b""]
