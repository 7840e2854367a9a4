"""Figures for real data (issue 14): reading a user's own PostgreSQL table, reading Parquet
files from a landing folder, and committing typed state with a composite key and several
measures.

    python bench/real_data.py --rows 10000000

- ``table``: an ``orders`` table of --rows rows (loaded by COPY first), read by TableSource
  with 1, 2 and 4 Spark tasks (read_chunk = rows / tasks): rows/s of the read alone (Spark's
  noop sink; local[4], or with SPARK_REMOTE set, that Spark Connect server);
- ``landing``: the same orders as Parquet files (1M rows each) in a landing folder: indexing
  (SHA-256, row groups) and reading by Spark's Parquet reader, rows/s;
- ``commit``: the orders example's revenue state (key merchant text + day date; measures
  numeric sum, count, max): --keys distinct keys staged by COPY and applied by the commit's
  SQL, first as inserts then as updates of every key, rows/s; and the append table.

Every read is counted on the way (an observed metric of the same job) and every commit's rows
written: each against the rows made (the check; exit 1 when one differs). Uses a database of
its own (onceflow_bench_real, dropped first) and a folder under .run/. Say the load average
with every figure (printed): the machine must be quiet.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from benchkit import loadavg, need_examples, project_dir, recreate_database, server_dsn


def say(line: str) -> None:
    print(f"{line}   [load {loadavg()}]", flush=True)


def fresh_database(name: str) -> str:

    server, _ = server_dsn()
    return recreate_database(server, name)


def orders_csv(rows: int, start: int = 0) -> io.StringIO:
    """Deterministic orders as CSV (merchant, amount, ordered_at), fast to make."""
    base = datetime(2026, 11, 1, tzinfo=UTC)
    buf = io.StringIO()
    for i in range(start, start + rows):
        at = base + timedelta(seconds=(i * 7919) % (14 * 86400))
        buf.write(f"merchant-{(i * 31) % 40:02d},{(i * 7717) % 200000 / 100:.2f},"
                  f"{at.isoformat()}\n")
    buf.seek(0)
    return buf


def noop_rows(frame) -> int:
    """Write ``frame`` to Spark's noop sink (every column computed, nothing kept), counting its
    rows on the way; the count."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    seen = Observation("rows")
    frame.observe(seen, F.count(F.lit(1)).alias("rows")).write.format("noop") \
        .mode("overwrite").save()
    return seen.get["rows"]


def checked(what: str, got: int, want: int, wrong: list[str]) -> None:
    if got != want:
        wrong.append(f"{what}: {got} rows, not {want}")


