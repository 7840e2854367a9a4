"""Small building blocks the tests share."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from psycopg2 import sql

from onceflow.core.begin import begin
from onceflow.core.commit import CommitResult, commit
from onceflow.core.pipeline import Pipeline
from onceflow.core.registration import register
from onceflow.core.registry import clear_cache, get_pipeline
from onceflow.core.txlog import Batch
from onceflow.kvstate import open_state_provider
from onceflow.sources import catalog
from onceflow.sources.pglog import PostgresLog
from tweets_example.data import generate
from tweets_example.pipelines import TWEETS

OUTSIDE = Path(__file__).parent / "outside"  # the outside pipeline package (pageviews)



def another(pipeline: Pipeline, name: str, **changes) -> Pipeline:
    """``pipeline`` as another pipeline ``name``, its states in tables of its own
    (``<name>_<table>``, fed by the same sinks): two pipelines never share a table."""
    states = tuple(dataclasses.replace(s, name=f"{name}_{s.name}", source=s.source_name)
                   for s in pipeline.states)
    return dataclasses.replace(pipeline, name=name, states=states, **changes)


# The tweets pipeline with a one-task transaction DAG, reached as "helpers:TWEETS_SINGLE"
# (tests/test_single_task_dag.py)
TWEETS_SINGLE = another(TWEETS, "tweets_single", dag_shape="single")
# The tweets pipeline whose dead letters are replayed only after a person approves, reached as
# "helpers:TWEETS_APPROVED" (tests/test_ui.py)
TWEETS_APPROVED = another(TWEETS, "tweets_approved", dead_letter_approval=True)


@contextmanager
def outside_pipeline(monkeypatch, ref: str, conn=None, name: str = "page_views"
                     ) -> Iterator[Pipeline | None]:
    """The outside package reachable the way a user makes it so: its folder on PYTHONPATH and
    ``ref`` in ONCEFLOW_PIPELINES (this process and every one it starts). With ``conn``:
    the pipeline ``name`` registered (its source created), yielded."""
    monkeypatch.syspath_prepend(str(OUTSIDE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(OUTSIDE), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("ONCEFLOW_PIPELINES", ref)
    clear_cache()
    found = None
    if conn is not None:
        found = get_pipeline(name)
        register(conn, found, create_source=True)
    try:
        yield found
    finally:
        clear_cache()


def produce(conn, topic: str, payloads) -> int:
    """Append payloads to a PostgreSQL-log topic."""
    return PostgresLog(topic=topic).append(conn, payloads)


def ensure_topic(conn, topic: str, partitions: int) -> None:
    catalog.ensure_topic(conn, topic, partitions, create=True)


def read_ranges(spark, dsn: str, topic: str, ranges, chunk: int = 100_000):
    return PostgresLog(topic=topic, read_chunk=chunk).read(spark, dsn, ranges)


def delete_before(conn, topic: str, before: int, partition: int | None = None, *,
                  force: bool = True) -> int:
    """Retention (forced by default: these tests delete records pipelines have not read)."""
    from onceflow.core.registry import pipelines
    from onceflow.ops import retention

    known = pipelines()
    source = next((p.source for p in known.values() if p.topic == topic),
                  PostgresLog(topic=topic))
    plan = retention.apply(conn, source, before, partition=partition, force=force,
                           pipelines=known)
    return plan.deletes


def tweets_events(events: int, *, seed: int = 7, malformed_share: float = 0.05,
                  poison_share: float = 0.0005, flaky_share: float = 0.001) -> list[str]:
    """Generated tweets (tweets_pipeline's defaults): what a test produces and then checks
    the state against (assert_exact)."""
    return list(generate(events, seed=seed, malformed_share=malformed_share,
                         poison_share=poison_share, flaky_share=flaky_share))


def tweets_pipeline(conn, *, events: int = 0, payloads: list[str] | None = None,
                    batch_size: int = 1000, state_dsns=None, **overrides) -> Pipeline:
    """The tweets example's pipeline registered in ``conn``'s database, with ``payloads``
    produced (or ``events`` generated ones: tweets_events' keyword arguments apply)."""
    shares = {k: overrides.pop(k) for k in ("seed", "malformed_share", "poison_share",
                                            "flaky_share") if k in overrides}
    source = {k: overrides.pop(k) for k in ("partitions", "max_record_bytes") if k in overrides}
    if source:
        overrides["source"] = dataclasses.replace(get_pipeline("tweets").source, **source)
    pipeline = get_pipeline("tweets", batch_size=batch_size, **overrides)
    register(conn, pipeline, state_dsns, create_source=True)
    if payloads is None and events:
        payloads = tweets_events(events, **shares)
    if payloads:
        produce(conn, pipeline.topic, payloads)
    return pipeline


# -- an oracle of the tests' own --------------------------------------------------------------
HOST = re.compile(r"^https?://([^/:?#\s]+)")


@dataclass(frozen=True)
class Tweet:
    """What the test made of one generated payload, by its own rules (not onceflow's, not the
    example's recount): ``kind`` is "good", "rejected" (malformed, no URL, not http(s)),
    "poison" (a host with an empty label: fails every try) or "flaky" (fails its first
    ``flaky`` tries, then counts)."""

    kind: str
    url: str = ""
    domain: str = ""
    flaky: int = 0


def classify_tweet(payload: str) -> Tweet:
    """The generator writes well-formed tweets, four kinds of unusable ones, poison hosts
    ("a..b") and ASCII hosts only, so this is all it takes."""
    try:
        doc = json.loads(payload)
    except ValueError:
        return Tweet("rejected")
    url = doc.get("url") if isinstance(doc, dict) else None
    match = HOST.match(url) if isinstance(url, str) else None
    if match is None:
        return Tweet("rejected")
    host = match.group(1)
    if ".." in host:
        return Tweet("poison", url, host)
    flaky = doc.get("flaky") or 0
    return Tweet("flaky" if flaky else "good", url, host.lower(), flaky)


@dataclass
class Exact:
    """What assert_exact found, for further assertions: positions read, queued, dead."""

    read: int
    counted: int
    rejected: int
    queued: set
    dead: set


def assert_exact(conn, pipeline: Pipeline, payloads: list[str], *, read_all: bool,
                 drained: bool = False, state_conns: dict | None = None) -> Exact:
    """The committed state against what the test produced, with none of onceflow's
    bookkeeping as the expectation: the topic holds exactly ``payloads``; committed ranges
    tile every partition from 0 (to its head when ``read_all``) and no range was skipped as
    a gap; the records in them, by the test's own classification, give the counts exactly;
    rejected records are exactly the unusable ones read; a dead letter is always a record
    that fails every try (poison, or flaky past ``max_replays``), a queued one a poison or
    flaky one (``drained``: none queued, every such record read dead), and every such record
    read is one or the other. ``state_conns``: a connection
    per state kept in another database."""
    topic, name = pipeline.topic, pipeline.name
    log = {(p, o): payload for p, o, payload in table(
        conn, 'SELECT partition, "offset", payload FROM source_log WHERE topic = %s', (topic,))}
    assert Counter(log.values()) == Counter(payloads), "the topic does not hold what was produced"
    ends: dict[int, int] = {}
    for partition, start, end in table(
            conn, """SELECT b.partition, b.start_offset, b.end_offset FROM batch_ranges b
                     JOIN transactions t USING (pipeline, txid)
                     WHERE t.state = 'committed' AND b.pipeline = %s
                       AND b.start_offset < b.end_offset ORDER BY 1, 2""", (name,)):
        assert start == ends.get(partition, 0), f"partition {partition}: committed ranges " \
            f"jump from {ends.get(partition, 0)} to {start}"
        ends[partition] = end
    if read_all:
        heads = dict(table(conn, "SELECT partition, next_offset FROM source_partitions "
                                 "WHERE topic = %s AND next_offset > 0", (topic,)))
        assert ends == heads, f"committed ranges end at {ends}, the heads are {heads}"
    assert table(conn, "SELECT count(*) FROM offset_gaps WHERE pipeline = %s", (name,)) == [(0,)]
    read = {pos: classify_tweet(log[pos]) for pos in log if pos[1] < ends.get(pos[0], 0)}

    def positions(query: str) -> set:
        return {(p, o) for p, o in table(conn, query, (name,))}

    queued = positions('SELECT partition, "offset" FROM backflow_items WHERE pipeline = %s')
    dead = positions('SELECT partition, "offset" FROM dead_letters WHERE pipeline = %s')
    rejected = positions('SELECT partition, "offset" FROM rejected_records WHERE pipeline = %s')
    kinds = {pos: t.kind for pos, t in read.items()}
    assert rejected == {p for p, k in kinds.items() if k == "rejected"}
    assert not dead & queued
    # a record dies when it fails every try it is given: poison always, a flaky one when it
    # fails more tries than the first and max_replays replays
    doomed = {p for p, t in read.items() if t.kind == "poison"
              or (t.kind == "flaky" and t.flaky > pipeline.max_replays)}
    assert dead <= doomed, "a record dead-lettered wrongly"
    assert {kinds.get(p) for p in queued} <= {"poison", "flaky"}, "a record queued wrongly"
    assert doomed <= dead | queued, "a record that fails every try neither dead nor queued"
    if drained:
        assert not queued and dead == doomed
    want: dict[str, Counter] = {"url_counts": Counter(), "domain_counts": Counter()}
    counted = [t for pos, t in read.items()
               if t.kind in ("good", "flaky") and pos not in queued and pos not in dead]
    for t in counted:
        want["url_counts"][t.url] += 1
        want["domain_counts"][t.domain] += 1
    for spec in pipeline.states:
        state = spec.source_name
        if state not in want:
            continue
        c = (state_conns or {}).get(spec.name, conn)
        got = dict(table(c, sql.SQL("SELECT key, value FROM {} WHERE value <> 0").format(
            sql.Identifier(spec.table))))
        assert got == dict(want[state]), f"{spec.table}: the counts differ from the payloads'"
    return Exact(len(read), len(counted), len(rejected), queued, dead)


def run_transaction(spark, dsn: str, conn, pipeline: Pipeline, run_id: str
                    ) -> tuple[Batch, CommitResult]:
    """begin -> process -> commit, the phase functions called directly."""
    from onceflow.spark.processing import process_batch

    batch = begin(conn, pipeline, run_id)
    for group in range(batch.groups):
        process_batch(spark, dsn, pipeline, batch.attempt, group)
    return batch, commit(conn, pipeline, batch.attempt, open_state=open_state_provider)


def table(conn, query: str, params=()) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(query, params)
        rows = cur.fetchall()
    conn.commit()
    return rows


def table_stats(conn, table_name: str) -> dict[str, int]:
    """PostgreSQL's scan and read counters of ``table_name`` so far (pg_stat_user_tables,
    and index entries read over its indexes), this connection's own included: flushed as
    its last transaction ended."""
    with conn.cursor() as cur:
        cur.execute("SELECT pg_stat_force_next_flush()")
    conn.commit()
    with conn.cursor() as cur:
        cur.execute("SELECT pg_stat_clear_snapshot()")
        cur.execute("""SELECT t.seq_scan, coalesce(t.idx_scan, 0),
                              t.seq_tup_read + coalesce(t.idx_tup_fetch, 0)
                              + coalesce((SELECT sum(i.idx_tup_read) FROM pg_stat_user_indexes i
                                          WHERE i.relid = t.relid), 0)
                       FROM pg_stat_user_tables t WHERE t.relname = %s""", (table_name,))
        seq_scan, idx_scan, read = cur.fetchone()
    conn.commit()
    return {"seq_scan": seq_scan, "idx_scan": idx_scan, "read": int(read)}
