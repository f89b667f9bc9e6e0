"""The agent's front door: who may call, and how many streams anyone may hold.

One ``grpc.ServerInterceptor`` wraps every handler, so no RPC can forget a check:

* **Credentials.** With a token configured, every call that arrives over TCP
  (``Report``, ``Commands``, ``Status``, ``Sync``, ``RequestCheckpoint``, and any
  RPC added later) needs ``authorization: Bearer <token>``, or it is refused with
  UNAUTHENTICATED.  Calls on the Unix socket are not asked: the socket is 0600 in
  a directory of the agent's user, and that is its access control.  The server
  tells the two apart by ``context.peer()``: ``unix:...`` for the socket,
  ``ipv4:``/``ipv6:`` for TCP.
* **Streams are capped.** ``Report`` and ``Commands`` hold a server thread for
  their whole life.  At most ``per_peer`` of them per TCP host, ``per_process`` per
  process on the Unix socket, and ``total`` in all are served.  At a cap a newcomer
  takes the seat of the stream that stands lowest there, or is refused with
  RESOURCE_EXHAUSTED (:mod:`.seats`, by :mod:`.admission`'s rule), counted and logged.
* **Capacity for the control calls.** The server's thread pool has ``total +
  reserve`` threads (:meth:`StreamLimits.threads`).  Streams can take at most
  ``total`` of them, so ``Status``, ``Sync`` and ``RequestCheckpoint`` always find
  one of the ``reserve`` threads free, however many streams anyone opens.  Reserved
  threads were chosen over a second server or ``grpc.aio`` because they keep one
  port and one handler table, and the bound is plain arithmetic (streams <= total
  < threads) that a test can check.
* **A hello is due.** A ``Report`` stream that has sent nothing within
  ``hello_timeout`` is cancelled, so idle connections cannot sit on the caps.
* **So is every request.** gRPC runs a unary or server-streaming handler only once
  its request message has arrived, on a pool thread that waits for it with no
  limit: calls that never send it would take every thread.  So every such method
  is served as a client-streaming one (the same on the wire): the credentials are
  checked on the headers, before any message; every wait for the message is
  cancelled after ``request_timeout``, and callers without the job's credentials are
  also capped in how many may wait (``waiting_per_peer``, and half the reserve in all).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from rankwatch.agent.rpc.auth import authorized
from rankwatch.agent.rpc.limits import StreamLimits, is_local_peer, peer_host
from rankwatch.agent.rpc.deadlines import Watchdog
from rankwatch.agent.rpc.seats import Seats
from rankwatch.agent.rpc import sync_rights

__all__ = ["Gate", "StreamLimits", "is_local_peer", "peer_host"]

log = logging.getLogger(__name__)

_STREAMS = ("Report", "Commands")   # the long-lived RPCs that hold a server thread
_LOG_EVERY = 10.0                   # seconds between log lines per refusal reason
_CAPACITY = ("streams_total", "waiting", "no_request", "expired")   # refusals for lack of room in all


class Gate(grpc.ServerInterceptor):
    """Checks credentials and stream caps for every call (its series: :mod:`..export.prom_refusals`).

    Args:
        token: the job's bearer token (None: TCP calls need none).
        node: this node's id (the ``node`` label).
        limits: stream caps and the hello deadline.
        on_unauthenticated: called with (method, peer) for each refused call.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(self, token: str | None, limits: StreamLimits | None = None, *, node: str = "",
                 on_unauthenticated: Callable[[str, str], None] = lambda m, p: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.token = token
        self.node = node
        self.limits = limits or StreamLimits()
        self._on_unauthenticated = on_unauthenticated
        self._clock = clock
        self._lock = threading.Lock()
        self.seats = Seats(self.limits, self._refuse, clock)
        self._keys: dict[Any, int] = {}   # a Report stream's context -> its seat
        self.tls = False
        """Whether this agent serves TCP with mutual TLS (then a ``Sync`` speaks only for the
        node its certificate names: :mod:`.sync_rights`)."""
        self._watchdog = Watchdog()
        self._request_seconds = self.limits.request_timeout.total_seconds()
        self._waiting: dict[str, int] = {}   # calls waiting for their request message, by peer
        self._waiting_all = 0
        self.refused: dict[str, int] = {}
        self._logged: dict[str, tuple[float, int]] = {}   # reason -> (when, count then)

    # -- grpc.ServerInterceptor -------------------------------------------------
    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        kind = _kind(handler)
        inner = getattr(handler, kind)
        stream = method in _STREAMS
        if kind == "unary_unary":
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(method, inner), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if kind == "unary_stream":
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_unary_stream(method, inner, stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        wrap = self._wrap_stream if stream else self._wrap_call
        return handler._replace(**{kind: wrap(method, kind, inner)})

    def _wrap_unary(self, method: str, inner: Callable) -> Callable:
        def call(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            trusted = self._check(method, context)
            request = self._request(method, requests, context, capped=not trusted)
            if method in sync_rights.METHODS:
                self._sync_rights(method, request, context)
            return inner(request, context)
        return call

    def _wrap_unary_stream(self, method: str, inner: Callable, stream: bool) -> Callable:
        def gen(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            trusted = self._check(method, context)
            key = self._acquire(method, context, trusted) if stream else None
            try:
                request = self._request(method, requests, context, capped=not trusted)
                if key is not None:   # (Commands) who it is for: a rank and its pid
                    self.seats.identify(key, context, rank=getattr(request, "rank", -1),
                                        pid=getattr(request, "pid", 0))
                yield from inner(request, context)
            finally:
                if key is not None:
                    self.seats.release(key)
        return gen

    def _wrap_call(self, method: str, kind: str, inner: Callable) -> Callable:
        if kind == "stream_stream":
            def gen(requests: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                self._check(method, context)
                yield from inner(requests, context)
            return gen

        def call(requests: Any, context: grpc.ServicerContext) -> Any:
            self._check(method, context)
            return inner(requests, context)
        return call

    def _wrap_stream(self, method: str, kind: str, inner: Callable) -> Callable:
        if kind == "stream_unary":
            def report(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                key = self._acquire(method, context, self._check(method, context))
                with self._lock:
                    self._keys[context] = key
                try:
                    return inner(self._hello_due(requests, context, key), context)
                finally:
                    with self._lock:
                        self._keys.pop(context, None)
                    self.seats.release(key)
            return report

        def commands(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            key = self._acquire(method, context, self._check(method, context))
            try:
                yield from inner(request, context)
            finally:
                self.seats.release(key)
        return commands

    # -- checks -----------------------------------------------------------------
    def _check(self, method: str, context: grpc.ServicerContext) -> bool:
        """Refuse a TCP call without the token; True if the caller holds the job's credentials
        (the token, or the socket), False if none is configured."""
        peer = context.peer()
        if is_local_peer(peer):
            return True
        if authorized(context, self.token):
            return self.token is not None
        self._refuse("unauthenticated", f"{method} from {peer} without the job's token")
        self._on_unauthenticated(method, peer)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method} needs the job's token "
                      "(authorization: Bearer; --token-file or $RANKWATCH_TOKEN)")
        raise AssertionError("context.abort raises")  # for the type checker: abort never returns

    def _acquire(self, method: str, context: grpc.ServicerContext, trusted: bool) -> int:
        """A seat for a new stream (:meth:`Seats.open`; the call is aborted without one)."""
        return self.seats.open(method, context, peer_host(context.peer()), trusted)

    def identify_report(self, context: grpc.ServicerContext, *, rank: int, pid: int, cred_pid: int | None,
                        holds: bool, world: tuple[str, int]) -> None:
        """A Report stream's hello, as :mod:`.identity` judged it (``cred_pid``: the process
        SO_PEERCRED names, None when unknown): its seat is decided (:meth:`Seats.identify`;
        the call is aborted if it has none)."""
        with self._lock:
            key = self._keys.get(context)
        if key is None:
            return
        local = is_local_peer(context.peer())
        bucket = (f"pid:{cred_pid}" if cred_pid is not None else "unix") if local else None
        self.seats.identify(key, context, rank=rank, pid=pid, bucket=bucket,
                            verified=cred_pid is not None if local else None, holds=holds, world=world)

    def _sync_rights(self, method: str, request: Any, context: grpc.ServicerContext) -> None:
        """Under mutual TLS, a Sync or SyncGroup speaks only for the node its certificate names."""
        if not self.tls:
            return
        why = sync_rights.refusal(method, request, sync_rights.caller(context, self.node))
        if why is not None:
            self._refuse("not_this_node", f"{method} from {context.peer()}: {why}")
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method} refused: {why}")

    def _request(self, method: str, requests: Iterator[Any], context: grpc.ServicerContext,
                 capped: bool = True) -> Any:
        """The call's one request message, waited for under the deadline, and under the caps for a
        caller without the job's credentials (a coordinator's thousands of nodes hold them, and
        are not counted: the caps keep threads from the others, the deadline bounds everyone)."""
        if not capped:
            return self._await_request(method, requests, context)
        key = peer_host(context.peer())
        lim = self.limits
        with self._lock:
            held = self._waiting.get(key, 0)
            full = self._waiting_all >= lim.waiting_total or held >= lim.waiting_per_peer
            if not full:
                self._waiting_all += 1
                self._waiting[key] = held + 1
        if full:
            self._refuse("waiting", f"{method} from {context.peer()}: too many calls wait for their request")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{method} refused: too many calls from {key} wait for their request")
        try:
            return self._await_request(method, requests, context)
        finally:
            with self._lock:
                self._waiting_all -= 1
                left = self._waiting[key] - 1
                if left:
                    self._waiting[key] = left
                else:
                    del self._waiting[key]

    def _await_request(self, method: str, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        """The one request message; the call is cancelled if it has not come by ``request_timeout``.

        A call whose caller is gone by the time a server thread takes it up (its deadline
        passed in the server's queue, or it was cancelled) is not served: nobody waits for the
        reply, and serving it would spend the agent's time when it has least, making the calls
        queued behind it late too.  It is refused as ``expired``, a refusal for lack of
        capacity, which a coordinator counts as its own overload (``pacing.overload``)."""
        self._shed_if_gone(method, context)
        timer = self._watchdog.after(self._request_seconds, lambda: self._overdue(method, context, "request"))
        try:
            request = next(requests, None)
        finally:
            self._watchdog.cancel(timer)
        if request is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method} needs one request message")
        self._shed_if_gone(method, context)
        return request

    def _shed_if_gone(self, method: str, context: grpc.ServicerContext) -> None:
        remaining = context.time_remaining()
        if (remaining is not None and remaining <= 0) or not context.is_active():
            self._refuse("expired", f"{method} from {context.peer()}: its caller's deadline passed "
                                    "before a server thread could serve it")
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} expired in the agent's queue")

    def _overdue(self, method: str, context: grpc.ServicerContext, what: str) -> None:
        if context.is_active():
            self._refuse(f"no_{what}", f"{method} from {context.peer()} sent no {what} in time")
            context.cancel()

    def _hello_due(self, requests: Iterator[Any], context: grpc.ServicerContext, key: int) -> Iterator[Any]:
        """``requests``, cancelled if the first message is not there in time; each batch
        with steps tells the stream's seat."""
        timer: list[Any] | None = self._watchdog.after(self.limits.hello_timeout.total_seconds(),
                                                 lambda: self._overdue("Report", context, "hello"))
        try:
            for msg in requests:
                if timer is not None:
                    self._watchdog.cancel(timer)
                    timer = None
                elif msg.WhichOneof("body") == "batch" and len(msg.batch.steps.step):
                    self.seats.stepped(key)
                yield msg
        finally:
            if timer is not None:
                self._watchdog.cancel(timer)

    def _refuse(self, reason: str, detail: str) -> None:
        """Count a refusal; log one line per reason per 10 s, with the count since."""
        with self._lock:
            count = self.refused[reason] = self.refused.get(reason, 0) + 1
            now = self._clock()
            at, before = self._logged.get(reason, (float("-inf"), 0))
            if now - at < _LOG_EVERY:
                return
            self._logged[reason] = (now, count)
        more = count - before - 1
        log.warning("refused: %s%s", detail, f" (and {more} more since the last line)" if more > 0 else "")

    # -- views --------------------------------------------------------------------
    def capacity_refusals(self) -> int:
        """Calls refused so far because the agent was full (not for a bad or greedy peer)."""
        with self._lock:
            return sum(n for reason, n in self.refused.items() if reason in _CAPACITY)

    def open_streams(self) -> int:
        return self.seats.open_count()

    def refusals(self) -> dict[str, int]:
        """Calls refused so far, by reason (the ``rankwatch_rpcs_refused`` series read it)."""
        with self._lock:
            return dict(self.refused)


def _kind(handler: Any) -> str:
    if handler.request_streaming:
        return "stream_stream" if handler.response_streaming else "stream_unary"
    return "unary_stream" if handler.response_streaming else "unary_unary"
