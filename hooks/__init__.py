"""Training-side instrumentation of rankwatch (needs torch).

Instrument your own loop in a few lines::

    import rankwatch.hooks as rw
    mon = rw.init(mesh=mesh)            # after init_process_group
    for n, batch in enumerate(loader):
        with mon.step(n, tokens=tokens_per_rank):
            ...;  mon.mark("data")
            ...;  mon.mark("forward")
            ...;  mon.mark("backward")
            ...;  mon.mark("optimizer")
    mon.close()

or run the bundled harness: ``torchrun ... -m rankwatch.hooks.train``.
"""

from rankwatch.hooks.instrument.monitor import Monitor, NullMonitor, init
from rankwatch.hooks.instrument.recorder import OPS, PHASES, Recorder

__all__ = ["OPS", "PHASES", "Monitor", "NullMonitor", "Recorder", "init"]
