"""The peers onceflow is compared with, on the same data and the same workload W.

W: JSON events, one per line, counted per URL and per domain (the lower-cased host) into
``url_counts(key text primary key, value bigint)`` and ``domain_counts(...)``. An event is
usable iff Spark's PERMISSIVE ``from_json`` finds no corrupt record, the url is not null and
its http(s) host is not empty: the rule of ``tweets_example.topology.parse``, which
``tweets_example.data.classify`` states in Python (the ground truth here).

- ``raw_spark``: what a user writes without a framework: one Spark batch job over all files,
  the counts collected with ``toArrow()`` and COPYed into fresh tables. Fast, but not
  incremental and not safe to re-run over new files (it replaces the tables).
- ``structured_streaming``: Spark Structured Streaming's file source and a ``foreachBatch``
  sink made exactly-once the usual way: a fence table of micro-batch ids, checked and
  written in the same PostgreSQL transaction as the counts (upserted as increments). Two
  readings: text lines parsed by ``from_json`` (what onceflow's bolts do with a payload), or
  Spark's JSON source (``reader="json"``), which is what most users write and parses about a
  third faster: it hands Jackson each line's bytes, where ``from_json`` decodes every payload
  through a ``java.io.InputStreamReader`` first.

Structured Streaming also reads the events as rows (``reader="csv"`` or ``"parquet"``, the
rows' ``schema`` given), CSV or Parquet files made by ``write_rows``: the like of onceflow's
landing folders of those formats.

Helpers: ``write_json_lines`` (the input files), ``event_rows`` and ``write_rows`` (the same
events as rows), ``ground_truth`` (the expected counts), ``read_table`` and ``check``.
Table names are ``prefix`` + the name above; every identifier goes through ``psycopg2.sql``.
"""

from __future__ import annotations

import io
import os
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import psycopg2
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from psycopg2 import sql
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from tweets_example.data import URL_HOST, classify, parse_event

# The same JSON reading as tweets_example/topology.py. Setting options also keeps Spark's
# optimizer from pruning the schema (with none set, a from_json read for one field is cut down
# to that field: measured on 4.2, a read of _corrupt_record alone then missed a wrongly typed
# flaky). A corrupt record may still carry a url (partial results): corruption is tested first.
_SCHEMA = "url string, flaky int, _corrupt_record string"
_JSON_OPTIONS = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt_record",
                 "allowSingleQuotes": "false"}
# Kinds of rows in the aggregate: a URL count, a domain count, rejected events by reason.
URL, DOMAIN, REJECT = "url", "domain", "reject"
_LINE_SEP = "\n"


# --- session --------------------------------------------------------------------------------

def local_session(app_name: str = "onceflow-peers", master: str = "local[2]") -> SparkSession:
    """The project's local session (onceflow.spark.session.get_spark: 2g driver, 4 shuffle
    partitions, no UI, no console progress), the same for every system compared."""
    from onceflow.spark.session import get_spark

    return get_spark(app_name, master=master)


# --- data and ground truth ------------------------------------------------------------------

def write_json_lines(folder: Path, payloads: Iterable[str], files: int, *,
                     first: int = 0) -> list[Path]:
    """``payloads`` as ``files`` JSON-lines files in ``folder`` (created if missing), their
    sizes in events differing by at most one, named ``part-NNNNN.json`` from ``first`` on so
    that lexical order is production order. Each file is written under a hidden temp name
    (Spark's file listing skips names starting with "."), then renamed into place, so a
    streaming reader never sees a half-written file. Returns the paths in order."""
    if files < 1:
        raise ValueError(f"files={files!r} must be at least 1")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    events = list(payloads)
    size, extra = divmod(len(events), files)
    paths, start = [], 0
    for i in range(files):
        end = start + size + (1 if i < extra else 0)
        name = f"part-{first + i:05d}.json"
        final, temp = folder / name, folder / f".{name}.tmp"
        with open(temp, "w", encoding="utf-8", newline="") as out:
            for payload in events[start:end]:
                out.write(payload)
                out.write(_LINE_SEP)
        os.replace(temp, final)
        paths.append(final)
        start = end
    return paths


ROW_FIELDS = ("id", "user", "text", "url")


def event_rows(payloads: Iterable[str]) -> pa.Table:
    """The events as rows (``ROW_FIELDS``; id a 64-bit integer, the others strings): each
    JSON event's fields, a malformed event's all null (a row form cannot hold a broken
    document; without a url it counts nowhere, as the rejected JSON event does)."""
    columns: dict[str, list] = {name: [] for name in ROW_FIELDS}
    for payload in payloads:
        doc = parse_event(payload) or {}
        for name in ROW_FIELDS:
            value = doc.get(name)
            if name == "id":
                value = value if type(value) is int else None
            elif value is not None and not isinstance(value, str):
                value = None  # not text: no url (the JSON event's url is refused too)
            columns[name].append(value)
    return pa.table({name: pa.array(values, pa.int64() if name == "id" else pa.string())
                     for name, values in columns.items()})


