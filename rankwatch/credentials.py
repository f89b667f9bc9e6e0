"""The client side of the job's credentials: a bearer token and mutual TLS.

Every client of an agent (the ranks' stream, ``rankwatch status``, ``diagnose`` and
``checkpoint``, and an agent syncing with its coordinator) opens its channel here,
so they all read the credentials the same way:

* ``RANKWATCH_TOKEN`` (the token itself) or ``RANKWATCH_TOKEN_FILE`` (a file of
  mode 0600 holding it): sent as ``authorization: Bearer <token>`` on every call.
* ``RANKWATCH_TLS_CA``, ``RANKWATCH_TLS_CERT``, ``RANKWATCH_TLS_KEY``: PEM files.
  With the CA set, TCP channels use TLS and check the agent's certificate against
  it; with the certificate and key too, the client presents them (mutual TLS).

A Unix socket is never wrapped in TLS (its file mode is its access control).
Shared by the training side and the node side, so it imports neither.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from rankwatch.address import Address

__all__ = ["TLS_CA_ENV", "TLS_CERT_ENV", "TLS_KEY_ENV", "TOKEN_ENV", "TOKEN_FILE_ENV",
           "ClientCredentials", "job_token", "open_channel", "read_token_file"]

TOKEN_ENV = "RANKWATCH_TOKEN"
TOKEN_FILE_ENV = "RANKWATCH_TOKEN_FILE"
TLS_CA_ENV = "RANKWATCH_TLS_CA"
TLS_CERT_ENV = "RANKWATCH_TLS_CERT"
TLS_KEY_ENV = "RANKWATCH_TLS_KEY"
_HEADER = "authorization"


def read_token_file(path: Path) -> str:
    """The token in ``path``, stripped.

    Raises:
        ValueError: the file is unreadable, empty, or readable by others.
    """
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


def job_token(env: Mapping[str, str], token_file: Path | None = None) -> str | None:
    """The job's token: ``token_file``, else ``$RANKWATCH_TOKEN_FILE``, else ``$RANKWATCH_TOKEN``;
    None without one.

    Raises:
        ValueError: the named file is unreadable, empty, or readable by others.
    """
    file = token_file or (Path(env[TOKEN_FILE_ENV]) if env.get(TOKEN_FILE_ENV) else None)
    return read_token_file(file) if file is not None else (env.get(TOKEN_ENV) or None)


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class ClientCredentials:
    """What a client presents to an agent over TCP.  Empty: nothing (plain TCP)."""

    token: str | None = None
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *,
                 token_file: Path | None = None) -> ClientCredentials:
        """The credentials from ``token_file`` and the ``RANKWATCH_*`` variables.

        Raises:
            ValueError: a named file is unreadable, or the TLS settings are incomplete.
        """
        env = os.environ if env is None else env
        return cls.tls(job_token(env, token_file), env.get(TLS_CA_ENV), env.get(TLS_CERT_ENV), env.get(TLS_KEY_ENV))

    @classmethod
    def tls(cls, token: str | None, ca: str | None, cert: str | None,
            key: str | None) -> ClientCredentials:
        """Credentials from PEM file paths (any may be None).

        Raises:
            ValueError: a file is unreadable, or only one of ``cert`` and ``key`` is given,
                or a certificate without a CA to check the agent's against.
        """
        if bool(cert) != bool(key):
            raise ValueError(f"TLS needs both a certificate and its key ({TLS_CERT_ENV}, {TLS_KEY_ENV})")
        if cert and not ca:
            raise ValueError(f"a TLS client certificate needs the CA too ({TLS_CA_ENV})")
        return cls(token, _read(ca, "TLS CA"), _read(cert, "TLS certificate"), _read(key, "TLS key"))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((_HEADER, f"Bearer {self.token}"),) if self.token else ()


def open_channel(addr: Address, creds: ClientCredentials | None = None,
                 options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A channel to the agent at ``addr``: TLS over TCP when a CA is set, and every call
    carrying the token when one is set."""
    creds = creds or ClientCredentials()
    target = addr.grpc_target()
    if not addr.is_unix and creds.ca is not None:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(
            root_certificates=creds.ca, private_key=creds.key, certificate_chain=creds.cert),
            options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    if creds.token:
        return grpc.intercept_channel(channel, _Bearer(creds.metadata()))
    return channel


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the token to every call's metadata."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> Any:
        have = [kv for kv in (details.metadata or ()) if kv[0] != _HEADER]
        return _Details(details.method, details.timeout, [*have, *self._metadata],
                        details.credentials, getattr(details, "wait_for_ready", None),
                        getattr(details, "compression", None))

    def _call(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    intercept_unary_unary = intercept_unary_stream = _call
    intercept_stream_unary = intercept_stream_stream = _call


@dataclass(frozen=True)
class _Details(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list[tuple[str, str]]
    credentials: Any
    wait_for_ready: bool | None
    compression: Any
