"""Read planned offset ranges of the PostgreSQL source log into a Spark DataFrame.

No JDBC driver is needed: the ranges are cut into chunks, each chunk is one Spark task, and
the task streams its rows out of PostgreSQL with ``COPY ... TO STDOUT`` and parses them with
Arrow's CSV reader (``mapInArrow``), so the rows reach the JVM as Arrow batches. Works the same
in local mode, on a cluster and through Spark Connect.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pyspark.sql import DataFrame, SparkSession

from onceflow.planner import PartitionRange

RECORD_SCHEMA = "partition int, offset long, payload string"
CHUNK_SCHEMA = "chunk int, partition int, start long, end long"
DEFAULT_CHUNK = 100_000


def chunk_ranges(ranges: Iterable[PartitionRange], chunk: int = DEFAULT_CHUNK
                 ) -> list[tuple[int, int, int]]:
    """Split ranges into (partition, start, end) pieces of at most ``chunk`` offsets."""
    pieces = []
    for r in ranges:
        for start in range(r.start, r.end, chunk):
            pieces.append((r.partition, start, min(r.end, start + chunk)))
    return pieces


def _copy_reader(dsn: str, topic: str):
    def read(batches: Iterator) -> Iterator:
        import io

        import psycopg2
        import pyarrow as pa
        from pyarrow import csv as pacsv

        types = {"partition": pa.int32(), "offset": pa.int64(), "payload": pa.string()}
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
                        buf = io.BytesIO()
                        cur.copy_expert(query, buf)
                        if buf.tell() == 0:
                            continue
                        buf.seek(0)
                        table = pacsv.read_csv(
                            buf,
                            read_options=pacsv.ReadOptions(column_names=list(types)),
                            parse_options=pacsv.ParseOptions(newlines_in_values=True),
                            convert_options=pacsv.ConvertOptions(
                                column_types=types, strings_can_be_null=False,
                                quoted_strings_can_be_null=False),
                        )
                        yield from table.to_batches()
            conn.rollback()
        finally:
            conn.close()

    return read


def read_ranges(spark: SparkSession, dsn: str, topic: str, ranges: Iterable[PartitionRange],
                chunk: int = DEFAULT_CHUNK) -> DataFrame:
    """The records of ``ranges``: columns partition, offset, payload."""
    pieces = chunk_ranges(ranges, chunk)
    rows = [(i, p, s, e) for i, (p, s, e) in enumerate(pieces)]
    # No repartition: the local rows are already spread over the default parallelism (the
    # cores), and each reader task takes its chunks one after the other.
    chunks = spark.createDataFrame(rows, CHUNK_SCHEMA)
    return chunks.mapInArrow(_copy_reader(dsn, topic), RECORD_SCHEMA)
