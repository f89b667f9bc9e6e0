"""``rankwatch certs``: a job's CA, and each node's key and certificate for mutual TLS.

* ``certs init DIR`` makes the job's CA in DIR: ``ca.crt`` and ``ca.key`` (0600; DIR is made
  0700).  It never overwrites one that is there.
* ``certs issue DIR --node ID`` signs a key and certificate for node ID with that CA:
  ``ID.crt`` and ``ID.key`` (0600) in ``--out`` (default DIR).  The certificate names the node
  the way the agents read it (:mod:`rankwatch.agent.rpc.tls`: a URI SAN
  ``urn:rankwatch:node:ID``, and ``urn:rankwatch:relay:ID`` unless ``--no-relay``), carries
  both server and client use (an agent serves with it and syncs with it), and the DNS and IP
  names its agent is reached at (``localhost`` and ``127.0.0.1`` always, ``--dns``/``--ip``
  more).  ``--client NAME`` issues a certificate that names no node (an operator's CLI,
  a rank over TCP): it may call every RPC but ``Sync`` and ``SyncGroup``.

The CA key must be private: one readable by group or others is refused, as is a key that
already exists where a new one would go.  Keys are EC P-256, made with ``cryptography``.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import sys
from pathlib import Path

from rankwatch.agent.rpc.tls import client_uri, node_uri, relay_uri

__all__ = ["add_parser", "init_ca", "issue", "run"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_CA_DAYS = 365
_NODE_DAYS = 30


def _crypto():
    """The ``cryptography`` modules (imported when a command needs them)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file of mode 0600 (never over an existing one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def _key_usage(x509, *, ca: bool):
    """A CA signs certificates; a node's key only signs its handshakes."""
    return x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         encipher_only=False, decipher_only=False)


def _write_pair(serialization, key, cert, key_path: Path, crt: Path) -> None:
    """The key (0600, never over an existing file), then its certificate."""
    _write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    _write_public(crt, cert.public_bytes(serialization.Encoding.PEM))


def init_ca(root: Path, *, name: str = "rankwatch job CA", days: int = _CA_DAYS) -> tuple[Path, Path]:
    """Make the job's CA in ``root``; (certificate, key).

    Raises:
        ValueError: a CA is there already.
    """
    x509, hashes, serialization, ec, _, NameOID = _crypto()
    crt, key_path = root / "ca.crt", root / "ca.key"
    if crt.exists() or key_path.exists():
        raise ValueError(f"{root} holds a CA already (ca.crt, ca.key): remove them to make a new one")
    _private_dir(root)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(x509, ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_pair(serialization, key, cert, key_path, crt)
    return crt, key_path


def _load_ca(root: Path):
    x509, _, serialization, _, _, _ = _crypto()
    crt, key_path = root / "ca.crt", root / "ca.key"
    try:
        mode = key_path.stat().st_mode
        if mode & 0o077:
            raise ValueError(f"{key_path} is readable by group or others (chmod 600 it): a CA key "
                             "anyone can read lets anyone join the job")
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate(crt.read_bytes())
    except OSError as exc:
        raise ValueError(f"no job CA in {root} ({exc.strerror}; make one with `rankwatch certs init {root}`)") from None
    return cert, key


def issue(root: Path, name: str, *, out: Path | None = None, client: bool = False, relay: bool = True,
          dns: tuple[str, ...] = (), ips: tuple[str, ...] = (), days: int = _NODE_DAYS) -> tuple[Path, Path]:
    """Sign a key and certificate for node ``name`` (or a client, ``client``); (certificate, key).

    Raises:
        ValueError: a bad name or address, no usable CA in ``root``, or a key already there.
    """
    if not _NAME.match(name):
        raise ValueError(f"{name!r}: a name is 1-128 of A-Z a-z 0-9 . _ - (and starts with a letter or digit)")
    x509, hashes, serialization, ec, EKU, NameOID = _crypto()
    ca_cert, ca_key = _load_ca(root)
    out = out or root
    crt, key_path = out / f"{name}.crt", out / f"{name}.key"
    if key_path.exists():
        raise ValueError(f"{key_path} exists: remove it to issue a new key")
    try:
        addresses = [ipaddress.ip_address(a) for a in ("127.0.0.1", *ips)]
    except ValueError as exc:
        raise ValueError(f"--ip: {exc}") from None
    uris = [client_uri(name)] if client else [node_uri(name), *([relay_uri(name)] if relay else [])]
    names = [x509.UniformResourceIdentifier(u) for u in uris]
    names += [x509.DNSName(d) for d in dict.fromkeys(("localhost", *dns))]
    names += [x509.IPAddress(a) for a in dict.fromkeys(addresses)]
    _private_dir(out)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH, EKU.CLIENT_AUTH]), critical=False)
            .add_extension(_key_usage(x509, ca=False), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_pair(serialization, key, cert, key_path, crt)
    return crt, key_path


def add_parser(sub) -> None:
    """The ``certs`` command and its ``init`` and ``issue`` subcommands."""
    c = sub.add_parser("certs", help="make a job CA and the nodes' certificates for mutual TLS")
    cs = c.add_subparsers(dest="certs_command", required=True, metavar="ACTION")
    i = cs.add_parser("init", help="make the job's CA (ca.crt, ca.key) in DIR")
    i.add_argument("dir", type=Path, metavar="DIR")
    i.add_argument("--days", type=int, default=_CA_DAYS, help=f"validity (default {_CA_DAYS})")
    s = cs.add_parser("issue", help="sign a node's key and certificate (ID.crt, ID.key) with DIR's CA")
    s.add_argument("dir", type=Path, metavar="DIR")
    who = s.add_mutually_exclusive_group(required=True)
    who.add_argument("--node", metavar="ID", help="the node id the certificate names (the agent's --node-id)")
    who.add_argument("--client", metavar="NAME", help="a certificate that names no node (an operator's CLI)")
    s.add_argument("--out", type=Path, default=None, metavar="DIR", help="where the key and certificate go (default DIR)")
    s.add_argument("--dns", action="append", default=[], metavar="NAME", help="a DNS name its agent is reached at")
    s.add_argument("--ip", action="append", default=[], metavar="ADDR", help="an IP address its agent is reached at")
    s.add_argument("--no-relay", action="store_true", help="the node may not relay other nodes' summaries")
    s.add_argument("--days", type=int, default=_NODE_DAYS, help=f"validity (default {_NODE_DAYS})")


def run(args: argparse.Namespace) -> int:
    """``rankwatch certs init|issue``."""
    try:
        if args.days < 1:
            raise ValueError("--days must be at least 1")
        if args.certs_command == "init":
            crt, key = init_ca(args.dir, days=args.days)
        else:
            crt, key = issue(args.dir, args.node or args.client, out=args.out, client=args.client is not None,
                             relay=not args.no_relay, dns=tuple(args.dns), ips=tuple(args.ip), days=args.days)
    except ValueError as exc:
        print(f"rankwatch certs: {exc}", file=sys.stderr)
        return 1
    print(f"certificate {crt}\nkey         {key}")
    return 0
