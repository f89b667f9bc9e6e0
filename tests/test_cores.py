"""The two-worker schedule's locks (tests/cores.py), with real flock between separate opens,
as two xdist workers hold them."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from cores import Cores, is_heavy, order

A, B, C, H = (Path(f"tests/test_{n}.py") for n in "abch")
WEIGHTS = {A: False, B: False, C: False, H: True}


def _item(path: Path) -> SimpleNamespace:
    return SimpleNamespace(path=path)


@pytest.fixture
def worker(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return lambda: Cores("run-1", WEIGHTS)


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
    solo = Cores(None, WEIGHTS)
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


def test_the_order_runs_light_e2e_files_then_units_then_heavy_files_each_whole():
    items = [_marked("h", "e2e"), _marked("u"), _marked("l", "e2e", "light"), _marked("h"), _marked("u")]
    weights = order(items, gpu=False)
    assert [str(i.path) for i in items] == ["l", "u", "u", "h", "h"]
    assert weights == {Path("h"): True, Path("u"): False, Path("l"): False}


def test_a_closed_worker_lets_go_and_leaves_no_files(worker, tmp_path):
    w1, w2 = worker(), worker()
    assert _enters(w1, H).wait(5)
    waiting = _enters(w2, A)
    assert not waiting.wait(0.5)
    w1.close()                            # a worker that ends holding its slots
    assert waiting.wait(5)
    w2.close()
    assert list(tmp_path.glob("rankwatch-tests-cores-*")) == []
