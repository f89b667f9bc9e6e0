"""Under mutual TLS a node speaks only for itself: three real agents with `rankwatch certs`.

n1 coordinates on TCP; n2 and n3 sync with it, each with its own certificate from
``rankwatch certs issue`` (n3's without the relay name).  With n2's certificate and the
job's token, a ``Sync`` for n1 or for a made-up node, claiming rank 0 hung, is refused with
PERMISSION_DENIED; so is a ``SyncGroup`` of other nodes' summaries under n3's.  The
coordinator's status shows no phantom node and no second rank, and the refusals are counted.
"""

from __future__ import annotations

import time

import grpc
import pytest

from conftest import AgentProcess, parse_metrics, wait_for
from multinode import free_port
from rankwatch.address import Address
from rankwatch.credentials import ClientCredentials, open_channel
from rankwatch.proto import pb, pb_grpc
from tlscerts import CertAuthority

pytestmark = [pytest.mark.e2e, pytest.mark.light]

TOKEN = "node-rights-token"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rights")
    ca = CertAuthority(tmp / "pki", "job")
    certs = {"n1": ca.issue("n1"), "n2": ca.issue("n2"), "n3": ca.issue("n3", "--no-relay")}
    coord = Address.parse(f"127.0.0.1:{free_port()}")
    env = {"RANKWATCH_TOKEN": TOKEN}
    n1 = AgentProcess(tmp / "n1.sock", "n1", extra=("--listen", str(coord), "--coordinator", str(coord),
                                                    *certs["n1"].flags()), env=env).start()
    others = [AgentProcess(tmp / f"{n}.sock", n, extra=("--coordinator", str(coord), *certs[n].flags()),
                           env=env).start() for n in ("n2", "n3")]
    try:
        wait_for(lambda: {"n2", "n3"} <= set(n1.status()["nodes"]), 20, what="n2 and n3 synced over mutual TLS")
        yield n1, coord, certs
    finally:
        for a in (*others, n1):
            a.stop()


def _hung_rank(node: str, seq: int) -> pb.NodeSummary:
    now = time.time()
    return pb.NodeSummary(node_id=node, seq=seq, sent_at=now, ranks=[pb.RankSummary(
        rank=0, pid=4242, step=1, step_seconds=0.1, steps_completed=1, activity="train",
        progress_at=now - 600, last_seen=now, connected=True)])


def _call(coord: Address, cert, fn) -> grpc.StatusCode:
    creds = ClientCredentials.tls(TOKEN, str(cert.ca), str(cert.cert), str(cert.key))
    with open_channel(coord, creds) as ch:
        try:
            fn(pb_grpc.AgentStub(ch))
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def test_a_nodes_certificate_syncs_for_that_node_only(job):
    n1, coord, certs = job
    for node in ("n1", "ghost"):
        code = _call(coord, certs["n2"], lambda stub: stub.Sync(_hung_rank(node, 10**6), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED, node
    group = pb.GroupSummary(nodes=[_hung_rank("n3", 10**6), _hung_rank("ghost", 1)], held_seconds=[0.0, 0.0])
    assert _call(coord, certs["n3"], lambda stub: stub.SyncGroup(group, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    status = n1.status()
    assert "ghost" not in status["nodes"], status["nodes"]
    assert [r for r in status["ranks"] if r["rank"] == 0 and r["pid"] == 4242] == [], status["ranks"]
    assert [r for r in status["ranks"] if r["state"] == "hung"] == []
    refused = parse_metrics(n1.metrics()).get(
        ("rankwatch_rpcs_refused_total", frozenset({("node", "n1"), ("reason", "not_this_node")})), 0.0)
    assert refused == 3
    assert {"n2", "n3"} <= set(n1.status()["nodes"])   # the real nodes still sync
