"""Checkpoints with torch.distributed.checkpoint (DCP), complete or not at all.

A checkpoint is a directory ``step_<N>`` holding the DCP shards, each rank's
RNG state and, written last and atomically by rank 0 after every rank has
finished, ``COMPLETE`` (JSON with the step).  Only directories with that
marker are ever loaded, so a save cut short is ignored on resume.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["Checkpointer", "latest_complete"]

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def latest_complete(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root`` as ``(step, path)``, or None."""
    best = None
    if not root.is_dir():
        return None
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if not m or not (entry / MARKER).is_file():
            continue
        try:
            step = int(json.loads((entry / MARKER).read_text())["step"])
        except (ValueError, KeyError, OSError):
            log.warning("rankwatch: ignoring checkpoint %s with an unreadable marker", entry)
            continue
        if best is None or step > best[0]:
            best = (step, entry)
    return best


@dataclass(kw_only=True)
class Checkpointer:
    root: Path
    """Directory holding ``step_<N>`` checkpoints."""
    interval: int = 0
    """Save every this many steps; 0 saves only on request."""
    keep: int = 3
    """Complete checkpoints kept; older ones are deleted."""

    def due(self, step: int) -> bool:
        return self.interval > 0 and step > 0 and step % self.interval == 0

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any] | None = None) -> Path:
        """Save ``step`` on every rank (collective); rank 0 then marks it complete."""
        path = self.root / f"step_{step:08d}"
        rank = dist.get_rank()
        if rank == 0:
            if (path / MARKER).exists():  # an old run's complete save of this step
                shutil.rmtree(path)
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
        torch.save({"cpu": torch.get_rng_state()}, path / f"rng_rank{rank}.pt")
        dist.barrier()
        if rank == 0:
            _atomic_write(path / MARKER, json.dumps({"step": step, **(extra or {})}))
            self._prune()
        return path

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, dict]:
        """Load the newest complete checkpoint; return ``(step, extra)``, or ``(0, {})``."""
        found = latest_complete(self.root)
        if found is None:
            return 0, {}
        step, path = found
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        rng = path / f"rng_rank{dist.get_rank()}.pt"
        if rng.is_file():  # absent when resuming at a larger world size
            torch.set_rng_state(torch.load(rng, weights_only=True)["cpu"])
        extra = json.loads((path / MARKER).read_text())
        log.info("rankwatch: resumed from %s (step %d)", path, step)
        return step, extra

    def _prune(self) -> None:
        complete = sorted(
            (int(m.group(1)), p) for p in self.root.iterdir()
            if (m := _STEP_DIR.match(p.name)) and (p / MARKER).is_file())
        for _, path in complete[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(path, ignore_errors=True)
        newest = complete[-1][0] if complete else -1
        for p in self.root.iterdir():  # half-written saves older than the newest complete one
            m = _STEP_DIR.match(p.name)
            if m and int(m.group(1)) < newest and not (p / MARKER).is_file():
                shutil.rmtree(p, ignore_errors=True)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
