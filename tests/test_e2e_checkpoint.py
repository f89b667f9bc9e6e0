"""Resume from the newest complete DCP checkpoint; half-written ones are never loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import processes_cleaned_up, torchrun
from rankwatch.hooks.harness.dcp import MARKER, complete_checkpoints

pytestmark = pytest.mark.e2e


def run(tmp_path, name, steps, ckpt, *extra):
    out = tmp_path / name
    job = torchrun(2, "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--metrics-out", str(out),
                   "--log-every", "0", *extra, log=tmp_path / f"{name}.log")
    assert job.wait(180) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    return json.loads((out / "rank0.json").read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The two resume tests' reference: the default model trained 8 steps uninterrupted, saving
    at steps 3 and 6 (each test resumes from a copy of those checkpoints)."""
    tmp = tmp_path_factory.mktemp("straight")
    with processes_cleaned_up():
        metrics = run(tmp, "straight", 8, tmp / "ckpt", "--checkpoint-interval", "3", "--no-rankwatch")
    return metrics, tmp / "ckpt"


def _copy(ckpt: Path, to: Path, *drop: int) -> Path:
    shutil.copytree(ckpt, to)
    for step in drop:
        shutil.rmtree(to / f"step_{step:08d}")
    return to


def test_resume_continues_the_loss_curve(tmp_path, straight):
    metrics, saved = straight
    assert metrics["start"] == 0
    assert sorted(p.name for p in saved.iterdir()) == ["step_00000003", "step_00000006"]
    ckpt = _copy(saved, tmp_path / "ckpt")
    # A save cut short (no marker) and one with a garbled marker, both newer.
    (ckpt / "step_00000009").mkdir()
    (ckpt / "step_00000009" / ".metadata").write_bytes(b"partial")
    (ckpt / "step_00000012").mkdir()
    (ckpt / "step_00000012" / MARKER).write_text("{not json")
    resumed = run(tmp_path, "resumed", 8, ckpt, "--no-rankwatch")
    assert resumed["start"] == 6
    assert resumed["losses"] == pytest.approx(metrics["losses"][6:], rel=1e-5)


def test_resume_on_fewer_ranks_keeps_the_global_batch(tmp_path, straight):
    # Two dp ranks saved at step 3; one rank resumes (DCP reshards) and accumulates two
    # micro-batches per step, so its losses follow the uninterrupted two-rank run.
    metrics, saved = straight
    ckpt = _copy(saved, tmp_path / "ckpt", 6)
    out = tmp_path / "one"
    job = torchrun(1, "--steps", "6", "--checkpoint-dir", str(ckpt), "--metrics-out", str(out),
                   "--log-every", "0", "--no-rankwatch", log=tmp_path / "one.log")
    assert job.wait(180) == 0, (tmp_path / "one.log").read_text()[-3000:]
    assert "accumulating 2 micro-batches" in (tmp_path / "one.log").read_text()
    resumed = json.loads((out / "rank0.json").read_text())
    assert resumed["start"] == 3
    # The dp-mean loss of the straight run against the single rank's mean over its micro-batches.
    assert resumed["losses"] == pytest.approx(metrics["dp_mean_losses"][3:6], rel=1e-4)


def _kill_tree(job) -> None:
    """SIGKILL torchrun and its workers (each worker runs in its own session)."""
    import os
    import signal

    import psutil

    try:
        procs = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
    except psutil.Error:
        procs = []
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    job.wait(30)


def test_killed_during_saves_every_resume_loads_a_complete_checkpoint(tmp_path):
    # A job saving (asynchronously) every step is SIGKILLed, workers and all, at five
    # different moments after a save begins: 0, 5, 15, 40 and 100 ms after its directory
    # appears.  Each restart must load the newest *complete* checkpoint on disk at the
    # kill, and the last run's losses must be exactly those of a run never interrupted:
    # no step lost, none applied twice.
    import re
    import time

    from rankwatch.hooks.harness.dcp import latest_complete

    steps = 60
    ckpt = tmp_path / "ckpt"
    common = ("--checkpoint-dir", str(ckpt), "--checkpoint-interval", "1", "--log-every", "0",
              "--no-rankwatch", "--dim", "128", "--hidden-dim", "512")
    newest_complete = 0
    half_written = []
    for i, delay in enumerate((0.0, 0.005, 0.015, 0.040, 0.100)):
        log = tmp_path / f"killed{i}.log"
        job = torchrun(2, "--steps", str(steps), *common, log=log)
        dirs = lambda: {p.name for p in ckpt.iterdir()} if ckpt.is_dir() else set()  # noqa: E731
        seen = dirs()
        deadline = time.monotonic() + 120
        target = newest_complete + 3  # let each run train a few steps past its resume point
        while time.monotonic() < deadline and job.poll() is None:
            new = dirs() - seen
            if any(int(n.split("_")[1]) >= target for n in new):
                break
            seen |= new
            time.sleep(0.001)
        assert job.poll() is None, log.read_text()[-3000:]
        time.sleep(delay)
        _kill_tree(job)
        if i:  # it resumed from the newest complete checkpoint of the kill before
            m = re.search(r"resumed from \S+ \(step (\d+)\)", log.read_text())
            assert m and int(m.group(1)) == newest_complete, (newest_complete, log.read_text()[-2000:])
        found = latest_complete(ckpt)
        assert found is not None
        newest_complete = found[0]
        half_written += [f"{p.name}: {sorted(f.name for f in p.iterdir())}" for p in ckpt.iterdir()
                         if p.name.startswith("step_") and not (p / MARKER).exists()]
    print(f"kills left {len(half_written)} half-written saves:", *half_written, sep="\n  ")
    assert half_written, "no kill landed during a save"
    out = tmp_path / "final"
    job = torchrun(2, "--steps", str(steps), *common, "--metrics-out", str(out),
                   log=tmp_path / "final.log")
    assert job.wait(180) == 0, (tmp_path / "final.log").read_text()[-3000:]
    final = json.loads((out / "rank0.json").read_text())
    assert final["start"] == newest_complete
    straight = run(tmp_path, "straight", steps, tmp_path / "other", "--no-rankwatch",
                   "--dim", "128", "--hidden-dim", "512")
    assert final["losses"] == pytest.approx(straight["losses"][newest_complete:], rel=1e-5)


