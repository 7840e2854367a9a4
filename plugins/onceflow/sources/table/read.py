"""A table source's Spark reader tasks: each chunk row's ``COPY ... TO STDOUT`` run on a
connection of the task's own and parsed by Arrow, as payloads (decoded when a json_schema is
declared) or, for a direct read, as the declared columns themselves.

pyarrow is imported here once: TableSource.read loads this module when a batch is read, so
``import onceflow`` (begin, commit, the CLI) loads no pyarrow.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import psycopg2
import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import csv as pacsv

from onceflow.core.source import CORRUPT, PROBLEM
from onceflow.sources.copy_read import copied_batches, copy_records
from onceflow.sources.json_arrow import arrow_type, decode_batches
from onceflow.sources.json_records import JsonRecords
from onceflow.sources.table.check import Declared

CHUNK_SCHEMA = "chunk int, copy string"


def copies_reader(dsn: str, each):
    """The Spark task: each chunk row's COPY statement, run on a connection of the task's
    own; the record batches ``each(cur, copy)`` makes of it."""

    def read(batches: Iterator) -> Iterator:
        conn = psycopg2.connect(dsn, application_name="onceflow-table-reader")
        try:
            with conn.cursor() as cur:
                for batch in batches:
                    for copy in batch.column("copy").to_pylist():
                        yield from each(cur, copy)
            conn.rollback()
        finally:
            conn.close()

    return read


def copy_reader(dsn: str, records: JsonRecords | None, max_bytes: int):
    """The Spark task: each chunk's CSV parsed by Arrow, decoded with ``records``
    (copy_read.copied_batches)."""
    return copies_reader(dsn, lambda cur, copy: copied_batches(
        copy_records(cur, copy), records, max_bytes))


def direct_reader(dsn: str, records: JsonRecords, fields: tuple[Declared, ...],
                  max_bytes: int):
    """The Spark task of a direct read (select.direct_select): each chunk's CSV parsed by
    Arrow into the declared types; the clean rows yielded as read, the rows that carry a
    payload decoded by ``records`` (corrupt or oversized exactly as the decoder says)."""
    present = [(f"c{n}", f.kind) for n, f in enumerate(fields) if f.pg_type is not None]
    types = {"partition": pa.int32(), "offset": pa.int64(),
             # a float column is parsed as a double, then rounded, as the decoder does
             **{c: arrow_type("double" if kind == "float" else kind) for c, kind in present},
             "payload": pa.string()}
    # COPY CSV writes NULL as an empty field, '' as "", a boolean as t or f
    convert = pacsv.ConvertOptions(column_types=types, null_values=[""],
                                   strings_can_be_null=True, quoted_strings_can_be_null=False,
                                   true_values=["t"], false_values=["f"])

    def clean(table) -> pa.Table:
        n = table.num_rows
        out = {"partition": table.column("partition"), "offset": table.column("offset")}
        for i, field in enumerate(fields):
            if field.pg_type is None:
                out[field.name] = pa.nulls(n, arrow_type(field.kind))
                continue
            column = table.column(f"c{i}")
            if field.kind in ("float", "double"):
                # to_json writes -0.0 as -0, an integer the decoder reads as 0.0
                column = pc.add(column, 0.0)
                if field.kind == "float":
                    column = column.cast(pa.float32())
            out[field.name] = column
        out[CORRUPT] = pa.nulls(n, pa.string())
        out[PROBLEM] = pa.nulls(n, pa.string())
        return pa.table(out)

    def read(cur, copy: str) -> Iterator:
        buf = io.BytesIO()
        cur.copy_expert(copy, buf)
        if not buf.tell():
            return
        buf.seek(0)
        table = pacsv.read_csv(
            buf, read_options=pacsv.ReadOptions(column_names=list(types)),
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=convert)
        judged = table.column("payload").is_valid()
        yield from clean(table.filter(pc.invert(judged))).to_batches()
        flagged = table.filter(judged)
        if flagged.num_rows:
            yield from decode_batches(
                records.columns, flagged.select(["partition", "offset", "payload"]), max_bytes)

    return copies_reader(dsn, read)
