"""What OpenTelemetry span export costs the agent's ingestion.

    python benchmarks/otel.py [--seconds 6] [--rounds 9]

Three arms: export off (no ``OTEL_*`` variables), on with the default step sampling, and
on with every step a span (``every=1``), exporting over OTLP/gRPC to a real OTLP endpoint
(the tests' receiver) in another process.  Each batch carries 1,024 collectives and 16 steps.

1. In process: ``NodeState.ingest`` on pre-built batches, the arms interleaved in rounds
   after a warm-up round; the median CPU microseconds per batch of the ingesting thread
   (what ingestion pays) and of the whole process (the exporter's thread included).  CPU
   time, not wall time, so that other work on a shared machine does not count.  With export
   off, the step-listener hook is one attribute test per batch.
2. A real ``rankwatch agent`` process per arm with 8 client processes at full speed
   (as ``benchmarks/ingest.py``): records/s and the agent's CPU per batch, median of 3.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import AgentProcess  # noqa: E402

CLIENTS = 8
COLLECTIVES = 1024
STEPS = 16
BODIES = 256             # distinct step ranges, so that periodic sampling sees every step number
REPORT = "/rankwatch.v1.Agent/Report"
ARMS = {"off": None, "on, default sampling": "", "on, every step": "every=1"}


def batch(i: int):
    """Batch ``i``: 1,024 collectives and steps 16*i+1 .. 16*i+16 of ~100 ms each."""
    from rankwatch.proto import pb

    rng = np.random.default_rng(i)
    cols = pb.CollectiveColumns(
        op=rng.integers(0, 3, COLLECTIVES).astype("<u1").tobytes(),
        pg=np.zeros(COLLECTIVES, "<u2").tobytes(), seq=np.arange(COLLECTIVES, dtype="<i8").tobytes(),
        start=np.full(COLLECTIVES, 1.7e9, "<f8").tobytes(),
        duration=rng.exponential(1e-3, COLLECTIVES).astype("<f8").tobytes(),
        nbytes=np.full(COLLECTIVES, 1 << 20, "<i8").tobytes())
    dur = rng.normal(0.1, 0.003, STEPS)
    steps = pb.StepColumns(step=range(STEPS * i + 1, STEPS * i + STEPS + 1),
                           start=(1.7e9 + STEPS * i * 0.1 + 0.1 * np.arange(STEPS)).tolist(),
                           duration=dur.tolist(), data=[0.01] * STEPS, forward=(dur * 0.3).tolist(),
                           backward=(dur * 0.5).tolist(), optimizer=[0.005] * STEPS,
                           tokens=[2048.0] * STEPS, flops=[1e12] * STEPS, wait=(dur * 0.2).tolist())
    return pb.Batch(collectives=cols, steps=steps)


def _otel_env(arm: str | None, endpoint: str) -> dict[str, str]:
    if arm is None:
        return {}
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_METRICS_EXPORTER": "none",
            "RANKWATCH_OTEL_STEP_SAMPLE": arm}


def _sink(port: mp.Queue, stop: mp.Event) -> None:
    from test_otel import OtlpSink

    sink = OtlpSink("grpc").start()
    port.put(sink.port)
    stop.wait()
    port.put(len(sink.spans()))
    sink.stop()


# -- 1. in process --------------------------------------------------------------------------

def in_process(endpoint: str, rounds: int, batches: int) -> dict[str, tuple[float, float]]:
    """Per arm: median CPU microseconds per batch of the ingesting thread and of the process."""
    from rankwatch.agent.export import otel
    from rankwatch.agent.durable.incidents import IncidentLog
    from rankwatch.agent.node.intake import NodeState
    from rankwatch.hooks.instrument.recorder import OPS
    from rankwatch.proto import pb

    work = [batch(i) for i in range(batches)]
    saved = dict(os.environ)
    setups = {}
    for arm, sample in ARMS.items():
        state = NodeState("n0")
        os.environ.update(_otel_env(sample, endpoint))
        export = otel.install("n0", state, IncidentLog(None), gpu=None) if sample is not None else None
        rank = state.hello(pb.Hello(rank=0, world_size=1, pid=os.getpid(), op_names=list(OPS), job_id="bench"))
        setups[arm] = (state, rank, export)
        os.environ.clear()
        os.environ.update(saved)
    thread: dict[str, list[float]] = {arm: [] for arm in ARMS}
    process: dict[str, list[float]] = {arm: [] for arm in ARMS}
    seq = 0
    for i in range(rounds + 1):
        for arm, (state, rank, export) in setups.items():
            t0, p0 = time.thread_time(), time.process_time()
            for b in work:
                seq += 1
                b.seq = seq
                state.ingest(rank, b)
            if export is not None:
                export.provider.force_flush()  # the export of this round's spans counts here
            if i:  # round 0 warms up
                thread[arm].append((time.thread_time() - t0) / len(work) * 1e6)
                process[arm].append((time.process_time() - p0) / len(work) * 1e6)
    for _, _, export in setups.values():
        if export is not None:
            export.shutdown()
    return {arm: (statistics.median(thread[arm]), statistics.median(process[arm])) for arm in ARMS}


# -- 2. a real agent --------------------------------------------------------------------------

def client(addr: str, rank: int, stop_at: float) -> None:
    import grpc

    from rankwatch.hooks.instrument.recorder import OPS
    from rankwatch.proto import pb

    hello = pb.ReportMessage(hello=pb.Hello(rank=rank, world_size=CLIENTS, pid=os.getpid(),
                                            op_names=list(OPS), job_id="bench")).SerializeToString()
    bodies = [pb.ReportMessage(batch=batch(i)).SerializeToString() for i in range(BODIES)]

    def messages():
        yield hello
        seq = 0
        while time.monotonic() < stop_at:
            seq += 1
            # Concatenated encodings merge: this sets batch.seq on the pre-built body.
            yield pb.ReportMessage(batch=pb.Batch(seq=seq)).SerializeToString() + bodies[seq % BODIES]

    with grpc.insecure_channel(addr) as ch:
        ch.stream_unary(REPORT)(messages())


def agent_phase(agent: AgentProcess, seconds: float) -> tuple[float, float]:
    """(records/s at the agent, agent CPU as a fraction of one core) with 8 clients at full speed."""
    proc = psutil.Process(agent.proc.pid)
    stop_at = time.monotonic() + seconds + 2.0
    procs = [mp.Process(target=client, args=(agent.addr.grpc_target(), r, stop_at)) for r in range(CLIENTS)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # connect, build bodies, warm up
    n0, c0, t0 = agent.status()["records_received"], _cpu(proc), time.monotonic()
    time.sleep(seconds - 0.5)
    n1, c1, t1 = agent.status()["records_received"], _cpu(proc), time.monotonic()
    for p in procs:
        p.join()
    return (n1 - n0) / (t1 - t0), (c1 - c0) / (t1 - t0)


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=6)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batches", type=int, default=200, help="in-process batches per arm and round")
    args = ap.parse_args()
    for name in [v for v in os.environ if v.startswith("OTEL_")]:
        del os.environ[name]
    port, stop = mp.Queue(), mp.Event()
    sink = mp.Process(target=_sink, args=(port, stop))
    sink.start()
    endpoint = f"http://127.0.0.1:{port.get(timeout=30)}"
    try:
        off = None
        for arm, (thread, process) in in_process(endpoint, args.rounds, args.batches).items():
            off = off or (thread, process)
            print(f"| in process, {arm} | ingesting thread {thread:,.1f} µs CPU per batch "
                  f"({thread / off[0]:.3f} x off) | process {process:,.1f} µs ({process / off[1]:.3f} x off) |")
        for arm, sample in ARMS.items():
            with tempfile.TemporaryDirectory() as tmp:
                agent = AgentProcess(Path(tmp) / "agent.sock", env=_otel_env(sample, endpoint)).start()
                try:
                    runs = [agent_phase(agent, args.seconds) for _ in range(3)]
                finally:
                    agent.stop()
            rps = sorted(r for r, _ in runs)[1]
            per_batch = sorted(c / r * (COLLECTIVES + STEPS) * 1e6 for r, c in runs)[1]
            print(f"| agent process, {arm} | {rps:,.0f} records/s (median of 3) | "
                  f"agent CPU {per_batch:,.0f} µs per batch |")
    finally:
        stop.set()
        print(f"spans received by the OTLP endpoint: {port.get(timeout=30):,}")
        sink.join(10)


if __name__ == "__main__":
    main()
