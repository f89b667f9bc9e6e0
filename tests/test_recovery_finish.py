"""A worker still asking to join when the survivors finish the job exits cleanly (status 0),
told by the survivors' rank 0 (``InProcessRecovery.finish``), instead of waiting out its join
timeout and failing its node.  Real processes, a real TCPStore as the recovery store."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from rankwatch.hooks.recovery.store import JOIN_ENV, ROUND_ENV, STORE_ENV

SCRIPT = Path(__file__).parent / "data" / "recovery_finish.py"


@pytest.fixture
def store():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield s


def _env(store: TCPStore, **extra: str) -> dict[str, str]:
    return {**os.environ, STORE_ENV: f"127.0.0.1:{store.port}", ROUND_ENV: "job/round/1/",
            "OMP_NUM_THREADS": "1", **extra}


def _start(role: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), role, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)




def test_a_waiting_joiner_is_told_the_job_finished_and_exits_cleanly(store):
    survivor = _start("survivor", _env(store), "7")
    joiner = None
    try:
        assert survivor.stdout.readline().strip() == "survivor started"
        joiner = _start("joiner", _env(store, **{JOIN_ENV: "1"}))
        out, _ = joiner.communicate(timeout=90)
        assert joiner.returncode == 0, out
        assert "the job finished at step 7 while this worker asked to join" in out, out
        assert "joiner trains" not in out, out
        rest, _ = survivor.communicate(timeout=60)
        assert survivor.returncode == 0, rest
        assert "1 worker(s) asking to join were told to exit" in rest, rest
    finally:
        for p in (survivor, joiner):
            if p is not None and p.poll() is None:
                p.kill()


def test_a_joiner_that_asks_after_the_end_exits_at_once(store):
    store.set("job/round/1/inproc/finished", "12")   # as the survivors' rank 0 left it
    joiner = _start("joiner", _env(store, **{JOIN_ENV: "1"}))
    out, _ = joiner.communicate(timeout=90)
    assert joiner.returncode == 0, out
    assert "the job finished at step 12 while this worker asked to join" in out, out
    # A joiner imports torch's compiler stack before it asks, not while the survivors wait on
    # it in their new group (a meta-device init pulls it in: about a second on a fresh process).
    assert "joiner warmed: True" in out, out


def test_no_joiner_is_let_in_after_the_last_step(store):
    # After the last step the survivors' next collectives are the job's own end (a save, a
    # barrier): leaving "the step" there for a joiner would break them.  The request stays
    # pending for finish() to answer.  Rank 0's real watch, its background look included.
    from conftest import wait_for

    from rankwatch.hooks.recovery.joins import JoinWatch
    from rankwatch.hooks.recovery.protocol import Round

    env = _env(store, RANKWATCH_NODE_ID="n0")
    watch = JoinWatch(Round(store, "job/round/1/", env, settle=1.0), env, total_steps=5)
    watch.follow(rank=0, replica_size=1)
    watch.start()
    Round(store, "job/round/1/", {**env, "RANKWATCH_NODE_ID": "n9"}, settle=1.0).ask_to_join("127.0.0.1:1", 0, 1)
    wait_for(lambda: watch._due.is_set(), 10, what="rank 0's look saw the request")
    assert not watch.due(5), "a joiner let in after the last step"
    assert watch._due.is_set(), "the request stays pending"
    assert watch.due(4), "before the last step the survivors leave the step to admit it"
    assert not watch._due.is_set()
    watch.finish(5)
