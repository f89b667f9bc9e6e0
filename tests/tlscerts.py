"""Throwaway certificate authorities and certificates for the TLS tests (the openssl CLI)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


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


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


class CertAuthority:
    """A CA in ``root`` that signs certificates for loopback (DNS:localhost, IP:127.0.0.1)."""

    def __init__(self, root: Path, name: str = "ca") -> None:
        if shutil.which("openssl") is None:
            pytest.fail("the TLS tests need the openssl command")
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.ca, self._key = root / f"{name}.crt", root / f"{name}.key"
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", str(self._key), "-out", str(self.ca), "-days", "2", "-subj", f"/CN={name}",
                 cwd=root)

    def issue(self, name: str) -> Cert:
        key, csr, crt, ext = (self.root / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
        ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                       "extendedKeyUsage=serverAuth,clientAuth\nkeyUsage=digitalSignature\n")
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key),
                 "-out", str(csr), "-subj", f"/CN={name}", cwd=self.root)
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self._key),
                 "-CAcreateserial", "-days", "2", "-out", str(crt), "-extfile", str(ext), cwd=self.root)
        key.chmod(0o600)
        return Cert(crt, key, self.ca)
