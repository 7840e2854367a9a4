"""What the source watcher of a kept-up pipeline costs when there is nothing to do: the CPU of
one look (onceflow.core.keepup.look) in the watcher's process and in its PostgreSQL backend,
on a pipeline with a long history and no new record.

    python bench/bench_keepup_look.py --txids 2000 --files 1000 --seconds 20

Two sources: a PostgreSQL log (4 partitions) whose ``--txids`` transactions are all
committed, and a landing folder of ``--files`` indexed files (each look lists the folder).
Prints per source the looks per second of a tight loop and the CPU milliseconds per look,
client and server, then what a look every 2 s (the default ``watch_interval``) costs per
minute. Uses a database of its own (onceflow_bench_keepup, dropped at the start).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import psutil
from benchkit import need_examples, recreate_database, server_dsn

from onceflow.core import db, keepup
from onceflow.core.begin import begin
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.sources.landing import LandingFolder

need_examples()  # the examples' code and pipelines (bench/README.md)


def history(conn, pipeline, txids: int, per_txid: int) -> None:
    """``txids`` planned transactions, then marked committed with their offsets (a bench's
    shortcut: no Spark; the rows a long-running pipeline has)."""
    pipeline.source.append(conn, [json.dumps({"n": i}) for i in range(txids * per_txid)])
    for i in range(txids):
        begin(conn, pipeline, f"bench-{i}")
    with conn.cursor() as cur:
        cur.execute("UPDATE transactions SET state = 'committed', committed_at = now() "
                    "WHERE pipeline = %s", (pipeline.name,))
        cur.execute("""INSERT INTO partition_offsets (pipeline, instance_id, topic, partition,
                                                      "offset", txid)
                       SELECT b.pipeline, p.instance_id, b.topic, b.partition,
                              max(b.end_offset), max(b.txid)
                       FROM batch_ranges b JOIN pipelines p ON p.name = b.pipeline
                       WHERE b.pipeline = %s GROUP BY b.pipeline, p.instance_id, b.topic,
                                                       b.partition""", (pipeline.name,))
        cur.execute("UPDATE pipelines SET last_committed_txid = next_txid - 1 WHERE name = %s",
                    (pipeline.name,))
    conn.commit()


def measure(dsn: str, pipeline, seconds: float) -> tuple[int, float, float]:
    """(looks, client CPU ms per look, server CPU ms per look) of a tight loop."""
    conn = db.connect(dsn, application_name="onceflow-watch")
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        backend = psutil.Process(cur.fetchone()[0])
        keepup.look(cur, pipeline)  # warm: plans cached
        server0, client0 = sum(backend.cpu_times()[:2]), time.process_time()
        looks, until = 0, time.monotonic() + seconds
        while time.monotonic() < until:
            seen = keepup.look(cur, pipeline)
            looks += 1
        assert seen.unread == 0 and seen.open == 0, seen
        client = time.process_time() - client0
        server = sum(backend.cpu_times()[:2]) - server0
    conn.close()
    return looks, 1000 * client / looks, 1000 * server / looks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--txids", type=int, default=2000)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    server, how = server_dsn()
    dsn = recreate_database(server, "onceflow_bench_keepup")
    conn = db.connect(dsn)
    print(f"PostgreSQL: {how}; load average {os.getloadavg()[0]:.2f}")

    log = get_pipeline("tweets", batch_size=100, keep_up=True)
    register(conn, log, create_source=True)
    # planned all at once (max_pending lifted for the build-up), then committed
    history(conn, log.with_settings(max_pending=args.txids, attempt_lease_s=86_400), args.txids,
            100)

    with tempfile.TemporaryDirectory(prefix="onceflow-bench-landing-") as name:
        folder = Path(name)
        for i in range(args.files):
            path = folder / f"f{i:05d}.jsonl"
            path.write_text("".join(json.dumps({"n": n}) + "\n" for n in range(10)))
            os.utime(path, (time.time() - 60, time.time() - 60))
        tweets = get_pipeline("tweets", batch_size=10 * args.files, keep_up=True)
        landed = tweets.with_settings(  # tables of its own: two pipelines never share one
            name="tweets_landed", source=LandingFolder(topic="landed", path=str(folder)),
            states=tuple(dataclasses.replace(s, name=f"landed_{s.name}", source=s.source_name)
                         for s in tweets.states))
        register(conn, landed, create_source=True)
        begin(conn, landed, "index")  # indexes every file, plans them all
        with conn.cursor() as cur:
            cur.execute("UPDATE transactions SET state = 'committed' WHERE pipeline = %s",
                        (landed.name,))
            cur.execute("""INSERT INTO partition_offsets (pipeline, instance_id, topic, partition,
                                                          "offset", txid)
                           SELECT b.pipeline, p.instance_id, b.topic, b.partition, b.end_offset,
                                  b.txid
                           FROM batch_ranges b JOIN pipelines p ON p.name = b.pipeline
                           WHERE b.pipeline = %s""", (landed.name,))
        conn.commit()

        conn.autocommit = True  # what autovacuum does to a long-running pipeline's tables
        with conn.cursor() as cur:
            cur.execute("VACUUM ANALYZE")
        for what, pipeline in ((f"PostgreSQL log, {args.txids} committed txids", log),
                               (f"landing folder, {args.files} indexed files", landed)):
            looks, client_ms, server_ms = measure(dsn, pipeline, args.seconds)
            per_minute = 30 * (client_ms + server_ms) / 1000
            print(f"{what}: {looks / args.seconds:.0f} looks/s; per look {client_ms:.2f} ms "
                  f"CPU in the watcher, {server_ms:.2f} ms in PostgreSQL; a look every 2 s: "
                  f"{per_minute:.3f} CPU s per minute")
    print(f"load average {os.getloadavg()[0]:.2f}")
    conn.close()


if __name__ == "__main__":
    main()
