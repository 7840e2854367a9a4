"""How a segment's Parquet layout changes the read of a batch smaller than a segment: the
segments bench_sources.py left (``--kinds files --import``: one 400,000-record segment per
partition) are rewritten in each layout, then the same ranges (``--per-partition`` records
of every partition, starting at ``--start``) are read with Spark (the batch's read: the
range filter pushed down; every payload decoded) and with payloads()'s reader
(onceflow.sources.segments.read_ranges). Best of ``--repeat``.

    python bench/bench_sources.py --kinds files --import --partitions 8 \\
        --events 3200000 --batch-size 1000000
    python bench/bench_segment_layout.py --start 125000 --per-partition 125000

Layouts: ``one`` (one row group per segment, as segments were written before), ``rgN`` (row
groups of N rows), ``rgN+pages`` (the same, with the page index and pages of at most 8,192
rows, which Spark's reader also skips by). With SPARK_REMOTE set, Spark reads through that
Spark Connect server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import pyarrow.parquet as pq
from benchkit import project_dir

from onceflow.core.planner import PartitionRange
from onceflow.sources.segments import SPARK_SCHEMA, read_ranges

LAYOUTS = "one,rg32768,rg65536,rg131072,rg65536+pages"


def _layout(name: str) -> dict:
    if name == "one":
        return {"row_group_size": 1 << 30}
    rows, _, pages = name.removeprefix("rg").partition("+")
    return {"row_group_size": int(rows),
            **({"write_page_index": True, "max_rows_per_page": 8_192} if pages else {})}


def _scanned(frame) -> int:
    """Rows Spark's Parquet scan returned (after skipping by statistics), local mode only."""
    plan = frame._jdf.queryExecution().executedPlan()
    if plan.nodeName() == "AdaptiveSparkPlan":
        plan = plan.finalPhysicalPlan()
    found = plan.collectLeaves()
    leaves = [found.apply(i) for i in range(found.size())]
    return sum(leaf.metrics().apply("numOutputRows").value() for leaf in leaves
               if leaf.nodeName().startswith("Scan parquet"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", type=int, default=125_000)
    parser.add_argument("--per-partition", type=int, default=125_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layouts", default=LAYOUTS)
    args = parser.parse_args()

    from pyspark.sql import functions as F

    from onceflow.spark.session import get_spark

    source = project_dir() / ".run" / "bench-segments" / "tweets_files"
    segments = sorted(source.glob("p*/*.parquet"))
    if not segments:
        raise SystemExit(f"no segments under {source}: run bench_sources.py --kinds files "
                         "--import first (see this docstring)")
    spark = get_spark("onceflow-bench-segment-layout")
    if not os.environ.get("SPARK_REMOTE"):
        spark.sparkContext.setLogLevel("ERROR")
    ranges = [PartitionRange(int(p.parent.name[1:]), args.start,
                             args.start + args.per_partition) for p in segments]
    wanted = None
    for r in ranges:
        one = ((F.col("partition") == r.partition) & (F.col("offset") >= r.start)
               & (F.col("offset") < r.end))
        wanted = one if wanted is None else wanted | one
    print(f"{len(segments)} segments, {pq.ParquetFile(segments[0]).metadata.num_rows:,} rows "
          f"each; ranges [{args.start}, {args.start + args.per_partition}) of every partition")
    for name in args.layouts.split(","):
        folder = project_dir() / ".run" / "bench-segment-layout" / name
        shutil.rmtree(folder, ignore_errors=True)
        paths = []
        for segment in segments:
            path = folder / segment.parent.name / segment.name
            path.parent.mkdir(parents=True)
            pq.write_table(pq.read_table(segment), path,
                           write_statistics=["partition", "offset"], **_layout(name))
            paths.append(str(path))
        size = sum(os.path.getsize(p) for p in paths)
        spark_s, python_s = [], []
        for _ in range(args.repeat):
            t = time.monotonic()
            frame = (spark.read.schema(SPARK_SCHEMA).parquet(*paths).where(wanted)
                     .agg(F.count("*"), F.sum(F.length("payload"))))
            (n, _), = frame.collect()
            spark_s.append(time.monotonic() - t)
            assert n == args.per_partition * len(paths), n
            t = time.monotonic()
            got = sum(read_ranges(p, ranges, ["partition", "offset", "payload"]).num_rows
                      for p in paths)
            python_s.append(time.monotonic() - t)
            assert got == n, got
        scanned = "" if os.environ.get("SPARK_REMOTE") else f", {_scanned(frame):,} rows scanned"
        print(f"{name:>14}: {size / 1e6:6.1f} MB{scanned}; Spark read {min(spark_s):5.2f}s, "
              f"pyarrow read {min(python_s):5.2f}s (best of {args.repeat}); load average "
              f"{os.getloadavg()[0]:.2f}")
    spark.stop()


if __name__ == "__main__":
    main()
