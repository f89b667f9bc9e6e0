"""Mutual TLS for the agent's TCP listeners, with grpcio's own credentials.

``--tls-cert``, ``--tls-key`` and ``--tls-ca`` (PEM files) put every TCP listener
behind TLS that requires a client certificate signed by the CA.  The same
certificate and key are what this agent presents when it calls its coordinator,
so a job's per-node certificates carry both the server and the client usage.
The token, when set, is still checked on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from rankwatch.credentials import ClientCredentials

__all__ = ["TlsConfig"]


@dataclass(frozen=True)
class TlsConfig:
    """PEM files: this agent's certificate and key, and the CA its peers' are signed by."""

    cert: Path
    key: Path
    ca: Path

    def __post_init__(self) -> None:
        for what, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            try:
                Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"{what} {path}: {exc.strerror}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes(), require_client_auth=True)

    def client_credentials(self, token: str | None) -> ClientCredentials:
        return ClientCredentials.tls(token, str(self.ca), str(self.cert), str(self.key))
