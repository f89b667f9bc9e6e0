"""The ``rankwatch`` command line: its commands, ``run`` around torchrun, and the demo.

``python -m rankwatch.agent.cli`` is the ``rankwatch`` command (:func:`main`, in ``app``).
"""

from rankwatch.agent.cli.app import main

__all__ = ["main"]
