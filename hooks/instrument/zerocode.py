"""Zero-code instrumentation: what ``rankwatch run`` gives a script that never imports rankwatch.

``rankwatch run`` puts the bootstrap directory (``rankwatch/hooks/autostart``) first on the
workers' ``PYTHONPATH``; its ``sitecustomize`` calls :func:`bootstrap` before the script's
first line, for ``script.py`` and ``-m module`` alike.  Then, in a torchrun worker only:

1. **When torch is imported** (an import watcher: nothing of torch loads earlier than the
   script asks for it), the process is armed: a recorder, the global step and phase hooks of
   :mod:`.step_hooks` (DDP's reduction timed in the backwards they see: :mod:`.ddp_timing`),
   and wrappers of ``init_process_group`` and ``init_device_mesh``.
2. **When the process group exists** (``init_process_group`` returned, or
   ``init_device_mesh`` made it), the monitor starts as :func:`rankwatch.hooks.init` starts
   one: collective timers on every group, the agent stream, hang evidence; its Hello says
   ``instrumentation: auto``.
3. **When a DeviceMesh is built** with ``init_device_mesh``, this rank's coordinates go to
   the agent (the mesh with the most dimensions is the job's).
4. **When the script calls** ``rankwatch.hooks.init()`` itself, this stands down first
   (hooks removed, its stream closed with a goodbye): the script's own markers are the only
   ones, and nothing is counted twice (DDP's reduction is then untimed).

Fail-open: any failure leaves the script running as if rankwatch were absent, and says so
once on stderr.  The script's own errors are untouched: an exception raised inside a wrapped
call leaves the wrapper with its traceback as PyTorch raised it (the wrapper's frame taken
off, re-raised bare, which adds none), and no hook of this package runs around user code.  ``RANKWATCH_AUTO=0`` (or ``RANKWATCH_DISABLE=1``) turns it off.  Processes the
worker starts (data-loader workers, subprocesses) are not instrumented: the worker takes the
bootstrap directory off their path, and a process whose ``RANKWATCH_AUTO_PID`` names another
process stays out.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
from typing import Any

from rankwatch.address import AUTO_ENV

__all__ = ["AUTO_ENV", "OWNER_ENV", "ZeroCode", "bootstrap", "wanted"]

OWNER_ENV = "RANKWATCH_AUTO_PID"
_DISABLE_ENV = "RANKWATCH_DISABLE"   # as monitor.DISABLE_ENV (not imported: that loads torch-side code)


def wanted(env: dict[str, str] | os._Environ, pid: int) -> bool:
    """Whether this process is a torchrun worker to instrument: torchrun's worker variables
    are set, rankwatch is not turned off, and no other process of the job owns the bootstrap
    (this one is not a process a worker started)."""
    if "TORCHELASTIC_RESTART_COUNT" not in env or "LOCAL_RANK" not in env:
        return False
    if env.get(AUTO_ENV, "1") == "0" or env.get(_DISABLE_ENV, "") not in ("", "0"):
        return False
    owner = env.get(OWNER_ENV, "")
    return owner in ("", str(pid))


def bootstrap(entry: str) -> None:
    """Arm zero-code instrumentation in this process if :func:`wanted`; ``entry``: the
    bootstrap directory, taken off ``PYTHONPATH`` for the processes this one starts."""
    if not wanted(os.environ, os.getpid()):
        return
    os.environ[OWNER_ENV] = str(os.getpid())
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != entry]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    auto = ZeroCode()
    if "torch" in sys.modules:
        auto.arm()
    else:
        sys.meta_path.insert(0, _TorchWatch(auto))


class _TorchWatch(importlib.abc.MetaPathFinder):
    """Arms :class:`ZeroCode` right after ``import torch`` has run, then leaves."""

    def __init__(self, auto: ZeroCode) -> None:
        self._auto = auto

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module, auto = loader.exec_module, self._auto

        def exec_then_arm(module: Any) -> None:
            exec_module(module)
            auto.arm()

        loader.exec_module = exec_then_arm
        return spec


class ZeroCode:
    """The zero-code instrumentation of one worker process (see the module's docstring)."""

    def __init__(self) -> None:
        self.recorder: Any = None
        self.monitor: Any = None
        self._hooks: Any = None
        self._ddp: Any = None
        self._saved: list[tuple[Any, str, Any]] = []
        self._mesh: Any = None
        self._stood_down = False
        self._failed = False

    # -- arming (at import torch) --------------------------------------------
    def arm(self) -> None:
        try:
            self._arm()
        except Exception as exc:  # noqa: BLE001 - never stop the script
            self._fail("could not arm", exc)

    def _arm(self) -> None:
        import torch.distributed as dist

        from rankwatch.hooks.instrument import monitor
        from rankwatch.hooks.instrument.ddp_timing import DdpTiming
        from rankwatch.hooks.instrument.recorder import Recorder
        from rankwatch.hooks.instrument.step_hooks import StepHooks

        if not dist.is_available():
            return
        monitor.ZERO_CODE.append(self)
        self.recorder = Recorder()
        self._ddp = DdpTiming(self._sink)
        self._hooks = StepHooks(self.recorder, ddp=self._ddp)
        self._hooks.install()
        c10d = dist.distributed_c10d
        self._wrap(c10d.init_process_group, self._after_init, (dist, c10d))
        from torch.distributed import device_mesh

        self._wrap(device_mesh.init_device_mesh, self._after_mesh, (device_mesh, dist))

    def _wrap(self, fn: Any, after: Any, owners: tuple[Any, ...]) -> None:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                out = fn(*args, **kwargs)
            except BaseException as exc:
                exc.__traceback__ = exc.__traceback__.tb_next if exc.__traceback__ else None
                raise   # bare: this frame is not added back; the error is PyTorch's own
            after(out)
            return out

        for owner in owners:
            if getattr(owner, fn.__name__, None) is fn:
                self._saved.append((owner, fn.__name__, fn))
                setattr(owner, fn.__name__, wrapped)

    # -- start (the process group exists) ---------------------------------------
    def _after_init(self, _out: Any) -> None:
        self._start()

    def _after_mesh(self, mesh: Any) -> None:
        try:
            names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
            known = tuple(getattr(self._mesh, "mesh_dim_names", None) or ())
            if names and len(names) >= len(known):
                self._mesh = mesh
                self._start()
                if self.monitor is not None:
                    self.monitor.mesh_built(mesh)
        except Exception as exc:  # noqa: BLE001
            self._fail("could not read the DeviceMesh", exc)

    def _start(self) -> None:
        if self.monitor is not None or self._stood_down or self._failed:
            return
        try:
            import torch.distributed as dist

            if not dist.is_initialized():
                return
            from rankwatch.address import node_id, resolve
            from rankwatch.hooks.instrument import monitor

            self.monitor = monitor._init(None, resolve(), node_id(), None, None, True,
                                         recorder=self.recorder, instrumentation="auto")
        except Exception as exc:  # noqa: BLE001
            self._fail("could not start", exc)

    def _sink(self) -> tuple[Any, Any] | None:
        mon = self.monitor
        if mon is None or mon._instr is None:
            return None
        return mon.recorder, mon._instr

    # -- an explicit rw.init() -------------------------------------------------
    def stand_down(self) -> None:
        """The script calls ``rankwatch.hooks.init()`` itself: remove the step hooks and wrappers,
        close this stream (a goodbye: no exit)."""
        if self._stood_down:
            return
        self._stood_down = True
        try:
            if self._hooks is not None:
                self._hooks.uninstall()
            for owner, name, original in reversed(self._saved):
                setattr(owner, name, original)
            self._saved.clear()
            mon, self.monitor = self.monitor, None
            if mon is not None:
                mon.close()
        except Exception as exc:  # noqa: BLE001
            self._fail("could not stand down", exc)

    def adopt(self, monitor: Any) -> None:
        """The script's own monitor (what a sink still asked for records on)."""
        self.monitor = monitor if hasattr(monitor, "_instr") else None

    def _fail(self, what: str, exc: BaseException) -> None:
        if not self._failed:
            self._failed = True
            print(f"rankwatch: zero-code instrumentation {what} ({type(exc).__name__}: {exc}); "
                  "the script runs without it", file=sys.stderr, flush=True)
        try:
            if self._hooks is not None:
                self._hooks.uninstall()
        except Exception:  # noqa: BLE001
            pass
