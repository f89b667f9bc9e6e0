"""Diagnosis outlives the job: a hung user script is SIGTERMed under ``rankwatch run``; once the job
and its agent are gone, ``diagnose`` and ``status`` read what the agent left in its state directory.

The script (tests/data/user_fsdp.py) exits on SIGTERM as many users' scripts do, so each rank
closes its monitor: a goodbye while hung.  That is the job ending, not progress resuming.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_for
from rankwatch.address import Address
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.status import AgentUnreachable, fetch_status

pytestmark = [pytest.mark.e2e, pytest.mark.light]

SCRIPT = Path(__file__).parent / "data" / "user_fsdp.py"


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def _hang(addr: Address):
    try:
        return [i for i in fetch_status(addr)["incidents"] if i["kind"] == "hang"]
    except AgentUnreachable:
        return []


def test_a_hung_job_ended_by_sigterm_is_diagnosed_after_its_agent_is_gone(tmp_path):
    sock, state = tmp_path / "agent.sock", tmp_path / "state"
    # The state directory comes from the environment: the agent `rankwatch run` starts reads it.
    # `diagnose` and `status` get no --state-dir: they find it by the socket's name.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKWATCH_STATE_DIR": str(state)}
    run = subprocess.Popen(
        [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(sock), "--node-id", "n0", "--",
         "--standalone", "--nproc-per-node", "2", str(SCRIPT), "--steps", "400", "--hang-at", "1:12"],
        env=env, stdout=open(tmp_path / "run.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        (hang,) = wait_for(lambda: _hang(Address(path=str(sock))), 150, interval=0.2, what="hang incident")
        assert hang["rank"] == 1, hang
        run.send_signal(signal.SIGTERM)
        assert run.wait(90) != 0
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    log = (tmp_path / "run.log").read_text()
    assert "progress resumed" not in log, log[-3000:]
    assert not sock.exists(), "the agent is gone"

    # On disk: the hang ended with the job, and the agent's last view is there.
    (on_disk,) = [i for i in IncidentLog.replay(state / "incidents.jsonl") if i.id == hang["id"]]
    assert on_disk.detail["outcome"] == "ended", dict(on_disk.detail)
    assert on_disk.resolved_at is not None and on_disk.run_id

    # diagnose, human: a story with a real traceback, read from the state directory.
    out = _cli("diagnose", "--agent", str(sock), env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    print(text[:2500])
    assert text.splitlines()[0].startswith(f"rankwatch diagnose: no agent answers at unix:{sock}: "
                                           f"reading what the agent left in {state}")
    assert f"{hang['id']}: the job hung at step 12" in text
    assert "stuck:    rank 1 on node n0" in text
    assert "process:  alive and running" in text
    assert "the job ended while hung" in text and "progress resumed" not in text
    coll = hang["detail"]["collective"]
    assert f"others:   wait in {coll['op']} on group {coll['group']}, seq {coll['seq']}" in text
    assert "Thread MainThread:\nTraceback (most recent call last):\n" in text
    assert f'File "{SCRIPT}", line' in text and "time.sleep(0.1)" in text and "\\n" not in text

    # diagnose --json: the machine form on stdout, the one line on stderr.
    out = _cli("diagnose", "--json", "--agent", str(sock), hang["id"], env=env)
    assert out.returncode == 0, out.stderr
    machine = json.loads(out.stdout)
    assert machine["id"] == hang["id"] and machine["rank"] == 1 and machine["kind"] == "hang"
    assert machine["detail"]["outcome"] == "ended" and "File " in machine["detail"]["stacks"]
    assert out.stderr.strip().startswith("rankwatch diagnose: no agent answers at")
    assert len(out.stderr.strip().splitlines()) == 1

    # status --json: the last view, every rank, in the status schema.
    out = _cli("status", "--json", "--agent", str(sock), env=env)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert sorted(r["rank"] for r in status["ranks"]) == [0, 1]
    assert all(r["step"] >= 12 and r["backend"] == "gloo" for r in status["ranks"])
    assert hang["id"] in [i["id"] for i in status["incidents"]]
    assert "reading what the agent left" in out.stderr

    out = _cli("status", "--agent", str(sock), env=env)
    assert out.returncode == 0 and "reading what the agent left" in out.stdout.splitlines()[0]
    assert "rank" in out.stdout and "n0" in out.stdout


def test_status_and_diagnose_say_when_there_is_nothing_to_read(tmp_path):
    env = {**os.environ, "RANKWATCH_STATE_DIR": str(tmp_path / "none")}
    for cmd in ("status", "diagnose"):
        out = _cli(cmd, "--agent", str(tmp_path / "agent.sock"), env=env)
        assert out.returncode == 1 and "no agent at" in out.stderr and "no agent state in" in out.stderr
