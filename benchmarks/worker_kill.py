"""One worker of a node is killed (an out-of-memory kill): in process against a torchrun restart.

Three torchrun "nodes" on this machine, two ranks each (``--nnodes 2:3``, the harness
with ``--replicate 3``: a replica per node, sharded over its two ranks), each with its
own agent (node 0's coordinates).  Once all train, one worker of node 1 is SIGKILLed;
node 1's torchrun and agent live on.

* ``inprocess``: the harness with ``--in-process-recovery``.  Node 1's torchrun stops its
  other worker to restart both; nodes 0 and 2 leave node 1 out in process and train on
  at world 4; the two workers node 1 starts again join them in process, at a step
  boundary, and the world is 6 again.
* ``inprocess-loop`` (``-foreach``, ``-fused``): ``inprocess`` with the harness's
  ``--adamw`` set so (its default is ``fused``).
* ``restart``: the same job without it.  Node 1's restart enters the rendezvous, and
  every node's torchrun restarts its workers, which load the newest checkpoint (every
  20 steps).

Measured from the kill, on this machine's clock:

* ``others``: nodes 0 and 2 train again (in process: the first recovery's first step,
  from the workers' clocks; restarted: their new pids step);
* ``world6``: all six ranks train together again;
* ``kept``: nodes 0 and 2 kept their worker processes.

    python benchmarks/worker_kill.py --runs 5 --modes inprocess,restart
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from join import _ranks, _recovery, _wait, alternate  # noqa: E402
from multinode import Cluster  # noqa: E402  (the tests' multi-node launcher)


def _once(tmp: Path, mode: str, timeout: float) -> dict:
    flags = ("--steps", "100000", "--log-every", "0", "--replicate", "3",
             "--checkpoint-dir", f"{tmp}/ck", "--checkpoint-interval", "20",
             *(("--in-process-recovery",) if mode.startswith("inprocess") else ()),
             *(("--adamw", mode.split("-", 1)[1]) if "-" in mode else ()))
    with Cluster(tmp, 3) as c:
        for i in range(3):
            c.torchrun(i, "2:3", 2, *flags, launcher="rankwatch")
        ranks = _wait("3 nodes training", lambda: (rs := _ranks(c)) and len(rs) == 6
                      and min(r["step"] for r in rs) >= 25 and rs, 180)
        victim = next(r for r in ranks if r["node"] == "n1")
        old = {r["pid"] for r in ranks}
        others_old = {r["pid"] for r in ranks if r["node"] != "n1"}
        killed = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        if mode.startswith("inprocess"):
            lost = _wait("the others training again", lambda: _recovery(c, 4, killed), timeout)
            others = lost["started_at"] + lost["phases"]["first_step"] - killed
            print(f"  caught {lost['started_at'] - killed:.3f} s after the kill; then "
                  + ", ".join(f"{k} {v:.3f}" for k, v in lost["phases"].items()), flush=True)
            back = _wait("world 6 training", lambda: _recovery(c, 6, killed), timeout)
            world6 = back["started_at"] + back["phases"]["first_step"] - killed
        else:
            _wait("the others training again", lambda: len([r for r in _ranks(c) if r["node"] != "n1"
                                                            and r["pid"] not in old and r["step"] > 0]) == 4,
                  timeout)
            others = time.time() - killed
            _wait("world 6 training", lambda: len([r for r in _ranks(c) if r["pid"] not in old
                                                   and r["step"] > 0]) == 6, timeout)
            world6 = time.time() - killed
        kept = others_old <= {r["pid"] for r in _ranks(c)}
        return {"others": others, "world6": world6, "kept": kept}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--modes", default="inprocess,restart")
    args = p.parse_args()
    results = alternate(args.modes.split(","), args.runs, _once, args.timeout)
    for mode, got in results.items():
        o, w = [r["others"] for r in got], [r["world6"] for r in got]
        print(f"{mode}: the other nodes train again {statistics.median(o):.2f} s after the kill "
              f"({min(o):.2f}-{max(o):.2f}); world 6 again {statistics.median(w):.2f} s ({min(w):.2f}-{max(w):.2f}); "
              f"the other nodes kept their processes in {sum(r['kept'] for r in got)}/{len(got)} (medians of {len(got)})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
