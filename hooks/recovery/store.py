"""Where the in-process recovery tier agrees on membership: a store that outlives any worker.

The contract between the two processes that touch it:

* the rankwatch rendezvous handler (in each node's torchrun) exports, before it starts a
  round's workers, :data:`STORE_ENV` (``HOST:PORT`` of the rendezvous TCPStore, which lives
  as long as the rendezvous does, not in any worker) and :data:`ROUND_ENV` (this round's key
  prefix in it); the workers inherit both;
* the workers of a round agree there (:mod:`rankwatch.hooks.recovery.inprocess`), and mark each node
  they left out in :func:`regrouped_key`, so that the handler does not restart the round
  when the coordinator later excludes that node: the round already goes on without it.

Without the handler (plain ``c10d``, a static launch), the workers fall back to torchrun's
worker store (``MASTER_ADDR:MASTER_PORT``), which the first node's torchrun hosts.

**Trust.**  Neither a TCPStore nor etcd without its own auth asks who writes.  With the job's
token set (``RANKWATCH_TOKEN`` or ``RANKWATCH_TOKEN_FILE``, as for the agents), every value
the two processes read from each other is sealed (:class:`Seal`): an HMAC-SHA256 under a key
derived from the token, over the key's name and the value, so a value is neither forged nor
moved to another key (round and generation are in the name).  A value that does not open is
refused (:class:`ForgedValue`): the workers then leave the recovery to torchrun's restart, and
a node ignores it.  What sealing cannot cover: the store's counters (atomic adds) and the
presence of a key, so a writer without the token can still delay or fail an in-process
recovery (never change its membership or its state); and the process groups' own rendezvous
keys, which torch reads.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

__all__ = ["ForgedValue", "Seal", "ATTEMPTS_COUNT", "CAPABLE_KEY", "DECIDED_COUNT", "JOIN_ENV", "JOINED_COUNT", "STANDBY_ENV", "RESTARTING_KEY", "REGROUPED_COUNT", "REGROUPED_NODE", "ROUND_ENV", "STORE_ENV", "admitted_key", "connect", "mark_regrouped",
           "regrouped_key", "round_key"]

STORE_ENV = "RANKWATCH_RECOVERY_STORE"
ROUND_ENV = "RANKWATCH_RECOVERY_ROUND"
JOIN_ENV = "RANKWATCH_RECOVERY_JOIN"  # "1": this node's workers join the round's survivors in process
STANDBY_ENV = "RANKWATCH_RECOVERY_STANDBY"  # "1": ... as a hot spare's, for the next lost node's place
JOINED_COUNT = "joined_count"        # under a round's prefix: nodes the handler sent to join in process
REGROUPED_COUNT = "regrouped_count"  # under a round's prefix: nodes left out in process so far
REGROUPED_NODE = "regrouped_node/"   # regrouped_node/<i> -> the i-th node left out (from 1)
CAPABLE_KEY = "inproc/capable"       # under a round's prefix: its workers recover in process
RESTARTING_KEY = "restarting"        # under a round's prefix: torchrun is restarting the round
ATTEMPTS_COUNT = "inproc/attempts"   # under a round's prefix: agreements the workers began
DECIDED_COUNT = "inproc/decided"     # ... and those decided (fewer: one is under way)
_CONNECT_TIMEOUT = timedelta(seconds=10)


class ForgedValue(ValueError):
    """A value in the recovery store that was not sealed with the job's token."""


_SEALED = b"rw1:"
_MAC_HEX = 64


