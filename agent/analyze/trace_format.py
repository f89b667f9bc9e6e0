"""Reading the rankwatch trace format: JSON Lines (``.jsonl``, ``.jsonl.gz``), CSV (``.csv``,
``.csv.gz``) or Parquet (``.parquet``), one row per timed operation (``docs/analyze.md``).

The files are read a block at a time by Arrow's C++ readers (6.4 million rows in seconds),
and each block becomes numpy columns at once, so the rows are never held twice.  Unknown
columns are ignored.  A file Arrow refuses is read again line by line, only to name the row
and the field that is wrong.
"""

from __future__ import annotations

import csv
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq

from rankwatch.agent.analyze.table import (
    INT_OPTIONAL, KINDS, LIMITS, NOT_SET, WIDE, OpTable, TraceError, checked, concat,
)

__all__ = ["MAX_OPS", "SUFFIXES", "read_trace"]

MAX_OPS = 20_000_000
"""Operations read from all files together before ``analyze`` refuses (about 1.5 GB of
columns and replay state): ``--max-ops`` raises it."""
SUFFIXES = (".jsonl", ".jsonl.gz", ".csv", ".csv.gz", ".parquet")
_REQUIRED = {"rank": pa.int64(), "step": pa.int64(), "op": pa.string(), "kind": pa.string(),
             "start": pa.float64(), "duration": pa.float64()}
_OPTIONAL = {"node": pa.string(), "group": pa.string(), **{k: pa.int64() for k in INT_OPTIONAL}}
_SCHEMA = pa.schema({**_REQUIRED, **_OPTIONAL})
_KIND_INDEX = {k: i for i, k in enumerate(KINDS)}


