"""Resume from the newest complete DCP checkpoint; half-written ones are never loaded."""

from __future__ import annotations

import json

import pytest

from conftest import torchrun
from rankwatch.hooks.checkpoint import MARKER

pytestmark = pytest.mark.e2e


def run(tmp_path, name, steps, ckpt, *extra):
    out = tmp_path / name
    job = torchrun(2, "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--metrics-out", str(out),
                   "--log-every", "0", *extra, log=tmp_path / f"{name}.log")
    assert job.wait(180) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    return json.loads((out / "rank0.json").read_text())


def test_resume_continues_the_loss_curve(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, "first", 6, ckpt, "--checkpoint-interval", "3", "--no-rankwatch")
    assert first["start"] == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000003", "step_00000006"]
    # A save cut short (no marker) and one with a garbled marker, both newer.
    (ckpt / "step_00000009").mkdir()
    (ckpt / "step_00000009" / ".metadata").write_bytes(b"partial")
    (ckpt / "step_00000012").mkdir()
    (ckpt / "step_00000012" / MARKER).write_text("{not json")
    resumed = run(tmp_path, "resumed", 8, ckpt, "--no-rankwatch")
    assert resumed["start"] == 6
    straight = run(tmp_path, "straight", 8, tmp_path / "other", "--no-rankwatch")
    assert straight["losses"][:6] == pytest.approx(first["losses"], rel=1e-6)
    assert resumed["losses"] == pytest.approx(straight["losses"][6:], rel=1e-5)


def test_resume_on_fewer_ranks_keeps_the_global_batch(tmp_path):
    # Two dp ranks save at step 4; one rank resumes (DCP reshards) and accumulates two
    # micro-batches per step, so its losses follow the uninterrupted two-rank run.
    ckpt = tmp_path / "ckpt"
    run(tmp_path, "two", 4, ckpt, "--checkpoint-interval", "4", "--no-rankwatch")
    out = tmp_path / "one"
    job = torchrun(1, "--steps", "7", "--checkpoint-dir", str(ckpt), "--metrics-out", str(out),
                   "--log-every", "0", "--no-rankwatch", log=tmp_path / "one.log")
    assert job.wait(180) == 0, (tmp_path / "one.log").read_text()[-3000:]
    assert "accumulating 2 micro-batches" in (tmp_path / "one.log").read_text()
    resumed = json.loads((out / "rank0.json").read_text())
    assert resumed["start"] == 4
    straight = run(tmp_path, "straight", 7, tmp_path / "other", "--no-rankwatch")
    # The dp-mean loss of the straight run against the single rank's mean over its micro-batches.
    assert resumed["losses"] == pytest.approx(straight["dp_mean_losses"][4:], rel=1e-4)
