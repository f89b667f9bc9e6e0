"""The two-worker schedule's locks (tests/cores.py), with real flock between separate opens,
as two xdist workers hold them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from cores import BACKGROUND, BACKGROUND_NICE, HEAVY, WAITS, Cores, can_renice, is_heavy, order

A, B, C, H, U = (Path(f"tests/test_{n}.py") for n in "abchu")
WEIGHTS = {A: WAITS, B: WAITS, C: WAITS, H: HEAVY, U: BACKGROUND}


def _item(path: Path) -> SimpleNamespace:
    return SimpleNamespace(path=path)


@pytest.fixture
def worker(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return lambda renice=True: Cores("run-1", WEIGHTS, renice)


def _enters(cores: Cores, path: Path) -> threading.Event:
    done = threading.Event()
    threading.Thread(target=lambda: (cores.enter(_item(path)), done.set()), daemon=True).start()
    return done


def test_two_light_files_run_at_once_and_a_heavy_file_waits_for_both(worker):
    w1, w2, w3 = worker(), worker(), worker()
    assert _enters(w1, A).wait(5) and _enters(w2, B).wait(5)   # one slot each
    heavy = _enters(w3, H)
    assert not heavy.wait(0.5)
    w1.leave(_item(A), None)
    assert not heavy.wait(0.5)           # B still holds a slot
    w2.leave(_item(B), _item(C))         # B's last test: its slot goes back
    assert heavy.wait(5)
    light = _enters(w1, C)
    assert not light.wait(0.5)           # nothing runs beside a heavy file
    w3.leave(_item(H), None)
    assert light.wait(5)


def test_a_file_keeps_its_slot_until_its_last_test(worker):
    w1, w2 = worker(), worker()
    assert _enters(w1, H).wait(5)
    w1.leave(_item(H), _item(H))         # more of the same file follow
    second = _enters(w2, A)
    assert not second.wait(0.5)
    w1.leave(_item(H), None)
    assert second.wait(5)


def test_a_waiting_heavy_file_is_not_overtaken_by_light_ones(worker):
    w1, w2, w3 = worker(), worker(), worker()
    assert _enters(w1, A).wait(5)
    heavy = _enters(w2, H)
    assert not heavy.wait(0.5)
    light = _enters(w3, B)                # a slot is free, but the heavy file is first in line
    assert not light.wait(0.5)
    w1.leave(_item(A), None)
    assert heavy.wait(5) and not light.is_set()
    w2.leave(_item(H), None)
    assert light.wait(5)


def test_without_xdist_nothing_is_locked(worker):
    solo = Cores(None, WEIGHTS, True)
    solo.enter(_item(H))
    other = worker()
    assert _enters(other, H).wait(5)


def _marked(path: str, *marks: str) -> SimpleNamespace:
    return SimpleNamespace(path=Path(path), get_closest_marker=lambda name: name if name in marks else None)


def test_a_files_weight_comes_from_its_marks():
    assert is_heavy([_marked("a"), _marked("a", "e2e")], gpu=False)
    assert not is_heavy([_marked("a"), _marked("a", "e2e", "light")], gpu=False)
    assert not is_heavy([_marked("a"), _marked("a")], gpu=True)
    assert is_heavy([_marked("a", "gpu")], gpu=True) and not is_heavy([_marked("a", "gpu")], gpu=False)


def test_the_order_deals_the_unit_files_out_after_the_light_e2e_then_the_heavy_files():
    items = [_marked("h1", "e2e"), _marked("u1"), _marked("l", "e2e", "light"), _marked("h2", "e2e"),
             _marked("u2"), _marked("u3"), _marked("h1"), _marked("u1"), _marked("u4")]
    weights = order(items, gpu=False)
    assert [str(i.path) for i in items] == ["l", "u1", "u1", "h1", "h1", "u2", "h2", "u3", "u4"]
    assert weights == {Path("h1"): HEAVY, Path("h2"): HEAVY, Path("l"): WAITS,
                       **{Path(f"u{n}"): BACKGROUND for n in range(1, 5)}}
    units = [_marked("u2"), _marked("u1")]
    order(units, gpu=False)
    assert [str(i.path) for i in units] == ["u2", "u1"]


@pytest.mark.skipif(not can_renice(), reason="no CAP_SYS_NICE: a thread's priority may not be raised back")
def test_a_unit_file_runs_beside_a_heavy_one_at_low_priority_and_the_next_file_at_normal(worker):
    own = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, 0)   # this file is a unit file: under xdist it starts reniced
    try:
        _unit_beside_heavy(worker)
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, own)


def _unit_beside_heavy(worker) -> None:
    w1, w2 = worker(), worker()
    assert _enters(w1, H).wait(5)
    w1.leave(_item(H), _item(H))          # the heavy file holds both slots
    base, nice, entered = os.getpriority(os.PRIO_PROCESS, 0), [], threading.Event()

    def second_worker() -> None:          # a nice value is a thread's: read it in the one that entered
        w2.enter(_item(U))
        nice.append(os.getpriority(os.PRIO_PROCESS, 0))
        entered.set()
        w2.leave(_item(U), _item(A))
        w2.enter(_item(A))
        nice.append(os.getpriority(os.PRIO_PROCESS, 0))

    t = threading.Thread(target=second_worker, daemon=True)
    t.start()
    # A unit file takes no slot: it enters at once, reniced.
    assert entered.wait(5) and nice == [BACKGROUND_NICE] != [base]
    w1.leave(_item(H), None)
    t.join(5)
    assert nice[1:] == [base]             # the light e2e file after it, once it has its slot, at the run's


_SESSION_PROBE = """
import json, os, subprocess, sys
from pathlib import Path
from types import SimpleNamespace
import cores
renice, autogroup = cores.background_priority("run-1")
worker = cores.Cores("run-1", {Path("u"): cores.BACKGROUND, Path("a"): cores.WAITS}, renice, autogroup)
def child_autogroup():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    line = Path(f"/proc/{child.pid}/autogroup").read_text().split()
    child.communicate(b"")
    return line
