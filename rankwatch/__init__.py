"""rankwatch: observability and fault tolerance for distributed PyTorch training.

``rankwatch.hooks`` runs inside training ranks (needs torch), ``rankwatch.agent``
runs on every node (no torch), and ``rankwatch.proto`` is the wire between them.
What both sides need lives in this package itself (``rankwatch.address``,
``rankwatch.status``), which imports neither side; the hooks never import the agent.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
