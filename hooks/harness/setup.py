"""How the harness's run is set up: the job for a membership, its start step, each world's data.

The job is a membership's mesh, model and optimizer (and, the first time, the run's monitor);
the data comes with its per-step accounting.  :mod:`rankwatch.hooks.train` sequences the loop
over what :func:`start` returns.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rankwatch.hooks.instrument import monitor as _monitor
from rankwatch.hooks.harness.dcp import Checkpointer
from rankwatch.hooks.harness.data import SyntheticTokens, build_loader
from rankwatch.hooks.harness.flops import transformer_flops_per_token
from rankwatch.hooks.harness.model import FeedForward, ModelConfig, Transformer
from rankwatch.hooks.harness.moe import MoE
from rankwatch.hooks.harness.parallel import ParallelDims, build_mesh, device_type, dp_mesh, parallelize
from rankwatch.hooks.harness.pipeline import Pipe, split_layers, stage_model
from rankwatch.hooks.harness.parts import global_batch_for
from rankwatch.hooks.harness.profiling import StepProfiler, profiled_steps
from rankwatch.hooks.recovery.inprocess import InProcessRecovery, Job, Membership
from rankwatch.hooks.recovery.store import JOIN_ENV, STANDBY_ENV

__all__ = ["Feed", "Feeder", "JobBuilder", "Run", "recovery_on", "start"]


class JobBuilder:
    """Builds the job for a membership: at the start, and again after an in-process recovery.

    Its first call also makes the run's one monitor (:attr:`monitor`), with the first mesh.
    """

    def __init__(self, args: argparse.Namespace, cfg: ModelConfig, dev: str, ckpt: Checkpointer | None) -> None:
        self.args, self.cfg, self.dev, self.ckpt = args, cfg, dev, ckpt
        self.monitor: Any = None
        self.replica_size: int | None = None
        """The job's replica size once it started (its starter sets it): whole replicas that
        survive a recovery keep their layout."""

    def __call__(self, m: Membership) -> Job:
        args, dev = self.args, self.dev
        dims = self._dims(m, dist.get_world_size())
        mesh = build_mesh(dims, dev)
        if self.monitor is None:  # before parallelising, so the collectives that shard the weights are timed too
            for auto in _monitor.ZERO_CODE if args.no_rankwatch else ():   # under `rankwatch run`
                auto.stand_down()
            self.monitor = _monitor.NullMonitor() if args.no_rankwatch else _monitor.init(
                mesh=mesh, peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None)
        if m.generation == 0:
            torch.manual_seed(args.seed)  # identical initial weights on every rank
            model = parallelize(self._model(mesh, dims).to(dev), mesh, dims)
        else:  # the weights come from this rank's own shards in memory: allocate, don't initialise
            with torch.device("meta"):
                model = self._model(mesh, dims)
            model = parallelize(model, mesh, dims).to_empty(device=dev)
        pipe = self._pipe(model, mesh, dims)
        # The fused AdamW by default, on a GPU and on the CPU alike.  On a GPU the step commit
        # gates it on the device, without a host synchronisation (hooks/recovery/commit.py).
        # Either way it is one DTensor op per step, not ~8 per parameter: DTensor works out
        # each op's sharding again for a new generation's mesh, so after an in-process
        # recovery the loop's first optimizer step cost 10-20x a usual one (BENCHMARKS.md).
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=args.adamw == "fused",
                                foreach=args.adamw == "foreach")
        if self.ckpt:
            self.ckpt.regroup() if m.generation else self.ckpt.setup()
        return Job(model=model, optimizer=opt, replica_size=dims.replica_size,
                   extra={"mesh": mesh, "dims": dims, "pipe": pipe,
                          "cp": (mesh["cp"].get_local_rank(), dims.cp) if dims.cp > 1 else None})

    def _model(self, mesh: Any, dims: ParallelDims) -> Transformer:
        """The whole model, or this rank's pipeline stage of it; a mixture of experts with ``--ep``/``--experts``."""
        args, cfg = self.args, self.cfg
        ffn: Any = FeedForward
        if dims.ep > 1 or args.experts:
            experts, ep_rank = args.experts or 2 * dims.ep, mesh["ep"].get_local_rank() if dims.ep > 1 else 0
            bias = dict(args.router_bias)

            def ffn(c: ModelConfig) -> MoE:
                return MoE(c.dim, c.hidden_dim, experts, args.top_k, dims.ep, ep_rank, bias)
        model = Transformer(cfg, ffn)
        if dims.pp > 1:
            stage = mesh["pp"].get_local_rank()
            stage_model(model, stage, dims.pp, split_layers(cfg.n_layers, dims.pp, args.pp_split)[stage])
        return model

    def _pipe(self, model: Any, mesh: Any, dims: ParallelDims) -> Pipe | None:
        """With ``--pp``: this rank's stage and its schedule."""
        if dims.pp == 1:
            return None
        args, cfg = self.args, self.cfg
        return Pipe.build(model, mesh["pp"].get_local_rank(), dims.pp, mesh["pp"].get_group(),
                          schedule=args.pp_schedule, microbatches=args.microbatches, batch_size=args.batch_size,
                          seq_len=cfg.seq_len // dims.cp, dim=cfg.dim, vocab=cfg.vocab_size, device=self.dev)

    def _dims(self, m: Membership, world: int) -> ParallelDims:
        args = self.args
        more = {"pp": args.pp, "ep": args.ep, "cp": args.cp}
        if m.generation == 0:
            return ParallelDims.from_flags(args.dp, args.tp, world, args.replicate, **more)
        if self.replica_size is not None:  # whole replicas survived; each keeps its layout
            return ParallelDims.from_flags(None, args.tp, world, world // self.replica_size, **more)
        # a worker joining in process: the job's layout, from the flags
        return ParallelDims.from_flags(None, args.tp, world, args.replicate, **more)


@dataclass
class Feed:
    """The data and the per-step accounting for the job's current world."""

    global_batch: int
    accum: int
    """Micro-batches per step (gradient accumulation keeps the global batch of a shrunk job)."""
    batches: Iterator[torch.Tensor]
    tokens: float
    """This rank's share of a step's tokens (TP ranks split a batch) ..."""
    flops: float
    """... and of its FLOPs."""


class Feeder:
    """Each world's :class:`Feed`, from a step on, keeping the job's global batch: the
    checkpoint's at the start, then the one each feed kept."""

    def __init__(self, args: argparse.Namespace, cfg: ModelConfig, n_params: int, global_batch: int | None) -> None:
        self.args, self.cfg, self.n_params = args, cfg, n_params
        self.global_batch = global_batch

    def __call__(self, job: Job, done: int) -> Feed:
        args, cfg = self.args, self.cfg
        dims, mesh = job.extra["dims"], job.extra["mesh"]
        gb, accum = global_batch_for(self.global_batch, args.batch_size, dims.data, dist.get_rank())
        self.global_batch = gb
        ds = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=args.seed)
        micro = gb // (dims.data * accum)   # the batch size, or less to keep the global batch on a shrunk world
        pipe = job.extra.get("pipe")
        if pipe is not None and pipe.remake is not None and pipe.batch_size != micro:
            job.extra["pipe"] = pipe.remake(micro)   # a stage's shapes are fixed: built again for this batch
        batches = iter(build_loader(ds, micro, dp_mesh(mesh).get_local_rank(), dims.data, done * gb))
        # TP ranks split a batch's work, CP ranks its sequence; a pipeline stage does its layers' part.
        tokens = accum * args.batch_size * cfg.seq_len / (dims.tp * dims.cp)
        flops = tokens * transformer_flops_per_token(self.n_params, cfg.n_layers, cfg.dim, cfg.seq_len)
        return Feed(global_batch=gb, accum=accum, batches=batches, tokens=tokens, flops=flops)


@dataclass
class Run:
    """A started run: what the loop sequences, and where it started."""

    args: argparse.Namespace
    dev: str
    vocab: int
    ckpt: Checkpointer | None
    tier: InProcessRecovery | None
    """The in-process recovery tier (on by default over several nodes), else None."""
    mon: Any
    job: Job
    start: int
    """Optimizer steps applied before this worker's first (a checkpoint's, or a live replica's)."""
    first_rank: int
    """This worker's rank at the start (its metrics file keeps it); a joiner's id (no start rank)."""
    feeder: Feeder
    feed: Feed
    ckpt_extra: dict
    profiler: StepProfiler = field(default_factory=StepProfiler)
    """Marks each step's end for ``torch.profiler`` (``RANKWATCH_PROFILE_DIR``); a no-op unset."""


def start(args: argparse.Namespace) -> Run | None:
    """Everything before the first step: the device, the process group (or the in-process
    tier's start), the job, its monitor, the step to start from and the first world's data.

    None: the flags' layout does not fit the world (said on rank 0; the group is destroyed).
    """
    dev, backend = _device()
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, hidden_dim=args.hidden_dim, seq_len=args.seq_len)
    ckpt = Checkpointer(root=args.checkpoint_dir, interval=args.checkpoint_interval,
                        keep=args.keep_checkpoints, asynchronous=not args.checkpoint_sync
                        ) if args.checkpoint_dir else None
    build = JobBuilder(args, cfg, dev, ckpt)
    timeout = datetime.timedelta(seconds=args.collective_timeout)
    # Admitting joiners breaks a healthy step, and the asynchronous save in flight is drained
    # first: the break shuts every group's connections, the save's own too.
    tier = InProcessRecovery(build, backend=backend, settle=args.recovery_settle, timeout=timeout,
                             total_steps=args.steps, drain=ckpt.wait if ckpt else None,
                             snapshot_every=args.snapshot_every, reload=_reloader(ckpt, args.fault) if ckpt else None
                             ) if recovery_on(args.in_process_recovery, os.environ) else None
    try:
        job = _first_job(build, tier, backend, timeout)
    except ValueError as exc:
        if dist.get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return None
    build.replica_size = job.replica_size
    if tier is not None:
        tier.set_monitor(build.monitor)
    rank, world = dist.get_rank(), dist.get_world_size()
    first_rank = tier.membership.members[rank] if tier is not None and tier.membership is not None else rank
    n_params = sum(p.numel() for p in job.model.parameters())
    begin, extra = _resume(job, ckpt, tier)
    feeder = Feeder(args, cfg, n_params, extra.get("global_batch"))
    feed = feeder(job, begin)
    ckpt_extra = {"world_size": world, "dp": job.extra["dims"].dp, "global_batch": feed.global_batch}
    return Run(args=args, dev=dev, vocab=cfg.vocab_size, ckpt=ckpt, tier=tier, mon=build.monitor, job=job,
               start=begin, first_rank=first_rank, feeder=feeder, feed=feed, ckpt_extra=ckpt_extra,
               profiler=profiled_steps(rank))


