"""The step commit's steady cost on one device: with the commit before each optimizer step
against without, in alternating blocks of steps, after an A/A control.

    python benchmarks/commit_cost.py [--device cuda] [--steps 2000] [--block 20]

One process, world size 1 (NCCL on ``cuda``, gloo on ``cpu``).  On NCCL the commit makes
the host wait for its result before the optimizer step is enqueued
(``hooks/recovery/commit.py``), so what it costs is the GPU's idle time while the host
catches up.  The loop is a user's: a bf16 MLP, forward, backward, Adam (foreach), and, with
``--item-every N``, the loss read on the host every N steps (0: never, the commit's worst
case); ``--fused`` takes fused Adam, which the commit gates on the device instead, with
no host wait.  Two model sizes: ``--dim``/``--layers`` give a GPU-bound step, and a small one a
launch-bound step.  Each figure is the median over block pairs of (block with) / (block without); the A/A control labels blocks the
same way with the commit on throughout.  A block's last step waits for the GPU, so each
block's figure is its wall time (the sum of its steps): a loop that never reads the loss
lets the host run ahead, and single steps then time only the enqueueing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import block_ratios, quantile  # noqa: E402

from rankwatch.hooks.recovery.commit import StepCommit  # noqa: E402


def _loop(args: argparse.Namespace, dim: int, layers: int, batch: int):
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(dim, dim, bias=False), torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks).to(device=args.device, dtype=dtype)
    opt = (torch.optim.Adam(model.parameters(), lr=1e-5, fused=True) if args.fused
           else torch.optim.Adam(model.parameters(), lr=1e-5, foreach=True))
    commit = StepCommit("nccl" if args.device == "cuda" else "gloo")
    commit.attach(opt)
    x = torch.randn(batch, dim, device=args.device, dtype=dtype)

    def step(n: int) -> float:
        t0 = time.perf_counter()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.item_every and n % args.item_every == 0:
            loss.item()
        if args.device == "cuda" and n % args.block == args.block - 1:
            torch.cuda.synchronize()   # a block's last step: its time includes the GPU's backlog
        return time.perf_counter() - t0

    return commit, step


def _measure(args: argparse.Namespace, label: str, dim: int, layers: int, batch: int) -> None:
    commit, step = _loop(args, dim, layers, batch)
    for n in range(50):
        step(n)
    for control in (True, False):
        times, arms = [], []
        for i in range(args.steps):
            on = (i // args.block) % 2 == 0
            commit._on = on or control
            times.append(step(i))
            arms.append(on)
        commit._on = True
        r = block_ratios(times, arms, args.block, whole=True)
        print(f"| {label} | {'A/A control' if control else 'with / without commit'} | "
              f"{sum(times) / len(times) * 1e3:.3f} ms | {statistics.median(r):.4f} "
              f"({quantile(r, 0.25):.4f}-{quantile(r, 0.75):.4f}, {len(r)} pairs) |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=2000, help="steps per half (A/A, then A/B)")
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--fused", action="store_true",
                    help="fused Adam: the commit gates it on the device, with no host wait")
    ap.add_argument("--item-every", type=int, default=0, help="read the loss on the host every N steps")
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8192)
    args = ap.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{tmp}/store",
                                rank=0, world_size=1, timeout=timedelta(seconds=60))
        try:
            print(f"device {args.device}, {'fused' if args.fused else 'foreach'} Adam, loss read every {args.item_every or 'never'} step(s), "
                  f"{os.environ.get('TORCH_NCCL_ASYNC_ERROR_HANDLING', 'default')} error handling")
            print("| model | arm | mean step | ratio (IQR) |\n|---|---|---|---|")
            _measure(args, f"MLP {args.dim}x{args.layers}, batch {args.batch}", args.dim, args.layers, args.batch)
            _measure(args, "small MLP 1024x4, batch 256 (launch-bound)", 1024, 4, 256)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
