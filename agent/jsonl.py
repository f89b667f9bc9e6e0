"""Durable JSON Lines: one record per line, flushed to disk before the call returns."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["append"]


def append(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one line and fsync it (the state survives the agent's crash).

    Raises:
        OSError: the file cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
