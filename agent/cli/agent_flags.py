"""``rankwatch agent``'s flags, by concern, in the order its help lists them.  Each flag that
sets a config field takes its default from that field (:func:`.converters.default`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rankwatch.agent.cli.converters import address, default, gpu_source, port, positive
from rankwatch.agent.detect.hang_verdict import HangConfig
from rankwatch.agent.job.pacing import LoadConfig
from rankwatch.agent.job.policy import PolicyConfig
from rankwatch.agent.relays.routing import RelayConfig
from rankwatch.agent.rpc.limits import StreamLimits

__all__ = ["add_agent_flags"]


def add_agent_flags(a: argparse.ArgumentParser) -> None:
    """``rankwatch agent``'s flags by concern, in the order its help lists them."""
    from rankwatch.agent.config import AgentConfig

    _agent_node(a)
    _agent_detectors(a)
    _agent_coordination(a)
    _agent_trust(a)
    _agent_policy(a)
    _agent_gpu(a)
    grace = default(AgentConfig, "rank_grace")
    a.add_argument("--rank-grace", type=positive, default=grace, metavar="SECONDS",
                   help=f"how long a disconnected rank stays in /metrics (default {grace:g})")
    _agent_relays(a)
    most = default(AgentConfig, "status_max_ranks")
    a.add_argument("--status-max-ranks", type=int, default=most, metavar="N",
                   help=f"the most ranks a status answer lists unless asked for all: a bigger job's "
                        f"view lists the ranks not ok first (default {most})")


def _agent_node(a: argparse.ArgumentParser) -> None:
    """The agent's flags for what it serves: where it listens, its /metrics, its node id and state directory."""
    from rankwatch.agent.config import AgentConfig

    metrics_port = default(AgentConfig, "metrics_port")
    a.add_argument("--listen", type=address, action="append", default=None, metavar="ADDR",
                   help="socket path, unix:PATH or HOST:PORT; repeatable "
                        "(default: $RANKWATCH_AGENT, then the per-user socket)")
    a.add_argument("--metrics-port", type=port, default=metrics_port, metavar="N",
                   help=f"HTTP port of /metrics (0 picks a free one; default {metrics_port})")
    a.add_argument("--metrics-addr", default=default(AgentConfig, "metrics_addr"), help="interface of /metrics")
    a.add_argument("--node-id", default=None, help="default: $RANKWATCH_NODE_ID, then the host name")
    a.add_argument("--state-dir", type=Path, default=None,
                   help="keep incidents, decisions and the last status view here "
                        "(default $RANKWATCH_STATE_DIR, else /tmp/rankwatch-<uid>/<node-id>)")
    history = default(AgentConfig, "history_bytes")
    a.add_argument("--history-bytes", type=int, default=history, metavar="N",
                   help=f"keep at most N bytes of the ranks' step history in <state-dir>/history, "
                        f"oldest deleted first; 0 keeps none (default {history:,})")


def _agent_detectors(a: argparse.ArgumentParser) -> None:
    """The agent's flags for hang and straggler detection (the straggler flags' None: not given,
    the config's own default; :func:`~rankwatch.agent.cli.app._straggler_config`)."""
    from rankwatch.agent.detect.straggler import StragglerConfig

    floor, threshold = default(HangConfig, "floor_seconds"), default(StragglerConfig, "threshold")
    a.add_argument("--hang-floor", type=positive, default=floor, metavar="SECONDS",
                   help=f"shortest stall called a hang (default {floor:g})")
    a.add_argument("--straggler-threshold", type=positive, default=None, metavar="RATIO",
                   help=f"flag ranks whose own work is this much above the others' "
                        f"(default {threshold:g}: {threshold * 100:g}%%)")
    a.add_argument("--straggler-window", type=int, default=None, metavar="STEPS",
                   help=f"steps per straggler slowdown estimate (default {default(StragglerConfig, 'window')})")
    a.add_argument("--straggler-evidence", type=positive, default=None, metavar="LEVEL",
                   help="CUSUM level that confirms a slowdown: higher is slower and surer")


