"""The user's errors, untouched: what a rankwatch wrapper does when the call it wraps raises.

A wrapper around a PyTorch call (a collective, its ``wait()``, ``init_process_group``) is a
Python frame between the user's code and PyTorch's, and an exception passing through it
would carry that frame in its traceback.  So a wrapper catches, takes its own frame off the
traceback with :func:`raise_bare`, and re-raises with a bare ``raise`` (which, unlike
``raise exc``, adds no traceback entry for the frame it runs in)::

    try:
        out = fn(*args, **kwargs)
    except BaseException as exc:
        raise_bare(exc)
        raise

The user gets PyTorch's exception object, with PyTorch's message and PyTorch's frames only.
"""

from __future__ import annotations

__all__ = ["raise_bare"]


def raise_bare(exc: BaseException) -> None:
    """Take the first traceback entry (the catching wrapper's frame) off ``exc``; returns None."""
    tb = exc.__traceback__
    if tb is not None:
        exc.__traceback__ = tb.tb_next
