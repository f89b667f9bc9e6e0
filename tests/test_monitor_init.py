"""``rankwatch.hooks.init()`` in a real one-process gloo group, against a real agent.

It returns a Monitor that reaches the agent; a NullMonitor that sends nothing when
``RANKWATCH_DISABLE=1``; and a NullMonitor, with training going on, when rankwatch
cannot start.  Each case runs in a process of its own (init() times torch.distributed's
collectives for the rest of the process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import wait_for

# A user's own loop: one all-reduce per step, until the test says stop (at least 3 steps).
SCRIPT = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
import rankwatch.hooks as rw

store, address, stop = sys.argv[1:]
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
mon = rw.init(address=address)
print(json.dumps({"monitor": type(mon).__name__, "pid": os.getpid()}), flush=True)
t, n = torch.ones(4), 0
while n < 3 or not os.path.exists(stop) and n < 6000:
    n += 1
    with mon.step(n, tokens=8):
        dist.all_reduce(t)
        time.sleep(0.01)  # the step's work
        mon.mark("forward")
mon.close()
dist.destroy_process_group()
print(json.dumps({"steps": n, "sum": t.sum().item()}), flush=True)
"""


class Loop:
    """The loop in a process of its own; ``first`` is what init() returned."""

    def __init__(self, tmp_path, address: str, disable: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RANKWATCH_DISABLE"}
        if disable is not None:
            env["RANKWATCH_DISABLE"] = disable
        n = len(list(tmp_path.glob("stop-*")))
        self.stop_file, self.err = tmp_path / f"stop-{n}", tmp_path / f"loop-{n}.log"
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SCRIPT, str(tmp_path / f"store-{n}"), address, str(self.stop_file)],
                env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        self.first = json.loads(self.proc.stdout.readline() or "{}")
        assert self.first, self.err.read_text()[-3000:]

    def finish(self) -> dict:
        """Stop the loop; its last line (steps trained, the all-reduced tensor's sum)."""
        self.stop_file.touch()
        out, _ = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, self.err.read_text()[-3000:]
        return json.loads(out.splitlines()[-1])


def test_init_reports_to_the_agent(agent_proc, tmp_path):
    loop = Loop(tmp_path, str(agent_proc.addr))
    try:
        assert loop.first["monitor"] == "Monitor"
        (rank,) = wait_for(lambda: [r for r in agent_proc.status()["ranks"]
                                    if r["step"] >= 3 and r["collectives"] >= 3], 30,
                           what="the loop's steps and all-reduces at the agent")
        assert rank["pid"] == loop.first["pid"] and rank["backend"] == "gloo"
    finally:
        out = loop.finish()
    assert out["sum"] == 4.0 and out["steps"] >= 3


def test_disabled_gives_a_null_monitor_that_sends_nothing(agent_proc, tmp_path):
    loop = Loop(tmp_path, str(agent_proc.addr), disable="1")
    assert loop.first["monitor"] == "NullMonitor"
    out = loop.finish()
    assert out["sum"] == 4.0 and out["steps"] >= 3
    assert agent_proc.status()["ranks"] == [], "a disabled rank reached the agent"
    # "0" does not disable.
    loop = Loop(tmp_path, str(agent_proc.addr), disable="0")
    loop.finish()
    assert loop.first["monitor"] == "Monitor"


def test_init_falls_back_to_a_null_monitor_when_it_cannot_start(tmp_path):
    # An address that cannot be used: init() must not raise into the loop.
    loop = Loop(tmp_path, "host:notaport")
    out = loop.finish()
    err = loop.err.read_text()
    assert loop.first["monitor"] == "NullMonitor", err[-2000:]
    assert out["sum"] == 4.0 and out["steps"] >= 3
    assert "instrumentation failed to start; training without it" in err
    assert "neither a socket path" in err  # the cause is logged with it