def _agent_coordination(a: argparse.ArgumentParser) -> None:
    """The agent's flags for which agent coordinates the job."""
    from rankwatch.agent.config import AgentConfig

    a.add_argument("--coordinator", type=address, action="append", default=default(AgentConfig, "coordinators"),
                   metavar="ADDR",
                   help="the job's coordinator candidates in node-rank order, repeatable; the "
                        "first that answers coordinates (this agent's own address may be one). "
                        "Default: this agent coordinates its own node alone")
    a.add_argument("--election", default=default(AgentConfig, "election"), metavar="etcd://HOST:PORT[,...]",
                   help="the coordinator is the agent holding the job's key in this etcd (v2 API; "
                        "the [etcd] extra), instead of the --coordinator list's first")
    a.add_argument("--job-id", default=default(AgentConfig, "job_id"), metavar="ID",
                   help="the job's id in etcd (with --election)")
    a.add_argument("--advertise", default=default(AgentConfig, "advertise"), metavar="HOST:PORT",
                   help="this agent's address for the other agents (default: its first TCP --listen)")


def _agent_trust(a: argparse.ArgumentParser) -> None:
    """The agent's flags for the token, mutual TLS and the stream caps (None: not given, the
    stream caps' own defaults; :func:`~rankwatch.agent.cli.app._stream_limits`)."""
    a.add_argument("--token-file", type=Path, default=None, metavar="PATH",
                   help="the job's shared token (mode 0600): every call over TCP needs it, and "
                        "Sync and RequestCheckpoint on the socket too (default: $RANKWATCH_TOKEN_FILE, "
                        "then $RANKWATCH_TOKEN; none: unchecked)")
    a.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                   help="this agent's certificate: TCP listeners use TLS and require client "
                        "certificates signed by --tls-ca; also presented to the coordinator")
    a.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="the key of --tls-cert")
    a.add_argument("--tls-ca", type=Path, default=None, metavar="PEM",
                   help="the CA that signs the job's certificates")
    a.add_argument("--max-streams", type=int, default=None, metavar="N",
                   help=f"rank streams served at once (default {default(StreamLimits, 'total')}); more are refused")
    a.add_argument("--control-reserve", type=int, default=None, metavar="N",
                   help=f"server threads rank streams can never take, for Status, Sync and RequestCheckpoint "
                        f"(default {default(StreamLimits, 'reserve')}; half of them may wait for a request's message)")
    a.add_argument("--max-waiting-per-peer", type=int, default=None, metavar="N",
                   help=f"calls from one TCP host that may wait for their request's message "
                        f"(default {default(StreamLimits, 'waiting_per_peer')})")
    a.add_argument("--max-streams-per-process", type=int, default=None, metavar="N",
                   help="streams served at once from one process on the Unix socket "
                        f"(default {default(StreamLimits, 'per_process')})")
    a.add_argument("--max-streams-per-peer", type=int, default=None, metavar="N",
                   help=f"rank streams served at once from one TCP host (default {default(StreamLimits, 'per_peer')})")


def _agent_policy(a: argparse.ArgumentParser) -> None:
    """The agent's flags for the coordinator's policy: evictions, the minimum job, silent bursts."""
    speedup, nodes = default(PolicyConfig, "evict_straggler_speedup"), default(PolicyConfig, "silent_burst_nodes")
    share, seconds = default(PolicyConfig, "silent_burst_share"), default(PolicyConfig, "silent_burst_seconds")
    a.add_argument("--evict-straggler-speedup", type=positive, default=speedup, metavar="X",
                   help=f"evict a straggling node at the next checkpoint when the job would step "
                        f"X times faster without it (default {speedup:g}; inf never evicts)")
    a.add_argument("--min-nodes", type=int, default=default(PolicyConfig, "min_nodes"), metavar="N",
                   help="never exclude a node if fewer would remain (torchrun's --nnodes MIN)")
    a.add_argument("--silent-burst-nodes", type=int, default=nodes, metavar="N",
                   help=f"more nodes than N (and than --silent-burst-share of the job) silent at once "
                        f"are the coordinator's or the network's trouble: none is excluded for its "
                        f"silence alone (default {nodes})")
    a.add_argument("--silent-burst-share", type=float, default=share, metavar="F",
                   help=f"see --silent-burst-nodes (default {share:g}: {share * 100:g}%% of the job's nodes)")
    a.add_argument("--silent-burst-seconds", type=float, default=seconds, metavar="SECONDS",
                   help=f"a node excluded for its silence counts in the burst this long, so that at "
                        f"most the burst's size are excluded for silence in that time (default {seconds:g})")


