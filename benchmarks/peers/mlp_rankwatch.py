"""The peer benchmark's job under rankwatch's in-process recovery tier (a user loop).

Launched by ``cli/run.py`` through ``rankwatch run`` (one torchrun per member).  Plain data
parallelism: a replicated model and one flat gradient all-reduce per step
(``replica_size=1``: each rank is a whole replica).  ``PEERS_FT=0`` runs the same loop
without the tier (the steady-state control).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from _job import STEPS, StepLog, average_gradients, loss_of, make_model, make_optimizer
from rankwatch.hooks.recovery.inprocess import InProcessRecovery, Job, Membership


def make(membership: Membership | None) -> Job:
    # After a recovery the tier copies the weights and the AdamW state back by name.
    model = make_model()
    return Job(model=model, optimizer=make_optimizer(model), replica_size=1)


def main() -> None:
    log = StepLog()
    member = int(os.environ["PEERS_MEMBER"])  # data shard: the member's own, across recoveries
    tier = None
    if os.environ.get("PEERS_FT", "1") == "1":
        tier = InProcessRecovery(make, backend="gloo")
        job = tier.start()
    else:
        dist.init_process_group("gloo")
        job = make(None)
    done = 0
    while done < STEPS:
        try:
            job.optimizer.zero_grad()
            loss_of(job.model, done, member).backward()
            average_gradients(job.model)
            job.optimizer.step()
            done += 1
            log.step(dist.get_world_size(), job.model, done)
            if tier is not None:
                tier.stepped(done)
        except Exception as exc:  # noqa: BLE001 - the tier re-raises what it does not handle
            if tier is None:
                raise
            job, done = tier.recover(exc, job, completed=done)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
