"""PostgreSQL rows read in a Spark task: a ``COPY (SELECT partition, offset, payload ...) TO
STDOUT (FORMAT csv)`` parsed by Arrow's CSV reader, as the PostgreSQL log's reader tasks
(``log_reader``) and the table source's (onceflow.sources.table.read) run it.

pyarrow is imported here at the top: the sources load this module only where a batch is
read, so `import onceflow` loads no pyarrow.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import psycopg2
import pyarrow as pa
from pyarrow import csv as pacsv

from onceflow.sources import json_arrow
from onceflow.sources.json_records import JsonRecords


def copy_records(cur, statement: str):
    """In a Spark task: run one ``COPY (SELECT partition, offset, payload ...) TO STDOUT
    (FORMAT csv)`` and parse its CSV with Arrow. The records as an Arrow table, None when
    there are none."""
    buf = io.BytesIO()
    cur.copy_expert(statement, buf)
    if not buf.tell():
        return None
    buf.seek(0)
    types = {"partition": pa.int32(), "offset": pa.int64(), "payload": pa.string()}
    return pacsv.read_csv(
        buf,
        read_options=pacsv.ReadOptions(column_names=list(types)),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(column_types=types, strings_can_be_null=False,
                                             quoted_strings_can_be_null=False),
    )


def copied_batches(table, records: JsonRecords | None, max_bytes: int) -> Iterator:
    """The record batches a reader task yields for one COPY's records (``copy_records``):
    as read, or with ``records`` their payloads decoded (json_arrow.decode_batches)."""
    if table is None:
        return iter(())
    if records is None:
        return table.to_batches()
    return json_arrow.decode_batches(records.columns, table, max_bytes)


def log_reader(dsn: str, topic: str, records: JsonRecords | None, max_bytes: int):
    """The Spark task: each chunk row's records, read by COPY, checked whole (a shortfall
    fails the task), decoded with ``records`` (see copied_batches)."""

    def read(batches: Iterator) -> Iterator:
        conn = psycopg2.connect(dsn, application_name="onceflow-reader")
        try:
            with conn.cursor() as cur:
                for batch in batches:
                    cols = batch.to_pydict()
                    for partition, start, end in zip(cols["partition"], cols["start"], cols["end"],
                                                     strict=True):
                        query = cur.mogrify(
                            """COPY (SELECT partition, "offset", payload FROM source_log
                                     WHERE topic = %s AND partition = %s
                                       AND "offset" >= %s AND "offset" < %s)
                               TO STDOUT (FORMAT csv)""",
                            (topic, partition, start, end),
                        ).decode()
                        table = copy_records(cur, query)
                        rows = 0 if table is None else table.num_rows
                        if rows != end - start:
                            raise RuntimeError(
                                f"SourceShortfall: topic {topic!r} partition {partition} "
                                f"offsets [{start}, {end}) returned {rows} of {end - start} "
                                "records: records were deleted under a planned batch")
                        yield from copied_batches(table, records, max_bytes)
            conn.rollback()
        finally:
            conn.close()

    return read
