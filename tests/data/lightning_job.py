"""A PyTorch Lightning job as its users write one, launched by torchrun, on CPU and gloo.

It never imports rankwatch.  A small LightningModule, a synthetic dataset, and
``Trainer(strategy="ddp")``: under torchrun Lightning finds the rank and world in the
environment (its TorchElastic cluster environment) and starts no processes of its own.  The
test's knobs are arguments, as a user's script has them:

* ``--slow-loader RANK:SECONDS:FROM``: from optimizer step FROM on, each batch of that rank's
  loader takes SECONDS longer;
* ``--count-out PATH``: Lightning's own count of optimizer steps (``global_step``) is written
  there at the end, one file per rank (``PATH.<rank>``).
"""

import argparse
import gc
import os
import time

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class Points(Dataset):
    def __init__(self, n: int, dim: int, delay: float, from_sample: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.delay, self.from_sample = delay, from_sample
        self.served = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.served += 1
        if self.delay and self.served > self.from_sample:
            time.sleep(self.delay)
        return self.x[i], self.y[i]


class Classifier(L.LightningModule):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.body(x), y)
        self.log("loss", loss, sync_dist=True)   # an all-reduce outside forward and backward
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--slow-loader", default=None)
    p.add_argument("--count-out", default=None)
    args = p.parse_args()

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    delay, from_sample = 0.0, 0
    if args.slow_loader:
        who, seconds, start = args.slow_loader.split(":")
        if int(who) == rank:
            delay, from_sample = float(seconds) / args.batch_size, int(start) * args.batch_size
    L.seed_everything(0, verbose=False)
    data = Points(args.steps * args.batch_size * world, args.dim, delay, from_sample)
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")), max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Classifier(args.dim), DataLoader(data, batch_size=args.batch_size))
    if args.count_out:
        with open(f"{args.count_out}.{rank}", "w") as f:
            f.write(str(trainer.global_step))
    # What a careful user does: free DDP before the process group, and the group before exit
    # (gloo's threads can abort an interpreter that collects them at its end).
    del trainer
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
