"""The step commit: every rank applies an optimizer step, or none does.

A worker lost in the middle of a step (its node's other workers live on a moment) can
leave some survivors' shards a step ahead of the others', and then no replica is whole at
one step.  So before each optimizer step, every rank agrees in one all-reduce of one
element over the world (an optimizer step pre-hook): each rank adds 1 once its own
gradients for the step are whole, so a rank that reads the whole world's sum knows every
rank's gradients are whole.  When the commit does not complete on a rank whose peers
passed it, that rank finishes the step in the recovery (:meth:`StepCommit.finish_step`),
and the survivors agree on the step after it.  What one rank's read means is
:func:`outcome`.

**On NCCL** the all-reduce only enqueues work, and the optimizer step's kernels queue
behind it on the GPU.  Were a peer lost mid-step, the communicators aborted (by the
watchdog at the groups' timeout, or by the recovery) would end the all-reduce early, and
those queued kernels would then apply the step from partial gradients.  Two gates:

* **On the device**, for optimizers that skip a step on the GPU when told to (fused Adam,
  AdamW, SGD: those AMP's scaler drives through ``found_inf``): the commit hands the
  optimizer ``found_inf = (sum != world size)`` and the host runs on.  A step cut short is
  then skipped on the device, and a device counter of the steps that passed tells the
  recovery how many of the steps the host saw return were really applied
  (:meth:`StepCommit.unapplied`).
* **On the host**, for every other optimizer: the host reads the commit's result before
  the optimizer step is enqueued.  One GPU synchronisation a step (BENCHMARKS.md).

An abort also lets whatever was queued before the commit run on as if complete, so on
NCCL nothing proves this rank's gradients whole after a failure: a rank whose commit
failed never finishes the step itself, and takes the step from a replica that applied it
instead.

**Values carried in the commit** (:meth:`StepCommit.carry`): a loop that all-reduces a few
numbers every step anyway (its loss for the log, a token count) can hand them to the
commit, which sums them over the world in the same all-reduce.  The tier then adds no
collective to the step.
"""

from __future__ import annotations

import logging
from typing import Any

from rankwatch.hooks.recovery.decide import Job
from rankwatch.hooks.recovery.state import local_state

__all__ = ["FAILED_BEFORE", "FAILED_INSIDE", "PASSED", "CommitIncomplete", "StepCommit", "gates_on_device", "outcome"]

log = logging.getLogger(__name__)

PASSED = "passed"
FAILED_INSIDE = "failed inside"   # this rank's gradients are whole; the others may have passed
FAILED_BEFORE = "failed before"   # this rank's gradients are not whole


class CommitIncomplete(RuntimeError):
    """The step commit did not complete on this rank (a peer lost, or the communicators
    aborted): the step is not applied here.  The in-process tier's business."""


def outcome(total: float, world_size: int, reached: bool) -> str:
    """What this rank's read of the commit means.

    Args:
        total: the all-reduced flag, each rank's 1 summed (partial if the commit was cut short).
        world_size: the ranks that take part.
        reached: this rank's own part ran, its gradients for the step whole.
    """
    if total == world_size:
        return PASSED
    return FAILED_INSIDE if reached else FAILED_BEFORE