def write_rows(folder: Path, rows: pa.Table, name: str, fmt: str) -> Path:
    """``rows`` as one file ``name`` in ``folder`` (created if missing): CSV with a header
    line, or Parquet; written under a hidden temp name, then renamed into place."""
    if fmt not in ("csv", "parquet"):
        raise ValueError(f"fmt={fmt!r}: give csv or parquet")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final, temp = folder / name, folder / f".{name}.tmp"
    if fmt == "csv":
        pacsv.write_csv(rows, temp)
    else:
        pq.write_table(rows, temp)
    os.replace(temp, final)
    return final


def ground_truth(payloads: Iterable[str]) -> tuple[Counter, Counter]:
    """The expected (url counts, domain counts) of ``payloads``, in pure Python."""
    urls: Counter = Counter()
    domains: Counter = Counter()
    for payload in payloads:
        result = classify(payload)
        if isinstance(result, str):  # the rejection's reason
            continue
        url, domain = result
        urls[url] += 1
        domains[domain] += 1
    return urls, domains


# --- the Spark side, shared by both peers ---------------------------------------------------

def lines_to_counts(lines: DataFrame) -> DataFrame:
    """Text lines (column ``value``) -> (kind, key, value): per URL and per domain how many
    usable events, and per rejection reason how many events were refused. One scan: each
    usable event yields a URL row and a domain row, aggregated together."""
    doc = F.from_json("value", _SCHEMA, _JSON_OPTIONS)
    return docs_to_counts(lines.select(doc.alias("j")).select("j.*"))


def json_source(reader):
    """``reader`` (spark.read or spark.readStream) set up as Spark's JSON source with the
    same schema and options as ``lines_to_counts``'s from_json."""
    return reader.schema(_SCHEMA).options(**_JSON_OPTIONS, lineSep=_LINE_SEP)


def rows_to_counts(rows: DataFrame) -> DataFrame:
    """Events as rows (a ``url`` column; malformed ones have none) -> (kind, key, value)."""
    return docs_to_counts(rows.select(
        "url", F.lit(None).cast("string").alias("_corrupt_record")))


def docs_to_counts(docs: DataFrame) -> DataFrame:
    """Parsed events (url, _corrupt_record) -> (kind, key, value), as lines_to_counts."""
    parsed = docs.select(
        F.col("url"),
        F.lower(F.regexp_extract("url", URL_HOST, 1)).alias("domain"),
        F.col("_corrupt_record").isNotNull().alias("corrupt"),
    )

    def row(kind: str, key) -> F.Column:
        return F.struct(F.lit(kind).alias("kind"), key.alias("key"))

    rows = (
        F.when(F.col("corrupt"), F.array(row(REJECT, F.lit("malformed JSON"))))
        .when(F.col("url").isNull(), F.array(row(REJECT, F.lit("missing field: url"))))
        .when(F.col("domain") == "", F.array(row(REJECT, F.lit("url is not an http(s) URL"))))
        .otherwise(F.array(row(URL, F.col("url")), row(DOMAIN, F.col("domain"))))
    )
    return (parsed.select(F.explode(rows).alias("r"))
            .groupBy("r.kind", "r.key").agg(F.count(F.lit(1)).alias("value")))


def _split(table: pa.Table) -> dict[str, pa.Table]:
    """The collected aggregate per kind, as (key, value) tables."""
    kind = table.column("kind")
    return {k: table.filter(pc.equal(kind, k)).select(["key", "value"])
            for k in (URL, DOMAIN, REJECT)}


def _csv(table: pa.Table) -> io.BytesIO:
    buf = io.BytesIO()
    pacsv.write_csv(table, buf, pacsv.WriteOptions(include_header=False))
    buf.seek(0)
    return buf


def _copy(cur, table: sql.Composable, columns: list[str], data: pa.Table) -> None:
    query = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
        table, sql.SQL(", ").join(map(sql.Identifier, columns)))
    cur.copy_expert(query, _csv(data))


def _count_table_ddl(name: str, if_not_exists: bool) -> sql.Composed:
    return sql.SQL("CREATE TABLE {}{} (key text PRIMARY KEY, value bigint NOT NULL)").format(
        sql.SQL("IF NOT EXISTS ") if if_not_exists else sql.SQL(""), sql.Identifier(name))


