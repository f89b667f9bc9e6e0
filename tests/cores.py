"""How the suite shares this machine's two cores between pytest-xdist's two workers.

pyproject's addopts run two workers, a test file to a worker (``--dist loadfile``), in the order
this module sets (``--no-loadscope-reorder``).  Each file has a weight:

* **heavy**: it holds a test with the ``e2e`` or the ``gpu`` mark and is not marked ``light``.
  Its jobs take both cores (or the one GPU), and its checks (straggler ratios, hang floors, the
  coordinator's load shedding, GPU timings) assume that no other job competes with them.
* **waits**: an e2e file marked ``light``: its tests mostly wait on timers.
* **background**: every other file (the unit tests).  It runs at the lowest CPU priority
  (nice :data:`BACKGROUND_NICE`), so it takes the cycles that the file beside it leaves idle
  and little more.  Where this process may not raise a thread's priority back again (no
  ``CAP_SYS_NICE``), a background file is weighed as *waits* instead.

A nice value weighs only against the threads of its own scheduling group.  Where the kernel
groups by session (``CONFIG_SCHED_AUTOGROUP``, on by default in most distributions' kernels),
it first shares the CPU between sessions, and torchrun starts each rank in a session of its
own: a reniced unit in the run's session still took a rank's share (a third of the CPU beside
two busy ranks, measured).  So each worker moves to a session of its own (:func:`background_priority`)
and sets that session's autogroup to the background nice as well (about 0.5 % beside them).

A heavy file runs with no other file at normal priority beside it; two *waits* files may run at
once.  The two workers agree through ``flock`` on three files in a directory named for the run:
a *waits* file holds one of two slots, a heavy file both, from its first test's setup to its
last test's teardown (module-scoped jobs included); a background file holds none.  A gate keeps
*waits* files from overtaking a heavy file that waits for its slots.  The order: the *waits*
files, then the heavy ones, with the background files dealt out between them, so that while one
worker runs a file at normal priority the other mostly runs units in the cycles it leaves.

Without xdist (``-n 0``, or ``-p no:xdist``) nothing is locked or reniced, and the order is the same.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

HEAVY, WAITS, BACKGROUND = "heavy", "waits", "background"
BACKGROUND_NICE = 19   # CFS weighs a thread at nice 19 at 15, one at nice 0 at 1024
_SLOTS = ("slot0", "slot1")
_AUTOGROUP = Path("/proc/self/autogroup")


def is_heavy(items: list[pytest.Item], gpu: bool) -> bool:
    """A file's weight, from its items: an ``e2e`` test, or a ``gpu`` one on a machine with a
    GPU (elsewhere they are skipped), in a file not marked ``light``."""
    marked = any(i.get_closest_marker("e2e") or (gpu and i.get_closest_marker("gpu")) for i in items)
    return marked and not any(i.get_closest_marker("light") for i in items)


def weigh(items: list[pytest.Item], gpu: bool) -> str:
    """A file's weight: :data:`HEAVY`, :data:`WAITS` (a light e2e file) or :data:`BACKGROUND`."""
    if is_heavy(items, gpu):
        return HEAVY
    return WAITS if any(i.get_closest_marker("e2e") for i in items) else BACKGROUND


def order(items: list[pytest.Item], gpu: bool) -> dict[Path, str]:
    """Sort ``items`` in place, whole files at a time, and return each file's weight: the
    *waits* files, then the heavy ones, each followed by its share of the background files.
    Deterministic, as xdist needs every worker's collection to be the same."""
    by_file: dict[Path, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
    weight = {path: weigh(its, gpu) for path, its in by_file.items()}
    fore = [p for w in (WAITS, HEAVY) for p in by_file if weight[p] == w]
    back = [p for p in by_file if weight[p] == BACKGROUND]
    files = [] if fore else back
    for i, path in enumerate(fore):
        files += [path, *back[i * len(back) // len(fore):(i + 1) * len(back) // len(fore)]]
    items[:] = [i for path in files for i in by_file[path]]
    return weight


def background_priority(run_id: str | None) -> tuple[bool, Path | None]:
    """Whether this xdist worker may run background files reniced, and the autogroup control
    file (``/proc/self/autogroup``) to renice with them, whose nice value weighs this worker's
    whole session against the others.  Where the kernel has autogroups the worker first moves
    to a session of its own; where it cannot (it leads a process group), renicing is off."""
    if not run_id or not can_renice():
        return False, None
    if not _AUTOGROUP.exists():
        return True, None
    try:
        os.setsid()
    except OSError:
        return False, None
    return True, _AUTOGROUP


def can_renice() -> bool:
    """Whether a thread here may lower its CPU priority and raise it back again (probed on a
    thread of its own: on Linux a nice value belongs to a thread)."""
    ok = []

    def probe() -> None:
        try:
            base = os.getpriority(os.PRIO_PROCESS, 0)
            os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICE)
            os.setpriority(os.PRIO_PROCESS, 0, base)
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return bool(ok)


class Cores:
    """This worker's hold on the machine's cores: taken at a file's first test, given back
    after its last.

    Args:
        run_id: the xdist run's id (None without xdist: nothing is locked or reniced).
        weight: each file's weight (:func:`order`).
        renice: whether background files may run reniced (:func:`can_renice`); else they
            are weighed as *waits*.
        autogroup: this worker's session's autogroup control file (:func:`background_priority`), set
            to the background's nice with the thread; None where there is none to set.
    """

    def __init__(self, run_id: str | None, weight: dict[Path, str], renice: bool,
                 autogroup: Path | None = None) -> None:
        self._weight = weight if renice else {p: WAITS if w == BACKGROUND else w for p, w in weight.items()}
        self._fds: dict[str, int] = {}
        self._held: list[str] = []
        self._root: Path | None = None
        self._base = os.getpriority(os.PRIO_PROCESS, 0)
        self._niced = False
        self._autogroup = autogroup
        if run_id:
            self._root = Path(tempfile.gettempdir()) / f"rankwatch-tests-cores-{os.getuid()}-{run_id}"
            self._root.mkdir(parents=True, exist_ok=True)
            self._fds = {n: os.open(self._root / n, os.O_RDWR | os.O_CREAT, 0o600) for n in ("gate", *_SLOTS)}

    def enter(self, item: pytest.Item) -> None:
        if not self._fds or self._held:
            return
        weight = self._weight.get(item.path, HEAVY)
        self._nice(weight == BACKGROUND)
        if weight == BACKGROUND:
            return
        gate = self._fds["gate"]
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            if weight == HEAVY:
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

    def _nice(self, background: bool) -> None:
        """This thread (the tests', and so the processes they start) and this worker's
        session at the background's priority, or back at normal priority."""
        if background != self._niced:
            os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICE if background else self._base)
            if self._autogroup is not None:
                self._autogroup.write_text(str(BACKGROUND_NICE if background else 0))
            self._niced = background

    def leave(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        if nextitem is not None and nextitem.path == item.path:
            return
        while self._held:
            fcntl.flock(self._fds[self._held.pop()], fcntl.LOCK_UN)

    def close(self) -> None:
        """At the worker's end: let go, and remove the lock files.  The other worker opened
        them at its collection, so its descriptors keep working on the unlinked files."""
        if self._fds:
            self._nice(False)
        for fd in self._fds.values():
            os.close(fd)   # closing releases any lock still held
        self._fds, self._held = {}, []
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
