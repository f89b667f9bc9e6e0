"""Steady-state cost of the in-process recovery tier: the harness with and without it.

The same job (three ranks under ``torchrun --standalone``, HSDP ``--replicate 3``, the
harness's default model) runs in pairs, the two arms back to back in alternating order,
so both see the same machine; each run's median step time (after 20 warm-up steps) is
compared within its pair.  An A/A control labels two identical runs without the tier as
the two arms, to show the noise floor.  ``--commit-runs K`` adds K runs with the tier
whose step commits are timed (``timed_commit.py``): the wait in the commit per step, an
upper bound on its cost that step-time ratios this noisy cannot resolve.

    python benchmarks/inprocess_overhead.py --pairs 6 --steps 300 --commit-runs 3

On a GPU machine (NCCL; one GPU holds one rank of a job), ``--nproc 1 --harness-args
"<model>"`` gives the tier's cost on a GPU-bound step: its per-step host work and the
commit's enqueue, without a cross-rank wait.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


NPROC = 3
HARNESS: list[str] = []


OWN_REDUCE = "own"   # the tier on, the harness's loss summed in an all-reduce of its own (not carried)


def run(steps: int, tier: bool | str, tmp: Path, timed: bool = False, aligned: bool = False,
        whole: bool = False) -> float | tuple[float, float]:
    """The median step time (and with ``timed``, the median wait in the step commit).
    ``whole``: the median start-to-start interval instead (the whole iteration: the step and
    what follows it, the loss's all-reduce for the log among it).  ``tier``: True, False or
    :data:`OWN_REDUCE`."""
    out = tmp / ("on" if tier else "off")
    out.mkdir(exist_ok=True)
    entry = [str(Path(__file__).with_name("timed_commit.py"))] if timed else ["-m", "rankwatch.hooks.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
           *entry, "--steps", str(steps), "--log-every", "0", "--replicate", str(NPROC), *HARNESS,
           "--no-rankwatch", "--metrics-out", str(out), *(["--in-process-recovery"] if tier else []),
           *(["--recovery-own-loss-reduce"] if tier == OWN_REDUCE else []),
           *(["--commit-out", str(out)] if timed else []), *(["--commit-aligned"] if aligned else [])]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    times, waits = [], []
    for rank in range(NPROC):
        got = json.loads((out / f"rank{rank}.json").read_text())
        starts = got["step_starts"]
        times += [b - a for a, b in zip(starts, starts[1:])][20:] if whole else got["step_times"][20:]
        if timed:
            waits += json.loads((out / f"commit{rank}.json").read_text())[20:]
    return (statistics.median(times), statistics.median(waits)) if timed else statistics.median(times)


def ab_run(steps: int, tmp: Path, block: int, *flags: str) -> float:
    """One run of ``commit_ab.py`` (the tier on, its commit on and off in blocks of ``block``
    steps): the median over ranks of each rank's median iteration (start to start) in the
    "on" blocks over its median in the "off" blocks, after 20 warm-up steps."""
    out = tmp / "ab"
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
           str(Path(__file__).with_name("commit_ab.py")), "--steps", str(steps), "--log-every", "0",
           "--replicate", str(NPROC), *HARNESS, "--no-rankwatch", "--metrics-out", str(out),
           "--in-process-recovery", "--ab-out", str(out), "--ab-steps", str(block), *flags]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    ratios = []
    for rank in range(NPROC):
        starts = json.loads((out / f"rank{rank}.json").read_text())["step_starts"]
        arms = json.loads((out / f"ab{rank}.json").read_text())
        its = [(arm, b - a) for arm, a, b in zip(arms, starts, starts[1:])][20:]
        on, off = [t for arm, t in its if arm], [t for arm, t in its if not arm]
        if "--ab-aa" in flags:   # both arms off: label the blocks as they would have been
            on, off = ([t for i, (_, t) in enumerate(its, 20) if (i // block) % 2 == k] for k in (0, 1))
        ratios.append(statistics.median(on) / statistics.median(off))
    return statistics.median(ratios)


def per_step_cost(n: int = 1_000_000) -> float:
    """Seconds the training thread spends on the tier per step when nothing fails: the
    ``tier.stepped(done)`` call (the try/except around the step costs nothing in CPython 3.11)."""
    import timeit

    from rankwatch.hooks.recovery.inprocess import InProcessRecovery

    tier = InProcessRecovery(lambda m: None)
    return timeit.timeit(lambda: tier.stepped(1), number=n) / n - timeit.timeit(lambda: None, number=n) / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--commit-runs", type=int, default=0, help="runs with the step commit timed")
    p.add_argument("--nproc", type=int, default=3, help="ranks (HSDP: one replica each)")
    p.add_argument("--harness-args", default="", help="more harness arguments (a model size)")
    p.add_argument("--whole", action="store_true",
                   help="time whole iterations (step start to step start), not the step scope: the "
                        "harness's loss all-reduce after the step counts too")
    p.add_argument("--own-reduce-arm", action="store_true",
                   help="a third arm: the tier on, the loss summed in its own all-reduce (not carried)")
    p.add_argument("--ab-runs", type=int, default=0,
                   help="runs of commit_ab.py: the commit on and off in blocks within one run, with an "
                        "A/A run and a run with the loss in its own all-reduce each time")
    p.add_argument("--ab-steps", type=int, default=10, help="steps per block in --ab-runs")
    args = p.parse_args()
    global NPROC, HARNESS
    NPROC, HARNESS = args.nproc, shlex.split(args.harness_args)
    print(f"the tier's own work per step: {per_step_cost() * 1e9:.0f} ns", flush=True)
    ratios, own_ratios, controls = [], [], []
    arms: list[bool | str] = [True, False] + ([OWN_REDUCE] if args.own_reduce_arm else [])
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for i in range(args.pairs):
            order = arms[i % len(arms):] + arms[:i % len(arms)]   # each arm first in turn
            if i % 2:
                order.reverse()
            got = {arm: run(args.steps, arm, tmp, whole=args.whole) for arm in order}
            ratios.append(got[True] / got[False])
            a, b = run(args.steps, False, tmp, whole=args.whole), run(args.steps, False, tmp, whole=args.whole)
            controls.append(a / b)
            own = ""
            if OWN_REDUCE in got:
                own_ratios.append(got[OWN_REDUCE] / got[False])
                own = f", with its own loss all-reduce {got[OWN_REDUCE] * 1e3:.2f} ms (ratio {own_ratios[-1]:.3f})"
            print(f"pair {i}: with {got[True] * 1e3:.2f} ms, without {got[False] * 1e3:.2f} ms, "
                  f"ratio {ratios[-1]:.3f}{own}; A/A {controls[-1]:.3f}", flush=True)
        for i in range(args.commit_runs):
            step, wait = run(args.steps, True, tmp, timed=True)
            _, own = run(args.steps, True, tmp, timed=True, aligned=True)
            print(f"commit run {i}: median step {step * 1e3:.2f} ms; median wait in the commit "
                  f"{wait * 1e6:.0f} us ({wait / step:.2%} of a step); the commit after a barrier "
                  f"{own * 1e6:.0f} us ({own / step:.2%})", flush=True)
        ab: dict[str, list[float]] = {"on/off": [], "A/A": [], "own all-reduce on/off": []}
        for i in range(args.ab_runs):
            ab["on/off"].append(ab_run(args.steps, tmp, args.ab_steps))
            ab["A/A"].append(ab_run(args.steps, tmp, args.ab_steps, "--ab-aa"))
            ab["own all-reduce on/off"].append(ab_run(args.steps, tmp, args.ab_steps, "--ab-own-reduce"))
            print(f"ab run {i}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in ab.items()), flush=True)
        if args.ab_runs:
            print("in-run blocks, medians: " + ", ".join(
                f"{k} {statistics.median(v):.4f} ({min(v):.4f}-{max(v):.4f})" for k, v in ab.items()))
    if not ratios:
        return 0
    print(f"with/without: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); "
          f"A/A control: median {statistics.median(controls):.3f} "
          f"(range {min(controls):.3f}-{max(controls):.3f})")
    if own_ratios:
        print(f"with its own loss all-reduce/without: median {statistics.median(own_ratios):.3f} "
              f"(range {min(own_ratios):.3f}-{max(own_ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
