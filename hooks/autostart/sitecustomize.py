"""Start-up hook of a torchrun worker under ``rankwatch run``: arms zero-code instrumentation
(:func:`rankwatch.hooks.instrument.zerocode.bootstrap`), then runs the ``sitecustomize`` this one
shadows, if the environment has one.  Never raises: a failure is said once on stderr."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _arm() -> None:
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:   # not a torchrun worker: load nothing
        return
    try:
        from rankwatch.hooks.instrument.zerocode import bootstrap

        bootstrap(_HERE)
    except Exception as exc:  # noqa: BLE001 - the script runs whatever happens here
        print(f"rankwatch: zero-code instrumentation off ({type(exc).__name__}: {exc}); "
              "the script runs without it", file=sys.stderr, flush=True)


def _chain() -> None:
    """Run the next ``sitecustomize`` on the path (a distribution's or a site's own)."""
    try:
        import importlib.machinery
        import importlib.util

        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
        if spec is None or spec.loader is None or spec.origin == __file__:
            return
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001
        print(f"rankwatch: the environment's own sitecustomize failed ({type(exc).__name__}: {exc})",
              file=sys.stderr, flush=True)


_arm()
_chain()
