"""A lost node with the harness's default flags: the survivors regain the step they had reached.

Three torchrun "nodes" on this machine through ``rankwatch run`` (one rank each, ``--nnodes
2:3``), each with its own agent; the harness runs plain FSDP2 over the three ranks with no
recovery flag at all: in-process recovery and peer snapshots are its defaults.  Once every
rank passed ``--kill-after`` steps, node 2's whole tree (torchrun, worker, agent) is
SIGKILLed.  Measured from the kill, by the workers' own clocks:

* ``first``: the survivors' first step after the in-process recovery (the recovery
  incident's ``first_step``);
* ``regained``: the survivors completed again the step the failure cut short (their
  ``regained step`` log line; the later of the two survivors);
* ``recomputed``: the steps between the snapshot the survivors went on from and the step
  the failure cut short (the incident's ``recomputed_steps``), and the ``K`` they had chosen.

    python benchmarks/default_recovery.py --runs 10

``RANKWATCH_BENCH_KEEP_LOGS=DIR`` keeps the logs of a run that did not recover in process.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from multinode import Cluster  # noqa: E402  (the tests' multi-node launcher)

from rankwatch.status import AgentUnreachable  # noqa: E402

_REGAINED = re.compile(r"regained step (\d+) [\d.]+ s after the failure \(at ([\d.]+)\)")
_PLAN = re.compile(r"rankwatch: peer snapshots every (\d+) steps")


def once(tmp: Path, kill_after: int, timeout: float) -> dict:
    """One job, one kill; the figures of :mod:`this benchmark <default_recovery>`, None where missed."""
    with Cluster(tmp, 3, ("--min-nodes", "2")) as c:
        jobs = [c.torchrun(i, "2:3", 1, "--steps", "100000", "--log-every", "0", launcher="rankwatch")
                for i in range(3)]
        ranks = _wait_training(c, kill_after)
        victim = next(r for r in ranks if r["node"] == "n2")
        c.kill_node(2, jobs[2], [victim["pid"]])
        killed_at = time.time()
        old = {r["pid"] for r in ranks if r["node"] != "n2"}
        deadline = time.monotonic() + timeout
        rec = None
        while time.monotonic() < deadline and rec is None:
            rec = _incident(c)
            time.sleep(0.2)
        regained = None
        while rec is not None and time.monotonic() < deadline and regained is None:
            regained = _regained(tmp, 2)
            time.sleep(0.2)
        same = old == {r["pid"] for r in _survivors(c)}
        plans = [int(k) for i in range(2) for k in _PLAN.findall((tmp / f"job-n{i}.log").read_text())]
        if (keep := os.environ.get("RANKWATCH_BENCH_KEEP_LOGS")) and (rec is None or regained is None):
            dest = Path(keep) / uuid.uuid4().hex[:8]
            shutil.copytree(tmp, dest, ignore=shutil.ignore_patterns("*.sock"))
            print(f"no in-process recovery: logs in {dest}", flush=True)
    if rec is None:
        return {"first": None, "regained": None, "recomputed": None, "same_processes": same, "every": plans}
    return {"first": rec["started_at"] + rec["phases"]["first_step"] - killed_at,
            "regained": regained - killed_at if regained else None,
            "recomputed": rec.get("recomputed_steps"), "same_processes": same, "every": plans}


def _wait_training(c: Cluster, steps: int) -> list[dict]:
    deadline = time.monotonic() + 240
    while True:
        ranks = [r for a in c.agents for r in a.status()["ranks"] if r["node"] == a.node]
        if len(ranks) == 3 and min(r["step"] for r in ranks) >= steps:
            return ranks
        if time.monotonic() > deadline:
            c.print_logs()
            raise RuntimeError("the job did not reach the kill step")
        time.sleep(0.05)


def _incident(c: Cluster) -> dict | None:
    """The coordinator's in-process recovery incident, once it has its first step."""
    try:
        s = c.agents[0].status()
    except AgentUnreachable:
        return None
    for i in s["incidents"]:
        d = i["detail"]
        if i["kind"] == "restart" and d.get("tier") == "in_process" and d.get("ok") and \
                "first_step" in d.get("phases", {}):
            return d
    return None


def _regained(tmp: Path, nodes: int) -> float | None:
    """When the last of the survivors regained the step the failure cut short (Unix time)."""
    times = []
    for i in range(nodes):
        found = _REGAINED.findall((tmp / f"job-n{i}.log").read_text(errors="replace"))
        if not found:
            return None
        times.append(float(found[-1][1]))
    return max(times)


def _survivors(c: Cluster) -> list[dict]:
    out = []
    for a in c.agents[:2]:
        try:
            out += [r for r in a.status()["ranks"] if r["node"] == a.node and r["connected"]]
        except AgentUnreachable:
            pass
    return out


def kill_tagged(tag: str) -> None:
    """torchrun's workers live in their own sessions: kill every process of this run."""
    import psutil

    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("RANKWATCH_BENCH_TAG") == tag:
                p.kill()
        except (psutil.Error, OSError):
            pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--kill-after", type=int, default=50, help="kill once every rank passed this step")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    results = []
    for n in range(args.runs):
        os.environ["RANKWATCH_BENCH_TAG"] = tag = uuid.uuid4().hex
        try:
            with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
                r = once(Path(tmp), args.kill_after, args.timeout)
        finally:
            kill_tagged(tag)
        results.append(r)
        print(f"run {n + 1}: first step {_s(r['first'])}, regained {_s(r['regained'])}, recomputed "
              f"{r['recomputed']}, K {sorted(set(r['every']))}, same processes {r['same_processes']}", flush=True)
    _summary(results)
    return 0


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def _summary(results: list[dict]) -> None:
    def med(key: str) -> str:
        vals = [r[key] for r in results if r[key] is not None]
        return f"median {statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f}), {len(vals)} of " \
               f"{len(results)}" if vals else f"0 of {len(results)}"

    within = sum(1 for r in results if r["regained"] is not None and r["regained"] <= 3.0 and r["same_processes"])
    print(f"first step after the kill: {med('first')}")
    print(f"kill step regained: {med('regained')}; within 3 s in the same processes: {within} of {len(results)}")
    print(f"steps recomputed: {med('recomputed')}")


if __name__ == "__main__":
    sys.exit(main())
