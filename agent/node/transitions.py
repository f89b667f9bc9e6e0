"""A rank's state, as ``status`` shows it: the one place where it changes.

States: ``ok``, ``straggler`` (flagged slow), ``hung`` (named as a hang's
culprit), ``dead`` (its process went away without a goodbye) and ``excluded``
(its node was taken out of the job).  Every change goes through
:func:`next_state`; callers write ``r.state = next_state(r.state, event)`` and
nothing else assigns a rank's state (``tests/test_rankstate.py`` checks that).

Events:

* ``hang``: a hang verdict names the rank.  A straggler that hangs is hung.
* ``progressed``: the rank made progress after a hang verdict, or the hang was
  resolved: a hung rank is ``ok`` again.
* ``flagged`` / ``cleared``: a straggler flag raised or lifted (by this node's
  detector or the coordinator's).  A hung rank stays hung: the hang says more.
* ``exited``: the rank's stream ended without a goodbye and its process is gone.
* ``excluded``: the coordinator excluded the rank's node.

``dead`` and ``excluded`` are final for the worker: a new worker connects with
a hello, and starts as ``ok`` (:data:`INITIAL`).
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = ["EVENTS", "INITIAL", "STATES", "Event", "next_state"]

STATES: Final = ("ok", "straggler", "hung", "dead", "excluded")
INITIAL: Final = "ok"
Event = Literal["hang", "progressed", "flagged", "cleared", "exited", "excluded"]
EVENTS: Final[tuple[Event, ...]] = ("hang", "progressed", "flagged", "cleared", "exited", "excluded")

_LIVE: Final = frozenset({"ok", "straggler", "hung"})
_TABLE: Final[dict[tuple[str, str], str]] = {
    ("ok", "hang"): "hung", ("straggler", "hang"): "hung",
    ("hung", "progressed"): "ok",
    ("ok", "flagged"): "straggler",
    ("straggler", "cleared"): "ok",
    **{(s, "exited"): "dead" for s in _LIVE},
    **{(s, "excluded"): "excluded" for s in STATES},
}


def next_state(state: str, event: Event) -> str:
    """The rank's state after ``event``; unchanged where the event does not apply.

    Raises:
        ValueError: an unknown state or event (a bug in the caller, never wire input).
    """
    if state not in STATES:
        raise ValueError(f"unknown rank state {state!r}")
    if event not in EVENTS:
        raise ValueError(f"unknown rank event {event!r}")
    return _TABLE.get((state, event), state)
