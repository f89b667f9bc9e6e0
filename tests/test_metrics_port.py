"""The agent's /metrics port: taken by the bind itself, kept across back-to-back jobs, and
never a reason for an agent to exit (issue 56: three nodes' agents started together on one
host raced for the default port, and the loser exited with "Address already in use")."""

from __future__ import annotations

import subprocess
import threading
import urllib.request

from conftest import AgentProcess

from rankwatch.agent.cli.ports import free_port


def _start_together(agents: list[AgentProcess]) -> None:
    errors: list[BaseException] = []

    def start(a: AgentProcess) -> None:
        try:
            a.start()
        except BaseException as exc:  # noqa: BLE001 - reported below, with the agent's log
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _time_wait_on(port: int) -> int:
    out = subprocess.run(["ss", "-Htan", "state", "time-wait", "sport", "=", f":{port}"],
                         capture_output=True, text=True, check=True).stdout
    return len(out.splitlines())


def test_agents_started_together_each_serve_metrics_and_one_keeps_the_port(tmp_path):
    port = free_port()
    for round_ in range(10):
        agents = [AgentProcess(tmp_path / f"r{round_}-n{i}.sock", node=f"n{i}",
                               extra=("--metrics-port", str(port))) for i in range(3)]
        try:
            _start_together(agents)
            ports = [a.metrics_port for a in agents]
            assert all(a.proc is not None and a.proc.poll() is None for a in agents), round_
            assert len(set(ports)) == 3 and ports.count(port) == 1, (round_, ports)
            for a in agents:
                assert "rankwatch_" in a.metrics()
            moved = [a for a in agents if a.metrics_port != port]
            for a in moved:
                assert f"metrics port {port} is taken by another process: /metrics is on port " \
                       f"{a.metrics_port} instead" in a.log.read_text()
        finally:
            for a in agents:
                a.stop()


def test_a_job_right_after_another_keeps_the_metrics_port(tmp_path):
    port = free_port()
    first = AgentProcess(tmp_path / "first.sock", extra=("--metrics-port", str(port))).start()
    try:
        assert first.metrics_port == port
        for _ in range(5):   # scrapes: the server closes each connection, so it holds the TIME-WAIT
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                r.read()
    finally:
        first.stop()
    assert _time_wait_on(port) > 0, "the first agent's connections should still be in TIME-WAIT"
    second = AgentProcess(tmp_path / "second.sock", node="n1", extra=("--metrics-port", str(port))).start()
    try:
        assert second.metrics_port == port
        assert "is taken" not in second.log.read_text()
    finally:
        second.stop()
