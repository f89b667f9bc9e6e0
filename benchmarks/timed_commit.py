"""The harness with the step commit timed: how long each optimizer step waits in it.

Run as a torchrun entry point in place of ``rankwatch.hooks.train`` (same arguments, plus
``--commit-out DIR``); writes ``DIR/commit<rank>.json``: the seconds each step spent in the
commit's all-reduce (:class:`rankwatch.hooks.recovery.commit.StepCommit`).  That wait is an
upper bound on what the commit costs a step: it also holds the ranks' skew, which the next
collective would otherwise absorb.  With ``--commit-aligned``, each commit comes after an
untimed barrier, so the time is the commit's own: the all-reduce with every rank there.
Used by ``inprocess_overhead.py --commit-runs``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rankwatch.hooks.recovery import commit
from rankwatch.hooks.train import main

_agree = commit.StepCommit._agree
waits: list[float] = []
aligned = False


def _timed(self, *args):   # bound when the tier attaches to the optimizer, after this patch
    if aligned:
        import torch.distributed as dist

        dist.barrier()
    t0 = time.perf_counter()
    try:
        return _agree(self, *args)
    finally:
        waits.append(time.perf_counter() - t0)


if __name__ == "__main__":
    argv = sys.argv[1:]
    i = argv.index("--commit-out")
    out = Path(argv[i + 1])
    del argv[i:i + 2]
    if "--commit-aligned" in argv:
        argv.remove("--commit-aligned")
        aligned = True
    commit.StepCommit._agree = _timed
    rc = main(argv)
    (out / f"commit{os.environ.get('RANK', '0')}.json").write_text(json.dumps(waits))
    sys.exit(rc)
