"""A bolt that emits a stream it does not declare (issue 48: outputs good and bad, the bolt
routed some rows to "rows") loses no record silently: each such record fails, goes to the
backflow, is replayed, and after max_replays is a dead letter whose reason names the stream
value and the bolt's outputs. On real PostgreSQL and Spark, every count checked against the
test's own classification of the records it produced."""

from __future__ import annotations

import json
import random
from collections import Counter

from helpers import produce, run_transaction, table
from onceflow import ANCHORS, SPOUT, Pipeline, PostgresLog, StateSpec, Topology
from onceflow.core.registration import register
from onceflow.ops.verify import rerun


def routes(pipeline=None) -> Topology:
    """A user's bolt: the payload says where each record goes; "good" is counted by key,
    "bad" rejected. A payload of route "rows", or with no route, names no declared stream."""
    from pyspark.sql import functions as F

    def route(records):
        doc = F.from_json("payload", "k string, route string").alias("d")
        return records.select(*ANCHORS, doc).select(
            *ANCHORS, F.col("d.route").alias("_stream"), F.col("d.k").alias("key"),
            F.lit("refused by the producer").alias("error"))

    return (Topology("routes")
            .bolt("route", input=SPOUT, fn=route,
                  outputs={"good": "key string", "bad": "error string"})
            .count("good", "routed").reject("bad"))


PIPELINE = Pipeline(name="routes", source=PostgresLog(topic="routes", partitions=2),
                    topology=routes, states=(StateSpec("routed"),), batch_size=300,
                    replay_cap=200, max_replays=1)


def generated(n: int, seed: int = 48) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        route = rng.choices(["good", "bad", "rows", None], weights=[80, 8, 9, 3])[0]
        doc = {"k": f"k{rng.randrange(12)}", "n": i}
        if route is not None:
            doc["route"] = route
        out.append(doc)
    return out


def test_records_for_an_undeclared_stream_fail_and_become_dead_letters_exactly(spark, dsn,
                                                                                conn):
    docs = generated(900)
    payloads = [json.dumps(d) for d in docs]
    # the test's own reading of what it produced, by payload
    good = Counter(d["k"] for d in docs if d.get("route") == "good")
    bad = [json.dumps(d) for d in docs if d.get("route") == "bad"]
    stray = {json.dumps(d): d.get("route") for d in docs if d.get("route") not in ("good", "bad")}
    assert len(stray) > 80 and None in stray.values() and "rows" in stray.values()

    register(conn, PIPELINE, create_source=True)
    produce(conn, PIPELINE.topic, payloads)
    for i in range(8):  # three batches read the source; the replays follow, then nothing
        run_transaction(spark, dsn, conn, PIPELINE, f"run-{i}")
    assert table(conn, "SELECT count(*) FROM backflow_items") == [(0,)]
    assert table(conn, "SELECT sum(\"offset\") FROM partition_offsets") == [(900,)]

    assert dict(table(conn, "SELECT key, value FROM routed")) == dict(good)
    rejected = table(conn, """SELECT l.payload, r.error FROM rejected_records r
                              JOIN source_log l ON l.topic = r.topic
                               AND (l.partition, l."offset") = (r.partition, r."offset")""")
    assert sorted(p for p, _ in rejected) == sorted(bad)
    assert {e for _, e in rejected} == {"refused by the producer"}
    dead = dict(table(conn, "SELECT payload, errors[array_upper(errors, 1)] FROM dead_letters"))
    assert set(dead) == set(stray)  # every one, and nothing else
    outputs = "which is not one of its declared outputs ['bad', 'good']"
    for payload, reason in dead.items():
        shown = "null" if stray[payload] is None else f"'{stray[payload]}'"
        assert reason == (f"bolt route: emitted _stream={shown}, {outputs}: emit one of "
                          "those, or declare the stream in outputs"), reason
    # each failed on its first try and its one replay: all or nothing, counted nowhere else
    assert table(conn, "SELECT sum(failed), sum(replayed) FROM transactions") == [
        (2 * len(stray), len(stray))]
    assert table(conn, "SELECT count(*) FROM dead_letters WHERE failures = 2") == [
        (len(stray),)]
    assert len(good) and sum(good.values()) + len(bad) + len(stray) == 900
    # verify's re-run of the committed batches finds the same: the strays fail again
    assert rerun(conn, dsn, PIPELINE, spark).ok
