"""A training script written the way users write theirs, instrumented only as the README says.

Its own model and dataset, ``init_device_mesh`` (which makes the process
group), FSDP2's ``fully_shard`` (``--tp`` adds tensor parallelism on a 2-D
mesh), its own DataLoader, and the README's own-loop pattern: ``mon.steps``,
three marks, ``checkpoint_due``.  ``--slow-loader RANK:STEP:SECONDS`` makes one
rank's loader slow from STEP on (``--fetch-outside``: the older loop, each batch
fetched before ``with mon.step(n):`` opens); ``--hang-at RANK:STEP`` makes one rank stop in
STEP's forward for good.  Like many users' scripts it exits on SIGTERM (a
preemption), so ``mon.close()`` runs.
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import rankwatch.hooks as rw


class Net(nn.Module):
    def __init__(self, dim: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.down(F.gelu(self.up(x))))


class Points(Dataset):
    def __init__(self, n: int, dim: int, slow: tuple[int, int, float] | None, rank: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.slow = slow if slow and slow[0] == rank else None
        self.served = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.served += 1
        if self.slow and self.served // 8 >= self.slow[1]:  # 8 samples a batch
            time.sleep(self.slow[2] / 8)
        return self.x[i], self.y[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--slow-loader", default="")
    p.add_argument("--hang-at", default="")
    p.add_argument("--fetch-outside", action="store_true")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # preempted: exit, closing what is open
    world = int(os.environ["WORLD_SIZE"])
    if args.tp > 1:
        mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
    else:
        mesh = dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    if args.tp > 1:
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    slow = tuple(float(v) if i == 2 else int(v) for i, v in enumerate(args.slow_loader.split(":"))) \
        if args.slow_loader else None
    data = Points(8 * args.steps * dp_mesh.size(), 64, slow, rank)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(
        data, num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank(), shuffle=False))

    hang = tuple(int(v) for v in args.hang_at.split(":")) if args.hang_at else None

    def train_step(n: int, x: torch.Tensor, y: torch.Tensor) -> None:
        while hang == (rank, n):
            time.sleep(0.1)  # stuck (a deadlock in user code)
        loss = F.cross_entropy(model(x), y); mon.mark("forward")   # noqa: E702
        loss.backward();                     mon.mark("backward")  # noqa: E702
        opt.step(); opt.zero_grad();         mon.mark("optimizer")  # noqa: E702
        if mon.checkpoint_due(n):
            pass  # this script keeps no checkpoints

    mon = rw.init(mesh=mesh)  # after init_device_mesh made the process group
    if args.fetch_outside:
        for n, (x, y) in enumerate(loader, start=1):
            with mon.step(n):
                train_step(n, x, y)
    else:
        for n, (x, y) in mon.steps(loader):
            train_step(n, x, y)
    mon.close()  # before destroy_process_group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
