"""The node agent: gRPC server, per-rank state, collectors and exporters.

Nothing under ``rankwatch.agent`` imports torch, so the agent, ``status`` and
``diagnose`` start fast and the agent image carries no torch.
"""
