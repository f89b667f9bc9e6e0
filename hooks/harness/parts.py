"""The harness's parts that are not its sequence: one step's work, what follows a step
(the loss log, the injected faults, the saves), and what a run records for the tests.

:mod:`rankwatch.hooks.train` sequences them; a change of what a step does is made here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rankwatch.hooks.instrument import monitor as _monitor
from rankwatch.hooks.harness import moe as _moe
from rankwatch.hooks.harness.dcp import Checkpointer
from rankwatch.hooks.harness.parallel import loss_mesh
from rankwatch.hooks.recovery.inprocess import Job

log = logging.getLogger("rankwatch.train")


@dataclass
class RunRecord:
    """What this worker's run measured, written with ``--metrics-out`` (the tests read it)."""

    step_times: list[float] = field(default_factory=list)
    step_starts: list[float] = field(default_factory=list)   # perf_counter at each step's start
    losses: list[float] = field(default_factory=list)
    arms: list[bool] = field(default_factory=list)        # rankwatch on for the step (A/B blocks)
    dp_means: list[float] = field(default_factory=list)
    saves: list[dict] = field(default_factory=list)
    recoveries: list[dict] = field(default_factory=list)

    def write(self, out: Path, first_rank: int, start: int, model: torch.nn.Module) -> None:
        _write_metrics(out, first_rank, start, self.step_times, self.losses, self.arms, self.dp_means,
                       self.saves, self.recoveries, dist.get_rank(), dist.get_world_size(), _digest(model),
                       self.step_starts)


def train_step(m: Any, job: Job, batches: Any, accum: int, args: Any, vocab: int, dev: str, rank: int,
               step: int, record: RunRecord, carry: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step ``step + 1``'s data, forward, backward and optimizer step, marked for ``m``;
    returns the step's mean loss (detached) and, when ``carry`` (the in-process tier's)
    took it into the step commit, the loss summed over the world (else None)."""
    micro = [next(batches).to(dev) for _ in range(accum)]
    if slow := _slowdown_from(args.fault, "slow_data", rank, step + 1):
        time.sleep(slow * _usual(record.step_times))
    m.mark("data")
    _crash_faults(args.fault, rank, step + 1)
    if stuck := _faults_at(args.fault, "sleep_forward", rank, step + 1):
        _injected_sleep_in_forward(stuck)
    if slow := _slowdown_from(args.fault, "slow_compute", rank, step + 1):
        time.sleep(slow * _usual(record.step_times))
    # Gradient accumulation keeps the global batch when the job shrank; with more
    # than one micro-batch, "forward" is the first one's and "backward" the rest.
    pipe, cp = job.extra.get("pipe"), job.extra.get("cp")
    for i, batch in enumerate(micro):
        inputs, targets = _sequence_chunk(batch[:, :-1], cp), _sequence_chunk(batch[:, 1:], cp)
        if pipe is not None:  # the schedule runs this stage's forwards and backwards: all "forward"
            part = pipe.step(inputs, targets)
            loss = part if i == 0 else loss + part
            continue
        logits = job.model(inputs)
        part = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        loss = part.detach() if i == 0 else loss + part.detach()
        if i == 0:
            m.mark("forward")
        (part / accum if accum > 1 else part).backward()
        del logits, part
    loss = loss / accum
    m.mark("forward" if pipe is not None else "backward")
    if experts := _moe.take_expert_load(job.model):
        m.expert_load(experts)
    # The loss for the log rides in the tier's step commit (one all-reduce for both), except
    # at a step where a rank is to skip the loss's own all-reduce (the desync fault).
    summed = None
    if carry is not None and not _faults_at(args.fault, "skip_collective", -1, step + 1, any_rank=True):
        summed = loss.reshape(1).clone()
        if not carry(summed):
            summed = None
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    return loss, summed


def _sequence_chunk(tokens: torch.Tensor, cp: tuple[int, int] | None) -> torch.Tensor:
    """This context-parallel rank's chunk of the sequence (``cp``: its index and the chunks); all without."""
    if cp is None:
        return tokens
    index, chunks = cp
    size = tokens.shape[1] // chunks
    return tokens[:, index * size:(index + 1) * size]


