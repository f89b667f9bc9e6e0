"""A DDP script in the shape of PyTorch's DDP tutorial series, with CPU edits only.

It never imports rankwatch: under ``rankwatch run`` it is watched with no code change.  Its
own model, dataset, ``DistributedSampler`` and ``DataLoader``; ``init_process_group``, DDP,
SGD, ``loss.backward()``, ``optimizer.step()``.  The test's knobs are arguments, as a
user's script has them:

* ``--slow-loader RANK:SECONDS`` (RANK -1: every rank): each batch of that rank's loader
  takes SECONDS longer;
* ``--raise-at RANK:STEP``: that rank raises ``RuntimeError`` at that step;
* ``--exit-at RANK:STEP``: that rank leaves at that step, before its forward (exit code 0, as a
  peer that dies): the others' all-reduce in the backward fails (gloo: connection closed);
* ``--traceback-out PATH``: an exception that ends the script is written there first, as
  ``traceback`` formats it (``PATH.<rank>``), then raised on;
* ``--accumulate K``: K forward/backward micro-batches per optimizer step;
* ``--eval-every N``: an eval pass (``torch.no_grad``, no optimizer) every N steps;
* ``--count-out PATH``: the script writes its own count of optimizer steps there at the end;
* ``--dim D`` (width) and ``--time-out PATH``: the median wall time of its updates, as the
  script times them itself (benchmarks).
"""

import argparse
import gc
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Net(nn.Module):
    def __init__(self, dim: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.body(x))


class Points(Dataset):
    def __init__(self, n: int, dim: int, delay: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.delay:
            time.sleep(self.delay)
        return self.x[i], self.y[i]


def _pair(text: str | None) -> tuple[int, float] | None:
    if not text:
        return None
    a, b = text.split(":")
    return int(a), float(b)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--slow-loader", default=None)
    p.add_argument("--raise-at", default=None)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--count-out", default=None)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--time-out", default=None)
    p.add_argument("--exit-at", default=None)
    p.add_argument("--traceback-out", default=None)
    args = p.parse_args()
    try:
        train(args)
    except BaseException:
        if args.traceback_out:
            with open(f"{args.traceback_out}.{os.environ.get('RANK', '0')}", "w") as f:
                f.write(traceback.format_exc())
        raise


def train(args: argparse.Namespace) -> None:

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    slow, fail, leave = _pair(args.slow_loader), _pair(args.raise_at), _pair(args.exit_at)
    delay = slow[1] / args.batch_size if slow and slow[0] in (-1, rank) else 0.0
    data = Points(args.samples, args.dim, delay)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(data))
    model = DDP(Net(args.dim))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    steps, times, last = 0, [], time.perf_counter()
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if leave and leave[0] == rank and steps + 1 == int(leave[1]):
                sys.stdout.flush()
                os._exit(0)
            loss = F.cross_entropy(model(x), y) / args.accumulate
            loss.backward()
            if (i + 1) % args.accumulate:
                continue
            if fail and fail[0] == rank and steps + 1 == int(fail[1]):
                raise RuntimeError(f"injected failure at step {steps + 1} on rank {rank}")
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            now = time.perf_counter()
            times.append(now - last)
            last = now
            if args.eval_every and steps % args.eval_every == 0:
                model.eval()
                with torch.no_grad():
                    for xe, _ in zip(data.x[:64].split(16), range(4)):
                        model(xe)
                model.train()
                last = time.perf_counter()
    if args.count_out:
        with open(f"{args.count_out}.{rank}", "w") as f:
            f.write(str(steps))
    if args.time_out and times:
        kept = sorted(times[len(times) // 10:])   # the first tenth warms up
        with open(f"{args.time_out}.{rank}", "w") as f:
            f.write(str(kept[len(kept) // 2]))
    print(f"rank {rank}: {steps} steps", flush=True)
    # Free DDP (its reducer holds the process group, in reference cycles) while the interpreter
    # is whole: collected at exit instead, gloo's worker threads can abort the process.
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
