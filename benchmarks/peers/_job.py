"""The job every system trains: the same MLP, data, optimizer and step log.

Each member appends one line per completed optimizer step to
``$PEERS_OUT/member<M>.steps``: the wall-clock time of the step's end and the world
size it ran in, flushed at once, so that the driver can read the survivors' clocks.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch
from torch import nn

WIDTH = int(os.environ.get("PEERS_WIDTH", "512"))
LAYERS = int(os.environ.get("PEERS_LAYERS", "4"))
BATCH = int(os.environ.get("PEERS_BATCH", "32"))
STEPS = int(os.environ.get("PEERS_STEPS", "100000"))


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every member starts from the same weights
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic data: a fixed function of (step, data-parallel rank)."""
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    return x, x.roll(1, dims=1)


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return nn.functional.mse_loss(model(x), y)


def average_gradients(model: nn.Module, group=None) -> None:
    """One flat all-reduce of every gradient (plain data parallelism)."""
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


class StepLog:
    """Appends ``time world_size`` per completed step to this member's file; with
    ``PEERS_DIGEST_EVERY=N``, also ``# digest <step> <hash>`` of the parameters' bytes every N
    steps (replicas that agree are equal bit for bit)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        out = os.environ.get("PEERS_OUT", ".")
        member = os.environ.get("PEERS_MEMBER", os.environ.get("RANK", "0"))
        self._f = open(os.path.join(out, f"member{member}.steps"), "a", buffering=1)
        self._f.write(f"# pid {os.getpid()}\n")
        self._every = int(os.environ.get("PEERS_DIGEST_EVERY", "0"))

    def step(self, world_size: int, model: nn.Module | None = None, step: int | None = None) -> None:
        self._f.write(f"{time.time():.6f} {world_size}\n")
        if self._every and model is not None and step is not None and step % self._every == 0:
            h = hashlib.sha1()
            for p in model.parameters():
                h.update(p.detach().contiguous().numpy().tobytes())
            self._f.write(f"# digest {step} {h.hexdigest()[:16]}\n")
        self._f.flush()
