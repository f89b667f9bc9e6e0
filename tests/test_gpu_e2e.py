"""GPU faults in a real job: a real agent with the scripted GPU source, a real 2-rank torchrun job.

The script is handed to ``rankwatch agent --gpu-source script:PATH`` from outside:
GPU 0 throttles on heat and gathers corrected ECC errors, GPU 1 raises XID 79 and
falls off the bus while the job trains.  On CPU, GPU i is the rank with local_rank i.

The script's clock starts with the agent, and a rank's start-up time depends on
how busy the machine is.  So the job starts first (training goes on without an
agent), and the agent only once the job is stepping: the ranks then connect
within their reconnect backoff (at most 2 s), well before the XID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import AgentProcess, parse_metrics, torchrun, wait_for

pytestmark = pytest.mark.e2e

XID_AT = 6.0  # seconds after the agent starts
SCRIPT = {
    "gpus": {"count": 2, "name": "NVIDIA H100 80GB HBM3"},
    "events": [
        {"at": 1, "gpu": 0, "throttle": ["sw_power_cap", "hw_thermal_slowdown"]},
        {"at": 2, "gpu": 0, "ecc": {"corrected": 4}},
        {"at": XID_AT, "gpu": 1, "xid": 79},
        {"at": XID_AT + 0.5, "gpu": 1, "lost": True},
    ],
}


def gpu_faults(status: dict) -> list[dict]:
    return [i for i in status["incidents"] if i["kind"] == "gpu_fault"]


def test_xid_79_names_gpu_and_rank_and_training_goes_on(tmp_path):
    script = tmp_path / "gpu-faults.json"
    script.write_text(json.dumps(SCRIPT))
    agent = AgentProcess(tmp_path / "agent.sock",
                         extra=("--gpu-source", f"script:{script}", "--gpu-interval", "0.2"))
    log = tmp_path / "job.log"
    job = torchrun(2, "--steps", "5000", "--log-every", "5", "--checkpoint-dir", str(tmp_path / "ckpt"),
                   agent=agent.addr, log=log)
    try:
        wait_for(lambda: "step 5 loss" in log.read_text() or job.poll() is not None, 90, interval=0.2,
                 what="the job's first steps")
        assert job.poll() is None, log.read_text()[-2000:]
        agent.start()
        started = time.monotonic()
        wait_for(lambda: sum(r["connected"] for r in agent.status()["ranks"]) == 2, XID_AT - 1,
                 what="both ranks connected before the scripted XID")
        xid = wait_for(lambda: [i for i in gpu_faults(agent.status()) if i["detail"]["xid"] == 79],
                       XID_AT + 20 - (time.monotonic() - started), interval=0.2, what="the XID 79 incident")[0]
        assert (xid["node"], xid["rank"]) == ("n0", 1)
        d = xid["detail"]
        assert (d["gpu"], d["xid"], d["action"], d["ranks"], d["source"]) == (1, 79, "reboot", [1], "script")

        # The contract view: rankwatch status --json.
        out = subprocess.run([sys.executable, "-m", "rankwatch.agent.cli", "status", "--agent", str(agent.addr),
                              "--json"], capture_output=True, text=True, timeout=30, check=True).stdout
        faults = {(i["detail"]["reason"], i["detail"]["gpu"], i["rank"]) for i in gpu_faults(json.loads(out))}
        assert ("xid", 1, 1) in faults

        lost = wait_for(lambda: [i for i in gpu_faults(agent.status()) if i["detail"]["reason"] == "gpu_lost"],
                        10, what="the gpu_lost incident")[0]
        assert (lost["detail"]["gpu"], lost["detail"]["action"], lost["detail"]["ranks"]) == (1, "reboot", [1])

        m = parse_metrics(agent.metrics())
        g0, g1 = {("node", "n0"), ("gpu", "0")}, {("node", "n0"), ("gpu", "1")}
        assert m[("rankwatch_gpu_up", frozenset(g0))] == 1 and m[("rankwatch_gpu_up", frozenset(g1))] == 0
        assert m[("rankwatch_gpu_throttle", frozenset(g0 | {("reason", "hw_thermal_slowdown")}))] == 1
        assert m[("rankwatch_gpu_ecc_errors_total",
                  frozenset(g0 | {("severity", "corrected"), ("counter", "volatile")}))] == 4
        assert m[("rankwatch_gpu_temperature_celsius", frozenset(g0))] == 89.0
        assert m[("rankwatch_gpu_xid_errors_total", frozenset(g1 | {("xid", "79"), ("action", "reboot")}))] == 1
        assert m[("rankwatch_incidents", frozenset({("node", "n0"), ("kind", "gpu_fault")}))] == 2

        # Nothing of this reaches training: it goes on stepping.
        at_fault = min(r["step"] for r in agent.status()["ranks"])
        wait_for(lambda: min(r["step"] for r in agent.status()["ranks"]) >= at_fault + 20, 20,
                 what="steps after the fault")
        assert job.poll() is None, (tmp_path / "job.log").read_text()[-2000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
        agent.stop()