def bench_table(spark, dsn: str, rows: int, wrong: list[str]) -> None:
    from onceflow.core import db
    from onceflow.core.planner import PartitionRange
    from onceflow.sources.table import TableSource
    from orders_example.data import ORDERS_DDL

    with db.connection(dsn) as conn, db.transaction(conn) as cur:
        cur.execute(ORDERS_DDL)
        started = time.monotonic()
        step = 1_000_000
        for first in range(0, rows, step):
            cur.copy_expert("COPY public.orders (merchant, amount, ordered_at) FROM STDIN "
                            "(FORMAT csv)", orders_csv(min(step, rows - first), first))
        loaded = time.monotonic() - started
    say(f"table: loaded {rows} rows by COPY in {loaded:.1f}s")
    for tasks in (1, 2, 4):
        source = TableSource(topic="orders", table="public.orders", key="order_id",
                             read_chunk=-(-rows // tasks))
        with db.connection(dsn) as conn, db.transaction(conn) as cur:
            source.ensure(conn)
            head = source.positions(cur)[0].head
        started = time.monotonic()
        read = noop_rows(source.read(spark, dsn, [PartitionRange(0, 1, head)]))
        took = time.monotonic() - started
        checked(f"table read with {tasks} task(s)", read, rows, wrong)
        say(f"table: read {rows} rows with {tasks} task(s) in {took:.1f}s: "
            f"{rows / took:,.0f} rows/s")


def bench_landing(spark, dsn: str, rows: int, folder: Path, wrong: list[str]) -> None:
    from onceflow.core import db
    from onceflow.core.planner import PartitionRange
    from onceflow.sources.landing import LandingFolder
    from orders_example import data

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    started = time.monotonic()
    per_file = 1_000_000
    orders = data.generate(rows, seed=3, start_id=1)
    for n in range(0, rows, per_file):
        chunk = [next(orders) for _ in range(min(per_file, rows - n))]
        data.land_parquet(folder, chunk, f"orders-{n // per_file:04d}.parquet")
    say(f"landing: wrote {rows} orders as Parquet in {time.monotonic() - started:.1f}s")
    source = LandingFolder(topic="orders_files", path=str(folder), format="parquet",
                           pattern="*.parquet", settle_s=0.0, partitions=2)
    with db.connection(dsn) as conn:
        source.ensure(conn, create=True)
        started = time.monotonic()
        with db.transaction(conn) as cur:
            files = source.index(cur)
            positions = source.positions(cur)
        took = time.monotonic() - started
    say(f"landing: indexed {files} files (SHA-256, row groups) in {took:.1f}s")
    ranges = [PartitionRange(p, pos.log_start, pos.head) for p, pos in positions.items()]
    started = time.monotonic()
    read = noop_rows(source.read(spark, dsn, ranges))
    took = time.monotonic() - started
    checked("landing read", read, rows, wrong)
    say(f"landing: read {rows} Parquet rows (offsets, JSON payloads) in {took:.1f}s: "
        f"{rows / took:,.0f} rows/s")


def bench_commit(dsn: str, keys: int, wrong: list[str]) -> None:
    from psycopg2 import sql

    from onceflow.core import db, tables
    from onceflow.core.txlog import TransactionAttempt
    from orders_example.pipelines import ORDERS

    revenue, large = ORDERS.state("merchant_day_revenue"), ORDERS.state("large_orders")

    def staged(shape, txid: int, body) -> io.StringIO:
        buf = io.StringIO()
        for row in body:
            buf.write(f"{txid},1,0,{row}\n")
        buf.seek(0)
        return buf

    base = datetime(2026, 1, 1).date()
    for txid, what in ((1, "inserts"), (2, "updates")):
        with db.connection(dsn) as conn, db.transaction(conn) as cur:
            for spec in (revenue, large):
                tables.ensure_staging(cur, "orders", spec.shape())
                tables.ensure_table(cur, spec.shape(), spec.opaque, with_txid_index=False)
            rows = (f"m{k % 5000},{base + timedelta(days=k // 5000)},{k % 997}.25,3,{k % 97}.25"
                    for k in range(keys))
            names = [c for c, _ in revenue.shape().staged()]
            started = time.monotonic()
            cur.copy_expert(cur.mogrify(sql.SQL("COPY {} (txid, attempt, grp, {}) FROM STDIN "
                                                "(FORMAT csv)").format(
                tables.staging_table("orders", revenue.shape()),
                sql.SQL(", ").join(map(sql.Identifier, names)))).decode(),
                staged(revenue.shape(), txid, rows))
            copied = time.monotonic() - started
            ta = TransactionAttempt(txid, 1)
            started = time.monotonic()
            written = tables.apply_batch(
                cur, revenue.shape(), True, txid,
                tables.staged_batch("orders", revenue.shape(), 1),
                {"txid": ta.txid, "attempt": ta.attempt})
            applied = time.monotonic() - started
        checked(f"commit of {what}", written, keys, wrong)
        say(f"commit: {keys} composite keys x 3 measures ({what}): staging COPY "
            f"{keys / copied:,.0f} rows/s, apply {written / applied:,.0f} rows/s "
            f"({applied:.1f}s)")
    with db.connection(dsn) as conn, db.transaction(conn) as cur:
        facts = (f"{k},m{k % 40},{k % 99991}.50,2026-11-0{1 + k % 9}T00:00:00+00"
                 for k in range(keys))
        names = [c for c, _ in large.shape().staged()]
        cur.copy_expert(cur.mogrify(sql.SQL("COPY {} (txid, attempt, grp, {}) FROM STDIN "
                                            "(FORMAT csv)").format(
            tables.staging_table("orders", large.shape()),
            sql.SQL(", ").join(map(sql.Identifier, names)))).decode(),
            staged(large.shape(), 3, facts))
        started = time.monotonic()
        written = tables.apply_batch(cur, large.shape(), False, 3,
                                     tables.staged_batch("orders", large.shape(), 1),
                                     {"txid": 3, "attempt": 1})
        applied = time.monotonic() - started
    checked("append table", written, keys, wrong)
    say(f"commit: append table, {written} rows in {applied:.1f}s: "
        f"{written / applied:,.0f} rows/s")


def main(argv: list[str] | None = None) -> int:

    need_examples()  # the examples' code and pipelines (bench/README.md)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000, help="rows (10M)")
    parser.add_argument("--keys", type=int, default=1_000_000,
                        help="distinct keys of the commit figure (1M)")
    parser.add_argument("--only", choices=("table", "landing", "commit"), action="append",
                        help="run only these parts (repeatable)")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.keys < 1:
        parser.error("--rows and --keys must be at least 1")
    parts = args.only or ["table", "landing", "commit"]
    from onceflow.spark.session import get_spark

    dsn = fresh_database("onceflow_bench_real")
    say(f"real-data bench: {args.rows} rows, {args.keys} keys, parts {', '.join(parts)}")
    remote = bool(os.environ.get("SPARK_REMOTE"))
    spark = get_spark("onceflow-bench-real", master=None if remote else "local[4]") \
        if {"table", "landing"} & set(parts) else None
    if spark is not None and not remote:  # a Spark Connect session has no SparkContext
        spark.sparkContext.setLogLevel("ERROR")
    wrong: list[str] = []
    try:
        if "table" in parts:
            bench_table(spark, dsn, args.rows, wrong)
        if "landing" in parts:
            bench_landing(spark, dsn, args.rows, project_dir() / ".run" / "bench-landing",
                          wrong)
        if "commit" in parts:
            bench_commit(dsn, args.keys, wrong)
    finally:
        if spark is not None:
            spark.stop()
    print(f"check: {'; '.join(wrong) if wrong else 'OK'} (every read and commit counted "
          "against the rows made)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
