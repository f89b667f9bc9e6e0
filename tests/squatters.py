"""A hostile local process: one process holding many Report streams on an agent's socket.

Run as ``python squatters.py SOCKET N MODE [NONCE]``: it opens ``N`` Report streams with
grpc.aio (one process, one event loop: cheap on 2 cores), prints ``ready`` once each has
sent what its mode sends, and holds them until stdin closes, printing how each ended.

Modes: ``silent`` (nothing at all), ``idle`` (a hello, then nothing), ``stepping`` (a hello,
then a plausible step every second).  ``nonce``: each stream shows this process on the
credentials socket first, as a real rank does (so SO_PEERCRED knows it).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import grpc

from rankwatch.peercred import present
from rankwatch.proto import pb, pb_grpc


def _hello(i: int, nonce: bytes) -> pb.ReportMessage:
    return pb.ReportMessage(hello=pb.Hello(rank=1000 + i, world_size=4096, pid=os.getpid(), node_id="n0",
                                           backend="gloo", op_names=["all_reduce"], job_id="squat",
                                           peer_nonce=nonce))


def _step(seq: int) -> pb.ReportMessage:
    now = time.time()
    return pb.ReportMessage(batch=pb.Batch(seq=seq, steps=pb.StepColumns(
        step=[seq], start=[now - 0.5], duration=[0.5], data=[0.01], forward=[0.2], backward=[0.2],
        optimizer=[0.05], tokens=[64.0], flops=[1e9], wait=[0.04])))


async def main(sock: str, n: int, mode: str, nonce: bool) -> None:
    ends: list[str] = []
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(f"unix:{sock}") as ch:
        stub = pb_grpc.AgentStub(ch)
        sent = asyncio.Semaphore(0)

        async def one(i: int) -> None:
            call = stub.Report()
            try:
                if mode != "silent":
                    await call.write(_hello(i, present(sock) if nonce else b""))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass
            finally:
                sent.release()
            try:
                seq = 0
                while mode == "stepping" and not stop.is_set():
                    seq += 1
                    await call.write(_step(seq))
                    try:
                        await asyncio.wait_for(stop.wait(), 1.0)
                    except asyncio.TimeoutError:
                        pass
                await stop.wait()
                call.cancel()
                ends.append("held")
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                if ends and ends[-1] == "held" and exc.code() == grpc.StatusCode.CANCELLED:
                    return
                ends.append(f"{exc.code().name}: {exc.details()}")
            except asyncio.CancelledError:
                pass

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        for _ in range(n):
            await sent.acquire()
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        stop.set()
        await asyncio.wait(tasks, timeout=10)
    for e in ends:
        print(e, flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "nonce"))
