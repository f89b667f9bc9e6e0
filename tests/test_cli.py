"""The rankwatch CLI: contracts, clear errors, and a torch-free agent side."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import wait_for

RW = [sys.executable, "-m", "rankwatch.agent.cli"]


def rw(*args, **kw):
    return subprocess.run([*RW, *args], capture_output=True, text=True, timeout=60, **kw)


def test_agent_side_imports_no_torch():
    code = ("import sys, rankwatch.agent.cli.app, rankwatch.agent.server, rankwatch.status, "
            "rankwatch.address, rankwatch.hooks; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_status_without_agent_fails_clearly(tmp_path):
    r = rw("status", "--agent", str(tmp_path / "none.sock"), "--json")
    assert r.returncode == 1 and "no agent at" in r.stderr


@pytest.mark.parametrize("args,msg", [
    (["status", "--agent", "host:notaport"], "neither a socket path"),
    (["agent", "--metrics-port", "99999"], "out of range"),
    (["nosuchcommand"], "invalid choice"),
])
def test_bad_arguments(args, msg):
    r = rw(*args)
    assert r.returncode == 2 and msg in r.stderr


def test_run_needs_torchrun_args():
    r = rw("run")
    assert r.returncode == 2 and "after --" in r.stderr


def test_status_uses_env_then_default(tmp_path, agent_proc):
    import os

    env = {**os.environ, "RANKWATCH_AGENT": str(agent_proc.addr)}
    r = rw("status", "--json", env=env)
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert status["node"] == "n0" and status["ranks"] == [] and status["incidents"] == []
    assert "goodput" in status
    r = rw("status", env=env)  # the table
    assert r.returncode == 0 and "rankwatch" in r.stdout


def test_diagnose_and_checkpoint_are_honest(agent_proc):
    r = rw("diagnose", "--agent", str(agent_proc.addr))
    assert r.returncode == 0 and "no incidents" in r.stdout
    r = rw("diagnose", "--agent", str(agent_proc.addr), "nosuch")
    assert r.returncode == 1
    # No rank connected: the request is refused with the reason, not silently accepted.
    r = rw("checkpoint", "--agent", str(agent_proc.addr))
    assert r.returncode == 1 and "no rank is connected" in r.stderr
    r = rw("checkpoint", "--agent", str(agent_proc.addr.path) + ".missing")
    assert r.returncode == 1 and "no agent at" in r.stderr


@pytest.mark.e2e
def test_run_starts_a_local_agent(tmp_path):
    from rankwatch.address import Address
    from rankwatch.status import AgentUnreachable, fetch_status

    sock = tmp_path / "auto.sock"
    proc = subprocess.Popen([*RW, "run", "--agent", str(sock), "--node-id", "nx", "--",
                             "--standalone", "--nproc-per-node", "2", "-m", "rankwatch.hooks.train",
                             "--steps", "60", "--log-every", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def seen():
        try:
            s = fetch_status(Address(path=str(sock)))
        except AgentUnreachable:
            return None
        return s if len(s["ranks"]) == 2 and all(r["step"] > 0 for r in s["ranks"]) else None

    status = wait_for(seen, 120, what="ranks at the auto-started agent")
    assert status["node"] == "nx" and {r["node"] for r in status["ranks"]} == {"nx"}
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-2000:]
    assert f"rankwatch: agent at unix:{sock}, /metrics on port {status['metrics_port']}" in out, out[-2000:]
    wait_for(lambda: not sock.exists(), 10, what="the local agent stopped with the job")


def test_the_metrics_port_line_says_when_the_default_port_was_taken(agent_proc):
    from rankwatch.agent.cli.run import metrics_port_line

    port = agent_proc.status()["metrics_port"]  # the test agent binds port 0: never 9478
    assert metrics_port_line(agent_proc.addr) == (
        f"rankwatch: agent at {agent_proc.addr}, /metrics on port {port} (port 9478 is taken)")


@pytest.mark.e2e
def test_run_trains_when_no_agent_can_start(tmp_path):
    # The agent's socket directory cannot be created (its parent is a file): rankwatch run
    # says so at each of its attempts, loudly after the last, and trains anyway.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    r = subprocess.run([*RW, "run", "--agent", str(blocker / "agent.sock"), "--node-id", "nx", "--",
                        "--standalone", "--nproc-per-node", "1", "-m", "rankwatch.hooks.train",
                        "--steps", "5", "--log-every", "0"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    err = r.stderr
    assert "the local agent for node nx failed to start (attempt 3 of 3)" in err, err[-3000:]
    assert "WARNING: node nx has no agent at" in err and "ranks train unwatched" in err, err[-3000:]
