"""The job's shared token, on the agent's side.

With a token (``--token-file PATH``, ``$RANKWATCH_TOKEN_FILE`` or ``$RANKWATCH_TOKEN``)
the agent refuses every RPC that arrives over TCP without
``authorization: Bearer <token>`` (UNAUTHENTICATED); :mod:`rankwatch.agent.rpc.gate`
does that for every call in one place.  ``Sync`` and ``RequestCheckpoint`` need
the token on the Unix socket as well, since they move the whole job.  Other
calls on the socket are not asked: the socket is 0600 in a 0700 directory.
Clients send the token through :mod:`rankwatch.credentials`.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc

from rankwatch.credentials import TOKEN_ENV, TOKEN_FILE_ENV, job_token

__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "authorized", "load_token", "metadata"]

_HEADER = "authorization"


def load_token(path: Path | None = None) -> str | None:
    """The token from ``path``, else ``$RANKWATCH_TOKEN_FILE``, else ``$RANKWATCH_TOKEN``,
    else None.

    Raises:
        ValueError: the file is unreadable, empty, or readable by others.
    """
    return job_token(os.environ, path)


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((_HEADER, f"Bearer {token}"),) if token else ()


def authorized(context: grpc.ServicerContext, token: str | None) -> bool:
    """Whether the call carries ``authorization: Bearer <token>``, once.

    A call that carries the header more than once is refused whatever its values: which
    one "wins" differs between readers of the metadata (a dict keeps the last), and a
    proxy or client may add one of its own; one credential per call leaves nothing to choose.
    """
    if token is None:
        return True
    given = [value for key, value in context.invocation_metadata() if key.lower() == _HEADER]
    if len(given) != 1 or not isinstance(given[0], str):
        return False
    return hmac.compare_digest(given[0].encode(), f"Bearer {token}".encode())
