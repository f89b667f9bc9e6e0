"""Every RPC over TCP needs the job's token; the Unix socket does not ask.

A real ``rankwatch agent`` listens on its socket and on TCP with a token; the
calls are real gRPC from this process, the rank client and the CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import grpc
import pytest

from conftest import AgentProcess, wait_for
from multinode import free_port
from rankwatch.address import Address
from rankwatch.credentials import ClientCredentials, open_channel
from rankwatch.hooks.instrument.client import AgentClient
from rankwatch.hooks.instrument.recorder import OPS, Recorder
from rankwatch.proto import pb, pb_grpc
from rankwatch.status import fetch_status

TOKEN = "t0ken-for-the-test"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tcpauth")
    (tmp / "token").write_text(TOKEN + "\n")
    (tmp / "token").chmod(0o600)
    tcp = Address.parse(f"127.0.0.1:{free_port()}")
    agent = AgentProcess(tmp / "agent.sock", extra=("--listen", str(tcp), "--token-file", str(tmp / "token")),
                         env={"RANKWATCH_TOKEN": ""}).start()
    yield agent, tcp
    agent.stop()


def _hello(rank: int) -> pb.ReportMessage:
    return pb.ReportMessage(hello=pb.Hello(rank=rank, world_size=64, pid=os.getpid(), node_id="n0",
                                           backend="gloo", op_names=list(OPS)))


def _calls(stub: pb_grpc.AgentStub, rank: int) -> dict[str, object]:
    """One call of every RPC; each returns its status code (OK when it was served)."""
    def code(fn) -> grpc.StatusCode:
        try:
            fn()
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()

    def commands() -> None:
        it = stub.Commands(pb.CommandRequest(rank=rank, pid=os.getpid()), timeout=1.5)
        try:
            next(it)
        except grpc.RpcError as exc:   # served, and nothing to say before the deadline
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
    return {
        "Report": code(lambda: stub.Report(iter([_hello(rank), pb.ReportMessage(goodbye=pb.Goodbye())]),
                                           timeout=5)),
        "Commands": code(commands),
        "Status": code(lambda: stub.Status(pb.StatusRequest(), timeout=5)),
        "Sync": code(lambda: stub.Sync(pb.NodeSummary(node_id="x", seq=1), timeout=5)),
        "SyncGroup": code(lambda: stub.SyncGroup(pb.GroupSummary(nodes=[pb.NodeSummary(node_id="x", seq=1)],
                                                                 held_seconds=[0.0]), timeout=5)),
        "RequestCheckpoint": code(lambda: stub.RequestCheckpoint(pb.CheckpointRequest(reason="t"),
                                                                 timeout=5)),
    }


def test_every_tcp_rpc_without_the_token_is_unauthenticated(guarded):
    agent, tcp = guarded
    for creds in (ClientCredentials(), ClientCredentials("wrong")):
        with open_channel(tcp, creds) as ch:
            codes = _calls(pb_grpc.AgentStub(ch), rank=40)
        assert codes == dict.fromkeys(codes, grpc.StatusCode.UNAUTHENTICATED), codes
    assert not any(r["rank"] == 40 for r in agent.status()["ranks"]), "an unauthenticated rank got in"
    refused = wait_for(lambda: _metric(agent, 'rankwatch_rpcs_refused_total{node="n0",reason="unauthenticated"}'),
                       5, what="the refusals counted")
    assert refused >= 10


def test_with_the_token_every_tcp_rpc_is_served(guarded):
    agent, tcp = guarded
    with open_channel(tcp, ClientCredentials(TOKEN)) as ch:
        codes = _calls(pb_grpc.AgentStub(ch), rank=41)
    # Sync is heard and refused for a real reason (this agent coordinates no job); the
    # checkpoint request too (no rank trains).
    assert codes["Sync"] == codes["SyncGroup"] == grpc.StatusCode.FAILED_PRECONDITION
    del codes["Sync"], codes["SyncGroup"]
    assert codes == dict.fromkeys(codes, grpc.StatusCode.OK), codes


@pytest.mark.parametrize("headers", [
    ("Bearer bad", f"Bearer {TOKEN}"),      # the last value would win in a dict
    (f"Bearer {TOKEN}", "Bearer bad"),      # the first would win elsewhere
    (f"Bearer {TOKEN}", f"Bearer {TOKEN}"),  # even twice the same: a call carries one credential
])
def test_a_call_that_carries_the_header_more_than_once_is_refused(guarded, headers):
    agent, tcp = guarded
    meta = tuple(("authorization", h) for h in headers)
    with grpc.insecure_channel(str(tcp)) as ch:
        stub = pb_grpc.AgentStub(ch)
        for call in (lambda: stub.Status(pb.StatusRequest(), timeout=5, metadata=meta),
                     lambda: stub.RequestCheckpoint(pb.CheckpointRequest(reason="t"), timeout=5, metadata=meta)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
        # The same channel with the header once is served: the refusal was the repetition.
        assert stub.Status(pb.StatusRequest(), timeout=5,
                           metadata=(("authorization", f"Bearer {TOKEN}"),)).node_id == "n0"


def test_the_unix_socket_asks_no_token_of_ranks_and_status(guarded):
    agent, _ = guarded
    with open_channel(agent.addr) as ch:
        codes = _calls(pb_grpc.AgentStub(ch), rank=42)
    assert codes["Report"] == codes["Commands"] == codes["Status"] == grpc.StatusCode.OK, codes
    # Sync and RequestCheckpoint move the whole job: they need the token on the socket too.
    assert codes["Sync"] == codes["RequestCheckpoint"] == grpc.StatusCode.UNAUTHENTICATED


def test_rank_client_and_cli_send_the_token_over_tcp(guarded, tmp_path):
    agent, tcp = guarded
    rec = Recorder()
    hello = pb.Hello(rank=7, world_size=8, pid=os.getpid(), node_id="n0", backend="gloo", op_names=list(OPS))
    client = AgentClient(rec, hello, tcp, flush_interval=timedelta(milliseconds=20),
                         creds=ClientCredentials.from_env({"RANKWATCH_TOKEN": TOKEN}))
    stranger = AgentClient(Recorder(), pb.Hello(rank=6, world_size=8, pid=os.getpid(), node_id="n0",
                                                backend="gloo", op_names=list(OPS)), tcp)
    client.start()
    stranger.start()
    try:
        t = time.perf_counter_ns()
        for i in range(50):
            rec.collective(0, 0, i, t, t + 1000, 64)
        wait_for(lambda: any(r["rank"] == 7 and r["collectives"] >= 50 for r in agent.status()["ranks"]),
                 10, what="the rank's records over TCP with the token")
        assert not any(r["rank"] == 6 for r in agent.status()["ranks"]), "a rank without the token got in"
    finally:
        client.close()
        stranger.close()

    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKWATCH_TOKEN")}
    cmd = [sys.executable, "-m", "rankwatch.agent.cli", "status", "--json", "--agent", str(tcp)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 1 and "UNAUTHENTICATED" not in r.stdout and "token" in r.stderr, r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env={**env, "RANKWATCH_TOKEN": TOKEN})
    assert r.returncode == 0 and '"ranks"' in r.stdout, r.stderr
    (tmp_path / "tok").write_text(TOKEN)
    (tmp_path / "tok").chmod(0o600)
    r = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "diagnose", "--agent", str(tcp),
                        "--token-file", str(tmp_path / "tok")], capture_output=True, text=True,
                       timeout=30, env=env)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "diagnose", "--agent", str(tcp)],
                       capture_output=True, text=True, timeout=30,
                       env={**env, "RANKWATCH_TOKEN_FILE": str(tmp_path / "tok")})
    assert r.returncode == 0, r.stderr
    assert fetch_status(tcp, creds=ClientCredentials(TOKEN))["node"] == "n0"


def _metric(agent: AgentProcess, line_start: str) -> float:
    for line in agent.metrics().splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
