"""A rank id belongs to the process that holds it: SO_PEERCRED on the Unix socket.

The decision (agent/rpc/identity.py) is tested as a pure function; the rest against a
real agent process over real gRPC, with this process presenting its nonce on the
agent's credentials socket as a rank does.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import grpc
import pytest

from conftest import AgentProcess, wait_for
from rankwatch.agent.rpc.identity import Claim, Holder, judge
from rankwatch.hooks.instrument.client import AgentClient
from rankwatch.hooks.instrument.recorder import OPS, Recorder
from rankwatch.peercred import PeerCred, present
from rankwatch.proto import pb, pb_grpc

ME = os.getuid()


def claim(pid: int, cred_pid: int | None = None, uid: int = ME, same_ns: bool | None = True) -> Claim:
    return Claim(rank=3, pid=pid, cred=PeerCred(cred_pid, uid, 0) if cred_pid is not None else None,
                 same_ns=same_ns)


@pytest.mark.parametrize("c, holder, action, reason", [
    (claim(10, 10), None, "accept", ""),
    (claim(10), None, "accept", ""),                                      # unverified, nobody holds it
    (claim(10, 10, uid=ME + 1), None, "refuse", "uid_not_agent"),
    (claim(1, 10), None, "refuse", "pid_not_peer"),                       # borrowing another pid
    (claim(1, 10, same_ns=None), None, "accept", ""),                     # cannot tell: the true pid
    (claim(7, 4242, same_ns=False), None, "accept", ""),                  # a pod's own pid namespace
    (claim(10, 10), Holder(10, True, True), "replace", ""),               # the same process reconnects
    (claim(10, 10), Holder(99, False, True), "replace", ""),              # verified beats a squatter
    (claim(10), Holder(99, True, True), "refuse", "duplicate_rank"),      # a squatter cannot evict
    (claim(10), Holder(10, True, True), "refuse", "duplicate_rank"),      # ... even naming the pid
    (claim(10, 10), Holder(99, True, True), "refuse", "duplicate_rank"),  # two verified: first keeps it
    (claim(10, 10), Holder(99, True, False), "accept", ""),               # the holder's process is gone
    (claim(10), Holder(10, False, True), "replace", ""),                  # unverified reconnect
    (claim(10), Holder(99, False, True), "refuse", "duplicate_rank"),
])
def test_judge(c, holder, action, reason):
    v = judge(c, holder, ME)
    assert (v.action, v.reason) == (action, reason), v
    if action != "refuse":
        assert v.pid == (c.cred.pid if c.cred else c.pid) and v.verified == (c.cred is not None)


def test_root_peer_is_trusted():
    assert judge(claim(10, 10, uid=0), None, ME + 5).action == "accept"


def _hello(rank: int, pid: int, nonce: bytes = b"") -> pb.ReportMessage:
    return pb.ReportMessage(hello=pb.Hello(rank=rank, world_size=8, pid=pid, node_id="n0", backend="gloo",
                                           op_names=list(OPS), peer_nonce=nonce))


class RawStream:
    """A Report stream driven by hand: its hello, then held open until ``close()``."""

    def __init__(self, channel: grpc.Channel, hello: pb.ReportMessage) -> None:
        self._stop = threading.Event()

        def messages():
            yield hello
            self._stop.wait(30)
        self.call = pb_grpc.AgentStub(channel).Report.future(messages(), timeout=40)

    def code(self, timeout: float = 10) -> grpc.StatusCode:
        try:
            self.call.result(timeout=timeout)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()

    def close(self) -> None:
        self._stop.set()


@pytest.fixture
def agent(tmp_path):
    a = AgentProcess(tmp_path / "agent.sock").start()
    yield a
    a.stop()


def _rank(agent: AgentProcess, rank: int) -> dict | None:
    return next((r for r in agent.status()["ranks"] if r["rank"] == rank and r["connected"]), None)


def test_a_squatter_cannot_lock_the_real_rank_out(agent):
    channel = grpc.insecure_channel(agent.addr.grpc_target())
    squatter = RawStream(channel, _hello(3, os.getppid()))   # another live process, no nonce: unverified
    wait_for(lambda: _rank(agent, 3), 10, what="the squatter holds rank 3")
    rec = Recorder()
    real = AgentClient(rec, _hello(3, os.getpid()).hello, agent.addr, flush_interval=timedelta(milliseconds=20))
    real.start()
    try:
        t = time.perf_counter_ns()
        for i in range(20):
            rec.collective(0, 0, i, t, t + 1000, 64)
        wait_for(lambda: (_rank(agent, 3) or {}).get("collectives", 0) >= 20, 10,
                 what="the real rank's records")
        assert squatter.code() == grpc.StatusCode.CANCELLED   # its stream was closed
        # The squatter cannot take it back.
        again = RawStream(channel, _hello(3, os.getppid()))
        assert again.code() == grpc.StatusCode.ALREADY_EXISTS
        again.close()
    finally:
        squatter.close()
        real.close()
        channel.close()


def test_a_pid_that_is_not_the_peers_is_refused(agent):
    channel = grpc.insecure_channel(agent.addr.grpc_target())
    try:
        nonce = present(agent.addr.path)
        assert nonce, "the agent has no credentials socket"
        s = RawStream(channel, _hello(4, 1, nonce))                  # pid 1 is not this process
        assert s.code() == grpc.StatusCode.PERMISSION_DENIED
        s.close()
        # A nonce is good once, and only for the process that presented it.
        s = RawStream(channel, _hello(4, os.getpid(), nonce))
        wait_for(lambda: _rank(agent, 4), 10, what="an unverified claim, with a spent nonce, is let in")
        verified = RawStream(channel, _hello(4, os.getpid(), present(agent.addr.path)))
        assert s.code() == grpc.StatusCode.CANCELLED                 # replaced by the verified stream
        assert _rank(agent, 4)["pid"] == os.getpid()
        # A new hello from the same process replaces its old stream (a reconnect).
        newer = RawStream(channel, _hello(4, os.getpid(), present(agent.addr.path)))
        assert verified.code() == grpc.StatusCode.CANCELLED
        newer.close()
        assert newer.code() == grpc.StatusCode.OK
        verified.close()
    finally:
        channel.close()


_POD_RANK = """
import os, sys, time
from datetime import timedelta
from rankwatch.address import Address
from rankwatch.hooks.instrument.client import AgentClient
from rankwatch.hooks.instrument.recorder import OPS, Recorder
from rankwatch.proto import pb
hello = pb.Hello(rank=6, world_size=8, pid=os.getpid(), node_id="n0", backend="gloo", op_names=list(OPS))
c = AgentClient(Recorder(), hello, Address(path=sys.argv[1]), flush_interval=timedelta(milliseconds=20))
c.start()
print(os.getpid(), flush=True)
sys.stdin.read()
c.close()
"""


def test_a_rank_in_another_pid_namespace_is_known_by_its_true_pid(agent):
    """As from a Kubernetes pod: the rank's own pid means nothing to the agent; SO_PEERCRED
    gives the pid the agent's namespace knows it by."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.fail("this test needs unshare(1) and root, to start a process in a new pid namespace")
    proc = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", _POD_RANK, str(agent.sock)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        own_pid = int(proc.stdout.readline())
        assert own_pid < 10, "not in a fresh pid namespace"
        rank = wait_for(lambda: _rank(agent, 6), 15, what="the namespaced rank connected")
        import psutil

        true = psutil.Process(rank["pid"])
        assert rank["pid"] != own_pid and true.cmdline()[:2] == [sys.executable, "-c"], true.cmdline()
    finally:
        proc.stdin.close()
        proc.wait(10)
