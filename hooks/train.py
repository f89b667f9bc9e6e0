"""The rankwatch harness: an FSDP2 + TP Llama-style decoder on synthetic tokens.

    torchrun --nproc-per-node 4 -m rankwatch.hooks.train --steps 100 --tp 2

dp fills the world by default.  The job resumes from the newest complete
checkpoint in ``--checkpoint-dir``.  The loop only sequences calls; the
components (model, data, checkpointer, monitor) decide.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

# Flight Recorder is on in every run; it must be set before the first group.
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")

import torch.distributed as dist  # noqa: E402

from rankwatch.hooks.harness.parts import ABSwitch, RunRecord, after_step, report_saves, train_step  # noqa: E402
from rankwatch.hooks.harness.setup import Run, start  # noqa: E402
from rankwatch.hooks.recovery.inprocess import Job  # noqa: E402

log = logging.getLogger("rankwatch.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rankwatch.hooks.train", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="train until this step (total, across restarts)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: world / tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--replicate", type=int, default=1,
                   help="HSDP: the dp ranks form this many replicas, each sharded over dp/replicate "
                        "ranks (put one replica per node, so that a lost node takes whole replicas)")
    _parallelism_flags(p)
    _recovery_flags(p)
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="save and resume here")
    p.add_argument("--checkpoint-interval", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--keep-checkpoints", type=int, default=3)
    p.add_argument("--checkpoint-sync", action="store_true",
                   help="block the training thread until each save is written (default: the "
                        "shards are written in the background, dcp.async_save)")
    _model_flags(p)
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
                        "(the rank skips the step's loss all-reduce, a desync, then stalls SECONDS), "
                        "raise (a RuntimeError at STEP), segv (SIGSEGV to itself at STEP), reload_fails "
                        "(the in-process tier's checkpoint load raises); "
                        "RANK -1 is every rank")
    p.add_argument("--ab-block", type=int, default=0,
                   help="benchmarks: alternate blocks of N steps with rankwatch on and off")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error("--steps must be >= 0")
    if args.cp > 1 and args.seq_len % args.cp:
        p.error(f"--cp {args.cp} must divide --seq-len {args.seq_len}")
    return args


def _recovery_flags(p: argparse.ArgumentParser) -> None:
    """In-process recovery, its peer snapshots, and how long a collective waits."""
    p.add_argument("--in-process-recovery", action=argparse.BooleanOptionalAction, default=None,
                   help="when a node is lost, the surviving workers regroup and train on in process, from "
                        "replicas, peer snapshots or the checkpoint; what cannot be recovered so falls back to "
                        "torchrun's restart (default: on in a job over several nodes)")
    p.add_argument("--snapshot-every", type=_every, default=None, metavar="K|off",
                   help="in-process recovery's peer snapshots of each rank's shards every K steps (a job "
                        "without replicas recovers from them); off (or 0): none (default: on where the "
                        "host's memory allows, K sized to cost at most 1%% of the steps)")
    p.add_argument("--recovery-own-loss-reduce", action="store_true",
                   help="with --in-process-recovery, sum the loss for the log in an all-reduce of its own "
                        "after the step rather than in the step commit (the tier's cost before it carried it)")
    p.add_argument("--recovery-settle", type=float, default=1.0,
                   help="seconds the survivors wait for a silent member that is not proven dead "
                        "(a process that is gone is left out at once)")
    p.add_argument("--collective-timeout", type=float, default=1800.0,
                   help="seconds a collective waits for a hung peer before it fails")


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The model, its batch and its optimizer."""
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


def _every(text: str) -> int:
    """``--snapshot-every``: K >= 0, or ``off`` (0)."""
    if text.strip().lower() == "off":
        return 0
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of steps, or off") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 0")
    return n


_FAULT_KINDS = ("sleep_forward", "slow_checkpoint", "slow_compute", "slow_data", "skip_collective", "raise",
                "segv", "reload_fails")


