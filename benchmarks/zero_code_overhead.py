"""What zero-code instrumentation costs an unmodified job: per event, and end to end.

    python benchmarks/zero_code_overhead.py --job events
    python benchmarks/zero_code_overhead.py --job trainer --pairs 5 --steps 400
    python benchmarks/zero_code_overhead.py --job ddp --pairs 5

* ``events``: the training thread's cost per event (timeit, median of 9 repeats), in one
  process on a one-rank gloo group: a root module's forward (pre + post hook, the backward's
  pre-hook put on its output), a backward seen (pre-hook, two final callbacks, DDP's record;
  measured as a real tiny backward with the hooks against one without), an optimizer step's
  hooks, and what a Python DDP comm hook (the design this replaced) adds to a DDP backward
  against DDP's own C++ all-reduce.
* ``trainer``: ``tests/data/hf_trainer.py`` (a Hugging Face Trainer, tiny GPT-2, DDP on gloo,
  two ranks) under ``rankwatch run``, zero-code on against ``RANKWATCH_AUTO=0``; the figure is
  the Trainer's own ``train_steps_per_second`` (rank 0), turned into step time.
* ``ddp``: ``tests/data/plain_ddp.py`` (the DDP tutorial's shape), its own median update time.

Whole runs alternate (on, off, off; then off, off, on) for ``--pairs`` rounds; the ratio is
the median of the rounds' on/off step-time ratios, and the A/A control the median of off/off.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"


def _ns(stmt: str, g: dict, n: int) -> float:
    return statistics.median(timeit.repeat(stmt, globals=g, number=n, repeat=9)) / n * 1e9


def _added_ns(bare, other, x, n: int = 1000, rounds: int = 15) -> float:
    """What ``other``'s forward + backward costs over ``bare``'s: the median of paired rounds."""
    stmt = "model(x).sum().backward()"
    diffs = [timeit.timeit(stmt, globals={"model": other, "x": x}, number=n)
             - timeit.timeit(stmt, globals={"model": bare, "x": x}, number=n) for _ in range(rounds)]
    return statistics.median(diffs) / n * 1e9


def events(tmp: str) -> list[tuple[str, float]]:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rankwatch.hooks.instrument.collectives import CollectiveInstrumentation
    from rankwatch.hooks.instrument.ddp_timing import DdpTiming
    from rankwatch.hooks.instrument.recorder import Recorder
    from rankwatch.hooks.instrument.step_hooks import StepHooks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
    rec = Recorder(capacity=1 << 10, step_capacity=1 << 10)
    x = torch.randn(2, 4)
    bare = DDP(nn.Linear(4, 4))
    hooks = StepHooks(rec, ddp=DdpTiming(lambda: (rec, CollectiveInstrumentation(rec))))
    hooks.install()
    try:
        model = DDP(nn.Linear(4, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        model(x).sum().backward(), opt.step()          # the first step finds the root
        hooks._open, hooks._trained = True, True
        g = {"h": hooks, "m": model, "out": model(x)}
        rows = [("a root module's forward (pre + post hook, two marks, the backward's pre-hook)",
                 _ns("h._depth = 0; h._forward_pre(m, ()); h._forward_post(m, (), out)", g, 20_000))]
        rows.append(("a forward + backward seen (hooks, pre-hook, two final callbacks, DDP's record), added",
                     _added_ns(bare, model, x)))
        rows.append(("an optimizer step's pre + post hooks (a step ends)",
                     _ns("h._trained = True; h._open = True; h._optimizer_pre(None, (), {}); "
                         "h._optimizer_post(None, (), {})", g, 20_000)))
    finally:
        hooks.uninstall()
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    py = DDP(nn.Linear(4, 4))
    py.register_comm_hook(None, default_hooks.allreduce_hook)
    rows.append(("before: a Python DDP comm hook (one bucket), added to a backward", _added_ns(bare, py, x)))
    dist.destroy_process_group()
    return rows


def _trainer(auto: str, steps: int, tmp: Path) -> float:
    cmd = [sys.executable, "-m", "rankwatch.agent.cli", "run", "--", "--standalone", "--nproc-per-node", "2",
           str(DATA / "hf_trainer.py"), "--steps", str(steps), "--output-dir", str(tmp / "out")]
    out = subprocess.run(cmd, env={**os.environ, "RANKWATCH_AUTO": auto, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"RANKWATCH_AUTO={auto}: exit {out.returncode}\n{out.stderr[-2500:]}")
    line = next(ln for ln in out.stdout.splitlines() if "train_steps_per_second" in ln)
    return 1.0 / float(ast.literal_eval(line[line.index("{"):])["train_steps_per_second"])


def _ddp(auto: str, epochs: int, tmp: Path) -> float:
    cmd = [sys.executable, "-m", "rankwatch.agent.cli", "run", "--", "--standalone", "--nproc-per-node", "2",
           str(DATA / "plain_ddp.py"), "--epochs", str(epochs), "--samples", "2048", "--dim", "256",
           "--time-out", str(tmp / "t")]
    subprocess.run(cmd, env={**os.environ, "RANKWATCH_AUTO": auto, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=600)
    return float((tmp / "t.0").read_text())


def pairs(run, n: int) -> dict:
    on, off, aa = [], [], []
    for i in range(n):
        order = [("1", on), ("0", off), ("0", aa)] if i % 2 == 0 else [("0", off), ("0", aa), ("1", on)]
        for auto, sink in order:
            sink.append(run(auto))
    return {"step_ms_off": statistics.median(off) * 1e3, "step_ms_on": statistics.median(on) * 1e3,
            "ratio": statistics.median(a / b for a, b in zip(on, off)),
            "aa": statistics.median(a / b for a, b in zip(aa, off)),
            "per_pair": [round(a / b, 4) for a, b in zip(on, off)], "pairs": n}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", choices=("events", "trainer", "ddp"), required=True)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.job == "events":
            for name, ns in events(tmp):
                print(f"| {name} | {ns / 1e3:,.2f} µs |")
            return
        if args.job == "trainer":
            r = pairs(lambda auto: _trainer(auto, args.steps, Path(tmp)), args.pairs)
        else:
            r = pairs(lambda auto: _ddp(auto, args.epochs, Path(tmp)), args.pairs)
    print(f"| {args.job}: step time off / on | {r['step_ms_off']:.2f} ms / {r['step_ms_on']:.2f} ms |")
    print(f"| ratio on/off (median of {r['pairs']} pairs; per pair {r['per_pair']}) | {r['ratio']:.4f} |")
    print(f"| A/A control, off/off | {r['aa']:.4f} |")


if __name__ == "__main__":
    main()