def after_step(mon: Any, job: Job, ckpt: Checkpointer | None, ckpt_extra: dict, args: Any, dev: str,
               rank: int, step: int, record: RunRecord, summed: torch.Tensor | None = None) -> None:
    """After step ``step + 1``: the dp-mean loss for the log, the injected faults that come
    between steps, and the saves (on schedule, or asked for by the agent).  ``summed``: the
    loss summed over the world in the step commit (TP ranks hold the same loss, so the
    world's mean is the dp mean); None: one small all-reduce on the dp group here."""
    mesh, dims = job.extra["mesh"], job.extra["dims"]
    if summed is not None:
        dp_mean = summed.item() / dist.get_world_size()
    else:
        mean_loss = torch.tensor([record.losses[-1]], device=dev)
        if skip := _faults_at(args.fault, "skip_collective", rank, step + 1):
            time.sleep(skip)  # this rank never issues the all-reduce the others wait in
        else:
            dist.all_reduce(mean_loss, group=loss_mesh(mesh).get_group())
        dp_mean = mean_loss.item() / loss_mesh(mesh).size()
    record.dp_means.append(dp_mean)
    if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
        log.info("step %d loss %.4f (dp mean %.4f) step_time %.4fs", step + 1, record.losses[-1],
                 dp_mean, record.step_times[-1])
    if slow := _faults_at(args.fault, "slow_checkpoint", rank, step + 1):
        with mon.activity("checkpoint"):
            time.sleep(slow)
            dist.barrier()
    saved = False
    if ckpt and ckpt.due(step + 1):
        saved = _save(ckpt, mon, step + 1, job.model, job.optimizer, ckpt_extra)
    if mon.checkpoint_due(step + 1) and not saved:  # the agent asked; every rank agrees
        if ckpt is None:
            log.warning("checkpoint requested at step %d, but no --checkpoint-dir", step + 1)
            mon.checkpoint_saved(step + 1, started_at=time.time(), duration=0.0, ok=False,
                                 error="the job runs without --checkpoint-dir")
        else:
            _save(ckpt, mon, step + 1, job.model, job.optimizer, ckpt_extra)
    if ckpt:
        report_saves(mon, ckpt.finished(), record.saves)


def _usual(step_times: list[float]) -> float:
    """This rank's usual step time, frozen at the first 20 clean steps' median."""
    head = step_times[2:22] or step_times or [0.0]
    return sorted(head)[len(head) // 2]


def _injected_sleep_in_forward(seconds: float) -> None:
    """A rank stuck in Python: named so that its frame is recognisable in stacks."""
    time.sleep(seconds)


def _crash_faults(faults: list, rank: int, step: int) -> None:
    """The injected ends of a worker: ``raise`` (an uncaught RuntimeError) and ``segv``."""
    if any(k == "raise" and st == step and r in (rank, -1) for k, r, st, _ in faults):
        raise RuntimeError(f"injected fault: rank {rank} raises at step {step}")
    if any(k == "segv" and st == step and r in (rank, -1) for k, r, st, _ in faults):
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)


def _faults_at(faults: list, kind: str, rank: int, step: int, any_rank: bool = False) -> float:
    return sum(s for k, r, st, s in faults if k == kind and st == step and (any_rank or r in (rank, -1)))


def _slowdown_from(faults: list, kind: str, rank: int, step: int) -> float:
    return sum(s for k, r, st, s in faults if k == kind and step >= st and r in (rank, -1))


