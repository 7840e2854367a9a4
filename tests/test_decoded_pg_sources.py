"""The PostgreSQL log and the table source with a declared ``json_schema``: the reader task
decodes each COPY chunk's payloads (no ``from_json`` in the topology), and a pipeline counts
exactly what the same pipeline counts on payload strings: corrupt records, refused oversized
ones, failed records replayed decoded from the backflow; verify agrees."""

from __future__ import annotations

import json

import psycopg2
import pytest
import typed_tweets
from psycopg2 import sql
from test_table_source import sql as run_sql

from helpers import produce, run_transaction, table
from onceflow.core.errors import ConfigError
from onceflow.core.planner import PartitionRange
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.ops.verify import recount, rerun
from onceflow.sources.pglog import PostgresLog
from onceflow.sources.table import TableSource

# The decoded pipeline is the registered tweets_files (its own state tables), its source
# replaced: its state tables are these.
STATES = (("url_counts", "files_url_counts"), ("domain_counts", "files_domain_counts"))


def _run_all(spark, dsn, conn, pipelines, runs: int) -> None:
    for n in range(runs):  # flaky records fail once or twice, then count
        for pipeline in pipelines:
            _, result = run_transaction(spark, dsn, conn, pipeline, f"{pipeline.name}-{n}")
            assert result.status == "committed"


def _same_results(conn, dsn, spark, payload_kind, decoded_kind) -> None:
    """Both pipelines committed the same counts and rejects, and verify finds each equal to
    a recount of its source's payloads; the decoded one re-runs equal too."""
    def state(name):
        return table(conn, sql.SQL("SELECT key, value FROM {} ORDER BY key").format(
            sql.Identifier(name)))

    for a, b in STATES:
        assert state(a) and state(a) == state(b)
    # A decoding table source's payload holds only the declared columns: an oversized
    # record's size may differ, not its refusal.
    rejects = {name: table(conn, r"""SELECT partition, "offset", regexp_replace(error,
                                       '^oversized record \(\d+ bytes', 'oversized record (')
                                     FROM rejected_records
                                     WHERE pipeline = %s ORDER BY 1, 2""", (name,))
               for name in (payload_kind.name, decoded_kind.name)}
    assert rejects[payload_kind.name] == rejects[decoded_kind.name]
    for pipeline in (payload_kind, decoded_kind):
        report = recount(conn, pipeline)
        assert report.ok, report.mismatches
    assert rerun(conn, dsn, decoded_kind, spark).ok
    replayed = table(conn, """SELECT sum(replayed) FROM transactions
                              WHERE pipeline = %s AND state = 'committed'""",
                     (decoded_kind.name,))
    assert replayed[0][0] > 0  # flaky records came back from the backflow, decoded


def _expected(source, conn, ranges) -> list[tuple]:
    """What a decoding ``source`` must read for ``ranges``: JsonRecords.decode of its
    payloads, with their problems."""
    found = list(source.payloads(conn, ranges))
    conn.rollback()
    columns, problems = source.records.decode([p.encode() for _, _, p in found],
                                              source.max_record_bytes)
    values = [columns[name].to_pylist() for name in [*source.records.names,
                                                     "_corrupt_record"]]
    return sorted((p, o, *(v[i] for v in values), problems[i].as_py())
                  for i, (p, o, _) in enumerate(found))


# --- the PostgreSQL log -------------------------------------------------------------------

