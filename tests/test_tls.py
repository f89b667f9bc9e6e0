"""Mutual TLS on the agents' TCP listeners, with grpcio's own credentials.

Real agents with throwaway certificates (openssl): a coordinator and a node agent
syncing over mutual TLS with the token on top; the rank client, the CLI and
plain calls with the right, missing or foreign certificates.
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
from rankwatch.status import AgentUnreachable, fetch_status
from tlscerts import CertAuthority

TOKEN = "tls-and-a-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = CertAuthority(root / "job")
    rogue = CertAuthority(root / "rogue", "rogue")
    return {"n0": ca.issue("n0"), "n1": ca.issue("n1"), "client": ca.issue("client", client=True),
            "rogue": rogue.issue("intruder")}


@pytest.fixture(scope="module")
def job(pki, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tlsjob")
    coord = Address.parse(f"127.0.0.1:{free_port()}")
    env = {"RANKWATCH_TOKEN": TOKEN}
    n0 = AgentProcess(tmp / "n0.sock", "n0", extra=("--listen", str(coord), "--coordinator", str(coord),
                                                    *pki["n0"].flags()), env=env).start()
    n1 = AgentProcess(tmp / "n1.sock", "n1", extra=("--coordinator", str(coord), *pki["n1"].flags()),
                      env=env).start()
    yield n0, n1, coord
    n1.stop()
    n0.stop()


def _status_code(addr: Address, creds: ClientCredentials) -> grpc.StatusCode:
    with open_channel(addr, creds) as ch:
        try:
            pb_grpc.AgentStub(ch).Status(pb.StatusRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def test_node_agents_sync_with_their_coordinator_over_mutual_tls(job):
    n0, n1, _ = job
    wait_for(lambda: "n1" in n0.status()["nodes"], 15, what="n1 synced over mutual TLS")
    assert n1.status()["coordinator_node"] == "n0"


def test_only_a_certificate_of_the_jobs_ca_gets_in(job, pki):
    _, _, coord = job
    c = pki["client"]
    full = ClientCredentials.tls(TOKEN, str(c.ca), str(c.cert), str(c.key))
    assert _status_code(coord, full) == grpc.StatusCode.OK
    # TLS without the token: the token is still checked on top.
    assert _status_code(coord, ClientCredentials.tls(None, str(c.ca), str(c.cert), str(c.key))) \
        == grpc.StatusCode.UNAUTHENTICATED
    # No client certificate, a foreign CA's certificate, or plaintext: no connection at all.
    r = pki["rogue"]
    for creds in (ClientCredentials.tls(TOKEN, str(c.ca), None, None),
                  ClientCredentials.tls(TOKEN, str(c.ca), str(r.cert), str(r.key)),
                  ClientCredentials(TOKEN)):
        assert _status_code(coord, creds) == grpc.StatusCode.UNAVAILABLE, creds


def test_rank_client_and_cli_over_mutual_tls(job, pki):
    n0, _, coord = job
    env = ClientCredentials.from_env({**pki["client"].env(), "RANKWATCH_TOKEN": TOKEN})
    rec = Recorder()
    hello = pb.Hello(rank=5, world_size=8, pid=os.getpid(), node_id="n0", backend="gloo", op_names=list(OPS))
    client = AgentClient(rec, hello, coord, flush_interval=timedelta(milliseconds=20), creds=env)
    client.start()
    try:
        t = time.perf_counter_ns()
        for i in range(30):
            rec.collective(0, 0, i, t, t + 1000, 64)
        wait_for(lambda: any(r["rank"] == 5 and r["collectives"] >= 30 for r in n0.status()["ranks"]),
                 10, what="the rank's records over mutual TLS")
    finally:
        client.close()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANKWATCH_TOKEN", "RANKWATCH_TLS"))}
    cmd = [sys.executable, "-m", "rankwatch.agent.cli", "status", "--json", "--agent", str(coord)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                       env={**base, **pki["client"].env(), "RANKWATCH_TOKEN": TOKEN})
    assert r.returncode == 0 and '"node": "n0"' in r.stdout, r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env={**base, "RANKWATCH_TOKEN": TOKEN})
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr, r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                       env={**base, "RANKWATCH_TLS_CERT": str(pki["client"].cert)})
    assert r.returncode == 1 and "RANKWATCH_TLS_KEY" in r.stderr, r.stderr


def test_agent_refuses_incomplete_tls_flags(tmp_path, pki):
    c = pki["n0"]
    r = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "agent", "--listen", str(tmp_path / "a.sock"),
                        "--tls-cert", str(c.cert), "--tls-key", str(c.key)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--tls-ca" in r.stderr, r.stderr
    with pytest.raises(AgentUnreachable):
        fetch_status(Address(path=str(tmp_path / "a.sock")), timedelta(seconds=1))
