"""A big job's ``status`` is summarised: the ranks not ok first, up to the agent's limit.

A real ``rankwatch agent`` coordinates 6 simulated nodes of 8 ranks, whose summaries
arrive over real gRPC ``Sync`` calls (shaped by the coordinator load benchmark's node);
its limit is lowered to 16 ranks so that 48 are a "big" job.  The CLI and the client
read it as users do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import AgentProcess, wait_for
from multinode import free_port
from rankwatch.address import Address
from rankwatch.credentials import ClientCredentials, open_channel
from rankwatch.proto import pb, pb_grpc
from rankwatch.status import fetch_status

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from coordinator_load import SimNode  # noqa: E402

NODES, RANKS, LIMIT = 6, 8, 16


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("summary")
    tcp = Address.parse(f"127.0.0.1:{free_port()}")
    agent = AgentProcess(tmp / "coord.sock", node="coord",
                         extra=("--listen", str(tcp), "--coordinator", str(tcp), "--gpu-source", "none",
                                "--status-max-ranks", str(LIMIT))).start()
    try:   # (a setup that fails leaves no agent behind)
        wait_for(lambda: agent.status()["coordinator"], 15, what="the agent coordinating")
        born = time.time() - 5
        with open_channel(tcp, ClientCredentials(None)) as ch:
            stub = pb_grpc.AgentStub(ch)
            for i in range(NODES):
                summary = SimNode(i, RANKS, slow=False, born=born).summary(time.time())
                summary.run_id = ""
                if i == 4:  # the last rank of node 4 is hung, as its node agent says
                    summary.ranks[-1].state = "hung"
                stub.Sync(summary, timeout=10)
        yield agent
    finally:
        agent.stop()


def _cli(agent: AgentProcess, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "status", "--agent", str(agent.addr),
                           *flags], capture_output=True, text=True, timeout=60, check=True)


def test_a_view_over_the_limit_lists_the_ranks_not_ok_first(coordinator):
    s = json.loads(_cli(coordinator, "--json").stdout)
    assert s["ranks_total"] == NODES * RANKS and s["ranks_left_out"] == NODES * RANKS - LIMIT
    assert len(s["ranks"]) == LIMIT
    assert s["rank_states"] == {"hung": 1, "ok": NODES * RANKS - 1}
    hung = [r for r in s["ranks"] if r["state"] == "hung"]
    assert [(r["node"], r["rank"]) for r in hung] == [("sim00004", 4 * RANKS + RANKS - 1)]
    # The rest are the first ranks in the view's order (the coordinator lists its nodes sorted).
    assert [r["rank"] for r in s["ranks"] if r["state"] == "ok"] == list(range(LIMIT - 1))


def test_all_ranks_is_opt_in_and_a_caller_may_ask_for_fewer(coordinator):
    s = json.loads(_cli(coordinator, "--json", "--all-ranks").stdout)
    assert len(s["ranks"]) == s["ranks_total"] == NODES * RANKS and s["ranks_left_out"] == 0
    assert sorted(r["rank"] for r in s["ranks"]) == list(range(NODES * RANKS))
    with open_channel(coordinator.addr, ClientCredentials(None)) as ch:
        resp = pb_grpc.AgentStub(ch).Status(pb.StatusRequest(max_ranks=3), timeout=10)
    assert len(resp.ranks) == 3 and resp.ranks_left_out == NODES * RANKS - 3
    # The trouble is listed whatever the caller's limit; the list keeps the view's order.
    assert [r.state for r in resp.ranks] == ["ok", "ok", "hung"]
    assert fetch_status(coordinator.addr, all_ranks=True)["ranks_left_out"] == 0


def test_the_table_says_what_it_left_out(coordinator):
    out = _cli(coordinator).stdout
    assert f"{LIMIT} of {NODES * RANKS} ranks listed" in out and "(1 hung, 47 ok)" in out and "--all-ranks" in out


def test_states_are_counted_in_the_contracts_names_only():
    from rankwatch.agent.views.rank_list import by_state

    assert by_state(["ok", "hung", "ok", "x" * 60, "made-up"]) == {"hung": 1, "ok": 2, "other": 2}
