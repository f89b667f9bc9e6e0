"""Reading PyTorch profiler traces: one Chrome-trace JSON per rank (``.json``, ``.json.gz``), as
``torch.profiler``'s ``export_chrome_trace`` and ``tensorboard_trace_handler`` write them.

Rank and world from ``distributedInfo`` (else ``rank<N>`` in the file's name); steps from the
``ProfilerStep#N`` spans.  A step's rows are the top-level CPU events of the thread that ran
it, cut around its communication: while a ``gloo:*`` / ``nccl:*`` span is in flight (on any of
the rank's threads) the row is that collective's.  gloo's spans name no group or sequence
number: the group is the largest process group in ``distributedInfo.pg_config`` and ``seq``
the collective's ordinal in the trace.  ``baseTimeNanoseconds`` puts every rank on one clock.
The rules, and what they assume, are in ``docs/analyze.md`` ("PyTorch profiler traces").
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rankwatch.agent.analyze.table import KINDS, NOT_SET, OpTable, TraceError, checked, short

__all__ = ["MAX_BYTES", "ProfilerTrace", "is_profiler_trace", "parse_profiler", "read_profiler"]

MAX_BYTES = 512 << 20
"""The largest trace read (decompressed): 512 MiB, which peaks near 1.3 GB of memory."""
SNIFF_BYTES = 64 << 10
ORIGIN_NS = 1_600_000_000 * 10**9
"""Starts are seconds after this Unix time (2020-09-13), where the trace has its base: one
origin for every rank, near enough for float seconds to keep sub-microsecond steps."""
_STEP = re.compile(r"ProfilerStep#(\d+)$")
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_COMM = ("gloo:", "nccl:")
_P2P = ("send", "recv", "isend", "irecv", "recv_any_source")
_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
            "alltoall": "all_to_all", "allgatherintotensor": "all_gather", "reducescattertensor": "reduce_scatter",
            "allgatherintotensorcoalesced": "all_gather_coalesced", "alltoallv": "all_to_all"}
_DTYPE_BYTES = {"Float": 4, "Half": 2, "BFloat16": 2, "Double": 8, "Long": 8, "Int": 4, "Byte": 1, "Char": 1,
                "Bool": 1, "Short": 2, "Float8_e4m3fn": 1, "Float8_e5m2": 1}


@dataclass
class ProfilerTrace:
    """One rank's trace: its operations, and what the table has no column for."""

    table: OpTable
    rank: int
    world_size: int | None
    kernel_seconds: np.ndarray
    """Per row, the GPU time of the ``nccl`` kernels the row launched (NaN where none)."""


def is_profiler_trace(path: str) -> bool:
    """Whether ``path`` starts like a Chrome trace object (reads its first 64 KiB only)."""
    try:
        with _open(path) as f:
            head = f.read(SNIFF_BYTES)
    except (OSError, EOFError, gzip.BadGzipFile):
        return False
    text = head.decode("utf-8", "replace").lstrip("\ufeff \t\r\n")
    return text.startswith("{") and any(k in text for k in ('"traceEvents"', '"schemaVersion"', '"distributedInfo"'))


def read_profiler(path: str) -> OpTable:
    """The operations of one rank's profiler trace (see the module's docstring)."""
    return parse_profiler(path).table


def parse_profiler(path: str) -> ProfilerTrace:
    """One rank's trace: rows, rank, world size, and the GPU kernel time per row."""
    doc = _load(path)
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        raise TraceError(path, "no traceEvents list: not a PyTorch profiler trace")
    _validate(path, events)
    events = [e for e in events if e is not None]
    rank, world = _identity(path, doc)
    steps = _steps(path, events)
    main = (steps[0][4], steps[0][5])
    comms = _communication(events, main)
    base = doc.get("baseTimeNanoseconds")
    base_us = (int(base) - ORIGIN_NS) / 1e3 if isinstance(base, (int, float)) and _is_number(base) else 0.0
    rows = _rows(events, steps, main, comms)
    table, launched = _table(path, rows, rank, doc, base_us)
    return ProfilerTrace(table=checked(table, 0), rank=rank, world_size=world,
                         kernel_seconds=_kernel_seconds(events, launched, len(table)))


def _open(path: str) -> Any:
    return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")


