"""A shared token for the job's control traffic.

Node agent -> coordinator summaries (``Sync``) and checkpoint requests
(``RequestCheckpoint``, which the coordinator also answers for exclusions
and restarts through its decisions) carry ``authorization: Bearer <token>``
when a token is configured: ``--token-file PATH`` or ``$RANKWATCH_TOKEN``.
An agent with a token refuses those calls without it (UNAUTHENTICATED).
Rank streams stay on the node's 0600 Unix socket, where the file mode is the
access control.  Mutual TLS is not built yet.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc

__all__ = ["TOKEN_ENV", "authorized", "load_token", "metadata"]

TOKEN_ENV = "RANKWATCH_TOKEN"
_HEADER = "authorization"


def load_token(path: Path | None = None) -> str | None:
    """The token from ``path`` (stripped), else ``$RANKWATCH_TOKEN``, else None.

    Raises:
        ValueError: the file is unreadable, empty, or readable by others.
    """
    if path is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read token file {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise ValueError(f"token file {path} is readable by group or others (chmod 600 it)")
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((_HEADER, f"Bearer {token}"),) if token else ()


def authorized(context: grpc.ServicerContext, token: str | None) -> bool:
    if token is None:
        return True
    given = dict(context.invocation_metadata()).get(_HEADER, "")
    return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())
