"""The peer benchmark's job under torchft (Manager + lighthouse), as its README shows it.

Each member is a replica group of one process, started by its own single-node torchrun;
``cli/run.py`` starts the lighthouse.  torchft's DistributedDataParallel and Optimizer wrappers
do the gradient all-reduce and the commit.  ``PEERS_TUNED=1`` sets 1 s timeouts on the
group and the manager, 3 s on the quorum (the lighthouse gets a 1 s heartbeat timeout).
``PEERS_FT=0`` runs the same model and data with torch's own DDP on one gloo group of a
three-node torchrun (the steady-state control).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from _job import STEPS, StepLog, loss_of, make_model, make_optimizer


def with_torchft(log: StepLog, member: int) -> None:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    model = make_model()
    inner = make_optimizer(model)
    tuned = os.environ.get("PEERS_TUNED") == "1"
    one = timedelta(seconds=1)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=one) if tuned else ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"member{member}",
        # A quorum timeout of 1 s, no longer than the heartbeat timeout, fails the first
        # quorum after a loss (the lighthouse waits out the dead replica's heartbeat first):
        # TimeoutError, and the worker exits.  Tuned therefore waits up to 3 s for a quorum.
        **({"timeout": one, "quorum_timeout": timedelta(seconds=float(os.environ.get("PEERS_QUORUM_S", "3")))}
           if tuned else {}),
    )
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    step = 0
    while manager.current_step() < STEPS:
        opt.zero_grad()
        loss_of(ddp, step, member).backward()
        before = manager.current_step()
        opt.step()
        step += 1
        if manager.current_step() > before:  # committed: every participant applied it
            log.step(manager.num_participants(), model, manager.current_step())
    manager.shutdown()


def without(log: StepLog, member: int) -> None:
    dist.init_process_group("gloo")
    model = make_model()
    ddp = TorchDDP(model)
    opt = make_optimizer(model)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(ddp, step, member).backward()
        opt.step()
        log.step(dist.get_world_size(), model, step + 1)
    dist.destroy_process_group()


def main() -> None:
    log = StepLog()
    member = int(os.environ["PEERS_MEMBER"])
    if os.environ.get("PEERS_FT", "1") == "1":
        with_torchft(log, member)
    else:
        without(log, member)


if __name__ == "__main__":
    main()