def _parallelism_flags(p: argparse.ArgumentParser) -> None:
    """Pipeline, expert and context parallelism (dp and tp are the parser's own)."""
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (torch.distributed.pipelining)")
    p.add_argument("--pp-schedule", choices=("gpipe", "1f1b"), default="1f1b", help="the pipeline's schedule")
    p.add_argument("--microbatches", type=int, default=2, help="pipeline microbatches per step (divide --batch-size)")
    p.add_argument("--pp-split", default=None, metavar="N,N,...",
                   help="layers per stage, e.g. 1,3 (default: spread evenly)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallelism: ranks that split a mixture of experts (all-to-all dispatch)")
    p.add_argument("--experts", type=int, default=0, help="experts per MoE layer (default with --ep: 2 x ep)")
    p.add_argument("--top-k", type=int, default=1, help="experts each token is routed to")
    p.add_argument("--router-bias", type=_router_bias, action="append", default=[], metavar="EXPERT:LOGIT",
                   help="add LOGIT to the router's score of EXPERT (a hot expert, for tests)")
    p.add_argument("--cp", type=int, default=1,
                   help="context parallelism: ranks that split each sequence (all-gathered keys and values)")


def _router_bias(text: str) -> tuple[int, float]:
    try:
        expert, logit = text.split(":")
        return int(expert), float(logit)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--router-bias {text!r}: expected EXPERT:LOGIT") from None


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
    run = start(args)
    if run is None:
        return 2
    record = RunRecord()
    job, done = _train(run, record)
    _finish(run, job, done, record)
    return 0


def _train(run: Run, record: RunRecord) -> tuple[Job, int]:
    """Steps until ``--steps``; after a failure the in-process tier recovers from, on in the new
    world (any other failure is raised: torchrun restarts).  Returns the job and the steps done."""
    args, tier, mon, job, feed = run.args, run.tier, run.mon, run.job, run.feed
    ab = ABSwitch(mon, args.ab_block)
    carry = tier.carry if tier is not None and not args.recovery_own_loss_reduce else None
    done = run.start  # optimizer steps applied
    while done < args.steps:
        step = done
        rank = dist.get_rank()
        m = ab.monitor_for(step - run.start)
        t0 = time.perf_counter()
        record.step_starts.append(t0)
        try:
            with m.step(step + 1, tokens=feed.tokens, flops=feed.flops):
                loss, summed = train_step(m, job, feed.batches, feed.accum, args, run.vocab, run.dev, rank, step,
                                          record, carry)
                done = step + 1
                m.mark("optimizer")
                if args.step_sleep:
                    time.sleep(args.step_sleep)
            record.step_times.append(time.perf_counter() - t0)
            record.arms.append(ab.on)
            record.losses.append(loss.item())
            after_step(mon, job, run.ckpt, run.ckpt_extra, args, run.dev, rank, step, record, summed)
            run.profiler.step()
            if tier is not None and (phases := tier.stepped(done)) is not None:
                record.recoveries[-1]["phases"] = phases  # the recovery's first step is done
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
            feed = run.feeder(job, done)
            # Later saves record the world they are made in (a restart from one keeps its batch).
            run.ckpt_extra.update(world_size=dist.get_world_size(), dp=job.extra["dims"].dp,
                                  global_batch=feed.global_batch)
    return job, done


def _finish(run: Run, job: Job, done: int, record: RunRecord) -> None:
    """The tier told the job is done, the last save written, the metrics file, the group closed."""
    if run.tier is not None:
        run.tier.finish(done)
    if run.ckpt:  # the last save in flight is written before the job ends
        with run.mon.activity("checkpoint"):
            run.ckpt.wait()
        report_saves(run.mon, run.ckpt.finished(), record.saves)
    if run.args.metrics_out:
        record.write(run.args.metrics_out, run.first_rank, run.start, job.model)
    run.mon.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
