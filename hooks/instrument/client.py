"""The rank's side of the wire: drain the recorder, batch, stream to the agent.

Two daemon threads, neither of which the training thread ever waits on:

* the **flusher** drains the recorder's deques into columnar ``Batch``
  messages (:mod:`rankwatch.hooks.instrument.batches`), by size (``max_batch`` records) or by time (``flush_interval``),
  whichever comes first, and puts them on a bounded queue;
* the **sender** holds one long-lived ``Report`` stream to the agent and
  feeds it from that queue.  When the agent is absent or dies it reconnects
  with capped exponential backoff.

A third thread holds the ``Commands`` stream, on which the agent sends
checkpoint requests; the training thread reads them with
:meth:`AgentClient.requested_checkpoint` at a step boundary.

Fail-open: a full queue drops the batch, a full deque drops its oldest
records, and both are counted into ``dropped_total``, which every batch
carries so the agent learns the count once it is back.
"""

from __future__ import annotations

import atexit
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta

import grpc

from rankwatch.address import Address
from rankwatch.credentials import ClientCredentials, open_channel
from rankwatch.peercred import present
from rankwatch.hooks.instrument.batches import BatchBuilder
from rankwatch.hooks.instrument.command_inbox import RECONNECT_MAX as _RECONNECT_MAX
from rankwatch.hooks.instrument.command_inbox import RECONNECT_MIN as _RECONNECT_MIN
from rankwatch.hooks.instrument.command_inbox import CommandInbox
from rankwatch.hooks.instrument.recorder import Recorder
from rankwatch.proto import pb, pb_grpc

__all__ = ["AgentClient"]

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT = timedelta(seconds=1)
_IDLE_PROGRESS = timedelta(milliseconds=500)
# Records sent this recently before a stream broke may never have been taken
# (and a dead agent lost whatever it took): they are counted as dropped.
_IN_FLIGHT = timedelta(seconds=1)
_THREAD_STOP = timedelta(seconds=1)   # the most close() waits for a thread whose calls it cancelled


