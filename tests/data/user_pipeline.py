"""A pipeline-parallel training script written the way users write theirs, instrumented only
as the docs say (docs/instrumenting.md, "Pipeline parallelism").

Its own model (an embedding, residual MLP blocks and a head), its own split into stages (the
last stage holds the head and three times the first stage's blocks, as a head-heavy split
does), ``init_device_mesh`` with a ``pp`` dimension, ``torch.distributed.pipelining``'s
``PipelineStage`` with its shapes given (gloo cannot infer them) and a GPipe schedule over
``--microbatches``, its own dataset and DataLoader, and the README's own-loop pattern:
``rw.init(mesh=mesh)``, ``mon.steps``, a mark after the schedule's step and one after the
optimizer.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.utils.data import DataLoader, Dataset

import rankwatch.hooks as rw

DIM, CLASSES, FEATURES = 96, 10, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Stage(nn.Module):
    """One stage of the model: the first embeds, the last classifies."""

    def __init__(self, blocks: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, DIM) if first else None
        self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))
        self.head = nn.Linear(DIM, CLASSES) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.blocks(x)
        return self.head(x) if self.head is not None else x


class Samples(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    args = p.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    stage, stages = mesh.get_local_rank("pp"), world
    first, last = stage == 0, stage == stages - 1
    torch.manual_seed(stage)
    model = Stage(blocks=3 if last else 1, first=first, last=last)
    mb = args.batch // args.microbatches
    act = torch.zeros(mb, DIM)
    inp = torch.zeros(mb, FEATURES) if first else act
    out = torch.zeros(mb, CLASSES) if last else act
    pipe = PipelineStage(model, stage, stages, torch.device("cpu"), input_args=(inp,), output_args=(out,),
                         input_grads=(None,) if first else (act,), output_grads=(None,) if last else (out,),
                         group=mesh.get_group("pp"))
    schedule = ScheduleGPipe(pipe, args.microbatches, loss_fn=F.cross_entropy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Samples(args.batch * args.steps), batch_size=args.batch, shuffle=False)

    mon = rw.init(mesh=mesh)  # after init_device_mesh made the process group
    for _n, (x, y) in mon.steps(loader):
        if first:
            schedule.step(x)
        elif last:
            schedule.step(target=y)
        else:
            schedule.step()
        mon.mark("forward")   # the schedule ran this stage's forwards and backwards
        opt.step()
        opt.zero_grad()
        mon.mark("optimizer")
    mon.close()  # before destroy_process_group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
