"""One side of a job's end with a worker still asking to join (tests/test_recovery_finish.py).

    python recovery_finish.py survivor STEPS   # rank 0 of a 1-worker world: waits for the
                                               # join request, then finishes at STEPS
    python recovery_finish.py joiner           # a joining worker: start(), then train

The recovery store and the round come from the environment, as under ``rankwatch run``.
"""

from __future__ import annotations

import atexit
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from rankwatch.hooks.recovery import InProcessRecovery, Job, Membership
from rankwatch.hooks.recovery.store import connect


def make(m: Membership) -> Job:
    model = torch.nn.Linear(4, 4)
    return Job(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), replica_size=1)


def main() -> int:
    role = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    tier = InProcessRecovery(make, backend="gloo", total_steps=steps or None, join_timeout=120)
    if role == "joiner":     # whether it paid torch's one-time imports before it asked
        atexit.register(lambda: print(f"joiner warmed: {'torch._dynamo' in sys.modules}", flush=True))
    if role == "survivor":   # a world of one, with a store of its own (no port to pick)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    job = tier.start()
    if role == "survivor":
        store, prefix = connect()
        print("survivor started", flush=True)
        store.wait([prefix + "inproc/join/1"], timedelta(seconds=120))   # a worker asks to join
        tier.finish(steps)
        print("survivor finished", flush=True)
        return 0
    print(f"joiner trains from step {tier.completed} on {type(job.model).__name__}", flush=True)
    return 3   # not expected: there is nothing left to train


if __name__ == "__main__":
    sys.exit(main())
