"""The file-segment source: the same events give exactly the same committed state as the
PostgreSQL log."""

from __future__ import annotations

import pytest
from psycopg2 import sql

from helpers import delete_before, produce, run_transaction, table
from onceflow.core.errors import ConfigError
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.ops.verify import recount as verify
from onceflow.sources.segments import FileSegments, produce_segments
from tweets_example.data import generate


@pytest.fixture
def both(conn, tmp_path):
    log_kind = get_pipeline("tweets", batch_size=700)
    file_kind = get_pipeline("tweets_files", batch_size=700,
                             source=FileSegments(topic="tweets_files", path=str(tmp_path / "seg")))
    for pipeline in (log_kind, file_kind):
        register(conn, pipeline, create_source=True)
    produce(conn, "tweets", generate(2000, seed=11, malformed_share=0.05))
    # several produce calls: several segments per partition, ranges cross segment ends
    for start, count in ((0, 900), (900, 600), (1500, 500)):
        events = list(generate(2000, seed=11, malformed_share=0.05))[start:start + count]
        produce_segments(conn, file_kind.source.root(), "tweets_files", events,
                         chunk_size=250)
    return log_kind, file_kind


def test_file_segments_commit_exactly_what_the_postgres_log_commits(spark, conn, dsn, both):
    log_kind, file_kind = both
    assert table(conn, "SELECT count(*) FROM source_segments WHERE topic = 'tweets_files'") \
        == [(36,)]
    for i in range(3):
        for pipeline in both:
            _, result = run_transaction(spark, dsn, conn, pipeline, f"{pipeline.name}-{i}")
            assert result.status == "committed"
    def state(name):
        return table(conn, sql.SQL("SELECT key, value FROM {} ORDER BY key").format(
            sql.Identifier(name)))

    for a, b in (("url_counts", "files_url_counts"), ("domain_counts", "files_domain_counts")):
        assert state(a) and state(a) == state(b)
    offsets = table(conn, """SELECT pipeline, partition, "offset" FROM partition_offsets
                             ORDER BY partition, pipeline""")
    assert [o for _, _, o in offsets[0::2]] == [o for _, _, o in offsets[1::2]] == [500] * 4
    rejects = table(conn, """SELECT pipeline, count(*) FROM rejected_records
                             GROUP BY 1 ORDER BY 1""")
    assert rejects[0][1] == rejects[1][1] > 0
    for pipeline in both:
        report = verify(conn, pipeline)
        assert report.ok, report.mismatches
        assert report.records + report.queued + report.dead == 2000


def test_a_missing_source_path_is_refused(conn, tmp_path):
    with pytest.raises(ConfigError, match="source.path=.*does not exist"):
        register(conn, get_pipeline("tweets_files", source=FileSegments(
            topic="tweets_files", path=str(tmp_path / "nope"))))


def test_retention_refuses_a_file_topic(conn, both):
    with pytest.raises(ConfigError, match="retention is not supported by a file-segments"):
        delete_before(conn, "tweets_files", 10)