def _totals(parts: dict[str, pa.Table]) -> tuple[int, int]:
    """(events, usable events) of a collected aggregate."""
    usable = pc.sum(parts[DOMAIN].column("value")).as_py() or 0
    rejected = pc.sum(parts[REJECT].column("value")).as_py() or 0
    return usable + rejected, usable


# --- peer 1: one Spark batch job ------------------------------------------------------------

def raw_spark(spark: SparkSession, files: list[Path], dsn: str, prefix: str,
              reader: str = "text", schema: str | None = None) -> dict:
    """Count all ``files`` in one Spark job and write ``{prefix}url_counts`` and
    ``{prefix}domain_counts`` (dropped and created again) with COPY, in one transaction.
    ``reader``: JSON lines as text parsed with from_json, or CSV (a header line) or Parquet
    files of rows of ``schema``, read by Spark's own readers."""
    t0 = time.perf_counter()
    paths = [str(f) for f in files]
    if reader == "text":
        counts = lines_to_counts(spark.read.text(paths, lineSep=_LINE_SEP))
    elif reader == "csv":
        counts = rows_to_counts(spark.read.schema(schema).option("header", True).csv(paths))
    elif reader == "parquet":
        counts = rows_to_counts(spark.read.schema(schema).parquet(*paths))
    else:
        raise ValueError(f"reader={reader!r}: give text, csv or parquet")
    parts = _split(counts.toArrow())
    t1 = time.perf_counter()
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            for kind, name in ((URL, f"{prefix}url_counts"), (DOMAIN, f"{prefix}domain_counts")):
                cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))
                cur.execute(_count_table_ddl(name, if_not_exists=False))
                _copy(cur, sql.Identifier(name), ["key", "value"], parts[kind])
    finally:
        conn.close()
    t2 = time.perf_counter()
    events, usable = _totals(parts)
    return {
        "seconds": t2 - t0, "spark_seconds": t1 - t0, "pg_seconds": t2 - t1,
        "events": events, "usable": usable, "events_per_s": events / (t2 - t0),
        "url_keys": parts[URL].num_rows, "domain_keys": parts[DOMAIN].num_rows,
        "rejected": dict(zip(*parts[REJECT].to_pydict().values(), strict=True)),
    }


# --- peer 2: Structured Streaming, foreachBatch, a fence table ------------------------------

def create_stream_tables(dsn: str, prefix: str) -> None:
    """The streaming sink's tables, if missing: the counts (accumulated across runs) and the
    fence ``{prefix}sink_batches(batch_id)`` of the micro-batches already applied."""
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            for name in (f"{prefix}url_counts", f"{prefix}domain_counts"):
                cur.execute(_count_table_ddl(name, if_not_exists=True))
            cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (batch_id bigint PRIMARY KEY)")
                        .format(sql.Identifier(f"{prefix}sink_batches")))
    finally:
        conn.close()


