"""JSON lines decoded into Arrow columns by a declared schema: the work of the Spark tasks that
read a decoding source's records, and of the backflow's replays (the rules, and the schema's
declaration: onceflow.sources.json_records). msgspec decodes each line in C against a Struct
type built once per schema; pyarrow holds the columns.

pyarrow and msgspec are imported here at the top: the declarations (JsonRecords, the sources)
do not import this module, so a DAG parse, which declares them, loads neither.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from operator import attrgetter
from typing import Annotated, Any

import msgspec
import pyarrow as pa

from onceflow.core.source import CORRUPT, PROBLEM

INT_BITS = {"tinyint": 8, "smallint": 16, "int": 32, "bigint": 64}

Columns = tuple[tuple[str, str], ...]  # JsonRecords.columns: (name, Spark type)


def arrow_type(kind: str):
    """The Arrow type a declared column of Spark type ``kind`` is decoded into."""
    return {"string": pa.string(), "boolean": pa.bool_(), "tinyint": pa.int8(),
            "smallint": pa.int16(), "int": pa.int32(), "bigint": pa.int64(),
            "float": pa.float32(), "double": pa.float64()}[kind]


def decode(columns: Columns, lines: Sequence[bytes], max_bytes: int | None = None):
    """``lines`` (UTF-8 bytes, no line ends) as Arrow arrays: the declared ``columns`` and
    ``_corrupt_record`` (a dict by name), and ``_problem``, why the spout refuses a line:
    over ``max_bytes`` bytes (then nothing is decoded), or a NUL byte (PostgreSQL text
    cannot keep its payload; such a line is never valid JSON)."""
    decode_line, empty = _decoder(columns)
    errors = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
    rows: list[Any] = []
    corrupt: dict[int, bytes] = {}
    problems: dict[int, str] = {}
    if max_bytes is not None and lines and max(map(len, lines)) > max_bytes:
        oversized = [i for i, line in enumerate(lines) if len(line) > max_bytes]
        for i in oversized:
            problems[i] = (f"oversized record ({len(lines[i])} bytes, over "
                           f"max_record_bytes={max_bytes})")
        kept = set(oversized)
        lines = [b"null" if i in kept else line for i, line in enumerate(lines)]

    def refuse(i: int, line: bytes) -> None:
        if b"\x00" in line:
            problems[i] = "payload holds a NUL character, which PostgreSQL text cannot store"
        else:
            corrupt[i] = line

    # The lines are decoded by map in C; a line that fails stops it, is noted, and the
    # next map carries on after it, on the same iterator.
    remaining = iter(lines)
    while True:
        try:
            rows.extend(map(decode_line, remaining))
            break
        except errors:
            i = len(rows)
            rows.append(empty)
            if i not in problems:
                refuse(i, lines[i])
    # msgspec checks UTF-8 only in what it decodes: invalid bytes inside a field the
    # schema skips pass, where Spark's reader calls the whole line corrupt. One check of
    # the batch's bytes, and of each line only when that fails.
    try:
        b"\n".join(lines).decode("utf-8")
    except UnicodeDecodeError:
        for i, line in enumerate(lines):
            if i in problems or i in corrupt:
                continue
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                rows[i] = empty
                refuse(i, line)
    out = {}
    for n, (name, kind) in enumerate(columns):
        values = list(map(attrgetter(f"f{n}"), rows))
        if kind == "string":  # pyarrow's direct path from Python str, then cast
            out[name] = pa.array(values, pa.large_string()).cast(pa.string())
        else:
            out[name] = pa.array(values, arrow_type(kind))
    out[CORRUPT] = _sparse(len(rows), {i: line.decode("utf-8", "replace")
                                       for i, line in corrupt.items()})
    return out, _sparse(len(rows), problems)


def decode_batches(columns: Columns, table, max_bytes: int | None = None,
                   max_rows: int = 32_768):
    """``table`` (Arrow: partition, offset, payload) as record batches of ``max_rows`` rows
    at most: partition, offset, the payloads decoded (the declared ``columns`` and
    ``_corrupt_record``) and ``_problem`` (see ``decode``): what a decoding source's reader
    task yields."""
    for piece in table.to_batches(max_chunksize=max_rows):
        payloads = piece.column("payload")
        lines = payloads.cast(pa.binary()).to_pylist()
        if payloads.null_count:  # (none where onceflow keeps them: a null one is corrupt)
            lines = [line or b"" for line in lines]
        decoded, problems = decode(columns, lines, max_bytes)
        decoded[PROBLEM] = problems
        yield pa.RecordBatch.from_arrays(
            [piece.column("partition"), piece.column("offset"), *decoded.values()],
            names=["partition", "offset", *decoded])


def _sparse(n: int, values: dict[int, str]):
    """A string array of ``n`` nulls but at ``values``' positions."""
    if not values:
        return pa.nulls(n, pa.string())
    column: list[str | None] = [None] * n
    for i, value in values.items():
        column[i] = value
    return pa.array(column, pa.string())


@functools.lru_cache(maxsize=32)
def _decoder(columns: Columns):
    """(decode(line) -> a row with fields f0, f1, ..., the row of a corrupt line) for
    ``columns``: a msgspec Struct type built once per process (fields f<n>, renamed to the
    JSON names, which need not be Python identifiers)."""
    def typed(kind: str):
        if kind in INT_BITS:
            bits = INT_BITS[kind]
            return Annotated[int, msgspec.Meta(ge=-(2 ** (bits - 1)), le=2 ** (bits - 1) - 1)]
        return {"string": str, "boolean": bool, "float": float, "double": float}[kind]

    fields = [(f"f{n}", typed(kind) | None, None) for n, (_, kind) in enumerate(columns)]
    renamed = {f"f{n}": name for n, (name, _) in enumerate(columns)}
    row = msgspec.defstruct("Record", fields, rename=renamed)
    return msgspec.json.Decoder(row).decode, row()