def recovery_on(flag: bool | None, env: Mapping[str, str]) -> bool:
    """Whether the in-process tier runs: as ``--[no-]in-process-recovery`` says, else in a job
    over several nodes (a worker joining a running one included).  A one-node job has no
    survivors to recover: a lost worker costs its node, which torchrun restarts as before."""
    if flag is not None:
        return flag
    if env.get(JOIN_ENV) or env.get(STANDBY_ENV):
        return True
    return int(env.get("WORLD_SIZE", "1")) > int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))


def _device() -> tuple[str, str]:
    """This worker's device type and its process group's backend (on a GPU, LOCAL_RANK's device is set)."""
    dev = device_type()
    backend = "nccl" if dev == "cuda" else "gloo"
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dev, backend


def _first_job(build: JobBuilder, tier: InProcessRecovery | None, backend: str,
               timeout: datetime.timedelta) -> Job:
    """The job at the start: the in-process tier's (a joiner's, admitted by a live replica),
    else built once the process group is up."""
    if tier is not None:
        return tier.start()
    dist.init_process_group(backend, timeout=timeout)
    return build(Membership(generation=0, rank=dist.get_rank(), world_size=dist.get_world_size(),
                            members=tuple(range(dist.get_world_size()))))


def _resume(job: Job, ckpt: Checkpointer | None, tier: InProcessRecovery | None) -> tuple[int, dict]:
    """The step to start from and the checkpoint's extra: a joiner's from the live replica whose
    state it took, else the newest complete checkpoint's (step 0 without one)."""
    if tier is not None and tier.completed:  # joined in process: the state came from a live replica
        return tier.completed, {}
    return ckpt.load(job.model, job.optimizer) if ckpt else (0, {})


def _reloader(ckpt: Checkpointer, faults: list[tuple[str, int, int, float]]) -> Callable[[Job], int]:
    """The in-process tier's checkpoint loader: the newest complete checkpoint, resharded for
    the new world (``--fault reload_fails:RANK:0:0`` makes it raise on RANK, -1 every rank)."""
    def reload(job: Job) -> int:
        if any(kind == "reload_fails" and rank in (-1, dist.get_rank()) for kind, rank, _, _ in faults):
            raise RuntimeError("injected fault: the in-process checkpoint load fails")
        return ckpt.load(job.model, job.optimizer)[0]
    return reload