def test_checkpoint_sync_blocks_the_training_thread_until_written(agent_proc, tmp_path):
    # --checkpoint-sync: each save is written before training goes on.  Its records say so,
    # and the files on disk agree: all were written inside the training thread's blocked time.
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    job = torchrun(2, "--steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-interval", "3",
                   "--checkpoint-sync", "--metrics-out", str(out), "--log-every", "0",
                   agent=agent_proc.addr, log=tmp_path / "job.log")
    assert job.wait(180) == 0, (tmp_path / "job.log").read_text()[-3000:]
    for r in (0, 1):
        saves = json.loads((out / f"rank{r}.json").read_text())["checkpoints"]
        assert [s["step"] for s in saves] == [3, 6], saves
        for s in saves:
            assert s["ok"] and s["asynchronous"] is False, s
            assert s["blocked"] == s["completed_after"] > 0, s
    incidents = [i for i in agent_proc.status()["incidents"] if i["kind"] == "checkpoint"]
    assert sorted(i["step"] for i in incidents) == [3, 6], incidents
    for inc in incidents:
        d = inc["detail"]
        assert d["ok"] and d["asynchronous"] is False and d["seconds"] == d["complete_seconds"] > 0, d
        path = ckpt / f"step_{inc['step']:08d}"
        assert (path / MARKER).is_file()
        # Rank 0 marks the save complete after the others' barrier: its own blocked time covers
        # the marker too.  Every other file is written before any rank's save returns.
        files = [f for f in path.iterdir() if inc["rank"] == 0 or f.name != MARKER]
        assert any(f.suffix == ".distcp" for f in files) and (path / ".metadata") in files
        end = d["started_at"] + d["seconds"]
        late = {f.name: round(f.stat().st_mtime - end, 4) for f in files if f.stat().st_mtime > end}
        assert not late, f"written after the training thread went on (s): {late}"


_SMALL = ("--checkpoint-interval", "5", "--no-rankwatch", "--dim", "128", "--hidden-dim", "512")


@pytest.fixture(scope="module")
def saved20(tmp_path_factory):
    """20 steps of a small model saved every 5: steps 10, 15 and 20 kept (each test damages a copy)."""
    tmp = tmp_path_factory.mktemp("saved20")
    with processes_cleaned_up():
        metrics = run(tmp, "first", 20, tmp / "ckpt", *_SMALL)
    assert [step for step, _ in complete_checkpoints(tmp / "ckpt")] == [20, 15, 10]
    return metrics, tmp / "ckpt"


def test_a_corrupt_newest_checkpoint_is_skipped_and_the_one_before_it_loaded(tmp_path, saved20):
    # A shard of the newest complete checkpoint is cut short on disk after its marker was
    # written (a storage fault).  The restarted job must not fail on it at every restart:
    # every rank skips it alike, loads the one before it and trains on, and the steps after
    # it are trained again exactly as the first run trained them.
    first, saved = saved20
    ckpt = _copy(saved, tmp_path / "ckpt")
    newest = ckpt / "step_00000020"
    shards = sorted(newest.glob("*.distcp"))
    assert (newest / MARKER).exists() and shards
    shards[-1].write_bytes(shards[-1].read_bytes()[:100])
    again = run(tmp_path, "again", 25, ckpt, *_SMALL)
    log = (tmp_path / "again.log").read_text()
    assert "checkpoint" in log and "step_00000020 could not be loaded" in log, log[-3000:]
    assert again["start"] == 15
    assert again["losses"][:5] == pytest.approx(first["losses"][15:20], rel=1e-5)
    # The bad one's marker was set aside, and step 20 was saved again whole.
    assert (newest / f"{MARKER}.unreadable").exists()
    assert [step for step, _ in complete_checkpoints(ckpt)] == [25, 20, 15]


def test_no_loadable_checkpoint_fails_the_job_instead_of_starting_over(tmp_path, saved20):
    ckpt = _copy(saved20[1], tmp_path / "ckpt")
    for shard in ckpt.glob("step_*/*.distcp"):
        shard.write_bytes(b"")
    job = torchrun(2, "--steps", "25", "--checkpoint-dir", str(ckpt), *_SMALL, log=tmp_path / "again.log")
    assert job.wait(180) != 0
    log = (tmp_path / "again.log").read_text()
    assert "LoadFailed: none of the 3 complete checkpoint(s)" in log, log[-3000:]