class FencedSink:
    """A ``foreachBatch`` function, exactly-once the usual way: per micro-batch, in ONE
    PostgreSQL transaction, lock the fence table and look for the batch id; if it is there the
    batch was applied before (a replay after a failure) and is skipped, else the batch's counts
    are aggregated in Spark, collected, COPYed into a temp table, added to the count tables
    (INSERT .. ON CONFLICT DO UPDATE, as increments) and the batch id is recorded.

    The fence is looked up before Spark computes anything, so a replayed batch costs no
    Spark job; the lock is held while the batch is computed, which serializes concurrent
    writers (one query writes here, so it never waits)."""

    def __init__(self, dsn: str, prefix: str, counts=lines_to_counts) -> None:
        self.dsn = dsn
        self.counts = counts  # a micro-batch -> (kind, key, value)
        self.urls = sql.Identifier(f"{prefix}url_counts")
        self.domains = sql.Identifier(f"{prefix}domain_counts")
        self.fence = sql.Identifier(f"{prefix}sink_batches")
        self.conn = None
        self.applied: list[int] = []
        self.skipped: list[int] = []
        self.events = self.usable = 0
        self.spark_seconds = self.pg_seconds = 0.0

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        if self.conn is None or self.conn.closed:
            self.conn = psycopg2.connect(self.dsn)
        conn = self.conn
        t0, spark_before = time.perf_counter(), self.spark_seconds
        try:
            with conn, conn.cursor() as cur:  # one transaction: committed, or rolled back
                self._apply(cur, batch, batch_id)
        except Exception:
            conn.close()  # a broken connection is not reused by the next attempt
            raise
        finally:  # all but the Spark job: lock, fence, COPY, upsert, commit
            self.pg_seconds += time.perf_counter() - t0 - (self.spark_seconds - spark_before)

    def _apply(self, cur, batch: DataFrame, batch_id: int) -> None:
        cur.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(self.fence))
        cur.execute(sql.SQL("SELECT 1 FROM {} WHERE batch_id = %s").format(self.fence),
                    (batch_id,))
        if cur.fetchone() is not None:
            self.skipped.append(batch_id)
            return
        t1 = time.perf_counter()
        table = self.counts(batch).toArrow()
        t2 = time.perf_counter()
        parts = _split(table)
        staged = sql.Identifier("sink_in")
        cur.execute(sql.SQL("CREATE TEMP TABLE {} (kind text, key text, value bigint) "
                            "ON COMMIT DROP").format(staged))
        _copy(cur, staged, ["kind", "key", "value"], table)
        for kind, target in ((URL, self.urls), (DOMAIN, self.domains)):
            cur.execute(sql.SQL(
                "INSERT INTO {target} AS t (key, value) "
                "SELECT key, value FROM {staged} WHERE kind = %s ORDER BY key "
                "ON CONFLICT (key) DO UPDATE SET value = t.value + EXCLUDED.value"
            ).format(target=target, staged=staged), (kind,))
        cur.execute(sql.SQL("INSERT INTO {} (batch_id) VALUES (%s)").format(self.fence),
                    (batch_id,))
        events, usable = _totals(parts)
        self.events += events
        self.usable += usable
        self.applied.append(batch_id)
        self.spark_seconds += t2 - t1

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def structured_streaming(spark: SparkSession, folder: Path, dsn: str, prefix: str,
                         checkpoint: Path, files_per_trigger: int = 1,
                         reader: str = "text", schema: str | None = None) -> dict:
    """Consume every file in ``folder`` not yet in ``checkpoint`` with Structured Streaming
    (``maxFilesPerTrigger``, ``trigger(availableNow=True)``; ``reader``: the text source
    with from_json, the JSON source, or the CSV (a header line) or Parquet source of rows
    of ``schema``, a url among them) into the count tables through a ``FencedSink``,
    then stop. The tables are created if missing and never replaced: counts accumulate over
    runs, the fence keeps a replayed batch from counting twice. Returns timing figures and
    the micro-batches applied and skipped."""
    counts = {"text": lines_to_counts, "json": docs_to_counts, "csv": rows_to_counts,
              "parquet": rows_to_counts}
    if reader not in counts:
        raise ValueError(f"reader={reader!r}: give one of {', '.join(counts)}")
    if reader in ("csv", "parquet") and not schema:
        raise ValueError(f"reader={reader!r} needs the rows' schema (a DDL string)")
    create_stream_tables(dsn, prefix)
    sink = FencedSink(dsn, prefix, counts[reader])
    t0 = time.perf_counter()
    stream = spark.readStream.option("maxFilesPerTrigger", files_per_trigger)
    if reader == "text":
        source = stream.option("lineSep", _LINE_SEP).text(str(folder))
    elif reader == "json":
        source = json_source(stream).json(str(folder))
    elif reader == "csv":
        source = stream.schema(schema).option("header", True).csv(str(folder))
    else:
        source = stream.schema(schema).parquet(str(folder))
    query = (source.writeStream.foreachBatch(sink)
             .option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    try:
        query.awaitTermination()  # availableNow: it ends once the files listed at start are done
    finally:
        query.stop()
        sink.close()
    seconds = time.perf_counter() - t0
    # Spark's own view (the last spark.sql.streaming.numRecentProgressUpdates batches, 100 by
    # default); also right where the sink's counters are not (foreachBatch under Spark Connect
    # runs in a Python process of the server's).
    progress = query.recentProgress
    return {
        "seconds": seconds, "spark_seconds": sink.spark_seconds, "pg_seconds": sink.pg_seconds,
        "events": sink.events, "usable": sink.usable,
        "events_per_s": sink.events / seconds if seconds else 0.0,
        "micro_batches": len(sink.applied) + len(sink.skipped),
        "applied": sink.applied, "skipped": sink.skipped,
        "progress_batches": len(progress),
        "input_rows": sum(p.numInputRows for p in progress),
    }


# --- reading back ---------------------------------------------------------------------------

def read_table(dsn: str, table: str) -> dict[str, int]:
    """A count table as {key: value}."""
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT key, value FROM {}").format(sql.Identifier(table)))
            return dict(cur.fetchall())
    finally:
        conn.close()


def check(dsn: str, prefix: str, expected_urls: Counter, expected_domains: Counter) -> bool:
    """Whether ``{prefix}url_counts`` and ``{prefix}domain_counts`` hold exactly the expected
    counts (a key counted 0 times must be absent)."""
    def positive(counts) -> dict[str, int]:
        return {k: v for k, v in counts.items() if v}

    return (read_table(dsn, f"{prefix}url_counts") == positive(expected_urls)
            and read_table(dsn, f"{prefix}domain_counts") == positive(expected_domains))
