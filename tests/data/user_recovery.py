"""A user's own FSDP2 loop with rankwatch's in-process recovery, written as the docs show it.

Its own model and dataset, ``init_device_mesh`` with a replicate dimension across nodes
and a shard dimension within one, FSDP2's ``fully_shard`` (HSDP), its own DataLoader,
and the docs' pattern: ``make(membership)`` builds everything that holds a process
group, the tier's ``start``/``recover``/``stepped`` around the loop, and the Monitor's
``step``/``mark``.  The global batch is kept after a node's loss by accumulating more
micro-batches on the ranks left.

``--snapshot-every K`` makes it a plain FSDP2 job instead: one mesh dimension over every
rank, no replicas, and the tier's peer snapshots every ``K`` steps (``snapshot_every``).
After a node's loss the tier hands back the snapshot's step; the loop's data position is a
function of the step, so the loader is simply made again from there.

``--device cuda`` runs it on NCCL, one GPU per worker, with fused AdamW.  ``--out DIR`` writes ``rank<R>.json`` per worker (R: its rank at the start; a worker that
joined the running round later writes ``joiner<PID>.json``): its pid, the
steps it applied in order and their world-mean losses (summed in the tier's commit), the world it ended in, its recoveries, and a digest of its
parameters' bytes (equal on every replica).
"""

import argparse
import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

import rankwatch.hooks as rw
from rankwatch.hooks.recovery import InProcessRecovery, Job, Membership

MICRO = 8                  # samples per micro-batch
DIM, CLASSES = 64, 10


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.down(F.gelu(self.up(x))))


class Points(Dataset):
    def __init__(self, n: int) -> None:
        # A generator each: the first samples are the same however many the job asks for.
        self.x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(0))
        self.y = torch.randint(0, CLASSES, (n,), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--global-batch", type=int, default=MICRO * 6, help="samples per step, all ranks together")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="plain FSDP2 over every rank, recovered from peer snapshots taken every K steps")
    p.add_argument("--until-world", type=int, default=0,
                   help="train past --steps (2000 steps at most) until the world has this many ranks again")
    p.add_argument("--until-recoveries", type=int, default=0,
                   help="with --until-world: and until the world has been rebuilt this many times")
    p.add_argument("--data-wait", type=float, default=0.0,
                   help="seconds each step waits for its data before it begins, as a slow input pipeline would")
    args = p.parse_args()
    torch.set_num_threads(1)
    dev = args.device
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])   # HSDP: one replica per node, sharded within it
    plain = args.snapshot_every > 0                  # plain FSDP2: one shard dimension, no replicas
    # The job's global batch is the user's setting, as in any training config (a worker that
    # joins later sees only its own node's WORLD_SIZE in its environment).
    global_batch = args.global_batch

    def make(membership: Membership) -> Job:
        world = dist.get_world_size()
        if plain:
            mesh = init_device_mesh(dev, (world,), mesh_dim_names=("shard",))
        else:
            mesh = init_device_mesh(dev, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        with torch.device("meta") if membership.generation else contextlib.nullcontext():
            model = Net()
        if not membership.generation:
            model.to(dev)
        fully_shard(model, mesh=mesh)
        if membership.generation:
            model.to_empty(device=dev)   # the tier copies the weights back from memory
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True if dev == "cuda" else None)
        return Job(model=model, optimizer=opt, replica_size=world if plain else per_node, extra={"mesh": mesh})

    limit = args.steps + 2000 if args.until_world else args.steps
    data = Points(global_batch * limit)

    def batches(done: int):
        """This rank's micro-batches from global step ``done`` on, for the current world."""
        rest = Subset(data, range(done * global_batch, len(data)))
        sampler = DistributedSampler(rest, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                                     shuffle=False)
        return iter(DataLoader(rest, batch_size=MICRO, sampler=sampler))

    # The last step is known only without --until-world (then a joiner may come in at any step).
    tier = InProcessRecovery(make, backend="nccl" if dev == "cuda" else "gloo",
                             total_steps=None if args.until_world else args.steps, snapshot_every=args.snapshot_every)
    job = tier.start()
    done = tier.completed                   # 0, or the step a joining worker came in at
    mon = rw.init(mesh=job.extra["mesh"])   # after start(): it made the process group
    tier.set_monitor(mon)
    first_rank = dist.get_rank()
    joined = tier.membership is not None and tier.membership.generation > 0   # came in later
    applied, recoveries, loader = [], [], None
    mean_losses: list[float] = []   # the world's mean loss of each applied step, for the log
    whole_at: int | None = None   # with --until-world: the step the world was whole again at

    def more(done: int) -> bool:
        """Train on?  Past --steps only until the world is whole again and has trained a few
        steps so (a recovery is reported after its first step).  Every rank answers alike."""
        nonlocal whole_at
        # The generation counts the world's rebuilds alike on every rank, a joiner's too.
        rebuilt = tier.membership is None or tier.membership.generation >= args.until_recoveries
        if dist.get_world_size() < args.until_world or not rebuilt:
            whole_at = None
        elif whole_at is None:
            whole_at = done
        return done < args.steps or (done < limit and (whole_at is None or done < whole_at + 5))

    while more(done):
        try:
            loader = loader or batches(done)
            time.sleep(args.data_wait)
            accum = max(1, global_batch // (MICRO * dist.get_world_size()))
            with mon.step(done + 1):
                step_loss = torch.zeros(1, device=dev)
                for _ in range(accum):
                    x, y = next(loader)
                    loss = F.cross_entropy(job.model(x.to(dev)), y.to(dev)) / accum
                    loss.backward()
                    step_loss += loss.detach()
                mon.mark("backward")
                carried = tier.carry(step_loss)   # the loss for the log rides in the tier's commit
                job.optimizer.step()
                job.optimizer.zero_grad()
                mon.mark("optimizer")
            if not carried:
                dist.all_reduce(step_loss)
            done += 1
            applied.append(done)
            mean_losses.append(step_loss.item() / dist.get_world_size())
            if (phases := tier.stepped(done)) is not None:
                recoveries[-1]["phases"] = phases
        except Exception as exc:  # noqa: BLE001 - recover() re-raises what is not a lost peer
            before = done
            job, done = tier.recover(exc, job, completed=done)
            recoveries.append({"step": done, "from": before, "world_size": dist.get_world_size()})
            loader = None
    tier.finish(done)
    digest = hashlib.sha1()
    for param in job.model.parameters():
        digest.update(param.detach().full_tensor().cpu().numpy().tobytes())
    args.out.mkdir(parents=True, exist_ok=True)
    # A worker that joined a running round (a spare's, or a restarted node's) names its file apart.
    name = f"joiner{os.getpid()}" if joined else f"rank{first_rank}"
    (args.out / f"{name}.json").write_text(json.dumps({
        "pid": os.getpid(), "applied": applied, "mean_losses": mean_losses, "world_size": dist.get_world_size(),
        "recoveries": recoveries, "digest": digest.hexdigest(),
        "nccl_error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}))
    mon.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
