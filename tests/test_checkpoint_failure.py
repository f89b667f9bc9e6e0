"""A save that fails on a full disk is reported and never wedges the job (real gloo, real DCP).

The disk is made full from outside the code under test: the worker's file-size limit
(``RLIMIT_FSIZE``, soft, with ``SIGXFSZ`` ignored) makes every write past 64 KB fail, as
a full disk or an exhausted quota does.  DCP reports such a failure as
``CheckpointException``, a ``BaseException``: a background save's record must still be
finished with the error (an ``except Exception`` used to let it through, so the record
was never finished and the next save waited for it for ever), and a blocking save must
raise an ordinary exception that the training loop's handlers see.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_WORKER = r"""
import json, os, resource, signal, sys
from pathlib import Path
import torch, torch.distributed as dist
from rankwatch.hooks.harness.dcp import MARKER, Checkpointer

root, store, asynchronous = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "async"
dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
model = torch.nn.Linear(256, 256)
opt = torch.optim.Adam(model.parameters())
model(torch.randn(2, 256)).sum().backward()
opt.step()
ckpt = Checkpointer(root=root, interval=1, asynchronous=asynchronous)
ckpt.setup()
out = {}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))       # the disk fills up
try:
    ckpt.save(1, model, opt)
    out["raised"] = None
except Exception as exc:       # what the training loop catches
    out["raised"] = type(exc).__name__
out["waited"] = ckpt.wait()    # returns: the failed write is over
out["records"] = [[r.step, r.ok, r.error[:300]] for r in ckpt.finished()]
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))            # space again
ckpt.save(2, model, opt)
ckpt.wait()
out["after"] = [[r.step, r.ok] for r in ckpt.finished()]
out["complete"] = sorted(p.name for p in root.iterdir() if (p / MARKER).is_file())
print(json.dumps(out))
dist.destroy_process_group()
"""


def _run(tmp_path: Path, mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path / "ckpt"), str(tmp_path / "store"), mode],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_background_save_on_a_full_disk_is_reported_and_the_next_save_goes_on(tmp_path):
    out = _run(tmp_path, "async")
    assert out["raised"] is None          # the training thread only staged the state
    ((step, ok, error),) = out["records"]
    assert (step, ok) == (1, False) and "CheckpointException" in error, out
    assert out["after"] == [[2, True]] and out["complete"] == ["step_00000002"], out


def test_a_blocking_save_on_a_full_disk_raises_an_ordinary_exception(tmp_path):
    out = _run(tmp_path, "sync")
    assert out["raised"] == "SaveFailed", out
    assert out["records"] == [] and out["after"] == [[2, True]], out
    assert out["complete"] == ["step_00000002"], out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
