"""Recovery from a hung or a dead node: rankwatch's exclusion path against plain torchrun.

Three torchrun "nodes" on this machine (one rank each, ``--nnodes 2:3``), each
with its own agent (node 0's coordinates).  Once all train, node 2 fails:

* ``--fault hang``: its worker is SIGSTOPped;
* ``--fault kill``: its whole process tree (torchrun, worker) and its agent
  are SIGKILLed.

Measured from the fault:

* ``named``: the coordinator names node 2 (a ``hang`` incident, or node 2
  excluded as dead);
* ``back``: nodes 0 and 1 train again (a rank of theirs completes steps with a
  new pid), or never within ``--timeout``.

Launchers:

* ``rankwatch``: ``rankwatch run`` (the rankwatch rendezvous backend, c10d tuned:
  last_call_timeout=1, keep_alive 1 s x 2, ``--monitor-interval 0.1``,
  ``--max-restarts`` 0 for a hang, 1 for a kill);
* ``torchrun``: plain torchrun, c10d tuned the same way, with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it tuned restarts fail),
  ``--max-restarts 3``;
* ``torchrun-default``: plain torchrun with c10d's defaults (keep-alive 5 s x 3,
  30 s last call, the shared worker store), ``--max-restarts 3``.

The same agents watch every launcher.

    python benchmarks/restart.py --fault kill --runs 10 --launchers rankwatch
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from multinode import Cluster  # noqa: E402  (the tests' multi-node launcher)

_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"


def once(launcher: str, fault: str, timeout: float) -> dict:
    os.environ["RANKWATCH_BENCH_TAG"] = tag = uuid.uuid4().hex
    try:
        return _once(launcher, fault, timeout)
    finally:
        _kill_tagged(tag)


def _kill_tagged(tag: str) -> None:
    """torchrun's workers live in their own sessions: kill every process of this run."""
    import psutil

    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("RANKWATCH_BENCH_TAG") == tag:
                p.send_signal(signal.SIGCONT)
                p.kill()
        except (psutil.Error, OSError):
            pass


def _once(launcher: str, fault: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp, \
            Cluster(Path(tmp), 3, ("--min-nodes", "2")) as c:
        if launcher == "rankwatch":
            restarts = "0" if fault == "hang" else "1"
        else:
            restarts = "3"
        jobs = []
        for i in range(3):
            jobs.append(c.torchrun(
                i, "2:3", 1, "--steps", "100000", "--log-every", "0",
                "--checkpoint-dir", f"{tmp}/ck", "--checkpoint-interval", "20",
                launcher="rankwatch" if launcher == "rankwatch" else "torchrun",
                rdzv_conf="" if launcher == "torchrun-default" else _RDZV,
                env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if launcher == "torchrun" else None,
                launcher_args=("--max-restarts", restarts, "--monitor-interval", "0.1")))
        deadline = time.monotonic() + 180
        while True:
            ranks = c.coordinator.status()["ranks"]
            if len(ranks) == 3 and min(r["step"] for r in ranks) >= 25:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the job did not start")
            time.sleep(0.2)
        victim = next(r for r in ranks if r["node"] == "n2")
        old = {r["pid"] for r in ranks}
        if fault == "hang":
            os.kill(victim["pid"], signal.SIGSTOP)
        else:
            c.kill_node(2, jobs[2], [victim["pid"]])
        t0 = time.monotonic()
        named = back = None
        while time.monotonic() - t0 < timeout and back is None:
            s = c.coordinator.status()
            if named is None and (any(i["kind"] == "hang" and i["node"] == "n2" for i in s["incidents"])
                                  or "n2" in s["excluded_nodes"]):
                named = time.monotonic() - t0
            fresh = [r for r in s["ranks"] if r["node"] in ("n0", "n1") and r["connected"]
                     and r["pid"] not in old and r["step"] > 0]
            moving = {r["node"] for r in fresh}
            if moving == {"n0", "n1"}:
                back = time.monotonic() - t0
            time.sleep(0.2)
        try:
            os.kill(victim["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
        return {"named": named, "back": back}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--launchers", default="rankwatch,torchrun,torchrun-default")
    p.add_argument("--fault", choices=("hang", "kill"), default="hang")
    args = p.parse_args()
    for launcher in args.launchers.split(","):
        results = [once(launcher, args.fault, args.timeout) for _ in range(args.runs)]
        for r in results:
            print(f"{launcher}: named {r['named']}, back {r['back']}", flush=True)
        named = [r["named"] for r in results if r["named"] is not None]
        back = [r["back"] for r in results if r["back"] is not None]
        print(f"{launcher}: hang named in {len(named)}/{len(results)} "
              f"(median {statistics.median(named):.1f} s)" if named else f"{launcher}: never named",
              flush=True)
        print(f"{launcher}: training again in {len(back)}/{len(results)} within {args.timeout:.0f} s"
              + (f" (median {statistics.median(back):.1f} s)" if back else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
