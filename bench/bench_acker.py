"""What the acker costs: the example topology with the acker on and off, same data, same
batches.

    python bench/bench_acker.py --events 10000000 --batch-size 1000000

The events (demo tweets, with the default shares of malformed, poison and flaky ones) are
generated once into a Parquet file under .run/bench-acker/ and read back by Spark, so the
figures are the topology's alone (no PostgreSQL source, no staging). Per mode it prints the
processing throughput over all batches (events/s: read, bolts, the acker's aggregation and
all-or-nothing passes, one collect of deltas, rejects and failures); then the ratio. Each
mode runs as often as --modes names it, every run timed (the first pays the JIT's warm-up);
the best run of each mode counts. The acker keeps no state per root (onceflow.spark.runner:
its verdict is the failure notes of one pass), so there is none to measure.

The check: with the acker on, the failed roots are the events the example's own
classification (tweets_example.data) says fail a first try (poison and flaky tweets, counted
once when the data is generated); without it, none (no failure is routed). Exit 1 when
either differs. With SPARK_REMOTE set, the topology runs on that Spark Connect server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from benchkit import need_examples, project_dir

from onceflow.core.registry import get_pipeline

need_examples()  # the examples' code and pipelines (bench/README.md)

from tweets_example.data import classify, generate, normalize_host  # noqa: E402

PARTITIONS = 4


def fails_first_try(payload: str) -> bool:
    """Whether the example topology fails this tweet on its first try, by the example's own
    classification: a usable tweet whose host IDNA refuses (poison) or whose lookup is flaky."""
    found = classify(payload)
    if isinstance(found, str):  # rejected, never failed
        return False
    if json.loads(payload).get("flaky"):
        return True
    try:
        normalize_host(found[1])
    except UnicodeError:
        return True
    return False


def make_data(events: int, seed: int) -> tuple[Path, int]:
    """The events' Parquet file and how many of them fail a first try (kept beside it)."""
    path = project_dir() / ".run" / "bench-acker" / f"tweets-{events}-{seed}.parquet"
    expected = path.with_suffix(".failing")
    if path.exists() and expected.exists():
        return path, int(expected.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    schema = pa.schema([("partition", pa.int32()), ("offset", pa.int64()),
                        ("payload", pa.string())])
    tmp = path.with_suffix(".tmp")
    failing = 0
    with pq.ParquetWriter(tmp, schema) as writer:
        chunk: list[str] = []
        first = 0
        for i, payload in enumerate(generate(events, seed=seed)):
            chunk.append(payload)
            failing += fails_first_try(payload)
            if len(chunk) == 500_000 or i == events - 1:
                ids = range(first, first + len(chunk))
                writer.write_table(pa.table({
                    "partition": pa.array([n % PARTITIONS for n in ids], pa.int32()),
                    "offset": pa.array([n // PARTITIONS for n in ids], pa.int64()),
                    "payload": pa.array(chunk, pa.string()),
                }, schema=schema))
                first += len(chunk)
                chunk = []
    tmp.rename(path)
    expected.write_text(str(failing))
    print(f"generated {events:,} events into {path} in {time.monotonic() - started:.1f}s "
          f"({failing} of them fail a first try)")
    return path, failing


def run_mode(spark, path: Path, pipeline, events: int, batch: int,
             acker: bool) -> tuple[float, int]:
    from pyspark.sql import functions as F

    from onceflow.spark.runner import run_topology
    from tweets_example.topology import topology

    per_partition = batch // PARTITIONS
    total = 0.0
    failed = 0
    data = spark.read.parquet(str(path))
    for lo in range(0, -(-events // PARTITIONS), per_partition):
        src = data.where((F.col("offset") >= lo) & (F.col("offset") < lo + per_partition)) \
            .select("partition", "offset", "payload", F.lit(0).alias("replays"),
                    F.lit(False).alias("replayed"))
        started = time.monotonic()
        out = run_topology(topology(pipeline), src, attempt=1, acker=acker)
        collected = out.collect()
        total += time.monotonic() - started
        failed += len(collected.failed)
    rate = events / total
    print(f"acker {'on ' if acker else 'off'}: {events:,} events in {total:.1f}s = "
          f"{rate:,.0f} events/s ({failed} failed roots handed to the backflow)")
    return rate, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10_000_000, help="events (10M)")
    parser.add_argument("--batch-size", type=int, default=1_000_000,
                        help="events per transaction (1M)")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--modes", default="off,on,off,on",
                        help="acker modes in order (off,on,off,on); the best run of each counts")
    args = parser.parse_args()

    path, failing = make_data(args.events, args.seed)
    from onceflow.spark.session import get_spark

    started = time.monotonic()
    spark = get_spark("onceflow-bench-acker")
    if not os.environ.get("SPARK_REMOTE"):  # a Spark Connect session has no SparkContext
        spark.sparkContext.setLogLevel("ERROR")
    print(f"Spark session start: {time.monotonic() - started:.1f}s (not counted)")
    pipeline = get_pipeline("tweets", batch_size=args.batch_size)
    rates: dict[str, float] = {}
    wrong = []
    for mode in args.modes.split(","):
        rate, failed = run_mode(spark, path, pipeline, args.events, args.batch_size,
                                mode == "on")
        rates[mode] = max(rate, rates.get(mode, 0.0))
        if failed != (failing if mode == "on" else 0):
            wrong.append(f"acker {mode}: {failed} failed roots, not "
                         f"{failing if mode == 'on' else 0}")
    if {"on", "off"} <= set(rates):
        cost = 1 - rates["on"] / rates["off"]
        print(f"the acker costs {cost:.1%} of throughput (goal: at most 15%)")
    spark.stop()
    print(f"check: {'; '.join(wrong) if wrong else 'OK'} (with the acker on, {failing} events "
          "fail a first try)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
