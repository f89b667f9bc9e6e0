"""Relays: the nodes that gather their group's summaries for the coordinator (``relay``), and
which relay each node syncs through (``routing``)."""
