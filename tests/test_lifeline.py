"""A lost node leaves the rendezvous on proof (its torchrun's port refuses), not after its keep-alive
expires: the ``rankwatch`` handler over a real c10d rendezvous (TCPStore, stock dynamic handler),
three "nodes" joined from threads of this process (as ``tests/test_rendezvous.py``)."""

from __future__ import annotations

import time

from test_rendezvous import _handlers, _join, port  # noqa: F401  (the fixture)

from rankwatch.hooks.rendezvous import stock
from rankwatch.hooks.rendezvous.lifeline import OFF_ENV


def _silence(handler) -> None:
    """This node's torchrun stops beating (as a SIGKILLed one does)."""
    handler._inner._stop_heartbeats()


def _dropped_within(handler, seconds: float) -> tuple[list[str], float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        gone = handler._lifeline.drop_lost()
        if gone:
            return gone, time.monotonic() - t0
        time.sleep(0.05)
    return [], time.monotonic() - t0


def _stop(handlers) -> None:
    """Each node's lifeline closed and its heartbeats stopped: a thread left beating would write to
    the test's store after it is gone, for the rest of the test session."""
    for h in handlers:
        h._lifeline.close()
        _silence(h)


def test_a_node_whose_torchrun_is_gone_leaves_the_round_before_its_keep_alive_expires(monkeypatch, port):  # noqa: F811
    handlers = _handlers(["n0", "n1", "n2"], monkeypatch, port)
    try:
        _leaves_on_proof(handlers)
    finally:
        _stop(handlers)


def _leaves_on_proof(handlers) -> None:
    _join(handlers)
    n2 = stock.this_node(handlers[2]._inner)
    _silence(handlers[2])
    handlers[2]._lifeline.close()      # its port refuses now: the process behind it is gone
    _silence(handlers[1])              # n1 is silent too, but its port still accepts: alive
    gone, after = _dropped_within(handlers[0], 5.0)
    assert gone == [repr(n2)]
    # torch would drop it after keep_alive_interval (1 s) x keep_alive_max_attempt (3) of silence.
    assert after < 2.5, after
    state = stock.state(handlers[0]._inner)
    assert n2 not in state.participants and n2 not in state.last_heartbeats
    assert stock.this_node(handlers[1]._inner) in state.participants   # a silent but live node stays
    t0 = time.monotonic()   # another node's next read of the state from the store (it caches 1 s)
    while n2 in stock.state(handlers[1]._inner).participants:
        assert time.monotonic() - t0 < 3.0, "n1 still sees n2 in the round"
        time.sleep(0.05)


def test_switched_off_the_keep_alive_alone_decides(monkeypatch, port):  # noqa: F811
    monkeypatch.setenv(OFF_ENV, "0")
    handlers = _handlers(["n0", "n1"], monkeypatch, port, max_nodes=2)
    try:
        _join(handlers)
        _silence(handlers[1])
        handlers[1]._lifeline.close()
        assert _dropped_within(handlers[0], 1.5)[0] == []
        assert stock.this_node(handlers[1]._inner) in stock.state(handlers[0]._inner).participants
    finally:
        _stop(handlers)
