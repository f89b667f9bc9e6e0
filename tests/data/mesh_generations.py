"""Two generations of one world, as an in-process recovery makes them: the same mesh shape,
the ranks renumbered.  ``param.detach().full_tensor()`` in the second must use the second
generation's groups.  Run under torchrun with 4 processes; ``--no-forget`` skips the tier's
cache clearing (the bug it guards against)."""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from rankwatch.hooks.recovery.net import forget_old_meshes


def generation(g: int, rank: int, store: dist.Store, forget: bool) -> None:
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gen/{g}/", store), rank=rank, world_size=4)
    if forget:
        forget_old_meshes()   # as the tier does after each new default group
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    fully_shard(model, mesh=mesh)
    whole = next(model.parameters()).detach().full_tensor()
    assert whole.shape == (8, 8)
    dist.destroy_process_group()


def main() -> None:
    forget = "--no-forget" not in sys.argv
    first = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MESH_STORE_PORT"]), 4, first == 0,
                          timeout=datetime.timedelta(seconds=60))
    generation(0, first, store, forget)
    generation(1, 3 - first, store, forget)   # every rank renumbered, the shape the same
    print(f"generations ok on {first}", flush=True)


if __name__ == "__main__":
    main()
