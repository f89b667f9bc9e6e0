"""The control plane under attack and under TLS: real agents, real gRPC over TCP.

    python benchmarks/control_plane.py [--seconds 8] [--rounds 3]

1. Starvation: a coordinator (n0, TCP) and a node agent (n1) syncing with it.  An
   attacker opens 100 idle ``Report`` streams on n0's TCP port, then 500 concurrent
   streaming ones, while ``Status`` is called every 50 ms on n0's TCP port and
   socket.  Reports the worst ``Status`` latency of each phase, the refusals, and
   whether any node was excluded.
2. Ingestion with mutual TLS against without (both with the token), 8 client
   processes each holding one ``Report`` stream of pre-serialised 1,024-record
   batches at full speed; rounds interleaved, medians.
3. The TLS agent's CPU at 100,000 records/s offered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import AgentProcess, parse_metrics, wait_for  # noqa: E402
from ingest import CLIENTS, REPORT, measure, paced_batches  # noqa: E402  (benchmarks/ is on sys.path)
from multinode import free_port  # noqa: E402
from test_starvation import StatusProbe, _busy_streams, _idle_streams  # noqa: E402
from tlscerts import CertAuthority  # noqa: E402

from rankwatch.address import Address  # noqa: E402
from rankwatch.credentials import ClientCredentials, open_channel  # noqa: E402

TOKEN = "benchmark-token"


def starvation(tmp: Path) -> dict:
    tcp = Address.parse(f"127.0.0.1:{free_port()}")
    n0 = AgentProcess(tmp / "n0.sock", "n0", extra=("--listen", str(tcp), "--coordinator", str(tcp))).start()
    n1 = AgentProcess(tmp / "n1.sock", "n1", extra=("--coordinator", str(tcp))).start()
    try:
        wait_for(lambda: "n1" in n0.status()["nodes"], 15, what="n1 synced")
        out = {}
        for name, attack in (("100 idle streams", lambda: _idle_streams(tcp.grpc_target(), 100)),
                             ("500 concurrent streams", lambda: _busy_streams(tcp.grpc_target(), 500, 4.0))):
            with StatusProbe(tcp, n0.addr) as probe:
                codes = asyncio.run(attack())
            out[name] = {"worst_status_seconds": round(probe.worst, 3), "status_calls": probe.calls,
                         "status_failures": len(probe.failures),
                         "ends": {str(c).removeprefix("StatusCode."): codes.count(c) for c in set(codes)}}
        status = n0.status()
        metrics = parse_metrics(n0.metrics())
        out["refused"] = {dict(k[1])["reason"]: v for k, v in metrics.items()
                          if k[0] == "rankwatch_rpcs_refused_total"}
        out["excluded_nodes"] = status["excluded_nodes"]
        out["nodes"] = status["nodes"]
        return out
    finally:
        n1.stop()
        n0.stop()


def _client(addr: str, creds: ClientCredentials, rank: int, rate: float, stop_at: float) -> None:
    with open_channel(Address.parse(addr), creds) as ch:
        ch.stream_unary(REPORT)(paced_batches(rank, rate, stop_at))


def phase(agent: AgentProcess, tcp: Address, creds: ClientCredentials, seconds: float,
          rate_per_client: float) -> tuple[float, float]:
    """(records/s at the agent, agent CPU as a fraction of one core)."""
    return measure(agent, lambda r, stop_at: mp.Process(target=_client, args=(str(tcp), creds, r,
                                                                             rate_per_client, stop_at)),
                   seconds)


def ingestion(tmp: Path, seconds: float, rounds: int) -> dict:
    ca = CertAuthority(tmp / "pki")
    server, client = ca.issue("agent"), ca.issue("client")
    (tmp / "token").write_text(TOKEN)
    (tmp / "token").chmod(0o600)
    plain_tcp, tls_tcp = (Address.parse(f"127.0.0.1:{free_port()}") for _ in range(2))
    common = ("--token-file", str(tmp / "token"))
    plain = AgentProcess(tmp / "plain.sock", "plain", extra=("--listen", str(plain_tcp), *common)).start()
    tls = AgentProcess(tmp / "tls.sock", "tls", extra=("--listen", str(tls_tcp), *common, *server.flags())).start()
    plain_creds = ClientCredentials(TOKEN)
    tls_creds = ClientCredentials.tls(TOKEN, str(client.ca), str(client.cert), str(client.key))
    try:
        with open_channel(tls_tcp, tls_creds):
            pass
        runs: dict[str, list[tuple[float, float]]] = {"plain": [], "tls": []}
        for _ in range(rounds):   # interleaved, so drift hits both arms alike
            runs["plain"].append(phase(plain, plain_tcp, plain_creds, seconds, 0))
            runs["tls"].append(phase(tls, tls_tcp, tls_creds, seconds, 0))
        med = {k: (statistics.median(r for r, _ in v), statistics.median(c for _, c in v))
               for k, v in runs.items()}
        at_100k = [phase(tls, tls_tcp, tls_creds, seconds, 100_000 / CLIENTS) for _ in range(rounds)]
        return {
            "full_speed_records_per_second": {k: round(v[0]) for k, v in med.items()},
            "full_speed_agent_cpu_cores": {k: round(v[1], 3) for k, v in med.items()},
            "tls_over_plain": round(med["tls"][0] / med["plain"][0], 3),
            "rounds": {k: [round(r) for r, _ in v] for k, v in runs.items()},
            "tls_100k_taken_records_per_second": round(statistics.median(r for r, _ in at_100k)),
            "tls_100k_agent_cpu_cores": round(statistics.median(c for _, c in at_100k), 4),
        }
    finally:
        tls.stop()
        plain.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-starvation", action="store_true")
    args = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_starvation:
            (Path(tmp) / "s").mkdir()
            out["starvation"] = starvation(Path(tmp) / "s")
            print(json.dumps(out["starvation"], indent=1), flush=True)
        (Path(tmp) / "i").mkdir()
        out["ingestion"] = ingestion(Path(tmp) / "i", args.seconds, args.rounds)
        print(json.dumps(out["ingestion"], indent=1), flush=True)


if __name__ == "__main__":
    main()