def _load(path: str) -> dict:
    """The trace's top-level object, its X events as tuples (others dropped)."""
    p = Path(path)
    try:
        if not p.name.endswith(".gz") and p.stat().st_size > MAX_BYTES:
            raise TraceError(path, f"{p.stat().st_size} bytes: over the {MAX_BYTES} bytes read")
        with _open(path) as f:
            raw = f.read(MAX_BYTES + 1)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise TraceError(path, f"cannot read: {exc}") from None
    if len(raw) > MAX_BYTES:
        raise TraceError(path, f"over the {MAX_BYTES} bytes read (decompressed)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(path, f"not UTF-8 at byte {exc.start}") from None
    del raw
    try:
        doc = json.loads(text, object_hook=_keep)
    except json.JSONDecodeError as exc:
        at = len(text[:exc.pos].encode("utf-8"))
        raise TraceError(path, f"bad JSON at byte {at} (line {exc.lineno}, column {exc.colno}): {exc.msg}") from None
    except RecursionError:
        raise TraceError(path, "bad JSON: nested too deep") from None
    if not isinstance(doc, dict):
        raise TraceError(path, "not a JSON object: not a PyTorch profiler trace")
    return doc


def _keep(obj: dict) -> Any:
    """While parsing: a complete event (``ph: X``) as ``(name, cat, ts, dur, pid, tid, args or
    None)``, other events dropped (None)."""
    ph = obj.get("ph")
    if ph is None or "traceEvents" in obj:
        return obj
    if ph != "X":
        return None
    name, cat, args = obj.get("name"), obj.get("cat"), obj.get("args")
    keep = isinstance(name, str) and (name.startswith(_COMM) or name == "record_param_comms" or cat in (
        "kernel", "cuda_runtime", "cuda_driver"))
    return (name, cat, obj.get("ts"), obj.get("dur"), obj.get("pid"), obj.get("tid"), args if keep else None)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)


def _validate(path: str, events: list) -> None:
    for i, e in enumerate(events):
        if e is None:
            continue
        if not isinstance(e, tuple):
            raise TraceError(path, "not an event object", i, "traceEvents")
        if not isinstance(e[0], str):
            raise TraceError(path, f"{e[0]!r} is not a string", i, "name")
        for field_, v in (("ts", e[2]), ("dur", e[3])):
            if not _is_number(v) or (field_ == "dur" and v < 0):
                raise TraceError(path, f"{v!r} is not a number of microseconds", i, field_)


def _identity(path: str, doc: dict) -> tuple[int, int | None]:
    info = doc.get("distributedInfo")
    info = info if isinstance(info, dict) else {}
    rank, world = info.get("rank"), info.get("world_size")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        found = _RANK_IN_NAME.search(Path(path).name)
        if found is None:
            raise TraceError(path, "no rank: no distributedInfo.rank and no rank<N> in the file's name")
        rank = int(found.group(1))
    return rank, world if isinstance(world, int) and not isinstance(world, bool) else None


def _steps(path: str, events: list[tuple]) -> list[tuple]:
    """The ``ProfilerStep#N`` spans on the thread that ran most of them, by start."""
    steps = [e for e in events if _STEP.match(e[0])]
    if not steps:
        raise TraceError(path, "no ProfilerStep#N events: was the profiler stepped (prof.step()) in a schedule?")
    threads: dict[tuple, int] = {}
    for e in steps:
        threads[(e[4], e[5])] = threads.get((e[4], e[5]), 0) + 1
    main = max(threads, key=threads.__getitem__)
    return sorted((e for e in steps if (e[4], e[5]) == main), key=lambda e: e[2])


def _communication(events: list[tuple], main: tuple) -> list[tuple]:
    """The rank's communication spans, by start: gloo/nccl spans of the process, else its
    c10d ops and record_param_comms on the steps' thread."""
    spans = [e for e in events if e[4] == main[0] and e[0].startswith(_COMM) and e[1] != "kernel"]
    threads = {e[5] for e in spans}  # their record_param_comms (args, merged into the span they are in)
    spans += [e for e in events if e[0] == "record_param_comms" and e[4] == main[0] and e[5] in threads]
    if not spans:
        spans = [e for e in events if (e[4], e[5]) == main and (
            e[0].startswith("c10d::") and _op_name(e[0]) not in ("wait", "barrier_wait") or e[0] == "record_param_comms")]
    return sorted(spans, key=lambda e: (e[2], -e[3]))


