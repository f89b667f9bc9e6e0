"""A joiner's state from a live replica: pickled objects against tensors on the wire.

When a spare joins in process, the rank at its position in a live replica sends it its
shards of the parameters and of AdamW's state (:func:`rankwatch.hooks.recovery.state.transfer`).
This measures that hop alone, between two processes on gloo over loopback, for states the
size of a replica's shard of a model:

* ``pickled``: ``send_object_list`` of the whole state (what the tier did first): the
  sender serialises every tensor into one byte buffer, the receiver deserialises it;
* ``tensors``: :func:`~rankwatch.hooks.recovery.state.send_state` /
  :func:`~rankwatch.hooks.recovery.state.recv_state`: a small header of plain data, then each
  large tensor sent as it is into memory the receiver allocated.

The state is shaped like a transformer's: tensors of one layer's sizes, repeated until the
parameters reach the size asked, each with AdamW's two moments and a step count.  Each
size runs both ways alternately, ``--reps`` times each; the medians and their ratio are
printed, with the receiver's wall time from the first header to the last byte.

    python benchmarks/state_transfer.py --sizes-mb 32,128,384 --reps 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rankwatch.hooks.recovery.state import recv_state, send_state


def _state(params_mb: int, dim: int = 1024) -> dict:
    """Parameters of about ``params_mb`` MB (float32) in layer-shaped tensors, with AdamW's state."""
    shapes = [(dim, dim)] * 4 + [(4 * dim, dim), (dim, 4 * dim), (dim,), (dim,)]
    params, optim, total, i = {}, {}, 0, 0
    while total < params_mb * 2**20:
        shape = shapes[i % len(shapes)]
        t = torch.randn(shape)
        params[f"p{i}"] = t
        optim[f"p{i}"] = {"step": torch.tensor(float(i)), "exp_avg": torch.randn(shape),
                          "exp_avg_sq": torch.rand(shape)}
        total += t.numel() * 4
        i += 1
    return {"params": params, "optim": optim}


def _worker(rank: int, port: int, sizes: list[int], reps: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for mb in sizes:
        state = _state(mb) if rank == 0 else None
        for rep in range(reps):
            for mode in ("pickled", "tensors") if rep % 2 == 0 else ("tensors", "pickled"):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    if mode == "pickled":
                        dist.send_object_list([state], dst=1)
                    else:
                        send_state(state, 1)
                else:
                    if mode == "pickled":
                        box = [None]
                        dist.recv_object_list(box, src=0)
                        got = box[0]
                    else:
                        got = recv_state(0)
                    elapsed = time.perf_counter() - t0
                    assert torch.equal(got["params"]["p0"], got["params"]["p0"])  # touched, whole
                    out[(mb, mode, rep)] = elapsed
                    del got
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="32,128,384", help="parameter MB per rank (float32); state is 3x")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(port, sizes, args.reps, out), nprocs=2)
        results = dict(out)
    print(f"{'params MB':>9} {'state MB':>8} {'pickled s':>10} {'tensors s':>10} {'tensors/pickled':>16}")
    for mb in sizes:
        med = {m: statistics.median(v for (s, mode, _), v in results.items() if s == mb and mode == m)
               for m in ("pickled", "tensors")}
        print(f"{mb:>9} {3 * mb:>8} {med['pickled']:>10.3f} {med['tensors']:>10.3f} "
              f"{med['tensors'] / med['pickled']:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
