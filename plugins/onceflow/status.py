"""`onceflow status`: transactions in commit order, and partition offsets."""

from __future__ import annotations


def commit_log(cur, pipeline: str, limit: int = 50) -> list[str]:
    """One line per transaction, in txid order: the commit order, since txid N commits only
    after N - 1. Open transactions show their last attempt's failure reason."""
    cur.execute(
        """SELECT t.txid, t.attempt, t.state, t.run_id, t.records, t.replayed, t.failed,
                  t.rows_applied, t.committed_at, t.commit_wait_s,
                  (SELECT a.reason FROM transaction_attempts a WHERE a.pipeline = t.pipeline
                   AND a.txid = t.txid AND a.attempt = t.attempt),
                  (SELECT string_agg(format('p%%s:[%%s,%%s)', partition, start_offset, end_offset),
                                     ' ' ORDER BY partition)
                   FROM batch_ranges b WHERE b.pipeline = t.pipeline AND b.txid = t.txid)
           FROM (SELECT * FROM transactions WHERE pipeline = %s ORDER BY txid DESC LIMIT %s) t
           ORDER BY t.txid""",
        (pipeline, limit),
    )
    lines = []
    for (txid, attempt, state, run_id, records, replayed, failed, rows, at, wait, reason,
         ranges) in cur.fetchall():
        when = at.strftime("%Y-%m-%d %H:%M:%S") if at else "-"
        wait_s = f"{wait:.2f}s" if wait is not None else "-"
        lines.append(
            f"txid={txid} attempt={attempt} state={state} committed_at={when} waited={wait_s} "
            f"records={records} replayed={replayed} failed={failed if failed is not None else '-'}"
            f" rows={rows if rows is not None else '-'} run={run_id} "
            f"ranges={ranges or '-'}" + (f" reason={reason}" if reason else "")
        )
    return lines


def gap_lines(cur, pipeline: str) -> list[str]:
    cur.execute(
        """SELECT partition, from_offset, to_offset, txid, policy, at FROM offset_gaps
           WHERE pipeline = %s ORDER BY partition, from_offset""",
        (pipeline,),
    )
    return [
        f"partition={p} skipped=[{start},{end}) records={end - start} txid={txid} "
        f"policy={policy} at={at:%Y-%m-%d %H:%M:%S}"
        for p, start, end, txid, policy, at in cur.fetchall()
    ]


def partition_lines(cur, pipeline: str) -> list[str]:
    cur.execute(
        """SELECT sp.partition, sp.log_start_offset, sp.next_offset, po."offset", po.txid
           FROM pipelines p
           JOIN source_partitions sp ON sp.topic = p.topic
           LEFT JOIN partition_offsets po ON po.pipeline = p.name AND po.partition = sp.partition
           WHERE p.name = %s ORDER BY sp.partition""",
        (pipeline,),
    )
    return [
        f"partition={p} log_start={start} head={head} committed={off if off is not None else '-'}"
        f" lag={head - (off or start)} by_txid={txid if txid is not None else '-'}"
        for p, start, head, off, txid in cur.fetchall()
    ]
