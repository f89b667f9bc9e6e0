"""Phase markers of a torchrun worker, for ``benchmarks/restart_phases.py``.

Put on a worker's ``PYTHONPATH`` (``rankwatch run`` keeps it behind its own start-up hook,
which chains here).  With ``RANKWATCH_PHASES_OUT`` set, each worker appends one JSON line per
event to ``<dir>/<pid>.jsonl``, wall clock: ``exec`` (the process's start, from
``/proc/self/stat``), ``python`` (the interpreter reached site), ``torch`` (``import torch``
done), ``pg`` (``init_process_group`` returned), ``step`` (the first optimizer step done) and
``error`` (an exception ended the script) and ``exit`` (every exit handler ran).  The script itself is not touched.
"""

import json
import os
import sys
import time

_OUT = os.environ.get("RANKWATCH_PHASES_OUT")


def _mark(event: str, at: float | None = None) -> None:
    line = {"event": event, "at": time.time() if at is None else at, "pid": os.getpid(),
            "node": os.environ.get("RANKWATCH_NODE_ID", ""), "rank": os.environ.get("RANK", ""),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    with open(os.path.join(_OUT, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def _exec_time() -> float:
    """The process's start (``/proc``: clock ticks since boot, against ``/proc/uptime``)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rpartition(")")[2].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def _after_torch() -> None:
    try:
        _wrap()
    except Exception as exc:  # noqa: BLE001 - the script runs whatever happens here
        print(f"phase probe off: {exc}", file=sys.stderr, flush=True)


def _wrap() -> None:
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _mark("torch")
    init = dist.init_process_group

    def init_process_group(*args, **kwargs):
        out = init(*args, **kwargs)
        _mark("pg")
        return out

    dist.init_process_group = init_process_group
    first = []

    def stepped(*_):
        if not first:
            first.append(1)
            _mark("step")

    register_optimizer_step_post_hook(stepped)


class _TorchWatch:
    """A meta-path finder that only notices ``import torch`` finishing."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _after_torch()

        spec.loader.exec_module = exec_module
        return spec


if _OUT and "TORCHELASTIC_RESTART_COUNT" in os.environ and "torch" not in sys.modules:
    _mark("exec", _exec_time())
    _mark("python")
    sys.meta_path.insert(0, _TorchWatch())
    hook = sys.excepthook

    def _excepthook(kind, value, tb):
        _mark("error")
        hook(kind, value, tb)

    sys.excepthook = _excepthook
    import atexit

    atexit.register(_mark, "exit")   # registered first: runs after every later exit handler
