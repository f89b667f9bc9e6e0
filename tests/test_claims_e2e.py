"""A token holder cannot take a live node's rank or node id: two real agents, token only.

n1 coordinates on TCP; n2 syncs with it and serves a rank 1 stream (this process, on n2's
socket).  With the job's token, a peer sends a ``Sync`` from a made-up node claiming rank 1
hung, then one for n2 from another agent instance.  The first is a rank conflict: n2 keeps
rank 1, the view has one rank 1, and the conflict is shown and counted.  The second is
refused with ALREADY_EXISTS.  Once the peer stops, the conflict closes by itself.
"""

from __future__ import annotations

import os
import time

import grpc
import pytest

from conftest import AgentProcess, parse_metrics, wait_for
from multinode import free_port
from rankstream import Stream
from rankwatch.address import Address
from rankwatch.credentials import ClientCredentials, open_channel
from rankwatch.hooks.instrument.recorder import OPS
from rankwatch.proto import pb, pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.light]

TOKEN = "claims-token"


def _claim(node: str, seq: int, instance: str) -> pb.NodeSummary:
    """A summary of ``node`` whose rank 1 is hung (no progress for ten minutes)."""
    now = time.time()
    return pb.NodeSummary(node_id=node, seq=seq, sent_at=now, agent_instance=instance, ranks=[pb.RankSummary(
        rank=1, pid=4242, step=1, step_seconds=0.1, steps_completed=1, activity="train", state="hung",
        progress_at=now - 600, last_seen=now, connected=True, alive=True)])


def _sync(coord: Address, summary: pb.NodeSummary) -> grpc.StatusCode:
    with open_channel(coord, ClientCredentials(token=TOKEN)) as ch:
        try:
            pb_grpc.AgentStub(ch).Sync(summary, timeout=5)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def _counted(agent: AgentProcess, name: str, **labels: str) -> float:
    return parse_metrics(agent.metrics()).get((name, frozenset({("node", "n1"), *labels.items()})), 0.0)


def test_a_second_claim_to_a_live_rank_or_node_id_is_refused(tmp_path):
    coord = Address.parse(f"127.0.0.1:{free_port()}")
    env = {"RANKWATCH_TOKEN": TOKEN}
    n1 = AgentProcess(tmp_path / "n1.sock", "n1", extra=("--listen", str(coord), "--coordinator", str(coord)),
                      env=env).start()
    n2 = AgentProcess(tmp_path / "n2.sock", "n2", extra=("--coordinator", str(coord)), env=env).start()
    channel = grpc.insecure_channel(n2.addr.grpc_target())
    rank = None
    try:
        rank = Stream(channel, pb.Hello(rank=1, world_size=2, pid=os.getpid(), node_id="n2", backend="gloo",
                                        op_names=list(OPS)))
        rank.batch(progress=pb.Progress(step=3, sampled_at=time.time()))
        wait_for(lambda: [(r["node"], r["step"]) for r in n1.status()["ranks"] if r["rank"] == 1] == [("n2", 3)],
                 20, what="the coordinator to see n2's rank 1")

        assert _sync(coord, _claim("ghost", 1, "ghost-instance")) == grpc.StatusCode.OK   # its other claims stand
        status = n1.status()
        assert [(r["node"], r["pid"], r["state"]) for r in status["ranks"] if r["rank"] == 1] == \
            [("n2", os.getpid(), "ok")]
        assert [(c["rank"], c["node"], c["claimed_by"]) for c in status["rank_conflicts"]] == [(1, "n2", "ghost")]
        assert _counted(n1, "rankwatch_job_rank_conflicts") == 1
        assert _counted(n1, "rankwatch_messages_rejected_total", reason="rank_conflict") == 1

        assert _sync(coord, _claim("n2", 10**6, "not-n2s-agent")) == grpc.StatusCode.ALREADY_EXISTS
        assert _sync(coord, _claim("n2", 10**6, "")) == grpc.StatusCode.ALREADY_EXISTS
        assert _counted(n1, "rankwatch_messages_rejected_total", reason="node_taken") == 2
        rank.batch(progress=pb.Progress(step=4, sampled_at=time.time()))
        wait_for(lambda: [(r["node"], r["step"], r["state"]) for r in n1.status()["ranks"] if r["rank"] == 1]
                 == [("n2", 4, "ok")], 10, what="n2's own summaries to go on being taken")
        assert not [i for i in n1.status()["incidents"] if i["kind"] == "hang"]

        # The peer stops claiming: the conflict closes once its claim no longer holds.
        wait_for(lambda: n1.status()["rank_conflicts"] == [], 10, what="the conflict to close")
        assert _counted(n1, "rankwatch_job_rank_conflicts") == 0
    finally:
        if rank is not None:
            rank.cancel()
        channel.close()
        n2.stop()
        n1.stop()