def test_an_export_keeps_its_partitions_and_offsets(spark, conn, dsn, tmp_path, capsys):
    """`onceflow import`: records that have their partition and offset (e.g. a Kafka export)
    become segments with the same ones; the log of an empty partition starts at its first
    offset; a second import of the same files changes nothing; gaps and jumps are refused."""
    import json

    from onceflow.ops.cli import main

    root = tmp_path / "seg"
    pipeline = get_pipeline("tweets_files", batch_size=900,
                            source=FileSegments(topic="tweets_files", path=str(root)))
    register(conn, pipeline, create_source=True)
    payloads = list(generate(1200, seed=4, malformed_share=0.05))
    starts = {0: 1000, 1: 0, 2: 7, 3: 0}  # where each partition's export begins
    rows = [{"partition": i % 4, "offset": starts[i % 4] + i // 4, "payload": p}
            for i, p in enumerate(payloads)]
    first, second = tmp_path / "export-1.jsonl", tmp_path / "export-2.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in rows[:700]))
    second.write_text("".join(json.dumps(r) + "\n" for r in rows[700:]))
    args = ["import", "--pipeline", "tweets_files", str(first), str(second)]
    assert main(args) == 0
    assert "imported 1200 records" in capsys.readouterr().out
    assert main(args) == 0  # again: nothing changes
    assert "imported 0 records" in capsys.readouterr().out
    assert table(conn, """SELECT partition, log_start_offset, next_offset FROM source_partitions
                          WHERE topic = 'tweets_files' ORDER BY 1""") == [
        (0, 1000, 1300), (1, 0, 300), (2, 7, 307), (3, 0, 300)]
    for i in range(3):
        run_transaction(spark, dsn, conn, pipeline, f"imported-{i}")
    # the committed ranges are the export's offsets, and the result is the records' own
    assert table(conn, """SELECT partition, min(start_offset), max(end_offset) FROM batch_ranges
                          WHERE pipeline = 'tweets_files' GROUP BY 1 ORDER BY 1""") == [
        (0, 1000, 1300), (1, 0, 300), (2, 7, 307), (3, 0, 300)]
    report = verify(conn, pipeline)
    assert report.ok, report.mismatches
    assert report.records + report.queued + report.dead == 1200
    # refused before anything is written: a jump, and a start that is not the head
    gap = tmp_path / "gap.jsonl"
    gap.write_text(json.dumps({"partition": 1, "offset": 300, "payload": "{}"}) + "\n"
                   + json.dumps({"partition": 1, "offset": 302, "payload": "{}"}) + "\n")
    assert main(["import", "--pipeline", "tweets_files", str(gap)]) == 2
    assert "offset 302 follows 300" in capsys.readouterr().err
    ahead = tmp_path / "ahead.jsonl"
    ahead.write_text(json.dumps({"partition": 3, "offset": 500, "payload": "{}"}) + "\n")
    assert main(["import", "--pipeline", "tweets_files", str(ahead)]) == 2
    assert "start at offset 500, the partition's head is 300" in capsys.readouterr().err
    assert table(conn, "SELECT max(next_offset) FROM source_partitions "
                       "WHERE topic = 'tweets_files' AND partition IN (1, 3)") == [(300,)]


def _export(path, rows) -> str:
    import json

    path.write_text("".join(json.dumps({"partition": p, "offset": o, "payload": v}) + "\n"
                            for p, o, v in rows))
    return str(path)


def _log_state(conn, root):
    """What an import can change: the heads, the index and the files."""
    files = {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*"))
             if f.is_file()}
    return (table(conn, """SELECT partition, log_start_offset, next_offset
                           FROM source_partitions WHERE topic = 'tweets_files' ORDER BY 1"""),
            table(conn, """SELECT partition, base_offset, records, path FROM source_segments
                           WHERE topic = 'tweets_files' ORDER BY 1, 2"""), files)


def test_an_import_at_offsets_the_log_holds_otherwise_is_refused_whole(conn, tmp_path, capsys):
    """Records at offsets the log already has with another payload refuse the whole import
    (exit 2, the first conflicting range, how many, the flag), nothing written; the flag
    keeps the log's records and imports the rest; the same records again are a no-op."""
    from onceflow.core.planner import PartitionRange
    from onceflow.ops.cli import main

    root = tmp_path / "seg"
    pipeline = get_pipeline("tweets_files", source=FileSegments(topic="tweets_files",
                                                                path=str(root)))
    register(conn, pipeline, create_source=True)
    first = [(p, o, f"a-{p}-{o}") for p in (0, 1) for o in range(100)]
    first += [(3, o, f"a-3-{o}") for o in range(100, 120)]  # partition 3's log starts at 100
    args = ["import", "--pipeline", "tweets_files"]
    assert main([*args, _export(tmp_path / "a.jsonl", first)]) == 0
    before = _log_state(conn, root)
    capsys.readouterr()

    # the same records again (one of them twice in the files): nothing changes
    again = _export(tmp_path / "again.jsonl", [*first, first[5]])
    assert main([*args, again]) == 0
    assert "imported 0 records" in (out := capsys.readouterr().out)
    assert "220 were there already (the same payload)" in out
    assert _log_state(conn, root) == before

    def changed(p, o):
        return p == 0 and (60 <= o < 70 or 80 <= o < 85) or p == 1 and o in (95, 96)

    second = [(p, o, f"b-{p}-{o}" if changed(p, o) else f"a-{p}-{o}")
              for p in (0, 1) for o in range(50, 150)]
    second += [(2, o, f"b-2-{o}") for o in range(10)]  # new records of an empty partition
    conflicting = _export(tmp_path / "b.jsonl", second)
    assert main([*args, conflicting]) == 2
    err = capsys.readouterr().err
    assert ("import into topic 'tweets_files' refused, nothing imported: 17 record(s) are at "
            "offsets the log already holds with another payload (first: partition 0, offsets "
            "60..69; 2 partitions in all)") in err
    assert "--on-conflict keep-existing" in err and "Traceback" not in err
    assert _log_state(conn, root) == before  # not a file, not a row

    # below a partition's log start there is nothing to keep: refused as well
    early = _export(tmp_path / "early.jsonl", [(3, o, f"a-3-{o}") for o in range(90, 125)])
    assert main([*args, early]) == 2
    assert ("10 record(s) lie below their partition's log start, where the log has no "
            "records (first: partition 3, offsets 90..99; the log starts at 100)"
            in capsys.readouterr().err)
    # one offset twice in the files, with two payloads: no flag chooses between them
    twice = _export(tmp_path / "twice.jsonl", [(1, 100, "x"), (1, 100, "y")])
    assert main([*args, twice, "--on-conflict", "keep-existing"]) == 2
    assert "offset 100 appears twice in the files with different payloads" in \
        capsys.readouterr().err
    assert _log_state(conn, root) == before

    # a few offsets here and there: compared one by one
    sparse = _export(tmp_path / "sparse.jsonl",
                     [(0, 10, "a-0-10"), (0, 20, "a-0-20"), (0, 40, "b-0-40")])
    assert main([*args, sparse]) == 2
    assert "1 record(s) are at offsets the log already holds with another payload (first: " \
        "partition 0, offset 40)" in capsys.readouterr().err
    # a segment whose rows are not in offset order (not written by onceflow) is joined
    import pyarrow.parquet as pq

    (path,), = table(conn, "SELECT path FROM source_segments WHERE partition = 1")
    segment = pq.read_table(path)
    pq.write_table(segment.take(list(reversed(range(segment.num_rows)))), path)
    assert main([*args, again]) == 0
    assert "220 were there already (the same payload)" in capsys.readouterr().out
    pq.write_table(segment, path)
    assert _log_state(conn, root) == before

    # the flag: the log's records stay, the new ones past each head come in
    assert main([*args, conflicting, "--on-conflict", "keep-existing"]) == 0
    out = capsys.readouterr().out
    assert "imported 110 records" in out and "83 were there already" in out
    assert "17 at offsets it holds with another payload" in out
    assert table(conn, """SELECT partition, log_start_offset, next_offset FROM source_partitions
                          WHERE topic = 'tweets_files' ORDER BY 1""") == [
        (0, 0, 150), (1, 0, 150), (2, 0, 10), (3, 100, 120)]
    held = {(p, o): v for p, o, v in pipeline.source.payloads(conn, [
        PartitionRange(0, 0, 150), PartitionRange(1, 0, 150), PartitionRange(2, 0, 10)])}
    assert held[(0, 60)] == "a-0-60" and held[(1, 96)] == "a-1-96"  # the log's, kept
    assert held[(0, 120)] == "a-0-120" and held[(2, 3)] == "b-2-3"  # the new ones
    assert len(held) == 310
    assert main([*args, early, "--on-conflict", "keep-existing"]) == 0
    out = capsys.readouterr().out
    assert "imported 5 records" in out and "10 below a partition's log start" in out
