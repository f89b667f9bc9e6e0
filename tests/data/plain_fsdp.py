"""An FSDP2 script the way users write one, with no rankwatch import.

``init_device_mesh`` makes the process group and a 1-D ``dp`` mesh (``--tp 2``: a
``("dp", "tp")`` mesh, tensor parallelism inside); ``fully_shard``; its own DataLoader.  In the
shape of a Hugging Face-style loop it has two optimizers (the body's AdamW and the head's
SGD) stepped one after the other after each backward, and a learning-rate scheduler.
``--count-out PATH`` writes the script's own count of updates there at the end.
``--exit-at RANK:STEP``: that rank leaves at that step, before its forward (exit code 0, as a
peer that dies): the others' collectives fail (gloo: connection closed).
``--traceback-out PATH``: an exception that ends the script is written there first, as
``traceback`` formats it (``PATH.<rank>``), then raised on.
"""

import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, dim: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.block = Block(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--count-out", default=None)
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

    world = int(os.environ["WORLD_SIZE"])
    if args.tp > 1:
        mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = Model()
    if args.tp > 1:
        parallelize_module(model.block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    body = torch.optim.AdamW(model.block.parameters(), lr=1e-3)
    head = torch.optim.SGD(model.head.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.StepLR(body, step_size=10)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4096, 32, generator=g), torch.randint(0, 10, (4096,), generator=g))
    dp_rank = mesh["dp"].get_local_rank()
    sampler = DistributedSampler(data, num_replicas=world // args.tp, rank=dp_rank)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    updates = 0
    leave = tuple(int(v) for v in args.exit_at.split(":")) if args.exit_at else None
    for x, y in loader:
        if leave and leave[0] == dist.get_rank() and updates + 1 == leave[1]:
            sys.stdout.flush()
            os._exit(0)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        body.step()
        head.step()
        schedule.step()
        body.zero_grad()
        head.zero_grad()
        updates += 1
        if updates == args.steps:
            break
    if args.count_out:
        with open(f"{args.count_out}.{dist.get_rank()}", "w") as f:
            f.write(str(updates))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
