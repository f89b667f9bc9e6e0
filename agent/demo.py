"""``rankwatch demo``: a local CPU job under rankwatch, watched live.

A 4-rank (dp2 x tp2) FSDP2+TP job on gloo reports to an agent at the default
address, so ``rankwatch status --json`` in another terminal finds it, and
``/metrics`` stays up while it runs.  The job gets a straggler and a hang
injected; it ends with the final view and a timeline of the incidents.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live

from rankwatch.agent.address import AGENT_ENV, NODE_ID_ENV, resolve
from rankwatch.agent.client import AgentUnreachable, fetch_status, reachable
from rankwatch.agent.gpu import DEMO_SCRIPT, GpuConfig, GpuEvent, load_script
from rankwatch.agent.gpu.view import gpu_timeline
from rankwatch.agent.run import DEFAULT_METRICS_PORT, _port_free
from rankwatch.agent.server import Agent, AgentConfig
from rankwatch.agent.view import rank_table, timeline

__all__ = ["run_demo"]

_NODE = "demo-node0"


def run_demo(steps: int = 120, live: bool = True, out: Console | None = None) -> int:
    # Wide enough for the rank table even when output is not a terminal.
    console = out or Console(width=None if sys.stdout.isatty() else 140)
    addr = resolve(None)
    agent = None
    gpu_events: list[GpuEvent] = []
    if reachable(addr):
        console.print(f"[yellow]an agent already answers at {addr}; the demo reports to it[/]")
    else:
        port = DEFAULT_METRICS_PORT if _port_free(DEFAULT_METRICS_PORT) else 0
        # Scripted GPUs: GPU 2 (rank 2's) throttles on heat, GPU 1 gathers corrected ECC errors.
        agent = Agent(AgentConfig(node_id=_NODE, listen=[addr], metrics_port=port,
                                  gpu=GpuConfig(source="script", script=load_script(DEMO_SCRIPT))))
        agent.gpu_listeners.append(gpu_events.append)
        agent.start()
        console.print(f"agent [bold]{_NODE}[/] at {addr}; metrics at "
                      f"http://127.0.0.1:{agent.metrics_port}/metrics")
    workdir = Path(tempfile.mkdtemp(prefix="rankwatch-demo-"))
    env = {**os.environ, AGENT_ENV: str(addr), NODE_ID_ENV: _NODE,
           "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE", "2000"),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "rankwatch.hooks.train", "--steps", str(steps), "--dp", "2", "--tp", "2",
           "--checkpoint-dir", str(workdir / "checkpoints"), "--checkpoint-interval", "50",
           # Injected faults: rank 2 computes 50% slower from step 20 (a straggler),
           # and rank 3 is stuck in Python inside forward for 8 s at step 90 (a hang).
           "--fault", "slow_compute:2:20:0.5", "--fault", "sleep_forward:3:90:8"]
    console.print(f"job: 4 ranks (dp2 x tp2, gloo), {steps} steps; logs in {workdir}/job.log")
    console.print("faults: rank 2 slowed 50% from step 20; rank 3 stuck 8 s in forward at step 90")
    if agent is not None:
        console.print("GPUs (scripted): GPU 2 throttles on heat from 12 s; GPU 1 gathers corrected "
                      "ECC errors from 30 s")
    console.print("try [bold]rankwatch status[/] in another terminal")
    started = time.time()
    with open(workdir / "job.log", "w") as log:
        job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            status = _watch(job, addr, console, live)
        finally:
            if job.poll() is None:
                job.terminate()
                job.wait()
    try:
        status = fetch_status(addr)
    except AgentUnreachable:
        pass
    if status is not None:
        console.print(rank_table(status, title="final view"))
        console.print(timeline(status, started))
    if gpu_events:
        console.print(gpu_timeline(gpu_events, started))
    rc = job.returncode
    console.print(f"job exited with {rc} after {time.time() - started:.0f} s")
    if agent is not None:
        agent.stop(timedelta(seconds=1))
    return 0 if rc == 0 else 1


def _watch(job: subprocess.Popen, addr, console: Console, live: bool) -> dict | None:
    status = None
    last_print = 0.0
    with Live(console=console, refresh_per_second=4, transient=False) if live else _NoLive() as view:
        while job.poll() is None:
            time.sleep(0.5)
            try:
                status = fetch_status(addr, timedelta(seconds=1))
            except AgentUnreachable:
                continue
            if live:
                view.update(Group(rank_table(status)))
            elif time.monotonic() - last_print > 5:
                last_print = time.monotonic()
                steps = [r["step"] for r in status["ranks"]]
                console.print(f"ranks {len(steps)} steps {min(steps, default=-1)}..{max(steps, default=-1)}"
                              f" tokens/s {status['tokens_per_second']:.0f}")
    return status


class _NoLive:
    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