def read_trace(path: str | Path, max_ops: int = MAX_OPS) -> OpTable:
    """Every row of one trace file, checked (:func:`~.table.checked`).

    Raises:
        TraceError: the file cannot be read, lacks a required column, has a malformed row
            or a value out of range (naming the row and the field), or holds more than
            ``max_ops`` rows.
    """
    p = str(path)
    fmt = _format(p)
    first = 2 if fmt == "csv" else 1
    parts, rows = [], 0
    try:
        for batch in _batches(p, fmt):
            part = _columns(batch, p, first + rows)
            rows += len(part)
            if rows > max_ops:
                raise TraceError(p, f"more than {max_ops:,} operations (raise --max-ops to read it)")
            parts.append(checked(part, first + rows - len(part)))
    except (pa.ArrowInvalid, pa.ArrowTypeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _locate(p, fmt, e) from None
    except (OSError, EOFError) as e:
        raise TraceError(p, f"cannot be read: {e}") from None
    if not parts:
        raise TraceError(p, "holds no operations")
    return concat(parts, source=p)


def _format(path: str) -> str:
    name = path.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        return "jsonl"
    if name.endswith((".csv", ".csv.gz")):
        return "csv"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    raise TraceError(path, f"not a trace file: expected one of {', '.join(SUFFIXES)}")


def _stream(path: str) -> Any:
    return pa.input_stream(path, compression="gzip" if path.lower().endswith(".gz") else None)


def _batches(path: str, fmt: str) -> Iterator[pa.RecordBatch]:
    if fmt == "parquet":
        f = pq.ParquetFile(path)
        missing = [c for c in _REQUIRED if c not in f.schema_arrow.names]
        if missing:
            raise TraceError(path, f"no column {missing[0]!r} (required: {', '.join(_REQUIRED)})")
        cols = [c for c in _SCHEMA.names if c in f.schema_arrow.names]
        yield from f.iter_batches(batch_size=1 << 20, columns=cols)
        return
    if fmt == "csv":
        reader = pcsv.open_csv(_stream(path), read_options=pcsv.ReadOptions(block_size=32 << 20),
                               convert_options=pcsv.ConvertOptions(column_types=_SCHEMA, strings_can_be_null=True))
    else:
        reader = pjson.open_json(_stream(path), read_options=pjson.ReadOptions(block_size=32 << 20),
                                 parse_options=pjson.ParseOptions(explicit_schema=_SCHEMA,
                                                                  unexpected_field_behavior="ignore"))
    yield from reader


def _columns(batch: pa.RecordBatch, path: str, first_row: int) -> OpTable:
    """One block's columns as numpy, names dictionary-encoded."""
    names: list[str] = []
    have = set(batch.schema.names)

    def need(col: str) -> pa.Array:
        if col not in have:
            raise TraceError(path, f"no column {col!r} (required: {', '.join(_REQUIRED)})")
        a = batch.column(col).cast(_SCHEMA.field(col).type)
        if a.null_count:
            row = first_row + int(np.flatnonzero(a.is_null().to_numpy(zero_copy_only=False))[0])
            raise TraceError(path, "missing (required)", row, col)
        return a

    def encoded(a: pa.Array) -> np.ndarray:
        d = pc.dictionary_encode(pc.utf8_slice_codeunits(a, 0, 128))
        base = len(names)
        names.extend(d.dictionary.to_pylist())
        idx = d.indices.fill_null(-1 - base).to_numpy(zero_copy_only=False).astype(np.int32)
        return idx + base

    kind_names = need("kind")
    kd = pc.dictionary_encode(kind_names)
    lut = np.array([_KIND_INDEX.get(k, -1) for k in kd.dictionary.to_pylist()] or [0], np.int8)
    kind = lut[kd.indices.to_numpy(zero_copy_only=False)]
    if (kind < 0).any():
        i = int(np.flatnonzero(kind < 0)[0])
        raise TraceError(path, f"{kind_names[i].as_py()!r} is not one of {', '.join(KINDS)}", first_row + i, "kind")
    have = {c for c in have if batch.column(c).null_count < len(batch)}   # a column no row fills is absent
    ints = {k: _ints(batch.column(k), k) for k in INT_OPTIONAL if k in have}
    return OpTable(rank=_narrow(need("rank").to_numpy(), "rank"), step=need("step").to_numpy(), op=encoded(need("op")), kind=kind,
                   start=need("start").to_numpy(), duration=need("duration").to_numpy(), names=names,
                   node=encoded(batch.column("node")) if "node" in have else None,
                   group=encoded(batch.column("group")) if "group" in have else None, ints=ints, source=path)


def _ints(a: pa.Array, name: str) -> np.ndarray:
    return _narrow(a.cast(pa.int64()).fill_null(NOT_SET).to_numpy(), name)


def _narrow(x: np.ndarray, name: str) -> np.ndarray:
    """int32 where the field's range allows and the values fit (out-of-range values keep
    int64, so that :func:`~.table.checked` reports them as they are)."""
    if name in WIDE or not x.size or x.max() > LIMITS[name][1] or x.min() < NOT_SET:
        return x
    return x.astype(np.int32)


def _locate(path: str, fmt: str, error: Exception) -> TraceError:
    """The first row and field a reader refused, found by reading the rows one by one."""
    seen = False
    try:
        for row, record in _records(path, fmt):
            seen = True
            for col, typ in zip(_SCHEMA.names, _SCHEMA.types):
                value = record.get(col)
                if value in (None, "") and col not in _REQUIRED:
                    continue
                if not _fits(value, typ):
                    return TraceError(path, f"{str(value)[:40]!r} is not {'a number' if typ != pa.string() else 'text'}",
                                      row, col)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return TraceError(path, f"not JSON ({getattr(e, 'msg', e)})", getattr(e, "row", None))
    except (OSError, EOFError, csv.Error) as e:
        return TraceError(path, f"cannot be read: {e}")
    if not seen:
        return TraceError(path, "holds no operations")
    return TraceError(path, f"unreadable: {str(error).splitlines()[0][:200]}")


def _records(path: str, fmt: str) -> Iterator[tuple[int, dict]]:
    opener = gzip.open if path.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
        if fmt == "csv":
            for row, rec in enumerate(csv.DictReader(f), start=2):
                yield row, rec
            return
        for row, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                e.row = row  # type: ignore[attr-defined]
                raise
            if not isinstance(rec, dict):
                raise _not_object(row, line)
            yield row, rec


def _not_object(row: int, line: str) -> json.JSONDecodeError:
    e = json.JSONDecodeError("a row must be a JSON object", line[:40], 0)
    e.row = row  # type: ignore[attr-defined]
    return e


def _fits(value: Any, typ: pa.DataType) -> bool:
    if typ == pa.string():
        return isinstance(value, (str, int, float)) or value is None
    if isinstance(value, str):
        try:
            value = float(value) if typ == pa.float64() else int(value)
        except ValueError:
            return False
    if isinstance(value, bool) or value is None:
        return False
    return isinstance(value, (int, float)) and (typ == pa.float64() or float(value).is_integer())


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    """Rows to a JSON Lines file (``.gz``: compressed): for tests and tools."""
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    p = str(path)
    with (gzip.open(p, "wb") if p.endswith(".gz") else open(p, "wb")) as f:
        f.write(data)

