"""A world that comes back to an earlier shape (a node lost in process, then one joined) must
not reuse the earlier generation's meshes: DTensor caches sharding results under specs whose
meshes compare equal by shape, so a detached parameter's ``full_tensor()`` would ask for a
destroyed group.  Real torchrun, four gloo processes, real FSDP2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).parent / "data" / "mesh_generations.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    from rankwatch.agent.cli.ports import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MESH_STORE_PORT": str(free_port())}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), *args],
                          env=env, capture_output=True, text=True, timeout=180)


def test_a_renumbered_world_of_an_earlier_shape_uses_its_own_groups():
    out = _run()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("generations ok") == 4


def test_without_forgetting_the_earlier_generation_the_groups_are_stale():
    # The guard's reason, shown on this torch: without it the second generation fails.
    out = _run("--no-forget")
    assert out.returncode != 0 and "Could not resolve the process group" in out.stderr, out.stderr[-3000:]