def _agent_gpu(a: argparse.ArgumentParser) -> None:
    """The agent's flags for GPU health (--gpu-interval None: not given, the source's own interval)."""
    from rankwatch.agent.gpu.settings import GpuConfig

    a.add_argument("--gpu-source", type=gpu_source, default=default(GpuConfig, "source"),
                   metavar="{auto,nvml,none,script:PATH}",
                   help="GPU health: NVML, none, or a fault script (JSON); auto (default) uses NVML "
                        "if it initialises, else none")
    a.add_argument("--dcgm-url", default=default(GpuConfig, "dcgm_url"), metavar="URL",
                   help="scrape this dcgm-exporter /metrics for GPU health instead of NVML")
    a.add_argument("--gpu-interval", type=positive, default=None, metavar="SECONDS",
                   help="between GPU readings (default 5; 0.5 for a script)")


def _agent_relays(a: argparse.ArgumentParser) -> None:
    """The agent's flags for a big job's relays and first syncs."""
    from rankwatch.agent.config import AgentConfig

    group, least = default(RelayConfig, "group_size"), default(RelayConfig, "min_nodes")
    every, intervals = default(RelayConfig, "whole_every_seconds"), default(RelayConfig, "whole_every_intervals")
    steps, hold = default(RelayConfig, "whole_every_steps"), default(RelayConfig, "busy_hold_seconds")
    wait, spread = default(RelayConfig, "long_wait_seconds"), default(RelayConfig, "long_wait_spread_seconds")
    jobs = default(AgentConfig, "job_nodes")
    a.add_argument("--relay-group", type=int, default=group, metavar="N",
                   help=f"in a big job, nodes sync through one relay agent per N nodes (default {group}; "
                        f"0: every node syncs with the coordinator; the coordinator's setting)")
    a.add_argument("--relay-min-nodes", type=int, default=least, metavar="N",
                   help=f"relays only in a job of at least N nodes (default {least})")
    a.add_argument("--relay-whole-every-seconds", type=float, default=every,
                   metavar="S", help=f"as a relay, send each node's summary whole at least every S seconds "
                                     f"(default {every:g}; beats between)")
    a.add_argument("--relay-whole-every-intervals", type=float, default=intervals,
                   metavar="K", help=f"... or every K sync intervals when the coordinator asks for slower syncs, "
                                     f"if that is longer (default {intervals:g}; 0: every S seconds however slow)")
    a.add_argument("--relay-whole-every-steps", type=int, default=steps, metavar="N",
                   help=f"as a relay, also send a node's summary whole once its ranks completed N steps "
                        f"since the last, if that comes first (default {steps})")
    a.add_argument("--relay-long-wait-spread-seconds", type=float, default=spread,
                   metavar="S", help=f"as a relay, send a node whole once a collective waited (or its ranks stood "
                                     f"still) {wait:g} s plus the node's own share of S "
                                     f"seconds, spreading a job-wide hang's summaries (default "
                                     f"{spread:g}; 0: all at once)")
    a.add_argument("--job-nodes", type=int, default=jobs, metavar="N",
                   help=f"the job's node count, if known (a Slurm job's SLURM_JOB_NUM_NODES): a big job's "
                        f"agents spread their first syncs over N/{default(LoadConfig, 'first_syncs_per_second'):g} s, "
                        f"at least {default(LoadConfig, 'first_sync_spread'):g} s (default {jobs}: not known)")
    a.add_argument("--relay-busy-hold-seconds", type=float, default=hold, metavar="S",
                   help=f"as a relay whose coordinator is busy, hold the nodes' summaries and have them back "
                        f"off for up to S seconds after its last reply, before sending them to the "
                        f"coordinator themselves (default {hold:g}; 0: never)")
