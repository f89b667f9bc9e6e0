"""The backend a rank reports is read from its process group, however the group was made.

``init_device_mesh`` without ``init_process_group`` makes a default group whose
``dist.get_backend()`` is "undefined"; the hello must still say "gloo".  Real
torch.distributed, one rank, in a spawned process.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.multiprocessing as mp


def _rank(rank: int, out: str) -> None:
    # One rank: its store binds port 0.
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rankwatch.hooks.instrument.hello import hello as _hello

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    hello = _hello(mesh, "n0", None, "job")
    Path(out).write_text(f"{dist.get_backend()} {hello.backend} {dict(hello.mesh_shape)}")
    dist.destroy_process_group()


def test_a_device_mesh_made_group_reports_its_backend(tmp_path):
    out = tmp_path / "out"
    mp.start_processes(_rank, args=(str(out),), nprocs=1, join=True, start_method="spawn")
    assert out.read_text() == "undefined gloo {'dp': 1}"
