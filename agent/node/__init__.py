"""The node agent's view of its own ranks: ingestion, per-rank records, node-side detector runs."""
