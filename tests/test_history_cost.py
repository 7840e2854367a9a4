"""A begin's cost must not grow with the committed history: the planned ends it reads per
partition (txlog.planned_ends) come from a walk of an index, not from every range ever
planned, and no statement of a whole begin scans the history. Counted in rows PostgreSQL
read, so the check does not depend on the machine."""

from __future__ import annotations

import io

import psycopg2
import psycopg2.extensions
from psycopg2 import sql

from helpers import tweets_pipeline
from onceflow.core import txlog
from onceflow.core.begin import begin
from onceflow.core.commit import commit
from onceflow.core.db import transaction
from onceflow.core.staging import stage_group

TXIDS = 200
PARTITIONS = 4


def _ends_by_aggregate(cur, pipeline: str, before: int | None) -> dict[int, int]:
    """What planned_ends must answer, over every range (the definition)."""
    cur.execute("""SELECT br.partition, max(br.end_offset) FROM batch_ranges br
                   JOIN transactions t ON t.pipeline = br.pipeline AND t.txid = br.txid
                   WHERE br.pipeline = %s AND t.state <> 'superseded'
                     AND (%s::bigint IS NULL OR br.txid < %s) GROUP BY 1""",
                (pipeline, before, before))
    return dict(cur.fetchall())


def _rows_read(cur) -> int:
    """Rows and index entries this transaction has read from batch_ranges so far."""
    cur.execute("""SELECT sum(pg_stat_get_xact_tuples_returned(oid)) FROM pg_class
                   WHERE oid = 'batch_ranges'::regclass
                      OR oid IN (SELECT indexrelid FROM pg_index
                                 WHERE indrelid = 'batch_ranges'::regclass)""")
    return int(cur.fetchone()[0] or 0)


def test_planned_ends_read_per_partition_not_per_txid(conn):
    pipeline = tweets_pipeline(conn, events=TXIDS * PARTITIONS, batch_size=PARTITIONS,
                               partitions=PARTITIONS)
    for n in range(TXIDS):
        batch = begin(conn, pipeline, f"run-{n}")
        stage_group(conn, pipeline.name, batch.attempt, 0,
                    deltas_csv=io.StringIO(f"url_counts,k{n},1\n"), rejects_csv=io.StringIO(),
                    records=batch.records)
        assert commit(conn, pipeline, batch.attempt).status == "committed"
    with transaction(conn) as cur:
        cur.execute("ANALYZE batch_ranges; ANALYZE transactions")
    with transaction(conn) as cur:
        cur.execute("SELECT count(*) FROM batch_ranges WHERE pipeline = %s", (pipeline.name,))
        ranges = cur.fetchone()[0]
        assert ranges >= TXIDS * PARTITIONS
        for before in (None, TXIDS // 2):
            assert txlog.planned_ends(cur, pipeline.name, 0, before) == \
                _ends_by_aggregate(cur, pipeline.name, before)
    with transaction(conn) as cur:
        read = _rows_read(cur)
        ends = txlog.planned_ends(cur, pipeline.name, 0, None)
        read = _rows_read(cur) - read
    assert len(ends) == PARTITIONS
    # a few index entries per partition, against the history's 800 ranges
    assert read <= 10 * PARTITIONS, f"planned_ends read {read} of {ranges} ranges"


# The tables that grow with the committed history
HISTORY = ("transactions", "transaction_attempts", "transaction_runs", "batch_ranges")
# This transaction's sequential scans of them, and rows and index entries read from them
_HISTORY_READS = """
    SELECT coalesce(sum(pg_stat_get_xact_numscans(c.oid)) FILTER (WHERE c.relkind = 'r'), 0),
           coalesce(sum(pg_stat_get_xact_tuples_returned(c.oid)), 0)
    FROM pg_class c
    WHERE c.oid = ANY(%(tables)s::regclass[])
       OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = ANY(%(tables)s::regclass[]))
"""


class _Counted(psycopg2.extensions.cursor):
    """Counts its statements and what each read of the history, in the statement's own
    transaction (its counters are this session's until the transaction ends)."""

    statements = scans = rows = 0

    def execute(self, query, params=None):
        with psycopg2.extensions.cursor(self.connection) as probe:
            probe.execute(_HISTORY_READS, {"tables": list(HISTORY)})
            scans, rows = probe.fetchone()
            result = super().execute(query, params)
            probe.execute(_HISTORY_READS, {"tables": list(HISTORY)})
            after = probe.fetchone()
        _Counted.statements += 1
        _Counted.scans += after[0] - scans
        _Counted.rows += after[1] - rows
        return result


def _begin_counted(conn, pipeline, run_id: str):
    """One begin on ``conn`` with sequential scans off, the history vacuumed and analyzed (as
    on a long history, where an index wins and autovacuum keeps the indexes clean and the
    statistics fresh): (the batch, its statements, its sequential scans of the history, the
    rows and index entries it read)."""
    conn.autocommit = True  # VACUUM runs outside a transaction
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("VACUUM ANALYZE {}").format(
                sql.SQL(", ").join(map(sql.Identifier, HISTORY))))
            cur.execute("SET enable_seqscan = off")
    finally:
        conn.autocommit = False
    _Counted.statements = _Counted.scans = _Counted.rows = 0
    factory, conn.cursor_factory = conn.cursor_factory, _Counted
    try:
        batch = begin(conn, pipeline, run_id)
    finally:
        conn.cursor_factory = factory
        with conn.cursor() as cur:
            cur.execute("RESET enable_seqscan")
        conn.commit()
    return batch, _Counted.statements, _Counted.scans, int(_Counted.rows)


def _commit_one(conn, pipeline, batch, key: str) -> None:
    stage_group(conn, pipeline.name, batch.attempt, 0,
                deltas_csv=io.StringIO(f"url_counts,{key},1\n"), rejects_csv=io.StringIO(),
                records=batch.records)
    assert commit(conn, pipeline, batch.attempt).status == "committed"


def test_a_begin_reads_no_more_of_a_long_history_than_of_a_short_one(conn):
    """A whole begin (PostgreSQL log source) after 20 and after 120 committed txids: a few
    dozen statements, no sequential scan of a history table where seq scans are discouraged
    (the plan a long history gets: a table without an index for the query would still be
    scanned), and the same few rows read from them each time."""
    pipeline = tweets_pipeline(conn, events=130 * PARTITIONS, batch_size=PARTITIONS,
                               partitions=PARTITIONS)
    rows = {}
    for n in range(121):
        if n in (20, 120):
            batch, statements, scans, rows[n] = _begin_counted(conn, pipeline, f"run-{n}")
            assert statements <= 30 and scans == 0, (statements, scans)
        else:
            batch = begin(conn, pipeline, f"run-{n}")
        assert batch.records == PARTITIONS
        _commit_one(conn, pipeline, batch, f"k{n}")
    with transaction(conn) as cur:
        cur.execute("SELECT count(*) FROM batch_ranges WHERE pipeline = %s", (pipeline.name,))
        assert cur.fetchone()[0] >= 120 * PARTITIONS
    assert 0 < rows[120] <= rows[20] + PARTITIONS and rows[120] <= 40, rows
