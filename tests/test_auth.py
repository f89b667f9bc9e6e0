"""The job's shared token on coordinator and control RPCs, over real gRPC between real agents."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from conftest import AgentProcess, wait_for
from multinode import free_port
from rankwatch.agent.rpc.auth import load_token
from rankwatch.agent.link.uplink import forward_checkpoint
from rankwatch.proto import pb, pb_grpc


def test_sync_and_checkpoint_need_the_token(tmp_path):
    coord = f"127.0.0.1:{free_port()}"
    token = {"RANKWATCH_TOKEN": "s3cret"}
    n0 = AgentProcess(tmp_path / "n0.sock", "n0", extra=("--listen", coord, "--coordinator", coord),
                      env=token).start()
    good = AgentProcess(tmp_path / "n1.sock", "n1", extra=("--coordinator", coord), env=token).start()
    bad = AgentProcess(tmp_path / "n2.sock", "n2", extra=("--coordinator", coord),
                       env={"RANKWATCH_TOKEN": "wrong"}).start()
    try:
        wait_for(lambda: n0.status()["coordinator"] and "n1" in (n0.status()["nodes"]), 10,
                 what="n1 synced with the token")
        assert "n2" not in n0.status()["nodes"], "a node with the wrong token was let in"
        wait_for(lambda: "refused this node's token" in bad.log.read_text(), 10, what="n2 says why")
        with grpc.insecure_channel(coord) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.AgentStub(ch).Sync(pb.NodeSummary(node_id="intruder", seq=1), timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            forward_checkpoint(n0.addr, "no token")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # With the token the request is heard (and refused for a real reason: no ranks).
        assert "no rank is connected" in forward_checkpoint(n0.addr, "ok", "s3cret").message
        r = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "checkpoint", "--agent",
                            str(n0.addr)], capture_output=True, text=True, timeout=30,
                           env={k: v for k, v in os.environ.items() if k != "RANKWATCH_TOKEN"})
        assert r.returncode == 1 and "needs the job's token" in r.stderr
    finally:
        for a in (bad, good, n0):
            a.stop()


def test_token_file_must_be_private(tmp_path):
    f = tmp_path / "token"
    f.write_text("abc\n")
    f.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_token(f)
    f.chmod(0o600)
    assert load_token(f) == "abc"
    (tmp_path / "empty").write_text("")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(ValueError, match="empty"):
        load_token(tmp_path / "empty")
