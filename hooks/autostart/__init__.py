"""The bootstrap directory ``rankwatch run`` puts first on its workers' ``PYTHONPATH``.

It holds only ``sitecustomize``, which Python imports at start-up, before the script; see
:mod:`rankwatch.hooks.instrument.zerocode`.  (Nothing imports this package.)
"""
