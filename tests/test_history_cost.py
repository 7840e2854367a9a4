"""A begin's cost must not grow with the committed history: the planned ends it reads per
partition (txlog.planned_ends) come from a walk of an index, not from every range ever
planned. Counted in rows PostgreSQL read, so the check does not depend on the machine."""

from __future__ import annotations

import io

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
