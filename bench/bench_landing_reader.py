"""What a landing folder's readers cost per pass over one file of JSON lines (default 1M
tweets, about 150 MB), without PostgreSQL: the file is cut into chunks as the index cuts it,
then read whole, several times, by

- the Python reader (the mapInArrow function, called in this process): CPU seconds;
- the JVM reader (``onceflow.spark.JsonLinesSource`` in a local Spark session): the JVM's
  CPU seconds (/proc) and the wall time of an aggregate over
  every payload.

The best of ``--rounds`` passes is printed for each (a shared machine's noise only adds).

    python bench/bench_landing_reader.py --lines 1000000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchkit import project_dir


def landed_file(lines: int) -> Path:
    from tweets_example.data import generate

    folder = project_dir() / ".run" / "bench-landing"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{lines}.jsonl"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for payload in generate(lines, seed=7):
                f.write(payload + "\n")
        os.replace(tmp, path)
    return path


def _cpu(pid: int) -> float:
    """CPU seconds (user and system) process ``pid`` has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-bytes", type=int, default=32 << 20,
                        help="bytes of a chunk at most, as the index cuts them (32 MiB)")
    args = parser.parse_args()

    import pyarrow as pa

    from onceflow.sources.landing import files as landing_files
    from onceflow.sources.landing import read as landing_read
    from onceflow.sources.landing import scan as landing_scan
    from onceflow.sources.landing import storage as landing_storage

    path = landed_file(args.lines)
    filesystem, _ = landing_storage.open_filesystem(str(path))
    scan = landing_scan.scan_text(filesystem, str(path), 0, path.stat().st_size,
                                   args.chunk_bytes, header=False, limit=64 << 10, tail=False)
    chunks = [landing_files.Chunk(str(path), None, None, first, start, end, count, 0, crc, None)
              for first, start, end, count, _, crc in scan.chunks]
    print(f"{path}: {path.stat().st_size / 1e6:.0f} MB, {scan.records:,} lines, "
          f"{len(chunks)} chunks")
    assert scan.records == args.lines, (scan.records, args.lines)  # every line indexed
    wanted = [(0, 0, scan.records)]

    read = landing_read.chunk_reader("jsonl", False, str(path), chunks, wanted)
    ids = pa.RecordBatch.from_arrays([pa.array(range(len(chunks)), pa.int64())], ["id"])
    best = float("inf")
    for _ in range(args.rounds):
        started = time.process_time()
        rows = sum(b.num_rows for b in read([ids]))
        best = min(best, time.process_time() - started)
        assert rows == scan.records, rows
    print(f"Python reader: {best:.3f} CPU s per pass (best of {args.rounds})")

    from pyspark.sql import functions as F

    from onceflow.sources.jvm import READER
    from onceflow.spark.session import get_spark

    spark = get_spark("onceflow-bench-landing-reader")
    spark.sparkContext.setLogLevel("ERROR")
    spec = json.dumps({"chunks": [landing_read.jvm_chunk(c) for c in chunks], "wanted": wanted,
                       "columns": None, "max_record_bytes": 64 << 10})
    jvm = spark._jvm.java.lang.ProcessHandle.current().pid()
    best_cpu = best_wall = float("inf")
    for _ in range(args.rounds + 1):  # the first pass warms the JIT up: not counted
        cpu, wall = _cpu(jvm), time.monotonic()
        total = spark.read.format(READER).option("spec", spec).load() \
            .agg(F.count("*"), F.sum(F.length("payload"))).collect()[0]
        cpu, wall = _cpu(jvm) - cpu, time.monotonic() - wall
        assert total[0] == scan.records, total
        if _:
            best_cpu, best_wall = min(best_cpu, cpu), min(best_wall, wall)
    print(f"JVM reader: {best_cpu:.3f} JVM CPU s, {best_wall:.3f} s wall per pass "
          f"(best of {args.rounds})")


if __name__ == "__main__":
    main()
