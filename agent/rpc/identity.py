"""Which stream may speak for a rank id: the decision, and its bookkeeping.

A hello on the Unix socket that carries a nonce the rank presented on the
credentials socket (:mod:`rankwatch.peercred`) is *verified*: the agent knows
the process's true pid and uid from SO_PEERCRED.  Hellos over TCP (which needs the
job's token) or from clients without a nonce are *unverified*.

:func:`judge` decides, a pure function of the claim and the current holder:

* a verified peer of another uid (other than root) is refused;
* a verified peer that claims a pid other than its own, in the agent's own pid
  namespace, is refused (from another namespace, as in a Kubernetes pod, the
  claimed pid is the container's, and the true one replaces it);
* a new hello from the holder's own pid replaces the old stream (a reconnect);
* a verified claim replaces an unverified holder, so a squatter without
  credentials cannot lock the real rank out;
* otherwise a live holder keeps its rank id, and the newcomer is refused
  (ALREADY_EXISTS); a holder whose process is gone is replaced.

Two verified processes of the agent's own uid racing for one rank id: the first
keeps it.  The socket is 0600, so such a process could ptrace the ranks anyway;
the uid is the trust boundary on the node.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import grpc

from rankwatch.agent.node.intake import NodeState, RankState, Rejected, _pid_alive
from rankwatch.peercred import PeerCred
from rankwatch.proto import pb

__all__ = ["Claim", "Holder", "RankStreams", "Verdict", "judge", "same_pid_namespace"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    rank: int
    pid: int
    """The pid the hello claims."""
    cred: PeerCred | None
    """The presenting process's credentials; None: unverified."""
    same_ns: bool | None
    """Whether that process shares the agent's pid namespace (None: unknown)."""


@dataclass(frozen=True)
class Holder:
    pid: int
    verified: bool
    alive: bool


@dataclass(frozen=True)
class Verdict:
    action: Literal["accept", "replace", "refuse"]
    pid: int = 0
    verified: bool = False
    reason: str = ""
    """For a refusal: ``duplicate_rank``, ``pid_not_peer`` or ``uid_not_agent``."""
    detail: str = ""


def judge(claim: Claim, holder: Holder | None, agent_uid: int) -> Verdict:
    pid, verified = claim.pid, claim.cred is not None
    if claim.cred is not None:
        if claim.cred.uid not in (agent_uid, 0):
            return Verdict("refuse", reason="uid_not_agent",
                           detail=f"rank {claim.rank}: the peer runs as uid {claim.cred.uid}")
        if claim.pid != claim.cred.pid and claim.same_ns:
            return Verdict("refuse", reason="pid_not_peer",
                           detail=f"rank {claim.rank} claims pid {claim.pid}; the peer is pid {claim.cred.pid}")
        pid = claim.cred.pid
    if holder is None:
        return Verdict("accept", pid, verified)
    if holder.pid == pid and (verified or not holder.verified):
        return Verdict("replace", pid, verified, detail=f"rank {claim.rank}: pid {pid} reconnected")
    if verified and not holder.verified:
        return Verdict("replace", pid, verified,
                       detail=f"rank {claim.rank}: verified pid {pid} replaces an unverified claim (pid {holder.pid})")
    if not holder.alive:
        return Verdict("accept", pid, verified)
    return Verdict("refuse", reason="duplicate_rank",
                   detail=f"rank {claim.rank} is already reporting from pid {holder.pid} on this node")


def same_pid_namespace(pid: int) -> bool | None:
    """Whether ``pid`` shares this process's pid namespace (None: cannot tell)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") == os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


class RankStreams:
    """The live Report stream of each rank id: whether it is verified, and its context
    (to close it when a newer stream replaces it)."""

    def __init__(self, seat: Callable[..., None] | None = None) -> None:
        """Args:
            seat: told of each stream given its rank id, before it is registered
                (:meth:`Gate.identify_report <rankwatch.agent.rpc.gate.Gate.identify_report>`:
                its seat is decided there, and the call aborted if it gets none).
        """
        self._lock = threading.Lock()
        self._streams: dict[int, tuple[grpc.ServicerContext, int, bool]] = {}
        self._admitting = threading.Lock()
        self._seat = seat

    def holder(self, rank: int) -> tuple[int, bool] | None:
        """(pid, verified) of the rank's live stream, or None."""
        with self._lock:
            got = self._streams.get(rank)
        return (got[1], got[2]) if got else None

    def hold(self, rank: int, context: grpc.ServicerContext, pid: int, verified: bool) -> None:
        """Register ``context`` as the rank's stream; close the one it replaces."""
        with self._lock:
            old = self._streams.get(rank)
            self._streams[rank] = (context, pid, verified)
        if old is not None and old[0] is not context:
            old[0].cancel()

    def release(self, rank: int, context: grpc.ServicerContext) -> None:
        with self._lock:
            got = self._streams.get(rank)
            if got is not None and got[0] is context:
                del self._streams[rank]

    def admit(self, state: NodeState, hello: pb.Hello, context: grpc.ServicerContext,
              creds: Callable[[bytes], PeerCred | None]) -> RankState:
        """Register the stream that sent ``hello``, as :func:`judge` decides.

        Args:
            creds: the credentials that presented a nonce (None: unknown nonce).

        Raises:
            Rejected: the claim is refused.
        """
        local = context.peer().startswith("unix:")
        cred = creds(hello.peer_nonce) if local and hello.peer_nonce else None
        claim = Claim(hello.rank, hello.pid, cred, same_pid_namespace(cred.pid) if cred else None)
        with self._admitting:
            held = self.holder(hello.rank)
            holder = Holder(held[0], held[1], _pid_alive(held[0])) if held else None
            verdict = judge(claim, holder, os.getuid())
            if verdict.action == "refuse":
                raise Rejected(verdict.reason, verdict.detail)
            if self._seat is not None:
                self._seat(context, rank=hello.rank, pid=verdict.pid, cred_pid=cred.pid if cred else None,
                           holds=True, world=(hello.job_id, hello.world_size))
            if verdict.pid != hello.pid:
                hello = pb.Hello.FromString(hello.SerializeToString())
                hello.pid = verdict.pid
            rank = state.hello(hello, replace=verdict.action == "replace")
            self.hold(hello.rank, context, verdict.pid, verdict.verified)
        if verdict.action == "replace":
            log.info("%s", verdict.detail)
        return rank
