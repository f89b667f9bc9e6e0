"""The step commit: every rank applies an optimizer step, or none does.

A worker lost in the middle of a step (its node's other workers live on a moment) can
leave some survivors' shards a step ahead of the others', and then no replica is whole at
one step.  So before each optimizer step, every rank agrees in one all-reduce of one
element over the world (an optimizer step pre-hook): a rank that passes it knows every
rank's gradients for the step are whole.  When the all-reduce fails on a rank whose peers
passed it, that rank finishes the step in the recovery (:meth:`StepCommit.finish_step`),
and the survivors agree on the step after it.
"""

from __future__ import annotations

import logging
from typing import Any

from rankwatch.hooks.recovery_decide import Job
from rankwatch.hooks.recovery_state import local_state

__all__ = ["StepCommit"]

log = logging.getLogger(__name__)


class StepCommit:
    """Args:
        backend: the process groups' backend (``nccl`` puts the flag on this rank's GPU).
    """

    def __init__(self, backend: str) -> None:
        self._backend = backend
        self._flag: Any = None
        self._on = True            # off while a rank finishes a step the others committed
        self._failed_inside = False  # the last failure came inside a commit: gradients whole

    def attach(self, optimizer: Any) -> None:
        """Agree before each of ``optimizer``'s steps (a new job's optimizer, after each build)."""
        register = getattr(optimizer, "register_step_pre_hook", None)
        if callable(register):
            register(self._agree)
        else:
            log.warning("rankwatch: %s has no step pre-hooks: a worker lost mid-step may leave the "
                        "survivors' shards steps apart (then torchrun's restart recovers)",
                        type(optimizer).__name__)

    def failed_inside(self) -> bool:
        """The failure being recovered came inside a commit (and forget it for the next one):
        this rank's gradients for the step are whole, so it may finish the step."""
        was, self._failed_inside = self._failed_inside, False
        return was

    def finish_step(self, job: Job, completed: int) -> dict[str, Any]:
        """Apply step ``completed + 1``, whose commit the others passed (this rank's gradients
        for it are whole), and return the shards after it."""
        log.warning("rankwatch: the others committed step %d; this rank applies it too", completed + 1)
        self._on = False
        try:
            job.optimizer.step()
        finally:
            self._on = True
        return local_state(job)

    def _agree(self, *_: Any) -> None:
        """Every rank reached the optimizer step (the gradients are whole), or this raises
        on every survivor, before any applies it."""
        import torch
        import torch.distributed as dist

        if not self._on:
            return
        if self._flag is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self._backend == "nccl" else "cpu"
            self._flag = torch.zeros(1, device=device)
        try:
            dist.all_reduce(self._flag)
        except BaseException:
            self._failed_inside = True   # if another rank passed it, this one finishes the step
            raise