def _op_name(name: str) -> str:
    """``gloo:all_reduce``, ``c10d::allreduce_``, ``nccl:_all_gather_base`` -> the collective."""
    n = name.rsplit(":", 1)[-1].strip("_").removesuffix("_base").strip("_")
    return _ALIASES.get(n.replace("_", ""), n)


def _kind(name: str) -> str:
    """The kind of a row that is not communication."""
    return "data" if name.startswith("enumerate(DataLoader)") else (
        "optimizer" if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")) else "compute")


def _rows(events: list[tuple], steps: list[tuple], main: tuple, comms: list[tuple]) -> list[tuple]:
    """Per step, the chain ``(step, event, start_us, end_us, ordinal)``: communication spans
    (``ordinal`` their index among the kept spans) and the top-level events cut around them."""
    on_main = sorted((e for e in events if (e[4], e[5]) == main and not _STEP.match(e[0])),
                     key=lambda e: (e[2], -e[3]))
    starts = np.fromiter((e[2] for e in on_main), float, len(on_main))
    kept = _unnested(comms)
    comm_starts = np.fromiter((e[2] for e in kept), float, len(kept))
    rows: list[tuple] = []
    for s in steps:
        a, b, n = s[2], s[2] + s[3], int(_STEP.match(s[0]).group(1))  # type: ignore[union-attr]
        cut: list[tuple] = []
        prev = a
        for k in range(int(np.searchsorted(comm_starts, a)), int(np.searchsorted(comm_starts, b))):
            e = kept[k]
            start = max(e[2], prev)
            prev = max(start, min(e[2] + e[3], b))
            cut.append((n, e, start, prev, k))
        top, end = [], a
        for i in range(int(np.searchsorted(starts, a)), int(np.searchsorted(starts, b, "right"))):
            e = on_main[i]
            if e[2] >= end and e[2] + e[3] <= b:
                top.append(e)
                end = e[2] + e[3]
        rows.extend(_merge(n, top, cut))
    return rows


def _unnested(comms: list[tuple]) -> list[tuple]:
    """Communication spans that are not inside an earlier one (a nested span's args fill the
    outer's where it has none: a ``record_param_comms`` inside ``nccl:*``, or the reverse)."""
    kept: list[tuple] = []
    for e in comms:
        if kept and e[5] == kept[-1][5] and e[2] + e[3] <= kept[-1][2] + kept[-1][3]:
            outer = kept[-1]
            if e[6] and not outer[6]:
                kept[-1] = (*outer[:6], e[6])
            elif e[6] and outer[6]:
                kept[-1] = (*outer[:6], {**e[6], **outer[6]})
            continue
        kept.append(e)
    return kept


def _merge(step: int, top: list[tuple], cut: list[tuple]) -> list[tuple]:
    """The step's chain: ``cut`` (communication), and ``top``'s events less the time in ``cut``."""
    out, j = [], 0
    for e in top:
        x, y = e[2], e[2] + e[3]
        while j < len(cut) and cut[j][3] <= x:
            j += 1
        k = j
        while x < y and k < len(cut) and cut[k][2] < y:
            if cut[k][2] > x:
                out.append((step, e, x, cut[k][2], None))
            x = max(x, cut[k][3])
            k += 1
        if x < y:
            out.append((step, e, x, y, None))
    out.extend(cut)
    out.sort(key=lambda r: (r[2], r[3]))
    return out


def _group_of(doc: dict, rank: int) -> tuple[str, int]:
    """The group of communication whose event names none (the largest process group), and the
    peer of its point-to-point operations where that group has two ranks (else NOT_SET)."""
    info = doc.get("distributedInfo")
    configs = info.get("pg_config") if isinstance(info, dict) else None
    best = None
    for pg in configs if isinstance(configs, list) else []:
        if isinstance(pg, dict) and isinstance(pg.get("pg_size"), int) and pg["pg_size"] > 1:
            if best is None or pg["pg_size"] > best["pg_size"]:
                best = pg
    if best is None:
        return "default", NOT_SET
    ranks: list = best["ranks"] if isinstance(best.get("ranks"), list) else []
    others = [r for r in ranks if r != rank] if rank in ranks else []
    peer = others[0] if len(ranks) == 2 and len(others) == 1 and isinstance(others[0], int) else NOT_SET
    return short(best.get("pg_desc") or best.get("pg_name")), peer


def _pairing(e: tuple, op: str, fallback: tuple[str, int], counts: dict) -> tuple[str, int, int, int]:
    """``(group, seq, bytes, peer)`` of a communication row (NOT_SET where unknown).  Without a
    ``Seq``, a collective's is its ordinal in its group, a send's (receive's) its ordinal among
    those to (from) its peer: the n-th send pairs with the peer's n-th receive."""
    args = e[6] if isinstance(e[6], dict) else {}
    group = next((short(args[k]) for k in ("Process Group Description", "Process Group Name")
                  if args.get(k) not in (None, "", "undefined")), fallback[0])
    nelems = max((int(args[k]) for k in ("In msg nelems", "Out msg nelems") if isinstance(args.get(k), int)),
                 default=None)
    size = nelems * _DTYPE_BYTES.get(str(args.get("dtype")), 0) if nelems is not None else 0
    peer = args.get("Dst Rank" if op in ("send", "isend") else "Src Rank") if op in _P2P else NOT_SET
    peer = peer if isinstance(peer, int) and peer >= 0 else (fallback[1] if op in _P2P else NOT_SET)
    seq = args.get("Seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        key = (group, op in ("send", "isend"), peer) if op in _P2P else (group,)
        seq = counts[key] = counts.get(key, -1) + 1
    return group, seq, size if size > 0 else NOT_SET, peer


def _table(path: str, rows: list[tuple], rank: int, doc: dict, base_us: float) -> tuple[OpTable, list[tuple]]:
    """The rows as an :class:`OpTable`; also ``(row, start_us, end_us)`` of each communication row."""
    names: dict[str, int] = {}
    fallback, n = _group_of(doc, rank), len(rows)
    counts: dict[tuple, int] = {}
    ops, kinds, groups = np.empty(n, np.int32), np.empty(n, np.int8), np.full(n, NOT_SET, np.int32)
    ints = {k: np.full(n, NOT_SET, np.int64) for k in ("seq", "bytes", "peer")}
    launched = []
    for i, (_, e, x, y, ordinal) in enumerate(rows):
        name, kind = e[0], _kind(e[0])
        if ordinal is not None:  # communication
            name = _op_name(name if name != "record_param_comms" else str((e[6] or {}).get("Collective name", name)))
            kind = "p2p" if name in _P2P else "collective"
            g, ints["seq"][i], ints["bytes"][i], ints["peer"][i] = _pairing(e, name, fallback, counts)
            groups[i] = names.setdefault(g, len(names))
            launched.append((i, x, y))
        ops[i] = names.setdefault(short(name), len(names))
        kinds[i] = KINDS.index(kind)
    # Both ends on the seconds clock: a row's start + duration is then exactly the next row's start.
    start = (np.fromiter((r[2] for r in rows), float, n) + base_us) / 1e6
    end = (np.fromiter((r[3] for r in rows), float, n) + base_us) / 1e6
    host = doc.get("host_name")
    node = None
    if isinstance(host, str) and host:
        node = np.full(n, names.setdefault(short(host), len(names)), np.int32)
    table = OpTable(rank=np.full(n, rank, np.int64), step=np.fromiter((r[0] for r in rows), np.int64, n),
                    op=ops, kind=kinds, start=start, duration=end - start, names=list(names),
                    node=node, group=groups, ints={k: v for k, v in ints.items() if (v != NOT_SET).any()},
                    source=path)
    return table, launched


def _kernel_seconds(events: list[tuple], launched: list[tuple], n: int) -> np.ndarray:
    """Per row, the time of the ``nccl`` GPU kernels launched inside it (NaN where none)."""
    out = np.full(n, np.nan)
    kernels: dict[Any, float] = {}
    for e in events:
        if e[1] == "kernel" and "nccl" in e[0].lower() and isinstance(e[6], dict):
            kernels[e[6].get("correlation")] = kernels.get(e[6].get("correlation"), 0.0) + e[3] / 1e6
    starts = np.array([r[1] for r in launched])
    for e in events if kernels and launched else []:
        if e[1] in ("cuda_runtime", "cuda_driver") and isinstance(e[6], dict) and e[6].get("correlation") in kernels:
            k = int(np.searchsorted(starts, e[2], "right")) - 1
            if k >= 0 and e[2] <= launched[k][2]:
                out[launched[k][0]] = np.nan_to_num(out[launched[k][0]]) + kernels[e[6]["correlation"]]
    return out
