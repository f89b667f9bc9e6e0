"""How the suite shares this machine's two cores between pytest-xdist's two workers.

pyproject's addopts run two workers, a test file to a worker (``--dist loadfile``), in the order
this module sets (``--no-loadscope-reorder``: xdist would sort files by their test count).  A file
is *heavy* when it holds a test with the ``e2e`` or the ``gpu`` mark and the file is not
marked ``light``: its jobs take both cores (or the one GPU), and its checks (straggler ratios,
hang floors, the coordinator's load shedding, GPU timings) assume that no other job runs
beside them.  Every other file is *light*: the tests without those marks, and the e2e files
that mostly wait on timers (marked ``light``).

A heavy file runs alone; two light files may run at once, one on each worker.  The two
workers agree through ``flock`` on three files in a directory named for the run: a light
file holds one of two slots, a heavy file both, from its first test's setup to its last
test's teardown (module-scoped jobs included).  A gate keeps light files from overtaking a
heavy file that waits for its slots.  The order runs the light e2e files first (they wait
beside each other), then the other light files, then the heavy ones.

Unit files do not run beside heavy ones, not even at the lowest CPU priority.  Where the kernel
groups the scheduler by session (``CONFIG_SCHED_AUTOGROUP``) a thread's nice value weighs only
inside its session, and torchrun starts each rank in a session of its own: units at nice 19
still took a third of the CPU beside two busy ranks, and flattened a pipeline's measured stage
imbalance.  Niced as a session of their own (the autogroup's nice), they got 0.5 % of it while
a heavy file kept both cores busy, and their own timeouts (a 30 s rendezvous, a free port taken
by a job meanwhile) failed.

Without xdist (``-n 0``, or ``-p no:xdist``) nothing is locked and the order is the same.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_SLOTS = ("slot0", "slot1")


def is_heavy(items: list[pytest.Item], gpu: bool) -> bool:
    """A file's weight, from its items: an ``e2e`` test, or a ``gpu`` one on a machine with a
    GPU (elsewhere they are skipped), in a file not marked ``light``."""
    marked = any(i.get_closest_marker("e2e") or (gpu and i.get_closest_marker("gpu")) for i in items)
    return marked and not any(i.get_closest_marker("light") for i in items)


def order(items: list[pytest.Item], gpu: bool) -> dict[Path, bool]:
    """Sort ``items`` in place, whole files at a time (light e2e, other light, heavy), and
    return each file's weight (True: heavy).  Deterministic, as xdist needs every worker's
    collection to be the same."""
    by_file: dict[Path, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
    heavy = {path: is_heavy(its, gpu) for path, its in by_file.items()}

    def rank(path: Path) -> int:
        its = by_file[path]
        if heavy[path]:
            return 2
        return 0 if any(i.get_closest_marker("e2e") for i in its) else 1

    items[:] = [i for path in sorted(by_file, key=rank) for i in by_file[path]]   # stable
    return heavy


class Cores:
    """This worker's hold on the machine's cores: taken at a file's first test, given back
    after its last."""

    def __init__(self, run_id: str | None, heavy: dict[Path, bool]) -> None:
        self._heavy = heavy
        self._fds: dict[str, int] = {}
        self._held: list[str] = []
        self._root: Path | None = None
        if run_id:
            self._root = Path(tempfile.gettempdir()) / f"rankwatch-tests-cores-{os.getuid()}-{run_id}"
            self._root.mkdir(parents=True, exist_ok=True)
            self._fds = {n: os.open(self._root / n, os.O_RDWR | os.O_CREAT, 0o600) for n in ("gate", *_SLOTS)}

    def enter(self, item: pytest.Item) -> None:
        if not self._fds or self._held:
            return
        gate = self._fds["gate"]
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            if self._heavy.get(item.path, True):
                for name in _SLOTS:
                    fcntl.flock(self._fds[name], fcntl.LOCK_EX)
                    self._held.append(name)
                return
            for name in _SLOTS:
                try:
                    fcntl.flock(self._fds[name], fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                self._held.append(name)
                return
            fcntl.flock(self._fds[_SLOTS[0]], fcntl.LOCK_EX)   # both taken: a heavy file runs
            self._held.append(_SLOTS[0])
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)

    def leave(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        if nextitem is not None and nextitem.path == item.path:
            return
        while self._held:
            fcntl.flock(self._fds[self._held.pop()], fcntl.LOCK_UN)

    def close(self) -> None:
        """At the worker's end: let go, and remove the lock files.  The other worker opened
        them at its collection, so its descriptors keep working on the unlinked files."""
        for fd in self._fds.values():
            os.close(fd)   # closing releases any lock still held
        self._fds, self._held = {}, []
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
