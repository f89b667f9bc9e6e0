"""Coordinator election and the decision log in etcd: no coordinator lives longer than its lease.

With ``--election etcd://HOST:PORT[,HOST:PORT...]`` every agent of the job
campaigns for one key, ``/rankwatch/<job>/coordinator``, written with a TTL
(etcd's v2 API, through python-etcd, as torch's etcd rendezvous uses it).  The
agent that wrote it is the coordinator while it refreshes it; its address is
the key's value, and every other agent syncs there.  When the coordinator dies,
or loses etcd, the key expires within the TTL and another agent takes it.  An
agent that cannot refresh in time steps down by itself: two coordinators never
act at once for longer than the clock drift between them.

The coordinator also appends each decision to ``/rankwatch/<job>/decisions/``,
and an agent that takes over reads them first, so its ids and the restart
generation go on from the job's log even if no node is left that applied them.

Without ``--election``, the ``--coordinator`` list's first agent that answers
coordinates (the c10d rule).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from rankwatch.agent.durable.decisions import Decision

__all__ = ["ETCD_SCHEME", "EtcdDecisions", "Election", "parse_endpoints"]

log = logging.getLogger(__name__)

ETCD_SCHEME = "etcd://"
_MAX_VALUE = 512   # an address; anything longer in the key is not one of ours


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``etcd://h1:p1,h2:p2`` -> [(h1, p1), (h2, p2)].

    Raises:
        ValueError: not that form.
    """
    if not text.startswith(ETCD_SCHEME):
        raise ValueError(f"election {text!r}: expected {ETCD_SCHEME}HOST:PORT[,HOST:PORT...]")
    out = []
    for part in text[len(ETCD_SCHEME):].split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"election endpoint {part!r}: expected HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    return out


def _client(endpoints: Sequence[tuple[str, int]], timeout: float) -> Any:
    try:
        import etcd  # python-etcd: the [etcd] extra
    except ImportError as exc:
        raise RuntimeError("--election etcd:// needs python-etcd: pip install 'rankwatch[etcd]'") from exc
    import urllib3

    hosts = tuple(endpoints)
    if len(hosts) == 1:
        client = etcd.Client(host=hosts[0][0], port=hosts[0][1], read_timeout=timeout)
    else:
        client = etcd.Client(host=hosts, allow_reconnect=True, read_timeout=timeout)
    # One try per member and request: python-etcd moves to the next member on a failure, but
    # urllib3's default 3 retries on the same member would spend 4 read timeouts there first,
    # longer than a short TTL, and a leader would step down while two members still answer.
    client.http = urllib3.PoolManager(num_pools=10, maxsize=10, timeout=timeout, retries=False)
    return client


class Election:
    """Campaign for the coordinator's key of ``job``.

    Args:
        endpoints: etcd's client endpoints (any member of the cluster).
        job: the job's id (the key's folder).
        me: this agent's address as the other agents reach it (``HOST:PORT``).
        ttl: seconds the key outlives its last refresh (whole seconds: etcd's v2 TTL).
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], job: str, me: str, ttl: int = 3) -> None:
        if ttl < 1:
            raise ValueError("Election ttl must be at least 1 s")
        self.key = f"/rankwatch/{job}/coordinator"
        self.me, self.ttl = me, ttl
        self._client = _client(endpoints, timeout=max(0.5, ttl / 3))
        self._lock = threading.Lock()
        self._leading_since: float | None = None
        self._refreshed = 0.0        # monotonic time of the last successful write as leader
        self._leader: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.decisions = EtcdDecisions(self._client, job)

    def start(self) -> None:
        self.campaign()
        self._thread = threading.Thread(target=self._loop, name="rankwatch-election", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning; a leader hands the key back at once (the next agent needs no TTL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        if self.is_leader():
            try:
                self._client.delete(self.key, prevValue=self.me)
            except Exception as exc:  # noqa: BLE001 - it expires by itself anyway
                log.debug("could not hand the coordinator key back: %s", exc)

    def is_leader(self) -> bool:
        """True while this agent holds the key and refreshed it within the TTL."""
        with self._lock:
            return (self._leading_since is not None
                    and time.monotonic() - self._refreshed < self.ttl)

    def leader(self) -> str | None:
        """The coordinator's address as last read (None: nobody holds the key)."""
        with self._lock:
            return self.me if self._leading_since is not None else self._leader

    def _loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.campaign()
            except Exception:  # noqa: BLE001 - the agent never dies of its election
                log.exception("election round failed")

    def campaign(self) -> None:
        """One round: refresh the key if this agent holds it, else try to take it."""
        import etcd

        leading = self._leading_since is not None
        try:
            if leading:
                self._client.write(self.key, self.me, ttl=self.ttl, prevValue=self.me)
            else:
                self._client.write(self.key, self.me, ttl=self.ttl, prevExist=False)
        except etcd.EtcdAlreadyExist:
            self._follow()
            if self.leader() != self.me:
                return
            # The key holds our address: our own earlier write landed though its answer was lost
            # (a member died under it).  Refresh it now rather than leave the job leaderless
            # until it expires.
            try:
                self._client.write(self.key, self.me, ttl=self.ttl, prevValue=self.me)
            except etcd.EtcdException as exc:
                log.debug("election round: refreshing our own key: %s", exc)
                return
        except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
            log.warning("lost the coordinator key %s (it expired or another agent holds it)", self.key)
            self._step_down()
            self._follow()
            return
        except etcd.EtcdException as exc:   # no member answers: a leader that cannot refresh steps down
            with self._lock:
                expired = self._leading_since is not None and time.monotonic() - self._refreshed >= self.ttl
            if expired:
                log.warning("etcd unreachable for the coordinator key's whole TTL (%s): stepping down", exc)
                self._step_down()
            else:
                log.debug("election round: etcd unreachable: %s", exc)
            return
        with self._lock:
            self._refreshed = time.monotonic()
            if self._leading_since is None:
                self._leading_since = self._refreshed
                log.warning("this agent holds the coordinator key %s", self.key)

    def _follow(self) -> None:
        import etcd

        try:
            value = str(self._client.read(self.key).value or "")
        except etcd.EtcdKeyNotFound:
            value = ""
        except etcd.EtcdException as exc:
            log.debug("reading the coordinator key: %s", exc)
            return
        with self._lock:
            self._leader = value if 0 < len(value) <= _MAX_VALUE else None

    def _step_down(self) -> None:
        with self._lock:
            self._leading_since = None


class EtcdDecisions:
    """The job's decision log in etcd: one key per decision, named by its place in the log."""

    def __init__(self, client: Any, job: str) -> None:
        self._client = client
        self.folder = f"/rankwatch/{job}/decisions"

    def append(self, d: Decision) -> None:
        """Record ``d`` (idempotent: a decision already there is left as it is)."""
        import etcd

        try:
            self._client.write(f"{self.folder}/{d.seq:010d}", json.dumps(d.to_json()), prevExist=False)
        except etcd.EtcdAlreadyExist:
            pass

    def load(self) -> list[Decision]:
        """Every decision in the log, in order; a record that does not parse is skipped (logged)."""
        import etcd

        try:
            folder = self._client.read(self.folder, recursive=True)
        except etcd.EtcdKeyNotFound:
            return []
        out = []
        for node in folder.leaves:
            if node.dir or node.key == self.folder or not node.value:
                continue
            try:
                out.append(Decision.from_json(json.loads(node.value)))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("decision %s in etcd left out: %s", node.key, exc)
        return sorted(out, key=lambda d: d.seq)