def test_a_decoding_postgres_log_counts_what_the_payload_log_counts(spark, conn, dsn):
    """The typed tweets (malformed, poison, flaky, one oversized, one wrongly typed) in two
    topics: read as payloads by the tweets topology, and decoded by the reader (the typed
    topology): the same counts, rejects, replays."""
    payloads = typed_tweets.payloads()
    payload_kind = get_pipeline("tweets", batch_size=700, source=PostgresLog(
        topic="tweets", partitions=2, max_record_bytes=typed_tweets.MAX_RECORD_BYTES))
    decoded_kind = typed_tweets.pipeline("tweets_files", PostgresLog(
        topic="typed_log", partitions=2, read_chunk=150, json_schema=typed_tweets.SCHEMA,
        max_record_bytes=typed_tweets.MAX_RECORD_BYTES))
    for pipeline in (payload_kind, decoded_kind):
        register(conn, pipeline, create_source=True)
        produce(conn, pipeline.source.topic, payloads)
    frame = decoded_kind.source.read(spark, dsn, [PartitionRange(0, 0, 10)])
    assert frame.columns == ["partition", "offset", "url", "flaky", "_corrupt_record",
                             "_problem"]
    _run_all(spark, dsn, conn, (payload_kind, decoded_kind), 4)
    rejected = dict(table(conn, """SELECT "offset", error FROM rejected_records
                                   WHERE pipeline = 'tweets_files' AND partition = 0"""))
    assert rejected[5].startswith("oversized record (")  # payload 10: partition 0, offset 5
    assert rejected[15] == "malformed JSON"  # payload 30: a wrongly typed field
    _same_results(conn, dsn, spark, payload_kind, decoded_kind)


def test_the_postgres_log_reads_its_payloads_decoded(spark, conn, dsn):
    """read() with json_schema gives JsonRecords.decode of payloads() for the same ranges:
    ranges cut inside partitions and across reader chunks, corrupt and oversized records."""
    source = PostgresLog(topic="typed_log", partitions=2, read_chunk=7, max_record_bytes=300,
                         json_schema="url string, flaky int, score double, ok boolean")
    source.validate()
    source.ensure(conn, create=True)
    conn.commit()
    payloads = [json.dumps({"url": f"https://h{i}.example/", "flaky": i % 3, "score": i / 4,
                            "ok": i % 2 == 0}) for i in range(60)]
    payloads[3] = '{"url": "https://broken.example/"'  # not JSON: corrupt
    payloads[8] = '{"url": 7}'  # a number where a string is declared: corrupt
    payloads[12] = json.dumps({"url": "https://big.example/" + "x" * 400})  # over 300 bytes
    payloads[20] = '["an array"]'
    payloads[21] = json.dumps({"flaky": 2 ** 31})  # out of int's range
    source.append(conn, payloads)
    ranges = [PartitionRange(0, 1, 29), PartitionRange(1, 0, 30)]
    rows = sorted(tuple(r) for r in source.read(spark, dsn, ranges).collect())
    assert rows == _expected(source, conn, ranges)
    # payload i is at partition i % 2, offset i // 2
    at = {(r[0], r[1]): r[2:] for r in rows}
    assert len(rows) == 28 + 30
    assert at[(1, 1)][-2] == payloads[3] and at[(0, 4)][-2] == payloads[8]
    assert at[(0, 10)][-2] == payloads[20] and at[(1, 10)][-2] == payloads[21]
    assert at[(0, 6)][:5] == (None,) * 5 and at[(0, 6)][-1].startswith("oversized record (")
    assert at[(1, 7)] == ("https://h15.example/", 0, 3.75, False, None, None)


# --- the table source ---------------------------------------------------------------------

POSTS = """CREATE TABLE public.posts (
    id    bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    url   text,
    flaky numeric)"""


