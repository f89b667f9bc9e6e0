"""Rank-id churn against a live agent: series in /metrics and the agent's RSS stay bounded.

    python benchmarks/churn.py [--ranks 2000] [--grace 10] [--tree DIR]

A real ``rankwatch agent`` process; 8 threads open one Report stream per rank id (hello,
one batch with a step and progress, goodbye), ``--ranks`` ids in all.  Reports the
agent's kept ranks, the series in /metrics, its size and the agent's RSS: before the
churn, right after it, and once ``--grace`` seconds (the agent's ``--rank-grace``) have
passed.  ``--tree`` runs the agent from another checkout's package tree (a directory
holding ``rankwatch/``, laid out as installed) to measure the code before a change.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import AgentProcess, parse_metrics  # noqa: E402

from rankwatch.hooks.instrument.recorder import OPS  # noqa: E402
from rankwatch.proto import pb  # noqa: E402

REPORT = "/rankwatch.v1.Agent/Report"
WORLD = 4096


def churn_rank(channel: grpc.Channel, rank: int) -> None:
    now = time.time()
    call = channel.stream_unary(REPORT, request_serializer=pb.ReportMessage.SerializeToString,
                                response_deserializer=pb.ReportSummary.FromString)
    call(iter([
        pb.ReportMessage(hello=pb.Hello(rank=rank, world_size=WORLD, pid=os.getpid(), backend="gloo",
                                        op_names=list(OPS), mesh_coords={"dp": rank})),
        pb.ReportMessage(batch=pb.Batch(seq=1, steps=pb.StepColumns(
            step=[1], start=[now], duration=[0.1], data=[0.01], forward=[0.03], backward=[0.05],
            optimizer=[0.01], tokens=[10.0], flops=[1.0]), progress=pb.Progress(step=1, sampled_at=now))),
        pb.ReportMessage(goodbye=pb.Goodbye())]), timeout=30)


def measure(agent: AgentProcess) -> dict[str, float]:
    text = agent.metrics()
    series = parse_metrics(text)
    return {"ranks": len(agent.status()["ranks"]), "series": len(series),
            "rank_series": sum(1 for (_, labels) in series if any(k == "rank" for k, _ in labels)),
            "metrics_kib": len(text) / 1024, "rss_mib": psutil.Process(agent.proc.pid).memory_info().rss / 2**20}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2000)
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--tree", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {"PYTHONPATH": str(args.tree.resolve())} if args.tree else None
        if args.tree:
            os.chdir(tmp)   # not this checkout's directory: the agent must import the tree's package
        extra = () if args.tree else ("--rank-grace", str(args.grace))
        agent = AgentProcess(Path(tmp) / "agent.sock", extra=extra, env=env).start()
        try:
            channel = grpc.insecure_channel(agent.addr.grpc_target())
            rows = [("before", measure(agent))]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda r: churn_rank(channel, r), range(args.ranks)))
            took = time.perf_counter() - t0
            rows.append((f"after {args.ranks} rank ids ({took:.1f} s)", measure(agent)))
            time.sleep(args.grace + 1)   # a benchmark waits out the grace period it measures
            rows.append((f"{args.grace + 1:.0f} s later", measure(agent)))
            channel.close()
        finally:
            agent.stop()
    print(f"agent from {'tree ' + str(args.tree) if args.tree else 'this checkout'}, "
          f"rank grace {'(none)' if args.tree else f'{args.grace:g} s'}")
    print("| when | ranks kept | series | of them per-rank | /metrics KiB | agent RSS MiB |")
    print("|---|---|---|---|---|---|")
    for when, m in rows:
        print(f"| {when} | {m['ranks']} | {m['series']} | {m['rank_series']} | {m['metrics_kib']:.0f} | "
              f"{m['rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