class Seal:
    """Seals and opens the values of the recovery store with the job's token (see the module);
    without a token, values pass as they are (the store's own access control is all)."""

    def __init__(self, token: str | None) -> None:
        self._key = hashlib.sha256(b"rankwatch recovery store\0" + token.encode()).digest() if token else None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Seal:
        """With the job's token from ``env``.

        Raises:
            ValueError: a token file is named but unreadable (or readable by others).
        """
        from rankwatch.credentials import job_token

        return cls(job_token(env))

    @classmethod
    def unusable(cls) -> Seal:
        """A seal under a random key, for a process whose token file cannot be read: it opens
        nothing the job sealed, and nothing it seals opens anywhere else.  (Falling back to
        no token would open forged values.)"""
        return cls(secrets.token_hex(32))

    @property
    def on(self) -> bool:
        return self._key is not None

    def _mac(self, key: str, data: bytes) -> bytes:
        assert self._key is not None
        return hmac.new(self._key, key.encode() + b"\0" + data, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, value: str | bytes) -> bytes:
        """``value`` as it is to be stored under ``key``."""
        data = value.encode() if isinstance(value, str) else value
        return data if self._key is None else _SEALED + self._mac(key, data) + b":" + data

    def open(self, key: str, raw: bytes) -> bytes:
        """The value stored under ``key``.

        Raises:
            ForgedValue: it was not sealed for ``key`` with the job's token.
        """
        if self._key is None:
            return raw
        head = len(_SEALED) + _MAC_HEX
        if not (raw.startswith(_SEALED) and raw[head:head + 1] == b":"
                and hmac.compare_digest(raw[len(_SEALED):head], self._mac(key, raw[head + 1:]))):
            raise ForgedValue(f"the recovery store's value at {key[-96:]!r} is not sealed with the job's token")
        return raw[head + 1:]


def etcd_endpoint(store: Any) -> str | None:
    """``etcd://HOST:PORT/PREFIX`` of torch's EtcdStore (the etcd-v2 backend's), else None."""
    client, prefix = getattr(store, "client", None), getattr(store, "prefix", None)
    host, port = getattr(client, "host", None), getattr(client, "port", None)
    if not isinstance(host, str) or not isinstance(port, int) or not isinstance(prefix, str):
        return None
    return f"etcd://{host}:{port}{prefix if prefix.startswith('/') else '/' + prefix}"


def _etcd(where: str, timeout: timedelta) -> Any:
    import etcd  # python-etcd, as torch's etcd-v2 backend needs
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    hostport, _, path = where[len("etcd://"):].partition("/")
    host, _, port = hostport.rpartition(":")
    client = etcd.Client(host=host, port=int(port), protocol="http", read_timeout=int(timeout.total_seconds()))
    return EtcdStore(client, "/" + path, timeout)


def round_key(round_: int) -> str:
    """A round's keys, under the handler's ``rankwatch/<run_id>/`` in the rendezvous store."""
    return f"round/{round_}/"


def admitted_key(node: str) -> str:
    """Under a round's prefix: ``node``'s workers were admitted to the round in process (the
    generation they came in at)."""
    return f"inproc/admitted/{node}"


def regrouped_key(node: str) -> str:
    """Under a round's prefix: ``node`` was left out of the round by its surviving workers."""
    return f"regrouped/{node}"


def mark_regrouped(store: Any, prefix: str, node: str, generation: int, seal: Seal) -> None:
    """Record that the round's workers left ``node`` out (the handler reads it)."""
    key = prefix + regrouped_key(node)
    store.set(key, seal.seal(key, str(generation)))
    i = store.add(prefix + REGROUPED_COUNT, 1)
    key = f"{prefix}{REGROUPED_NODE}{i}"
    store.set(key, seal.seal(key, node))  # a reader that sees i before this asks again


def connect(env: Mapping[str, str] = os.environ, timeout: timedelta = _CONNECT_TIMEOUT) -> tuple[Any, str]:
    """A client of the recovery store and this round's prefix in it.

    Raises:
        RuntimeError: no store is named in ``env``.
    """
    from torch.distributed import TCPStore

    where = env.get(STORE_ENV)
    if where and where.startswith("etcd://"):
        return _etcd(where, timeout), env.get(ROUND_ENV) or "rankwatch/round/"
    if where:
        host, _, port = where.rpartition(":")
        prefix = env.get(ROUND_ENV) or "rankwatch/round/"
    elif env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        host, port = env["MASTER_ADDR"], env["MASTER_PORT"]
        # Every node of a round runs the same restart attempt (torch's own worker store
        # prefix relies on it too).
        prefix = (f"rankwatch/{env.get('TORCHELASTIC_RUN_ID', 'none')}/attempt/"
                  f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
    else:
        raise RuntimeError(f"no recovery store: neither {STORE_ENV} nor MASTER_ADDR/MASTER_PORT is set")
    store = TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    return store, prefix
