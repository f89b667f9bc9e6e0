"""The peer benchmark's job under nvidia-resiliency-ext's in-process restart (``inprocess.Wrapper``).

Launched by ``cli/run.py`` as three single-process torchrun "nodes" on c10d.  The wrapped
function re-creates the process group on each restart (a prefix of the wrapper's
iteration in the torchrun store); the model and the AdamW state live outside it, in
memory, so the survivors go on from the weights they hold.  ``PEERS_TUNED=1``: gloo timeout
2 s, monitor thread and process intervals 0.2 s, heartbeat timeout 3 s.  ``PEERS_FT=0``:
``Wrapper(enabled=False)``, i.e. the plain function (the steady-state control).
"""

import os
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from nvidia_resiliency_ext import inprocess

from _job import STEPS, StepLog, average_gradients, loss_of, make_model, make_optimizer

TUNED = os.environ.get("PEERS_TUNED") == "1"
FT = os.environ.get("PEERS_FT", "1") == "1"

log = StepLog()
member = int(os.environ["PEERS_MEMBER"])
model = make_model()
optimizer = make_optimizer(model)
progress = {"done": 0}  # outlives the wrapped function's restarts

# The Wrapper adds NVML-based GPU, NVLink and NIC health checks to every restart when
# LOCAL_RANK is set; on a machine without NVML they fail (NVMLError_LibraryNotFound ->
# HealthCheckError) and no restart ever succeeds.  Hide LOCAL_RANK while it is built.
local_rank = os.environ.pop("LOCAL_RANK", None)
if TUNED:
    short = timedelta(seconds=0.2)
    wrapper = inprocess.Wrapper(
        store_kwargs={"port": int(os.environ["PEERS_NVRX_PORT"])},
        monitor_thread_interval=short, monitor_process_interval=short,
        heartbeat_timeout=timedelta(seconds=3), enabled=FT,
    )
else:
    wrapper = inprocess.Wrapper(store_kwargs={"port": int(os.environ["PEERS_NVRX_PORT"])}, enabled=FT)
if local_rank is not None:
    os.environ["LOCAL_RANK"] = local_rank


@wrapper
def train(call_wrapper: Optional[inprocess.CallWrapper] = None) -> None:
    iteration = call_wrapper.iteration if call_wrapper is not None else 0
    store = dist.PrefixStore(f"peers/{iteration}/", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=60)))
    kwargs = {"timeout": timedelta(seconds=2)} if TUNED else {}
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), **kwargs)
    while progress["done"] < STEPS:
        optimizer.zero_grad()
        loss_of(model, progress["done"], member).backward()
        average_gradients(model)
        optimizer.step()
        progress["done"] += 1
        log.step(dist.get_world_size(), model, progress["done"])
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
