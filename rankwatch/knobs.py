"""Checks shared by the configuration dataclasses (no dependencies, both sides may use it)."""

from __future__ import annotations

__all__ = ["require_positive"]


def require_positive(config: object, *knobs: str) -> None:
    """Raise ``ValueError`` naming the first of ``knobs`` of ``config`` that is not > 0 (NaN included)."""
    for knob in knobs:
        if not getattr(config, knob) > 0:
            raise ValueError(f"{type(config).__name__}.{knob} must be positive")