def test_a_decoding_table_source_counts_what_the_payload_source_counts(spark, conn, dsn):
    """One table read by two topics: as payloads (the tweets topology parses row_to_json)
    and decoded by the reader: the same counts, rejects and replays, for rows whose JSON
    breaks the schema (flaky 2.5 where an int is declared), an oversized row, a row
    without a URL, a flaky one."""
    run_sql(dsn, POSTS)
    rows = [(f"https://shop{i % 7}.example.com/{i}", None) for i in range(80)]
    rows[5] = ("https://flaky.example.com/1", 2)  # fails twice, replayed, then counts
    rows[9] = ("https://typed.example.com/1", 2.5)  # not an int: corrupt
    rows[17] = ("https://big.example.com/" + "x" * 3000, None)  # refused by max_record_bytes
    rows[23] = (None, None)  # no URL
    rows[31] = ("not a url", None)
    with psycopg2.connect(dsn) as c, c.cursor() as cur:
        cur.execute("INSERT INTO posts (url, flaky) SELECT * FROM unnest(%s::text[], "
                    "%s::numeric[])", ([u for u, _ in rows], [f for _, f in rows]))
    c.close()
    payload_kind, decoded_kind = posts_pipelines()
    for pipeline in (payload_kind, decoded_kind):
        register(conn, pipeline, create_source=True)
    _run_all(spark, dsn, conn, (payload_kind, decoded_kind), 5)
    rejected = dict(table(conn, """SELECT "offset", error FROM rejected_records
                                   WHERE pipeline = 'tweets_files'"""))
    assert rejected[10] == "malformed JSON"  # key 10: flaky 2.5
    assert rejected[18].startswith("oversized record (")
    assert set(rejected) == {10, 18, 24, 32}
    _same_results(conn, dsn, spark, payload_kind, decoded_kind)


def posts_pipelines():
    """The tweets pipelines on the posts table: one reading payloads (the tweets topology
    parses row_to_json), one decoded by the reader (json_schema)."""
    settings = {"table": "public.posts", "key": "id", "wait_s": 0.2, "read_chunk": 15,
                "max_record_bytes": 2048}
    payload_kind = get_pipeline("tweets", batch_size=30, source=TableSource(
        topic="posts_payload", **settings))
    decoded_kind = typed_tweets.pipeline("tweets_files", TableSource(
        topic="posts_typed", json_schema=typed_tweets.SCHEMA, **settings)
    ).with_settings(batch_size=30)
    return payload_kind, decoded_kind


def test_the_table_source_reads_its_rows_decoded(spark, conn, dsn):
    """read() with json_schema gives JsonRecords.decode of payloads() (row_to_json) for the
    same ranges; a text column declared int makes its row corrupt, the row's JSON kept."""
    run_sql(dsn, """CREATE TABLE public.items (
                    id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
                    name text, qty text, price double precision, at timestamptz)""",
        """INSERT INTO items (name, qty, price, at)
           SELECT 'item ' || i, CASE WHEN i % 10 = 3 THEN i::text END, i * 1.5,
                  '2026-01-01'::timestamptz + i * interval '1 hour'
           FROM generate_series(1, 50) AS i""",
        "UPDATE items SET name = repeat('n', 500) WHERE id = 44")
    source = TableSource(topic="items", table="public.items", key="id", wait_s=0.2,
                         read_chunk=8, max_record_bytes=400,
                         json_schema="name string, qty int, price double, at string")
    source.validate()
    ranges = [PartitionRange(0, 2, 41), PartitionRange(0, 44, 51)]
    rows = sorted(tuple(r) for r in source.read(spark, dsn, ranges).collect())
    assert rows == _expected(source, conn, ranges)
    by_key = {r[1]: r for r in rows}
    assert by_key[3][2:6] == (None,) * 4 and json.loads(by_key[3][6])["qty"] == "3"
    assert by_key[4][2:7] == ("item 4", None, 6.0, "2026-01-01T04:00:00+00:00", None)
    assert by_key[44][-1].startswith("oversized record (") and by_key[44][2] is None
    assert len(rows) == 39 + 7


@pytest.mark.parametrize("source", [
    PostgresLog(topic="t", json_schema="url map<string, int>"),
    TableSource(topic="t", table="public.orders", key="id", json_schema="url strin g"),
    TableSource(topic="t", table="public.orders", key="id", json_schema=""),
], ids=["log-map-type", "table-bad-ddl", "table-empty"])
def test_a_bad_json_schema_is_refused_by_name(source):
    with pytest.raises(ConfigError, match=r"source\.json_schema"):
        source.validate()
