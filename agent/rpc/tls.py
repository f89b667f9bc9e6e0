"""Mutual TLS for the agent's TCP listeners, with grpcio's own credentials, and whom a
peer's certificate names.

``--tls-cert``, ``--tls-key`` and ``--tls-ca`` (PEM files) put every TCP listener
behind TLS that requires a client certificate signed by the CA.  The same
certificate and key are what this agent presents when it calls its coordinator,
so a job's per-node certificates carry both the server and the client usage.
The token, when set, is still checked on top.

**What a certificate names** (``rankwatch certs issue`` writes it, :func:`peer_names` reads
it from grpc's auth context): URI SANs ``urn:rankwatch:node:ID`` (this certificate is node
ID's: it may sync for ID only), ``urn:rankwatch:relay:ID`` (node ID may also relay other
nodes' summaries) and ``urn:rankwatch:client:NAME`` (a client that names no node).  ID is
percent-encoded (RFC 3986).  A certificate of the job's CA without any rankwatch URI is not
bound to a node (``bound`` False): it speaks for any node, as a token holder does, so a PKI
made before (one certificate shared by every agent) keeps working; issue per-node
certificates with ``rankwatch certs`` to bind them.  What may be synced under those names is :mod:`.sync_rights`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import grpc

from rankwatch.credentials import ClientCredentials

__all__ = ["PeerNames", "TlsConfig", "client_uri", "node_uri", "peer_names", "relay_uri"]

_PREFIX = "urn:rankwatch:"


def node_uri(node: str) -> str:
    return f"{_PREFIX}node:{quote(node, safe='')}"


def relay_uri(node: str) -> str:
    return f"{_PREFIX}relay:{quote(node, safe='')}"


def client_uri(name: str) -> str:
    return f"{_PREFIX}client:{quote(name, safe='')}"


@dataclass(frozen=True)
class PeerNames:
    """Whom a call's TLS client certificate names (``tls`` False: no certificate, plain TCP
    or the Unix socket)."""

    tls: bool = False
    node: str | None = None
    """The node it may sync for (None: none)."""
    relay: bool = False
    """Whether it may carry other nodes' summaries."""
    bound: bool = True
    """False: a certificate without rankwatch names, trusted for any node like the token."""


def peer_names(context: grpc.ServicerContext) -> PeerNames:
    """What the peer's verified certificate names (grpc checked it against the job's CA)."""
    try:
        auth: dict[str, list[bytes]] = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - no auth context: no certificate
        return PeerNames()
    if auth.get("transport_security_type", [b""])[0] != b"ssl":
        return PeerNames()
    uris = [v.decode(errors="replace") for v in auth.get("peer_uri", ())]
    if not uris:   # older grpc: the SANs, all kinds together
        uris = [v.decode(errors="replace") for v in auth.get("x509_subject_alternative_name", ())]
    ours = [u[len(_PREFIX):] for u in uris if u.startswith(_PREFIX)]
    nodes = {unquote(u[5:]) for u in ours if u.startswith("node:")}
    relays = {unquote(u[6:]) for u in ours if u.startswith("relay:")}
    if not ours:
        return PeerNames(True, None, True, bound=False)
    node = next(iter(nodes)) if len(nodes) == 1 else None   # two node names: it names none
    return PeerNames(True, node, node is not None and node in relays)


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
