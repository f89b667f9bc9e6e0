"""A rank's Report stream for hostile-input tests: kept open, messages sent as the test goes."""

from __future__ import annotations

import os
import queue

import grpc

from rankwatch.hooks.instrument.recorder import OPS
from rankwatch.proto import pb

REPORT = "/rankwatch.v1.Agent/Report"


class Stream:
    """One rank's Report stream over ``channel``, opened with ``hello``."""

    def __init__(self, channel: grpc.Channel, hello: pb.Hello) -> None:
        self._q: queue.Queue = queue.Queue()
        call = channel.stream_unary(REPORT, request_serializer=pb.ReportMessage.SerializeToString,
                                    response_deserializer=pb.ReportSummary.FromString)
        self.future = call.future(iter(self._q.get, None), timeout=120)
        self.seq = 0
        self.send(pb.ReportMessage(hello=hello))

    def send(self, msg: pb.ReportMessage) -> None:
        self._q.put(msg)

    def batch(self, **fields) -> None:
        self.seq += 1
        self.send(pb.ReportMessage(batch=pb.Batch(seq=self.seq, **fields)))

    def close(self) -> pb.ReportSummary:
        self.send(pb.ReportMessage(goodbye=pb.Goodbye()))
        self._q.put(None)
        return self.future.result(timeout=30)

    def cancel(self) -> None:
        """End the stream from this side at once (what is still queued is not sent)."""
        self.future.cancel()
        self._q.put(None)


def hello(rank: int, world_size: int = 64, **kw) -> pb.Hello:
    return pb.Hello(rank=rank, world_size=world_size, pid=os.getpid(), node_id="n0", backend="gloo",
                    op_names=list(OPS), **kw)
