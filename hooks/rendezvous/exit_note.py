"""The note that tells ``rankwatch run`` why the rendezvous refused this node (``RANKWATCH_EXIT_NOTE``)."""

from __future__ import annotations

import logging
import os

from rankwatch.address import EXIT_NOTE_ENV

__all__ = ["write_exit_note"]

log = logging.getLogger(__name__)


def write_exit_note(why: str) -> None:
    """Tell ``rankwatch run`` (through ``RANKWATCH_EXIT_NOTE``) that this node was refused."""
    path = os.environ.get(EXIT_NOTE_ENV)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(why[:1000])
    except OSError as exc:  # the refusal stands; only the wrapper's exit code depends on it
        log.warning("rankwatch: could not write the exit note %s (%s)", path, exc)
