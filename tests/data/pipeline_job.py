"""A two-stage pipeline job as users write one, with no DeviceMesh and, by default, no rankwatch.

``torch.distributed.pipelining``'s ``PipelineStage`` over process groups the script makes itself
(``new_group``), a GPipe schedule over ``--microbatches``, synthetic data.  Stage 1 is the
heavier by design: its hidden layers are ``--wide`` times stage 0's width (so about that many
times its FLOPs) and it holds the loss.  With ``--dp 2`` each stage has two replicas (world 4,
stage-major: ranks 0-1 stage 0, ranks 2-3 stage 1) whose gradients the script all-reduces
itself after each schedule step.

``--rw-init`` calls ``rankwatch.hooks.init()`` (no mesh) and the own-loop pattern
(``mon.steps``); without it the script never imports rankwatch (``rankwatch run`` instruments it).
``--timing`` times this stage's own compute as a user profiling a stage would (its forward,
its backward between two autograd stopwatches, the optimizer step) and prints ``compute
stage=S seconds=X`` at the end, the median per step: the stages' compute measured outside
rankwatch.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

FEATURES, DIM, HIDDEN, CLASSES = 64, 256, 768, 10


class Stopwatch(torch.autograd.Function):
    """Identity; its backward notes when the gradient passes (``clock[key]``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: dict, key: str) -> torch.Tensor:
        ctx.clock, ctx.key = clock, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.clock[ctx.key] = time.perf_counter()
        if ctx.key == "done":   # the backward reached the stage's input: its time is over
            ctx.clock["backward"] += ctx.clock["done"] - ctx.clock["begin"]
        return grad, None, None


class Stage(nn.Module):
    """Stage 0 embeds and runs one MLP block; stage 1 runs a block ``wide`` times wider and the head."""

    def __init__(self, first: bool, wide: int) -> None:
        super().__init__()
        hidden = HIDDEN * (1 if first else wide)
        self.embed = nn.Linear(FEATURES, DIM) if first else None
        self.up, self.down = nn.Linear(DIM, hidden), nn.Linear(hidden, DIM)
        self.head = None if first else nn.Linear(DIM, CLASSES)
        self.clock: dict | None = None   # with --timing: {"forward", "backward"} seconds so far

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clock, t0 = self.clock, time.perf_counter()
        if clock is not None:
            x = Stopwatch.apply(x.detach().requires_grad_(), clock, "done")
        if self.embed is not None:
            x = self.embed(x)
        x = x + self.down(F.gelu(self.up(x)))
        x = x if self.head is None else self.head(x)
        if clock is None:
            return x
        clock["forward"] += time.perf_counter() - t0
        return Stopwatch.apply(x, clock, "begin")


def groups(world: int, dp: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """This rank's pipeline group (one rank per stage) and its replica group (None with dp 1)."""
    rank, stages = dist.get_rank(), world // dp
    pipe = replicas = None
    for d in range(dp):   # every rank makes every group, in the same order
        g = dist.new_group([s * dp + d for s in range(stages)])
        pipe = g if rank % dp == d else pipe
    for s in range(stages):
        g = dist.new_group([s * dp + d for d in range(dp)]) if dp > 1 else None
        replicas = g if rank // dp == s else replicas
    return pipe, replicas


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--wide", type=int, default=4)
    p.add_argument("--rw-init", action="store_true")
    p.add_argument("--timing", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    stages = world // args.dp
    stage = dist.get_rank() // args.dp
    pipe_group, replicas = groups(world, args.dp)
    first, last = stage == 0, stage == stages - 1
    torch.manual_seed(stage)
    model = Stage(first, args.wide)
    mb = args.batch // args.microbatches
    act = torch.zeros(mb, DIM)
    pipe = PipelineStage(model, stage, stages, torch.device("cpu"),
                         input_args=(torch.zeros(mb, FEATURES) if first else act,),
                         output_args=(torch.zeros(mb, CLASSES) if last else act,),
                         input_grads=(None,) if first else (act,), output_grads=(None,) if last else (act,),
                         group=pipe_group)
    schedule = ScheduleGPipe(pipe, args.microbatches, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model.clock = {"forward": 0.0, "backward": 0.0} if args.timing else None
    per_step = []
    g = torch.Generator().manual_seed(0)
    batches = ((torch.randn(args.batch, FEATURES, generator=g), torch.randint(0, CLASSES, (args.batch,), generator=g))
               for _ in range(args.steps))
    mon = None
    if args.rw_init:
        import rankwatch.hooks as rw

        mon = rw.init()   # no mesh: the stages are found from the pipeline itself
        batches = mon.steps(batches)
    else:
        batches = enumerate(batches, 1)
    for _n, (x, y) in batches:
        if first:
            schedule.step(x)
        elif last:
            schedule.step(target=y)
        else:
            schedule.step()
        if replicas is not None:
            flat = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
            dist.all_reduce(flat, group=replicas)
            torch.nn.utils.vector_to_parameters(flat / args.dp, [q.grad for q in model.parameters()])
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        if model.clock is not None:
            per_step.append(model.clock["forward"] + model.clock["backward"] + time.perf_counter() - t0)
            model.clock.update(forward=0.0, backward=0.0)
    if per_step:
        print(f"compute stage={stage} seconds={statistics.median(per_step[len(per_step) // 10:]):.6f}", flush=True)
    if mon is not None:
        mon.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
