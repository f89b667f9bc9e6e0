"""A spare joins a job that lost a node: in process against a torchrun restart.

Three torchrun "nodes" on this machine (one rank each, ``--nnodes 2:3``, the harness
with ``--replicate 3``), each with its own agent (node 0's coordinates).  Once all
train, node 2's whole process tree and agent are SIGKILLed; once the survivors train
again without it, a spare (node 3) starts ``rankwatch run`` with the same command.

* ``inprocess``: the harness with ``--in-process-recovery``.  The survivors regroup
  in their own processes; the spare's rendezvous handler sends its worker to join
  them, and they admit it at a step boundary, its state sent by a live replica.
* ``restart``: the same job without it.  The survivors come back through a torchrun
  restart, and the spare joins through another one (every worker restarts and
  loads the newest checkpoint, every 20 steps).

Measured from the spare's start (its ``rankwatch run``), on this machine's clock:

* ``world3``: all three ranks train together again (in process: the admitting
  recovery's first step, from the workers' clocks; restarted: three new pids step);
* ``pause``: how long the survivors stopped training to admit the spare: in process,
  from the recovery's own phases (left the step to the first step at world 3);
  restarted, from the last step the agents saw of their old processes (0.1 s polls).

    python benchmarks/join.py --runs 5 --modes inprocess,restart
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from multinode import Cluster  # noqa: E402  (the tests' multi-node launcher)
from restart import _kill_tagged  # noqa: E402

from rankwatch.status import AgentUnreachable  # noqa: E402


def tagged(body: Callable[[Path, str, float], dict], mode: str, timeout: float) -> dict:
    """``body(tmp, mode, timeout)`` in a fresh directory; every process it left is killed."""
    os.environ["RANKWATCH_BENCH_TAG"] = tag = uuid.uuid4().hex
    try:
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
            return body(Path(tmp), mode, timeout)
    finally:
        _kill_tagged(tag)


def alternate(modes: list[str], runs: int, body: Callable[[Path, str, float], dict],
              timeout: float) -> dict[str, list[dict]]:
    """``runs`` rounds of every mode in turn, so all see the same machine; each result printed."""
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(runs):
        for mode, got in results.items():
            r = tagged(body, mode, timeout)
            got.append(r)
            print(f"{mode}: {r}", flush=True)
    return results


def _ranks(c: Cluster) -> list[dict]:
    """Every connected rank of the live agents, as each agent sees its own."""
    out = []
    for a in c.agents:
        try:
            out += [r for r in a.status()["ranks"] if r["node"] == a.node and r["connected"]]
        except AgentUnreachable:
            pass
    return out


def _wait(what: str, cond, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def _once(tmp: Path, mode: str, timeout: float) -> dict:
    flags = ("--steps", "100000", "--log-every", "0", "--replicate", "3",
             "--checkpoint-dir", f"{tmp}/ck", "--checkpoint-interval", "20",
             *(("--in-process-recovery",) if mode == "inprocess" else ()))
    with Cluster(tmp, 4) as c:
        jobs = [c.torchrun(i, "2:3", 1, *flags, launcher="rankwatch") for i in range(3)]
        ranks = _wait("3 nodes training", lambda: (rs := _ranks(c)) and len(rs) == 3
                      and min(r["step"] for r in rs) >= 25 and rs, 180)
        c.kill_node(2, jobs[2], [r["pid"] for r in ranks if r["node"] == "n2"])
        old = {r["pid"] for r in ranks}
        # The survivors train again without n2: in process (an ok recovery incident), or
        # restarted (two new pids stepping).
        _wait("the survivors training again", lambda: _recovery(c, 2, 0.0) if mode == "inprocess" else
              len([r for r in _ranks(c) if r["pid"] not in old and r["step"] > 0]) == 2, timeout)
        kept = {r["pid"] for r in _ranks(c)}
        started_wall = time.time()
        c.torchrun(3, "2:3", 1, *flags, launcher="rankwatch")
        pause = None
        if mode == "inprocess":
            d = _wait("the spare admitted in process", lambda: _recovery(c, 3, started_wall), timeout)
            back, pause = d["started_at"] + d["phases"]["first_step"] - started_wall, d["phases"]["first_step"]
        else:
            last = {"step": -1, "at": started_wall}  # the survivors' old processes' last step

            def world3() -> bool:
                rs = _ranks(c)
                step = max((r["step"] for r in rs if r["pid"] in kept), default=-1)
                if step > last["step"]:
                    last.update(step=step, at=time.time())
                return len([r for r in rs if r["pid"] not in kept and r["step"] > 0]) == 3

            _wait("world 3 training", world3, timeout)
            back = time.time() - started_wall
            pause = time.time() - last["at"]
        survivors_kept = {r["pid"] for r in _ranks(c) if r["node"] != "n3"} <= old
        return {"world3": back, "pause": pause, "survivors_kept_processes": survivors_kept}


def _recovery(c: Cluster, new_world: int, since: float) -> dict | None:
    """The coordinator's in-process recovery incident to ``new_world`` ranks caught after
    ``since`` (wall time), once its first step is known."""
    try:
        incidents = c.coordinator.status()["incidents"]
    except AgentUnreachable:
        return None
    for i in incidents:
        d = i["detail"]
        if i["kind"] == "restart" and d.get("tier") == "in_process" and d.get("ok") and \
                d.get("new_world_size") == new_world and d.get("started_at", 0) >= since and \
                "first_step" in d.get("phases", {}):
            return d
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--modes", default="inprocess,restart")
    args = p.parse_args()
    results = alternate(args.modes.split(","), args.runs, _once, args.timeout)
    for mode, got in results.items():
        w = [r["world3"] for r in got]
        pauses = [r["pause"] for r in got if r["pause"] is not None]
        print(f"{mode}: world 3 training again {statistics.median(w):.2f} s after the spare started "
              f"(median of {len(w)}; {min(w):.2f}-{max(w):.2f})"
              + (f"; survivors paused {statistics.median(pauses):.2f} s (median of {len(pauses)})"
                 if pauses else "")
              + f"; survivors kept their processes in {sum(r['survivors_kept_processes'] for r in got)}/{len(got)}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
