"""What ``rankwatch run`` changes in the torchrun command it is given: decided here, and only here.

Everything after ``--`` goes to torchrun.  Its launcher options (those before the training
script or ``-m module``) may change in three ways, and everything else is passed through:

* **The rendezvous backend.** ``c10d`` becomes ``rankwatch`` and ``etcd-v2`` becomes
  ``rankwatch-etcd``: the same dynamic rendezvous plus the coordinator's exclusions and
  restart generations (``wrap=False``, from ``RANKWATCH_RDZV=0``, keeps torch's own).  A
  multi-node job that names no backend (``--nnodes 2:3 --rdzv-endpoint H:P``, as DESIGN.md's
  command is) gets ``rankwatch`` too: torchrun's default, ``static``, needs a fixed world and
  ``--node-rank`` on every node, and never restarts around a lost node.
* **Rendezvous timings.** torch's defaults (keep-alive every 5 s, a node dead after 3
  missed, a 30 s last call) make a multi-node job take about 47 s to train again after a
  node's loss.  Unless the user set them, a dynamic rendezvous gets :func:`fast_timings`.
  A key the user gave in ``--rdzv-conf`` (or ``PET_RDZV_CONF``) is never changed.
* **Restarts.** A multi-node job with no ``--max-restarts`` (nor ``PET_MAX_RESTARTS``)
  gets :data:`DEFAULT_MAX_RESTARTS`: with torchrun's 0, the survivors of a node's loss exit
  instead of training on.

Single-node jobs (``--standalone``) and static ones (``--rdzv-backend static``, or
``--node-rank``/``--master-addr`` with no backend) are left alone.  Every change is
listed in :attr:`Launch.notes`, which ``rankwatch run`` prints, so the user sees what ran.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["DEFAULT_MAX_RESTARTS", "DYNAMIC_BACKENDS", "Launch", "fast_timings", "plan"]

# torchrun's options that take no value (checked against torch's own parser by a test);
# every other option takes exactly one.
_NO_VALUE = frozenset({"-h", "--help", "--standalone", "-m", "--module", "--no-python", "--no_python",
                       "--run-path", "--run_path", "--virtual-local-rank", "--virtual_local_rank"})

WRAPPERS = {"c10d": "rankwatch", "etcd-v2": "rankwatch-etcd"}
"""torchrun's dynamic rendezvous backends -> rankwatch's exclusion-aware wrapper of each."""
DYNAMIC_BACKENDS = frozenset({*WRAPPERS, *WRAPPERS.values()})

DEFAULT_MAX_RESTARTS = 3
"""Worker-group restarts for a multi-node job that names none.  Exclusions restart without
spending one; a dead peer's survivors spend one each time; a script that crashes on its
own fails after this many tries."""

_NODES_PER_KEEP_ALIVE_SECOND = 64
_TORCH_KEEP_ALIVE_INTERVAL = 5      # torch's own default: the slowest this module ever asks for
_JOIN_TIMEOUT = 600                 # torch's own default, kept: see fast_timings
_STATIC_ONLY = ((("--node-rank", "--node_rank"), "PET_NODE_RANK"),
                (("--master-addr", "--master_addr"), "PET_MASTER_ADDR"),
                (("--master-port", "--master_port"), "PET_MASTER_PORT"))
_TORCH_TIMINGS = {"keep_alive_interval": "5", "keep_alive_max_attempt": "3", "last_call_timeout": "30",
                  "join_timeout": "600"}


def fast_timings(max_nodes: int) -> dict[str, str]:
    """Dynamic-rendezvous timings for a job of up to ``max_nodes`` nodes.

    * ``keep_alive_interval``: 1 s up to 64 nodes, one more second per 64 nodes, at most
      torch's 5 s.  Every node's keep-alive is a compare-and-set of the one rendezvous
      state (a blob that grows with the nodes): at 1 s a 512-node job would make hundreds
      of contended writes a second.
    * ``keep_alive_max_attempt``: 3 (torch's), so a dead node leaves the round after 3 s on
      a small job.  Two missed keep-alives (2 s) dropped live nodes from the round when four
      nodes shared two cores in this project's tests; three did not.  Node clocks must agree
      to well under that (NTP does): a node's keep-alive time is compared with its peers'.
    * ``last_call_timeout``: one keep-alive interval, not torch's 30 s.  When a round has
      room for more nodes than have come (after a loss, without a spare) it waits this long
      for stragglers.  A node later than that joins the round after next, which costs one
      more restart, not a failure.
    * ``join_timeout``: torch's 600 s.  It bounds the first rendezvous, which waits for the
      slowest node to be scheduled and started, and a re-formed round that cannot reach
      ``--nnodes`` MIN: where a replacement node takes minutes to come, a shorter wait would
      end a job that could have gone on.  It costs nothing in a recovery that can succeed.
    """
    interval = min(_TORCH_KEEP_ALIVE_INTERVAL, max(1, math.ceil(max_nodes / _NODES_PER_KEEP_ALIVE_SECOND)))
    return {"keep_alive_interval": str(interval), "keep_alive_max_attempt": "3",
            "last_call_timeout": str(interval), "join_timeout": str(_JOIN_TIMEOUT)}


@dataclass(frozen=True)
class Launch:
    args: list[str]
    """torchrun's arguments, changed."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables to set for torchrun (where the user set none)."""
    notes: list[str] = field(default_factory=list)
    """What was changed and why, one line each, for the user."""


def _options(args: Sequence[str]) -> list[tuple[int, str, str]]:
    """torchrun's launcher options, up to the training script (or module): (index, flag, value)
    each, the value in the next token for ``--flag value``, in the same for ``--flag=value``."""
    out = []
    i = 0
    while i < len(args) and args[i] != "--" and args[i].startswith("-"):
        flag, eq, value = args[i].partition("=")
        if eq or args[i] in _NO_VALUE:
            out.append((i, flag, value))
            i += 1
        else:
            out.append((i, flag, args[i + 1] if i + 1 < len(args) else ""))
            i += 2
    return out


def _find(args: Sequence[str], *names: str) -> tuple[int, str] | None:
    """(index, value) of the last of ``names`` among the launcher options, or None."""
    return next(((i, v) for i, flag, v in reversed(_options(args)) if flag in names), None)


def _parse_conf(text: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for kv in text.split(","):
        key, _, value = kv.partition("=")
        if key.strip():
            conf[key.strip()] = value.strip()
    return conf


def _max_nodes(nnodes: str) -> int:
    try:
        return max(1, int(nnodes.rpartition(":")[2]))
    except ValueError:
        return 1


def _set(args: list[str], names: tuple[str, ...], value: str) -> list[str]:
    """``args`` with the launcher option ``names[0]`` set to ``value``: replaced where it is, or
    put first (torchrun's options may come in any order; ``-m`` must stay before the module)."""
    found = _find(args, *names)
    if found is None:
        return [names[0], value, *args]
    i, _ = found
    if "=" in args[i]:
        return [*args[:i], f"{args[i].partition('=')[0]}={value}", *args[i + 1:]]
    return [*args[:i + 1], value, *args[i + 2:]]


def plan(torchrun_args: Sequence[str], environ: Mapping[str, str], wrap: bool = True) -> Launch:
    """What ``rankwatch run`` runs for ``torchrun_args`` (``environ``: torchrun's environment)."""
    args = list(torchrun_args)
    env: dict[str, str] = {}
    notes: list[str] = []

    def given(*names: str, pet: str) -> str | None:
        found = _find(args, *names)
        return found[1] if found is not None else environ.get(pet)

    standalone = _find(args, "--standalone") is not None or environ.get("PET_STANDALONE", "0") not in ("", "0")
    if standalone:
        return Launch(args)
    max_nodes = _max_nodes(given("--nnodes", pet="PET_NNODES") or "1")
    backend = given("--rdzv-backend", "--rdzv_backend", pet="PET_RDZV_BACKEND")
    if backend is None:
        static_setup = any(given(*names, pet=pet) is not None for names, pet in _STATIC_ONLY)
        if static_setup or not given("--rdzv-endpoint", "--rdzv_endpoint", pet="PET_RDZV_ENDPOINT"):
            return Launch(args)
        backend = "c10d"
        args = _set(args, ("--rdzv-backend", "--rdzv_backend"), backend)
        notes.append("no --rdzv-backend: c10d (torchrun's default, static, needs a fixed world and "
                     "--node-rank on every node)")
    if backend not in DYNAMIC_BACKENDS:
        return Launch(args)

    if wrap and backend in WRAPPERS:
        args = _set(args, ("--rdzv-backend", "--rdzv_backend"), WRAPPERS[backend])
        # torchrun's worker store shared across rounds keeps the old round's keys, and a
        # restarted round then fails to connect (gloo's connectFullMesh).
        if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in environ:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"

    conf = _parse_conf(given("--rdzv-conf", "--rdzv_conf", pet="PET_RDZV_CONF") or "")
    added = {k: v for k, v in fast_timings(max_nodes).items() if k not in conf}
    if added:
        merged = ",".join(f"{k}={v}" if v else k for k, v in {**conf, **added}.items())
        args = _set(args, ("--rdzv-conf", "--rdzv_conf"), merged)
        notes.append("rendezvous: " + ", ".join(f"{k}={v} (torch's {_TORCH_TIMINGS[k]})" for k, v in added.items())
                     + "; set any in --rdzv-conf to choose it")

    if max_nodes > 1 and given("--max-restarts", "--max_restarts", pet="PET_MAX_RESTARTS") is None:
        args = _set(args, ("--max-restarts", "--max_restarts"), str(DEFAULT_MAX_RESTARTS))
        notes.append(f"--max-restarts {DEFAULT_MAX_RESTARTS} (torchrun's 0 ends the job at a node's loss; "
                     "give --max-restarts to choose)")
    return Launch(args, env, notes)