class StepCommit:
    """Args:
        backend: the process groups' backend (``nccl`` puts the flag on this rank's GPU,
            and gates the step on the device or the host: see the module).
        device_gate: gate optimizers that can skip a step on the device that way (default:
            on NCCL; on gloo the host learns the commit's outcome at no cost).
    """

    def __init__(self, backend: str, device_gate: bool | None = None) -> None:
        self._backend = backend
        self._device_gate = backend == "nccl" if device_gate is None else device_gate
        self._flag: Any = None
        self._passed: Any = None   # on the device: commits that passed (the device gate)
        self._returned = 0         # optimizer steps that returned to the host, gated on the device
        self._theirs: tuple[Any, Any] | None = None   # (optimizer, the found_inf it had) during a step
        self._on = True            # off while a rank finishes a step the others committed
        self._failed_inside = False  # the last failure came inside a commit: gradients whole
        self._attached = False     # an optimizer's pre-hook runs the commit
        self._carried: Any = None  # values to sum in the next commit (:meth:`carry`)

    def attach(self, optimizer: Any) -> None:
        """Agree before each of ``optimizer``'s steps (a new job's optimizer, after each build)."""
        register = getattr(optimizer, "register_step_pre_hook", None)
        if callable(register):
            register(self._agree)
            optimizer.register_step_post_hook(self._after)
            self._attached = True
        else:
            log.warning("rankwatch: %s has no step pre-hooks: a worker lost mid-step may leave the "
                        "survivors' shards steps apart (then torchrun's restart recovers)",
                        type(optimizer).__name__)

    def carry(self, values: Any) -> bool:
        """Sum ``values`` (a floating-point tensor on the commit's device: the CPU on gloo,
        this rank's GPU on NCCL) over the world in the next commit, in place, instead of in
        a collective of the caller's own.  They are summed in float32, and read summed once
        the optimizer step has returned; if it raised, they are not.  False: no commit will
        run (none attached), and the caller sums them itself."""
        if not self._attached:
            return False
        device = "cuda" if self._backend == "nccl" else "cpu"
        if getattr(getattr(values, "device", None), "type", None) != device:
            raise ValueError(f"carry takes a tensor on the step commit's device ({device} on {self._backend}), "
                             f"not {type(values).__name__} on {getattr(values, 'device', 'no device')}")
        self._carried = values
        return True

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

    def unapplied(self) -> int:
        """Of the optimizer steps that returned to the host since the last call, how many the
        device skipped because their commit did not complete (0 without the device gate).
        Waits for the device: call it in a recovery, after the communicators are aborted."""
        import torch

        if self._passed is None:
            return 0
        if self._passed.is_cuda:
            torch.cuda.synchronize()
        passed = int(self._passed.item())
        self._passed.zero_()
        lag, self._returned = max(0, self._returned - passed), 0
        return lag

    def _agree(self, optimizer: Any, *_: Any) -> None:
        """Every rank reached the optimizer step (the gradients are whole), or this raises
        on every survivor (or, with the device gate, the step is skipped on the device),
        before any applies it."""
        import torch
        import torch.distributed as dist

        carried, self._carried = self._carried, None
        if not self._on:
            return
        if self._flag is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self._backend == "nccl" else "cpu"
            self._flag = torch.zeros(1, device=device)
        # The flag first, then the carried values: one all-reduce for both.
        sent = self._flag if carried is None else torch.cat([self._flag, carried.detach().reshape(-1).float()])
        sent[0] = 1.0
        if self._device_gate and gates_on_device(optimizer):
            self._gate_on_device(optimizer, sent)
        else:
            self._agree_on_host(sent)
        if carried is not None:
            carried.copy_(sent[1:].view(carried.shape))

    def _agree_on_host(self, sent: Any) -> None:
        """Raise unless the commit's all-reduce of ``sent`` (its flag first) completed."""
        import torch.distributed as dist

        # Gloo runs the step on this thread: being here proves this rank's gradients whole.
        # On NCCL an abort lets what was queued before the commit run on as if complete.
        reached = self._backend != "nccl"
        try:
            dist.all_reduce(sent)
            total = float(sent[0].item())   # on NCCL, the host waits for the commit here
        except BaseException:
            self._failed_inside = reached   # then it finishes the step if the others passed
            raise
        world = dist.get_world_size()
        verdict = outcome(total, world, reached)
        if verdict != PASSED:
            self._failed_inside = verdict == FAILED_INSIDE
            raise CommitIncomplete(f"the step commit did not complete on this rank ({total:g} of {world} ranks)")

    def _gate_on_device(self, optimizer: Any, sent: Any) -> None:
        """Hand the optimizer ``found_inf``: it skips the step on the device unless the
        commit's all-reduce of ``sent`` (its flag first) completed (with a scaler's own
        ``found_inf``, either one skips it)."""
        import torch
        import torch.distributed as dist

        if self._passed is None:
            self._passed = torch.zeros(1, dtype=torch.int64, device=self._flag.device)
        dist.all_reduce(sent)   # raises only if the groups are already gone
        passed = sent[:1] == dist.get_world_size()
        self._passed += passed
        skip = (~passed).to(torch.float32).reshape(())   # a 0-dim tensor, as a scaler hands it
        theirs = getattr(optimizer, "found_inf", None)
        self._theirs = (optimizer, theirs)
        optimizer.found_inf = skip if theirs is None else torch.maximum(theirs.to(torch.float32), skip)

    def _after(self, optimizer: Any, *_: Any) -> None:
        """Give the optimizer back the ``found_inf`` it had (a scaler's, or none)."""
        if self._theirs is None or self._theirs[0] is not optimizer:
            return
        theirs, self._theirs = self._theirs[1], None
        if theirs is None:
            del optimizer.found_inf
        else:
            optimizer.found_inf = theirs
        self._returned += 1


def gates_on_device(optimizer: Any) -> bool:
    """The optimizer skips a step on the device given ``found_inf`` (fused Adam, AdamW, SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and \
        bool(getattr(optimizer, "defaults", {}).get("fused"))
