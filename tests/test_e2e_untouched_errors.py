"""A user's error reaches the user as PyTorch raised it under zero-code instrumentation: no
rankwatch frame in its traceback, nothing of rankwatch's in its message, and no "Got the
following error when running the callback" wrapping (which a Python DDP comm hook's future
callback adds).  The unmodified scripts write their own traceback (``--traceback-out``); the
fault comes from their own arguments: a peer leaves mid-job (``--exit-at``), so the survivor's
collective fails in gloo, deterministically (rank 1 exits 0: torchrun keeps rank 0 running
until its own error ends it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

DATA = Path(__file__).parent / "data"


def _survivor_traceback(agent, script: str, tmp_path: Path, *args: str) -> str:
    cmd = [sys.executable, "-m", "rankwatch.agent.cli", "run", "--agent", str(agent.addr), "--node-id", "n0",
           "--", "--standalone", "--nproc-per-node", "2", str(DATA / script), "--exit-at", "1:3",
           "--traceback-out", str(tmp_path / "tb"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0, out.stderr[-3000:]
    assert "zero-code instrumentation" not in out.stderr, out.stderr[-3000:]   # it ran, untroubled
    assert not (tmp_path / "tb.1").exists()
    return (tmp_path / "tb.0").read_text()


def _assert_untouched(text: str, innermost: str) -> None:
    frames = [line for line in text.splitlines() if line.startswith("  File ")]
    assert frames and "rankwatch" not in text, text
    assert "Got the following error when running the callback" not in text, text
    assert innermost in frames[-1], text   # raised where PyTorch raised it
    assert text.rstrip().splitlines()[-1].startswith("RuntimeError: ") and "gloo" in text, text


def test_a_ddp_backward_whose_peer_died_raises_pytorchs_own_error(agent_proc, tmp_path):
    """The all-reduce in DDP's backward fails: the error comes out of the autograd engine's
    call, not out of a comm hook's future callback or a wrapper of the backward."""
    text = _survivor_traceback(agent_proc, "plain_ddp.py", tmp_path)
    _assert_untouched(text, "torch/autograd/graph.py")
    assert "loss.backward()" in text


def test_an_fsdp2_all_gather_whose_peer_died_raises_pytorchs_own_error(agent_proc, tmp_path):
    """FSDP2's all-gather goes through the timed ``torch.distributed`` verb and its timed
    ``Work.wait()``: neither shows in the traceback."""
    text = _survivor_traceback(agent_proc, "plain_fsdp.py", tmp_path, "--steps", "20")
    _assert_untouched(text, "torch/distributed/distributed_c10d.py")
    assert "work.wait()" in text