class AgentClient:
    """Streams one rank's records to its node agent.

    Args:
        recorder: the buffers the training thread writes.
        hello: this rank's identity, sent first on every stream.
        address: the agent.
        flush_interval: the longest a record waits before it is sent.
        max_batch: records per batch; a full batch is sent at once.
        queue_batches: batches held while the agent is slow or away.
        last_seq: returns the rank's latest collective sequence number.
        creds: the job's token and TLS files, for an agent over TCP (default: none).
    """

    def __init__(self, recorder: Recorder, hello: pb.Hello, address: Address, *,
                 flush_interval: timedelta = timedelta(milliseconds=100),
                 max_batch: int = 1024, queue_batches: int = 256,
                 last_seq: Callable[[], int] = lambda: -1,
                 group_seqs: Callable[[], dict[str, int]] = dict,
                 group_names: Callable[[], list[str]] = list,
                 creds: ClientCredentials | None = None) -> None:
        self._rec = recorder
        self._creds = creds or ClientCredentials()
        self._hello = hello
        self._address = address
        self._interval = flush_interval.total_seconds()
        self._max_batch = max_batch
        self._queue: queue.Queue[pb.Batch] = queue.Queue(maxsize=queue_batches)
        self._batches = BatchBuilder(recorder, max_batch, last_seq, group_seqs, group_names)
        self._stop = threading.Event()
        self._dropped_batches_records = 0
        self._lost_in_flight = 0
        self._yielded: deque[tuple[float, int]] = deque(maxlen=1024)  # (monotonic, records)
        self.connected = threading.Event()
        self.streams_opened = 0
        self._threads: list[threading.Thread] = []
        self._channels: set[grpc.Channel] = set()   # open now; close() cancels their calls
        self._channels_lock = threading.Lock()
        # close() flushes from the caller's thread while the flusher may be flushing: batches
        # must enter the queue in the order of their numbers (the agent refuses one that
        # comes after a higher number as a duplicate).
        self._flush_lock = threading.Lock()
        self._closed = False
        self.inbox = CommandInbox(pb.CommandRequest(rank=hello.rank, pid=hello.pid), self._open, self._stub,
                                  self._shut, self._stop)
        """Checkpoint requests from the agent (its own thread keeps the command stream)."""
        self._checkpoints: deque[pb.CheckpointRecord] = deque(maxlen=64)
        self._recoveries: deque[pb.RecoveryRecord] = deque(maxlen=16)
        self._exits: deque[pb.ExitRecord] = deque(maxlen=4)
        self._exit_sent = threading.Event()
        self.on_close: list[Callable[[], None]] = []
        """Called once :meth:`close` is done (the exit capture's uninstall)."""
        self._mesh_pending: pb.MeshUpdate | None = None

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        for name, target in (("flusher", self._flush_loop), ("sender", self._send_loop),
                             ("commands", self.inbox.run)):
            t = threading.Thread(target=target, name=f"rankwatch-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        # A daemon thread still inside a gRPC call when the interpreter finalises is ended by
        # pthread_exit in the middle of gRPC's C++ code, which aborts the process ("terminate
        # called without an active exception") after training ended: close before that.
        atexit.register(self.close)

    def close(self, timeout: timedelta = timedelta(seconds=2)) -> None:
        """Flush what is buffered, say goodbye and stop every thread; gives up waiting for
        the agent after ``timeout``.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        deadline = time.monotonic() + timeout.total_seconds()
        self._flush_once(force=True)
        while not self._queue.empty() and self.connected.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        sender = [t for t in self._threads if t.name == "rankwatch-sender"]
        for t in sender:  # its stream ends with the goodbye, once the agent has read it
            t.join(max(0.0, deadline - time.monotonic()))
        # The command stream waits for the agent's next command; cancel it (and a report stream
        # the agent never answered).  The threads then return at once.
        # Under the lock: a thread makes its stub under it, and gRPC crashes (SIGSEGV) when a
        # channel is closed while a stub is being made on it.
        with self._channels_lock:
            for channel in list(self._channels):
                channel.close()
        for t in self._threads:
            t.join(_THREAD_STOP.total_seconds())
        for done in self.on_close:
            try:
                done()
            except Exception:  # noqa: BLE001 - closing never raises
                log.exception("rankwatch: close hook failed")

    def _open(self) -> grpc.Channel:
        channel = open_channel(self._address, self._creds)
        with self._channels_lock:
            self._channels.add(channel)
        if self._stop.is_set():  # close() may have looked before this one was added
            channel.close()
        return channel

    def _stub(self, channel: grpc.Channel) -> pb_grpc.AgentStub:
        """A stub on ``channel``, made while close() cannot close it (see close)."""
        with self._channels_lock:
            if self._stop.is_set():
                raise grpc.RpcError("closed")
            return pb_grpc.AgentStub(channel)

    def _shut(self, channel: grpc.Channel) -> None:
        with self._channels_lock:
            self._channels.discard(channel)
        channel.close()

    @property
    def dropped_total(self) -> int:
        return self._batches.overflow + self._dropped_batches_records + self._lost_in_flight

    # -- flusher ------------------------------------------------------------
    def _flush_loop(self) -> None:
        last = time.monotonic()
        idle_every = _IDLE_PROGRESS.total_seconds()
        # Each wake-up takes the GIL from the training thread, so wake once per
        # interval while records trickle in, and 8x per interval only while a
        # full batch is building up (to honour "size or time, whichever first").
        while not self._stop.is_set():
            filling = len(self._rec.collectives) >= self._max_batch // 8
            time.sleep(self._interval / 8 if filling else self._interval)
            now = time.monotonic()
            due = now - last >= self._interval
            if len(self._rec.collectives) >= self._max_batch or (due and self._has_records()):
                self._flush_once()
                last = now
            elif now - last >= idle_every:
                self._flush_once(force=True)   # progress only: proves the rank is alive
                last = now

    def _has_records(self) -> bool:
        return (bool(self._rec.collectives) or bool(self._rec.steps) or bool(self._checkpoints)
                or bool(self._recoveries) or bool(self._exits))

    def _flush_once(self, force: bool = False) -> None:
        with self._flush_lock:
            self._flush_locked(force)

    def _flush_locked(self, force: bool) -> None:
        try:
            while True:
                batch, n = self._build_batch()
                if n == 0 and not force:
                    return
                self._enqueue(batch, n)
                if n < self._max_batch:
                    return
                force = False
        except Exception:  # noqa: BLE001 - the flusher must outlive any bug
            log.exception("rankwatch: flusher error")

    def _enqueue(self, batch: pb.Batch, n: int) -> None:
        mesh, self._mesh_pending = self._mesh_pending, None
        if mesh is not None:
            batch.mesh.CopyFrom(mesh)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._dropped_batches_records += n
            if mesh is not None and self._mesh_pending is None:
                self._mesh_pending = mesh   # with the next batch, then

    @property
    def mesh(self) -> tuple[dict[str, int], dict[str, int]]:
        """The rank's mesh coordinates and sizes as the agent last heard them."""
        return dict(self._hello.mesh_coords), dict(self._hello.mesh_shape)

    def update_mesh(self, coords: dict[str, int], shape: dict[str, int]) -> None:
        """The rank's DeviceMesh, learnt after the Hello: sent with the next batch (within the
        idle-progress interval), and in the Hello of every later stream."""
        mesh = pb.MeshUpdate(mesh_coords=coords, mesh_shape=shape)
        for field in ("mesh_coords", "mesh_shape"):
            getattr(self._hello, field).clear()
            getattr(self._hello, field).update(getattr(mesh, field))
        self._mesh_pending = mesh

    def _build_batch(self) -> tuple[pb.Batch, int]:
        batch, n = self._batches.build(self._checkpoints, self._recoveries, lambda: self.dropped_total)
        if self._exits:
            batch.exit.CopyFrom(self._exits.popleft())
            n += 1
        return batch, n

    # -- sender ---------------------------------------------------------------
    def _send_loop(self) -> None:
        delay = _RECONNECT_MIN.total_seconds()
        warned = False
        while not self._stop.is_set():
            channel = self._open()
            try:
                grpc.channel_ready_future(channel).result(timeout=_CONNECT_TIMEOUT.total_seconds())
                self.connected.set()
                self.streams_opened += 1
                log.info("rankwatch: streaming to agent at %s", self._address)
                delay = _RECONNECT_MIN.total_seconds()
                warned = False
                self._stub(channel).Report(self._requests(self._stream_hello()))
            except grpc.FutureTimeoutError:
                if not warned:
                    log.warning("rankwatch: no agent at %s; training goes on, retrying",
                                self._address)
                    warned = True
            except grpc.RpcError as exc:
                self._count_in_flight()
                log.warning("rankwatch: agent stream ended: %s", _describe(exc))
            except Exception:  # noqa: BLE001
                log.exception("rankwatch: sender error")
            finally:
                self.connected.clear()
                self._shut(channel)
            self._stop.wait(delay * (0.5 + random.random()))
            delay = min(delay * 2, _RECONNECT_MAX.total_seconds())

    # -- commands -------------------------------------------------------------
    def requested_checkpoint(self) -> tuple[int, str, str] | None:
        """The earliest pending checkpoint request: (step, command id, reason), or None."""
        return self.inbox.requested_checkpoint()

    def serve_requests(self, step: int) -> str:
        """A save of ``step`` began: the requests it serves (:meth:`CommandInbox.serve_requests`)."""
        return self.inbox.serve_requests(step)

    def checkpoint_saved(self, record: pb.CheckpointRecord) -> None:
        """Report a finished save (or a failed one)."""
        self.inbox.serve_requests(record.step)
        self._checkpoints.append(record)

    def recovered(self, record: pb.RecoveryRecord) -> None:
        """Report an in-process recovery (or a failed attempt); sent with the next batch."""
        self._recoveries.append(record)

    def exit_record(self, record: pb.ExitRecord, wait: float) -> None:
        """Send an uncaught exception's record now; wait at most ``wait`` seconds for the
        stream to take it (not at all while no agent is connected).  The exception hook calls it."""
        if self._closed:
            return
        self._exit_sent.clear()
        self._exits.append(record)
        self._flush_once(force=True)
        if self.connected.is_set():
            self._exit_sent.wait(wait)

    def _count_in_flight(self) -> None:
        horizon = time.monotonic() - _IN_FLIGHT.total_seconds()
        self._lost_in_flight += sum(n for t, n in self._yielded if t >= horizon)
        self._yielded.clear()

    def _stream_hello(self) -> pb.Hello:
        """The hello for a new stream: on a Unix socket, with the nonce this process just
        showed the agent, so that it knows the rank's true pid (rankwatch/peercred.py)."""
        hello = pb.Hello()
        hello.CopyFrom(self._hello)
        if self._address.path is not None:
            hello.peer_nonce = present(self._address.path)
        return hello

    def _requests(self, hello: pb.Hello) -> Iterator[pb.ReportMessage]:
        self._yielded.clear()
        yield pb.ReportMessage(hello=hello)
        while not self._stop.is_set():
            try:
                batch = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            batch.dropped_total = max(batch.dropped_total, self.dropped_total)
            self._yielded.append((time.monotonic(), _records_in(batch)))
            yield pb.ReportMessage(batch=batch)
            if batch.HasField("exit"):   # gRPC took it and asks for the next
                self._exit_sent.set()
        yield pb.ReportMessage(goodbye=pb.Goodbye())  # closed on purpose: not a death


def _records_in(batch: pb.Batch) -> int:
    return len(batch.collectives.op) + len(batch.steps.step)


def _describe(exc: grpc.RpcError) -> str:
    code = getattr(exc, "code", lambda: None)()
    details = getattr(exc, "details", lambda: "")()
    return f"{code.name if code else 'error'}: {details}"
