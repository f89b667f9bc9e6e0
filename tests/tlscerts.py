"""Certificate authorities and certificates for the TLS tests, made by ``rankwatch certs``.

The files the commands write are used as they are: ``certs init DIR`` (``ca.crt``,
``ca.key``) and ``certs issue DIR --node ID`` (``ID.crt``, ``ID.key``).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Cert:
    cert: Path
    key: Path
    ca: Path

    def env(self) -> dict[str, str]:
        """The rank's and the CLI's TLS variables for this certificate."""
        return {"RANKWATCH_TLS_CA": str(self.ca), "RANKWATCH_TLS_CERT": str(self.cert),
                "RANKWATCH_TLS_KEY": str(self.key)}

    def flags(self) -> tuple[str, ...]:
        return ("--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca))


def certs(*args: str) -> subprocess.CompletedProcess:
    """``rankwatch certs ARGS``."""
    return subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "certs", *args],
                          capture_output=True, text=True, timeout=60)


class CertAuthority:
    """A job CA in ``root`` (``rankwatch certs init``) that issues node certificates."""

    def __init__(self, root: Path, name: str = "ca") -> None:
        self.root = root / name
        done = certs("init", str(self.root))
        assert done.returncode == 0, done.stderr
        self.ca = self.root / "ca.crt"

    def issue(self, name: str, *extra: str, client: bool = False) -> Cert:
        """Node ``name``'s certificate (``client``: a client's, naming no node; ``extra``: more
        ``certs issue`` flags, e.g. ``--no-relay``)."""
        done = certs("issue", str(self.root), "--client" if client else "--node", name, *extra)
        assert done.returncode == 0, done.stderr
        return Cert(self.root / f"{name}.crt", self.root / f"{name}.key", self.ca)
