"""The rankwatch harness: an FSDP2 + TP Llama-style decoder on synthetic tokens.

    torchrun --nproc-per-node 4 -m rankwatch.hooks.train --steps 100 --tp 2

dp fills the world by default.  The job resumes from the newest complete
checkpoint in ``--checkpoint-dir``.  The loop only sequences calls; the
components (model, data, checkpointer, monitor) decide.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import time
from pathlib import Path

# Flight Recorder is on in every run; it must be set before the first group.
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rankwatch.hooks.instrument import monitor as _monitor  # noqa: E402
from rankwatch.hooks.harness.dcp import Checkpointer  # noqa: E402
from rankwatch.hooks.harness.data import SyntheticTokens, build_loader  # noqa: E402
from rankwatch.hooks.harness.flops import transformer_flops_per_token  # noqa: E402
from rankwatch.hooks.harness.model import ModelConfig, Transformer  # noqa: E402
from rankwatch.hooks.harness.parallel import ParallelDims, build_mesh, device_type, dp_mesh, parallelize  # noqa: E402
from rankwatch.hooks.recovery.inprocess import InProcessRecovery, Job, Membership  # noqa: E402
from rankwatch.hooks.harness.parts import (  # noqa: E402
    ABSwitch, RunRecord, after_step, global_batch_for, report_saves, train_step,
)

log = logging.getLogger("rankwatch.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rankwatch.hooks.train", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="train until this step (total, across restarts)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: world / tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--replicate", type=int, default=1,
                   help="HSDP: the dp ranks form this many replicas, each sharded over dp/replicate "
                        "ranks (put one replica per node, so that a lost node takes whole replicas)")
    p.add_argument("--in-process-recovery", action="store_true",
                   help="when a node is lost, the surviving workers regroup and train on in process "
                        "(needs --replicate > 1); what cannot be recovered so falls back to torchrun")
    p.add_argument("--recovery-own-loss-reduce", action="store_true",
                   help="with --in-process-recovery, sum the loss for the log in an all-reduce of its own "
                        "after the step rather than in the step commit (the tier's cost before it carried it)")
    p.add_argument("--recovery-settle", type=float, default=1.0,
                   help="seconds the survivors wait for a silent member that is not proven dead "
                        "(a process that is gone is left out at once)")
    p.add_argument("--collective-timeout", type=float, default=1800.0,
                   help="seconds a collective waits for a hung peer before it fails")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="save and resume here")
    p.add_argument("--checkpoint-interval", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--keep-checkpoints", type=int, default=3)
    p.add_argument("--checkpoint-sync", action="store_true",
                   help="block the training thread until each save is written (default: the "
                        "shards are written in the background, dcp.async_save)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per dp rank per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hidden-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--adamw", choices=("fused", "foreach", "loop"), default="fused",
                   help="AdamW's implementation: fused (one op per step, the default), foreach, or a "
                        "loop over the parameters")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per rank for MFU (default: device table; none on CPU)")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds of idle per step, to pace demos")
    p.add_argument("--no-rankwatch", action="store_true", help="train without instrumentation")
    p.add_argument("--metrics-out", type=Path, default=None,
                   help="write this rank's step times, losses and Flight Recorder dump here")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--fault", type=_fault, action="append", default=[], metavar="KIND:RANK:STEP:SECONDS",
                   help="inject a fault (tests, demo): sleep_forward (a rank stuck in Python "
                        "inside forward for SECONDS), slow_checkpoint (a save of SECONDS), "
                        "slow_compute / slow_data (from STEP on, the rank's forward / data "
                        "loading takes SECONDS x its usual step time longer), skip_collective "
                        "(the rank skips the step's loss all-reduce, a desync, then stalls SECONDS); "
                        "RANK -1 is every rank")
    p.add_argument("--ab-block", type=int, default=0,
                   help="benchmarks: alternate blocks of N steps with rankwatch on and off")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error("--steps must be >= 0")
    return args


_FAULT_KINDS = ("sleep_forward", "slow_checkpoint", "slow_compute", "slow_data", "skip_collective")


def _fault(text: str) -> tuple[str, int, int, float]:
    try:
        kind, rank, step, seconds = text.split(":")
        fault = (kind, int(rank), int(step), float(seconds))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fault {text!r}: expected KIND:RANK:STEP:SECONDS") from None
    if kind not in _FAULT_KINDS:
        raise argparse.ArgumentTypeError(f"--fault kind {kind!r} not in {_FAULT_KINDS}")
    return fault


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dev = device_type()
    backend = "nccl" if dev == "cuda" else "gloo"
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, hidden_dim=args.hidden_dim, seq_len=args.seq_len)
    ckpt = Checkpointer(root=args.checkpoint_dir, interval=args.checkpoint_interval,
                        keep=args.keep_checkpoints, asynchronous=not args.checkpoint_sync
                        ) if args.checkpoint_dir else None
    monitors: list = []  # the one Monitor, made with the first generation's mesh

    def make(m: Membership) -> Job:
        """The job for a membership: at the start, and again after an in-process recovery."""
        world = dist.get_world_size()
        if m.generation == 0:
            dims = ParallelDims.from_flags(args.dp, args.tp, world, args.replicate)
        elif replica_size:  # whole replicas survived; each keeps its layout
            dims = ParallelDims.from_flags(None, args.tp, world, world // replica_size[0])
        else:  # a worker joining in process: the job's layout, from the flags
            dims = ParallelDims.from_flags(None, args.tp, world, args.replicate)
        mesh = build_mesh(dims, dev)
        if not monitors:  # before parallelising, so the collectives that shard the weights are timed too
            monitors.append(_monitor.NullMonitor() if args.no_rankwatch else _monitor.init(
                mesh=mesh, peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None))
        if m.generation == 0:
            torch.manual_seed(args.seed)  # identical initial weights on every rank
            model = parallelize(Transformer(cfg).to(dev), mesh, dims)
        else:  # the weights come from this rank's own shards in memory: allocate, don't initialise
            with torch.device("meta"):
                model = Transformer(cfg)
            model = parallelize(model, mesh, dims).to_empty(device=dev)
        # The fused AdamW by default, on a GPU and on the CPU alike.  On a GPU the step commit
        # gates it on the device, without a host synchronisation (hooks/recovery/commit.py).
        # Either way it is one DTensor op per step, not ~8 per parameter: DTensor works out
        # each op's sharding again for a new generation's mesh, so after an in-process
        # recovery the loop's first optimizer step cost 10-20x a usual one (BENCHMARKS.md).
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=args.adamw == "fused",
                                foreach=args.adamw == "foreach")
        if ckpt:
            ckpt.regroup() if m.generation else ckpt.setup()
        return Job(model=model, optimizer=opt, replica_size=dims.replica_size,
                   extra={"mesh": mesh, "dims": dims})

    replica_size: list[int] = []
    tier = InProcessRecovery(make, backend=backend, settle=args.recovery_settle,
                             timeout=datetime.timedelta(seconds=args.collective_timeout),
                             total_steps=args.steps) if args.in_process_recovery else None
    try:
        if tier is not None:
            job = tier.start()
        else:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.collective_timeout))
            job = make(Membership(generation=0, rank=dist.get_rank(), world_size=dist.get_world_size(),
                                  members=tuple(range(dist.get_world_size()))))
    except ValueError as exc:
        if dist.get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    replica_size.append(job.replica_size)
    mon = monitors[0]
    if tier is not None:
        tier.set_monitor(mon)
    rank, world = dist.get_rank(), dist.get_world_size()
    # This worker's rank at the start (its metrics file keeps it); a joiner's id (no start rank).
    first_rank = tier.membership.members[rank] if tier is not None and tier.membership is not None else rank
    n_params = sum(p.numel() for p in job.model.parameters())
    if tier is not None and tier.completed:  # joined in process: the state came from a live replica
        start, extra = tier.completed, {}
    else:
        start, extra = ckpt.load(job.model, job.optimizer) if ckpt else (0, {})
    global_batch = extra.get("global_batch")

    def feed(job: Job, done: int) -> tuple:
        """The data and the per-step accounting for the job's current world, from step ``done`` on."""
        dims, mesh = job.extra["dims"], job.extra["mesh"]
        gb, accum = global_batch_for(global_batch, args.batch_size, dims.dp, dist.get_rank())
        ds = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=args.seed)
        batches = iter(build_loader(ds, args.batch_size, dp_mesh(mesh).get_local_rank(), dims.dp, done * gb))
        # Each rank's share of the job's tokens and FLOPs (TP ranks split a batch).
        tokens = accum * args.batch_size * cfg.seq_len / dims.tp
        flops = tokens * transformer_flops_per_token(n_params, cfg.n_layers, cfg.dim, cfg.seq_len)
        return gb, accum, batches, tokens, flops

    global_batch, accum, batches, tokens, flops = feed(job, start)
    ckpt_extra = {"world_size": world, "dp": job.extra["dims"].dp, "global_batch": global_batch}
    record = RunRecord()
    ab = ABSwitch(mon, args.ab_block)
    carry = tier.carry if tier is not None and not args.recovery_own_loss_reduce else None
    done = start  # optimizer steps applied
    while done < args.steps:
        step = done
        rank = dist.get_rank()
        m = ab.monitor_for(step - start)
        t0 = time.perf_counter()
        record.step_starts.append(t0)
        try:
            with m.step(step + 1, tokens=tokens, flops=flops):
                loss, summed = train_step(m, job, batches, accum, args, cfg.vocab_size, dev, rank, step, record,
                                          carry)
                done = step + 1
                m.mark("optimizer")
                if args.step_sleep:
                    time.sleep(args.step_sleep)
            record.step_times.append(time.perf_counter() - t0)
            record.arms.append(ab.on)
            record.losses.append(loss.item())
            after_step(mon, job, ckpt, ckpt_extra, args, dev, rank, step, record, summed)
        except Exception as exc:
            if tier is None:
                raise
            if len(record.dp_means) < len(record.losses):  # the step applied; the failure cut its dp-mean all-reduce
                record.dp_means.append(float("nan"))
            before = done
            job, done = tier.recover(exc, job, completed=done)  # or raises: torchrun restarts
            del exc
            # "from": this rank's own steps; a rank a step behind took the newest replica's state
            # (its step "from"+1..."step" was trained by the others, not recorded here).
            record.recoveries.append({"step": done, "from": before, "world_size": dist.get_world_size(),
                                      "rank": dist.get_rank(), "phases": tier.last_phases})
            global_batch, accum, batches, tokens, flops = feed(job, done)
            continue
        if tier is not None and (phases := tier.stepped(done)) is not None:
            record.recoveries[-1]["phases"] = phases  # the recovery's first step is done
    if tier is not None:
        tier.finish(done)

    if ckpt:  # the last save in flight is written before the job ends
        with mon.activity("checkpoint"):
            ckpt.wait()
        report_saves(mon, ckpt.finished(), record.saves)
    if args.metrics_out:
        record.write(args.metrics_out, first_rank, start, job.model)
    mon.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
