"""How an open hang ends: resumed by a completed step, or ended with the job's ranks."""

from __future__ import annotations

from rankwatch.agent.detect.hang_verdict import RankProgress
from rankwatch.agent.detect.hang_end import hang_end, steps_at


def rank(r: int, steps: int, *, connected: bool = True, clean: bool = False) -> RankProgress:
    return RankProgress(rank=r, node="n0", step=steps, step_seconds=0.1, steps_completed=steps,
                        activity="train", progress_at=0.0, last_seen=0.0, connected=connected,
                        exited_cleanly=clean)


AT = steps_at([rank(0, 70), rank(1, 69)])


def test_still_hung():
    assert hang_end([rank(0, 70), rank(1, 69)], AT) is None


def test_two_completed_steps_resume():
    assert hang_end([rank(0, 72), rank(1, 71)], AT) == "resumed"


def test_the_stuck_step_ended_on_the_way_out_is_not_progress():
    # SIGTERM: the stuck rank's sys.exit closes its step scope (one step), then its goodbye.
    assert hang_end([rank(0, 70), rank(1, 70)], AT) is None
    assert hang_end([rank(0, 71, connected=False, clean=True),
                     rank(1, 70, connected=False, clean=True)], AT) == "ended"


def test_ranks_that_said_goodbye_while_hung_ended_it():
    # A SIGTERM handler that exits: each rank closes its monitor (a goodbye), no step done.
    assert hang_end([rank(0, 70, connected=False, clean=True),
                     rank(1, 69, connected=False, clean=True)], AT) == "ended"


def test_ranks_killed_while_hung_ended_it():
    assert hang_end([rank(0, 70, connected=False), rank(1, 69, connected=False)], AT) == "ended"
    assert hang_end([], AT) == "ended"


def test_a_survivor_streaming_without_a_step_is_not_resumed():
    # The hung peer died; the survivor's failed collective is recorded, but no step completes.
    assert hang_end([rank(0, 70), rank(1, 69, connected=False)], AT) is None


def test_a_restarted_worker_resumes_once_it_trains():
    assert hang_end([rank(0, 0), rank(1, 0)], AT) is None
    assert hang_end([rank(0, 3), rank(1, 0)], AT) == "resumed"
