"""Rejected records: records the pipeline could not use (malformed, oversized), kept with
their position and reason by the commit of the txid that read them. This module alone reads
and writes ``rejected_records``.
"""

from __future__ import annotations


def keep(cur, pipeline: str, txid: int, attempt: int) -> int:
    """The commit's step: the attempt's staged rejects become rejected records."""
    cur.execute(
        """INSERT INTO rejected_records (pipeline, topic, partition, "offset", error, txid)
           SELECT pipeline, topic, partition, "offset", error, txid FROM staged_rejects
           WHERE pipeline = %s AND txid = %s AND attempt = %s
           ON CONFLICT DO NOTHING""",
        (pipeline, txid, attempt),
    )
    return cur.rowcount


def count(cur, pipeline: str) -> int:
    cur.execute("SELECT count(*) FROM rejected_records WHERE pipeline = %s", (pipeline,))
    return cur.fetchone()[0]


def positions(cur, pipeline: str, first: int = 1, last: int | None = None
              ) -> dict[tuple[int, int], str]:
    """(partition, offset) -> reason of every rejected record (that txids ``first..last``
    kept)."""
    cur.execute('SELECT partition, "offset", error FROM rejected_records WHERE pipeline = %s '
                'AND txid >= %s AND (%s::bigint IS NULL OR txid <= %s)',
                (pipeline, first, last, last))
    return {(p, o): error for p, o, error in cur.fetchall()}