def global_batch_for(saved: int | None, batch_size: int, dp: int, rank: int) -> tuple[int, int]:
    """The global batch to keep and the gradient accumulation that keeps it (its micro-batch:
    ``global_batch // (dp * accumulation)`` samples).

    A job resumed on fewer data-parallel ranks keeps the checkpoint's global batch
    by accumulating gradients, so its loss curve does not jump: micro-batches of
    ``batch_size``, or of fewer samples where the dp ranks' share is not a multiple
    of it (12 samples over dp 3 -> 2 is 6 a rank: 3 of 2).  When that is not possible
    (the global batch is not a multiple of dp), it says so and trains with the new
    global batch.
    """
    now = batch_size * dp
    if not saved or saved == now:
        return now, 1
    if saved % dp == 0:
        micro = math.gcd(saved // dp, batch_size)
        if rank == 0:
            log.warning("resumed at dp=%d: accumulating %d micro-batches to keep the global batch "
                        "of %d samples", dp, saved // dp // micro, saved)
        return saved, saved // dp // micro
    if rank == 0:
        log.warning("resumed at dp=%d: the checkpoint's global batch of %d samples does not split "
                    "over dp %d, so the global batch changes to %d (batch %d x dp %d); expect the loss "
                    "curve to shift", dp, saved, dp, now, batch_size, dp)
    return now, 1


def _save(ckpt: Checkpointer, mon: object, step: int, model: torch.nn.Module,
          opt: torch.optim.Optimizer, extra: dict) -> bool:
    """Save on every rank; a save that fails to start is reported to the agent, then raised."""
    started, t0 = time.time(), time.perf_counter()
    mon.checkpoint_started(step)
    with mon.activity("checkpoint"):
        try:
            ckpt.save(step, model, opt, extra=extra)
        except Exception as exc:  # noqa: BLE001 - reported, then re-raised: a broken save is fatal
            mon.checkpoint_saved(step, started_at=started, duration=time.perf_counter() - t0,
                                 ok=False, error=f"{type(exc).__name__}: {exc}")
            raise
    return True


def report_saves(mon: object, records: list, saves: list | None = None) -> None:
    """Report finished saves (complete on disk, or failed in the background) to the agent."""
    for rec in records:
        if saves is not None:
            saves.append({"step": rec.step, "blocked": rec.blocked, "asynchronous": rec.asynchronous,
                          "completed_after": rec.completed_after, "ok": rec.ok})
        mon.checkpoint_saved(rec.step, started_at=rec.started_at, duration=rec.blocked,
                             completed_after=rec.completed_after, asynchronous=rec.asynchronous,
                             path=str(rec.path) if rec.ok else "", ok=rec.ok, error=rec.error)


class ABSwitch:
    """For overhead benchmarks: blocks of steps alternate with rankwatch on and off.

    Both arms run in one job, so they see the same machine; the off arm also
    removes the collective timers.  With ``block == 0`` it is always on.
    """

    def __init__(self, mon: object, block: int) -> None:
        self._mon, self._block = mon, block
        self._null = _monitor.NullMonitor()
        self.on = True
        # A/A control: label the arms but never switch, to show the noise floor.
        self._control = os.environ.get("RANKWATCH_AB_CONTROL", "") not in ("", "0")

    def monitor_for(self, i: int) -> object:
        if self._block <= 0 or not isinstance(self._mon, _monitor.Monitor):
            return self._mon
        on = (i // self._block) % 2 == 0
        if self._control:
            self.on = on
            return self._mon
        if on != self.on:
            instr = self._mon._instr
            instr.install() if on else instr.uninstall()
            self.on = on
        return self._mon if on else self._null


def _digest(model: torch.nn.Module) -> str:
    """SHA-256 of this rank's parameter shards, in name order (replicas compare bit for bit)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        local = p.to_local() if hasattr(p, "to_local") else p
        h.update(name.encode())
        h.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _write_metrics(out: Path, rank: int, start: int, step_times: list[float],
                   losses: list[float], arms: list[bool], dp_means: list[float],
                   saves: list[dict], recoveries: list[dict], rank_now: int, world_now: int,
                   digest: str, step_starts: list[float]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fr = {}
    try:
        fr = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True))
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        log.warning("no Flight Recorder dump: %s", exc)
    with open(out / f"rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), "start": start, "step_times": step_times,
                   "step_starts": step_starts,
                   "losses": losses, "dp_mean_losses": dp_means, "rankwatch_on": arms,
                   "checkpoints": saves, "recoveries": recoveries, "rank_now": rank_now,
                   "world_size_now": world_now, "param_digest": digest,
                   "flight_recorder": fr.get("entries", [])}, f)
