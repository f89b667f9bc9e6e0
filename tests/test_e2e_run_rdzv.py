"""``rankwatch run`` and its rendezvous: c10d becomes rankwatch's exclusion-aware wrapper of it,
unless ``RANKWATCH_RDZV=0`` keeps the stock c10d rendezvous.

The test hosts the rendezvous store (a TCPStore on a port the system picked) and, before the
job starts, writes into it the coordinator's exclusion of the job's one node, as the relay in
a coordinator's torchrun writes it.  The rankwatch rendezvous refuses the node; the stock
c10d rendezvous knows nothing of exclusions, and the job trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters

from multinode import Cluster, free_port
from rankwatch.hooks.rendezvous.entry import create_handler

pytestmark = pytest.mark.e2e


@pytest.fixture
def store():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield s
    del s


def run(tmp_path, agent, store, run_id: str, rdzv: str | None) -> tuple[subprocess.CompletedProcess, object]:
    """``rankwatch run`` of a 2-rank, 3-step job as node ``nx``, excluded in the store beforehand."""
    writer = create_handler(RendezvousParameters(
        backend="rankwatch", endpoint=f"127.0.0.1:{store.port}", run_id=run_id, min_nodes=1, max_nodes=1,
        is_host=False))
    writer.write_decision({"kind": "exclude", "id": "exclude-1", "node": "nx", "generation": 1,
                           "reason": "test: nx excluded"})
    env = {k: v for k, v in os.environ.items() if k not in ("RANKWATCH_RDZV", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    env["OMP_NUM_THREADS"] = "1"
    env["LOGLEVEL"] = "INFO"  # torchrun logs why its rendezvous ended
    if rdzv is not None:
        env["RANKWATCH_RDZV"] = rdzv
    out = tmp_path / run_id
    r = subprocess.run(
        [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(agent.addr), "--node-id", "nx", "--",
         "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "0", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", run_id, "--rdzv-conf", "is_host=0",
         "-m", "rankwatch.hooks.train", "--steps", "3", "--log-every", "0", "--metrics-out", str(out)],
        env=env, capture_output=True, text=True, timeout=180)
    return r, out


def test_rankwatch_rendezvous_refuses_an_excluded_node(agent_proc, tmp_path, store):
    r, out = run(tmp_path, agent_proc, store, "job-rankwatch", None)
    log = r.stdout + r.stderr
    assert "node nx is excluded from the job: test: nx excluded" in log, log[-3000:]
    assert not out.exists(), "the excluded node trained"
    assert agent_proc.status()["ranks"] == []


def test_rdzv_0_keeps_the_stock_c10d_rendezvous(agent_proc, tmp_path, store):
    r, out = run(tmp_path, agent_proc, store, "job-c10d", "0")
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "excluded" not in log
    for rank in (0, 1):
        assert len(json.loads((out / f"rank{rank}.json").read_text())["step_times"]) == 3
    assert sorted((x["rank"], x["step"]) for x in agent_proc.status()["ranks"]) == [(0, 3), (1, 3)]


def test_designs_multi_node_command_trains_on_a_rendezvous_it_was_not_told(tmp_path):
    """DESIGN.md's command names no rendezvous backend; ``rankwatch run`` gives it c10d with
    rankwatch's exclusions (torchrun's static default would refuse ``--nnodes 2:3``), prints
    what it chose, and both nodes train to the end."""
    port = free_port()
    with Cluster(tmp_path, 2) as c:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen(
            [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(a.addr), "--node-id", a.node, "--",
             "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", "job1", "-m", "rankwatch.hooks.train", "--steps", "20", "--log-every", "0"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for a in c.agents]
        outs = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
        for out in outs:
            assert "rankwatch run: no --rdzv-backend: c10d" in out, out[-3000:]
            assert "rankwatch run: rendezvous: keep_alive_interval=1" in out, out[-3000:]
        ranks = c.coordinator.status()["ranks"]
        assert sorted((r["node"], r["step"]) for r in ranks) == [("n0", 20), ("n1", 20)], ranks
