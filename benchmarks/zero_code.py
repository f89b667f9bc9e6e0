"""Zero-code instrumentation's cost: per hook event, and on an unmodified script's steps.

    python benchmarks/zero_code.py [--pairs 6] [--epochs 3] [--dim 256]

1. **Per event** (timeit, median of 9 repeats): each global hook the training thread runs
   (a nested module's forward, the root's, the autograd call's wrapper, an optimizer step's
   pre and post hooks), what the global forward hooks add to one small module call during
   the first step, and what a module that is not a root pays after it.
2. **Step time**: ``tests/data/plain_ddp.py`` (never imports rankwatch), two ranks, under
   ``rankwatch run`` with zero-code instrumentation on against ``RANKWATCH_AUTO=0``, whole runs
   interleaved in pairs; and an A/A control, on against on, in the same rounds.  Each run's
   figure is the script's own median update time (rank 0); the ratio is the median of the
   pairs' ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "data" / "plain_ddp.py"


def _ns(stmt: str, g: dict, n: int = 100_000) -> float:
    return statistics.median(timeit.repeat(stmt, globals=g, number=n, repeat=9)) / n * 1e9


def per_event() -> list[tuple[str, float]]:
    import torch
    import torch.nn as nn

    from rankwatch.hooks.instrument.recorder import Recorder
    from rankwatch.hooks.instrument.step_hooks import StepHooks

    rec = Recorder(step_capacity=1 << 10)
    hooks = StepHooks(rec)
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    bare = _ns("lin(x)", {"lin": lin, "x": x}, 20_000)
    hooks.install()
    try:
        hooked = _ns("lin(x)", {"lin": lin, "x": x}, 20_000)
        lin(x)   # the root, as the first step finds it
        hooks._open, hooks._trained = True, True
        g = {"h": hooks, "m": lin}
        rows = [
            ("a nested module's forward (pre + post hook)",
             _ns("h._depth = 1; h._forward_pre(m, ()); h._forward_post(m, (), None)", g)),
            ("the root module's forward (pre + post hook, two marks)",
             _ns("h._depth = 0; h._forward_pre(m, ()); h._forward_post(m, (), None)", g)),
            ("the autograd call's wrapper (a no-op backward)",
             _ns("wrapped()", {"wrapped": hooks._timed_backward(lambda: None)})),
            ("an optimizer step's pre + post hooks (a step ends)",
             _ns("h._trained = True; h._open = True; h._optimizer_pre(None, (), {}); "
                 "h._optimizer_post(None, (), {})", g)),
        ]
        hooks._settle()   # the first step over: only the root modules keep hooks
        other = nn.Linear(4, 4)
        settled = _ns("other(x)", {"other": other, "x": x}, 20_000)
        other_bare = _ns("lin(x)", {"lin": nn.Linear(4, 4), "x": x}, 20_000)
    finally:
        hooks.uninstall()
    rows.append(("first step only: a module call, added by the global forward hooks", hooked - bare))
    rows.append(("after it: a call of a module that is not a root, added", settled - other_bare))
    return rows


def _one(env_auto: str, epochs: int, dim: int, out: Path) -> float:
    cmd = [sys.executable, "-m", "rankwatch.agent.cli", "run", "--", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), "--epochs", str(epochs), "--samples", "2048", "--dim", str(dim), "--time-out", str(out)]
    env = {**os.environ, "RANKWATCH_AUTO": env_auto, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return float(Path(f"{out}.0").read_text())


def step_time(pairs: int, epochs: int, dim: int) -> dict:
    on, off, aa = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            order = [("1", on), ("0", off), ("1", aa)] if i % 2 == 0 else [("0", off), ("1", aa), ("1", on)]
            for auto, sink in order:
                sink.append(_one(auto, epochs, dim, Path(tmp) / f"t{i}{auto}{len(sink)}"))
    ratio = statistics.median(a / b for a, b in zip(on, off))
    control = statistics.median(a / b for a, b in zip(aa, on))
    return {"update_seconds_off": statistics.median(off), "update_seconds_on": statistics.median(on),
            "ratio_on_off": ratio, "aa_control": control, "pairs": pairs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dim", type=int, default=256)
    args = p.parse_args()
    for name, ns in per_event():
        print(f"| {name} | {ns:,.0f} ns |")
    r = step_time(args.pairs, args.epochs, args.dim)
    print(f"| update time, off / on | {r['update_seconds_off'] * 1e3:.2f} ms / {r['update_seconds_on'] * 1e3:.2f} ms |")
    print(f"| ratio on/off (median of {r['pairs']} pairs) | {r['ratio_on_off']:.4f} |")
    print(f"| A/A control, on/on | {r['aa_control']:.4f} |")


if __name__ == "__main__":
    main()