worker.enter(SimpleNamespace(path=Path("u")))
unit = child_autogroup()
worker.leave(SimpleNamespace(path=Path("u")), SimpleNamespace(path=Path("a")))
worker.enter(SimpleNamespace(path=Path("a")))
print(json.dumps({"renice": renice, "leader": os.getsid(0) == os.getpid(), "unit": unit, "next": child_autogroup()}))
"""


@pytest.mark.skipif(not can_renice() or not Path("/proc/self/autogroup").exists(),
                    reason="needs CAP_SYS_NICE and a kernel that groups the scheduler by session")
def test_a_worker_renices_its_own_session_so_that_its_units_yield_to_ranks_in_theirs(tmp_path):
    """torchrun starts each rank in a session of its own; where the kernel shares the CPU between
    sessions first, the worker's units must be niced as a session, in one that is the worker's alone."""
    here = Path("/proc/self/autogroup").read_text().split()[0]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "TMPDIR": str(tmp_path)}
    normal = lambda: os.setpriority(os.PRIO_PROCESS, 0, 0)   # noqa: E731 - from a reniced unit file's thread
    out = subprocess.run([sys.executable, "-c", _SESSION_PROBE], capture_output=True, text=True, env=env,
                         timeout=60, preexec_fn=normal)
    assert out.returncode == 0, out.stderr
    probe = json.loads(out.stdout)
    assert probe["renice"] and probe["leader"], probe
    (group, _, unit_nice), (next_group, _, next_nice) = probe["unit"], probe["next"]
    assert group == next_group != here    # the units' processes share the worker's own session
    assert (unit_nice, next_nice) == (str(BACKGROUND_NICE), "0")


def test_without_renicing_a_unit_file_takes_a_slot(worker):
    w1, w2 = worker(), worker(renice=False)
    assert _enters(w1, H).wait(5)
    unit = _enters(w2, U)
    assert not unit.wait(0.5)
    w1.leave(_item(H), None)
    assert unit.wait(5)


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0 or not can_renice(),
                    reason="needs root with CAP_SYS_NICE and setpriv, to take the capability away")
def test_without_the_capability_to_raise_priority_back_renicing_is_off():
    probe = [sys.executable, "-c", "import cores; print(cores.can_renice())"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    normal = lambda: os.setpriority(os.PRIO_PROCESS, 0, 0)   # noqa: E731 - from a reniced unit file's thread
    dropped = subprocess.run(["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice", *probe],
                             capture_output=True, text=True, env=env, timeout=60, preexec_fn=normal)
    assert dropped.stdout.strip() == "False", dropped.stderr
    kept = subprocess.run(probe, capture_output=True, text=True, env=env, timeout=60, preexec_fn=normal)
    assert kept.stdout.strip() == "True", kept.stderr


def test_a_closed_worker_lets_go_and_leaves_no_files(worker, tmp_path):
    w1, w2 = worker(), worker()
    assert _enters(w1, H).wait(5)
    waiting = _enters(w2, A)
    assert not waiting.wait(0.5)
    w1.close()                            # a worker that ends holding its slots
    assert waiting.wait(5)
    w2.close()
    assert list(tmp_path.glob("rankwatch-tests-cores-*")) == []
