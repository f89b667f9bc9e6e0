"""The agent's files: a private default directory, no symlink followed, failed writes kept
and retried, torn lines tolerated (issue 13).  Real ``rankwatch agent`` processes.

These tests may run as root, which ignores mode bits: a write is made to fail by putting
a directory or a symlink where the file goes, never by a read-only mode.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from conftest import AgentProcess, parse_metrics, wait_for
from rankstream import Stream, hello
from rankwatch.address import AGENT_ENV, TMPDIR_ENV
from rankwatch.agent.durable import jsonl
from rankwatch.agent.durable.incidents import IncidentLog
from rankwatch.proto import pb


def agent_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "rankwatch.agent.cli", "agent", "--metrics-port", "0",
            "--metrics-addr", "127.0.0.1", "--node-id", "n0", *extra]


def default_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (AGENT_ENV, "RANKWATCH_STATE_DIR")}
    env[TMPDIR_ENV] = str(tmp)
    return env


def refused(tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run(agent_cmd(), env=default_env(tmp), capture_output=True, text=True, timeout=30)


def test_a_planted_default_directory_is_refused(tmp_path):
    planted = tmp_path / f"rankwatch-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    out = refused(tmp_path)
    assert out.returncode == 1 and "mode 0777" in out.stderr and str(planted) in out.stderr, out.stderr
    assert list(planted.iterdir()) == []   # nothing made in it: no socket, no state


def test_a_symlink_planted_as_the_default_directory_is_refused(tmp_path):
    target = tmp_path / "attacker"
    target.mkdir(mode=0o700)
    (tmp_path / f"rankwatch-{os.getuid()}").symlink_to(target)
    out = refused(tmp_path)
    assert out.returncode == 1 and "symlink" in out.stderr, out.stderr
    assert list(target.iterdir()) == []


def test_a_default_directory_of_another_user_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("planting a directory owned by another user needs root (chown)")
    planted = tmp_path / f"rankwatch-{os.getuid()}"
    planted.mkdir(mode=0o700)
    os.chown(planted, 65534, 65534)
    out = refused(tmp_path)
    assert out.returncode == 1 and "belongs to uid 65534" in out.stderr, out.stderr


def test_a_fresh_default_directory_is_private(tmp_path):
    env = default_env(tmp_path)
    base = tmp_path / f"rankwatch-{os.getuid()}"
    proc = subprocess.Popen(agent_cmd(), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        sock = base / "agent.sock"
        wait_for(lambda: sock.exists() or proc.poll() is not None, 15, what="the agent's socket")
        assert proc.poll() is None, proc.stderr.read()
        for path, mode in ((base, 0o700), (base / "n0", 0o700), (sock, 0o600),
                           (base / "n0" / "incidents.jsonl", 0o600), (base / "n0" / "decisions.jsonl", 0o600)):
            assert stat.S_IMODE(os.lstat(path).st_mode) == mode, (path, oct(os.lstat(path).st_mode))
    finally:
        proc.terminate()
        proc.wait(10)


def checkpoint(stream: Stream, step: int) -> None:
    stream.batch(checkpoints=[pb.CheckpointRecord(step=step, started_at=time.time(), duration=0.1, ok=True)])


def storage(agent: AgentProcess) -> dict:
    return agent.status()["storage"]["incidents"]


def metric(agent: AgentProcess, name: str, **labels) -> float:
    return parse_metrics(agent.metrics()).get(
        (name, frozenset({("node", "n0"), ("file", "incidents"), *labels.items()})), 0.0)


@pytest.mark.parametrize("plant", ["symlink", "directory"])
def test_a_failed_write_is_spooled_counted_and_flushed_once_writable(tmp_path, plant):
    state = tmp_path / "state-n0"
    state.mkdir()
    victim = tmp_path / "victim_bashrc"
    victim.write_text("# the victim's file\n")
    target = state / "incidents.jsonl"
    if plant == "symlink":
        target.symlink_to(victim)   # another user's trap: incidents appended to the victim's file
    else:
        target.mkdir()              # a path that cannot be written, even by root
    agent = AgentProcess(tmp_path / "agent.sock").start()
    channel = grpc.insecure_channel(agent.addr.grpc_target())
    try:
        assert storage(agent)["ok"] is False   # said at start, before any incident
        s = Stream(channel, hello(0, 8))
        for step in (10, 20, 30):
            checkpoint(s, step)
        wait_for(lambda: storage(agent)["spooled"] == 3, 10, what="three incidents spooled")
        st = storage(agent)
        assert st["failures"] >= 3 and st["last_error"] and st["written"] == 0
        assert ("symbolic links" in st["last_error"] or "ELOOP" in st["last_error"]) if plant == "symlink" \
            else "directory" in st["last_error"]
        assert metric(agent, "rankwatch_state_write_failures_total") >= 3
        assert metric(agent, "rankwatch_state_spooled_records") == 3
        assert metric(agent, "rankwatch_state_writable") == 0
        assert victim.read_text() == "# the victim's file\n"   # never followed
        assert "cannot write" in agent.log.read_text()
        # Writable again: the spool is flushed by the retry, in order, and the state says so.
        if plant == "symlink":
            target.unlink()
        else:
            target.rmdir()
        wait_for(lambda: storage(agent)["spooled"] == 0, 10, what="the spool flushed")
        assert storage(agent)["ok"] is True and storage(agent)["written"] == 3
        assert [i.step for i in IncidentLog.replay(target)] == [10, 20, 30]
        assert stat.S_IMODE(os.lstat(target).st_mode) == 0o600 and not target.is_symlink()
        assert metric(agent, "rankwatch_state_writable") == 1
        s.close()
    finally:
        channel.close()
        agent.stop()


def test_an_unwritable_state_directory_at_start_is_loud_and_the_agent_serves(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    agent = AgentProcess(tmp_path / "agent.sock", extra=("--state-dir", str(blocker / "state"))).start()
    try:
        st = storage(agent)
        assert st["ok"] is False and "Not a directory" in st["last_error"]
        assert "cannot write" in agent.log.read_text()
        out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "status", "--agent", str(agent.addr),
                              "--json"], capture_output=True, text=True, timeout=30)
        assert json.loads(out.stdout)["storage"]["decisions"]["ok"] is False
    finally:
        agent.stop()


def test_a_torn_line_never_makes_the_file_unreadable(tmp_path):
    state = tmp_path / "state-n0"
    state.mkdir()
    path = state / "incidents.jsonl"
    good = {"id": "checkpoint-1", "kind": "checkpoint", "node": "n0", "rank": 0, "step": 5,
            "detected_at": 1.0, "detail": {}, "run_id": ""}
    path.write_text(json.dumps(good) + "\n" + json.dumps(good)[:40])   # a write cut short (full disk)
    agent = AgentProcess(tmp_path / "agent.sock").start()
    channel = grpc.insecure_channel(agent.addr.grpc_target())
    try:
        s = Stream(channel, hello(0, 8))
        checkpoint(s, 7)
        s.close()
        wait_for(lambda: storage(agent)["written"] >= 1, 10, what="the incident written")
    finally:
        channel.close()
        agent.stop()
    replayed = IncidentLog.replay(path)
    assert [i.step for i in replayed] == [5, 7] and replayed.skipped == 1
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "diagnose", "--json", "--state-dir", str(state)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and json.loads(out.stdout)["step"] == 7, out.stderr


def test_the_spool_is_bounded(tmp_path):
    (tmp_path / "f.jsonl").mkdir()
    w = jsonl.Writer(tmp_path / "f.jsonl", spool_limit=10)
    try:
        for n in range(25):
            assert w.append({"n": n}) is False
        assert (w.spooled, w.dropped) == (10, 15) and w.failures == 25
        (tmp_path / "f.jsonl").rmdir()
        assert w.flush() is True
        assert [json.loads(line)["n"] for line in (tmp_path / "f.jsonl").read_text().splitlines()] == \
            list(range(15, 25))
    finally:
        w.close()


def test_the_demo_refuses_a_planted_default_directory_too(tmp_path):
    planted = tmp_path / f"rankwatch-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "demo", "--no-live"], env=default_env(tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "mode 0755" in out.stdout, out.stdout + out.stderr
    assert list(planted.iterdir()) == []
