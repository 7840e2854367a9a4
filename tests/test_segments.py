"""The file-segment source: the same events give exactly the same committed state as the
PostgreSQL log."""

from __future__ import annotations

import pytest
from psycopg2 import sql

from helpers import delete_before, produce, run_transaction, table
from onceflow.core.errors import ConfigError, ImportConflict
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

    from onceflow.cli import main

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
    from onceflow.cli import main
    from onceflow.core.planner import PartitionRange

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


def _scanned_rows(frame) -> int:
    """Rows the Parquet scan of a collected DataFrame returned, after the reader skipped row
    groups and pages by their statistics (before Spark's own filter)."""
    plan = frame._jdf.queryExecution().executedPlan()
    if plan.nodeName() == "AdaptiveSparkPlan":
        plan = plan.executedPlan()
    leaves = plan.collectLeaves()
    scans = [leaves.apply(i) for i in range(leaves.size())
             if leaves.apply(i).nodeName().startswith("Scan parquet")]
    assert len(scans) == 1, [leaves.apply(i).nodeName() for i in range(leaves.size())]
    return scans[0].metrics().apply("numOutputRows").value()


def test_a_sub_range_reads_exactly_its_records_from_the_row_groups_that_hold_them(
        spark, conn, dsn, tmp_path, monkeypatch):
    """Segments are written (imported and produced) in row groups of ROW_GROUP_ROWS with
    offset statistics; a read of ranges that start and end inside row groups and at their
    edges gets exactly the planned records, from Spark and from payloads(), and Spark's scan
    skips the row groups outside them; an old segment of one row group reads exactly too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from onceflow.core.planner import PartitionRange
    from onceflow.sources import segments

    monkeypatch.setattr(segments.write, "ROW_GROUP_ROWS", 100)
    root = tmp_path / "seg"
    pipeline = get_pipeline("tweets_files", source=FileSegments(topic="tweets_files",
                                                                path=str(root)))
    register(conn, pipeline, create_source=True)
    source = pipeline.source
    # partitions 0 and 1 imported (1,000 records each, one segment), then 800 produced
    # round-robin (200 per partition): p0 and p1 get a second segment, p2 and p3 their first
    segments.import_segments(conn, root, "tweets_files", pa.table({
        "partition": [p for p in (0, 1) for _ in range(1000)],
        "offset": [o for _ in (0, 1) for o in range(1000)],
        "payload": [f"i-{p}-{o}" for p in (0, 1) for o in range(1000)]}))
    produce_segments(conn, root, "tweets_files", [f"n-{i}" for i in range(800)])
    index = table(conn, """SELECT partition, base_offset, records, path FROM source_segments
                           WHERE topic = 'tweets_files' ORDER BY 1, 2""")
    assert [(p, b, n) for p, b, n, _ in index] == [
        (0, 0, 1000), (0, 1000, 200), (1, 0, 1000), (1, 1000, 200), (2, 0, 200), (3, 0, 200)]
    for partition, base, records, path in index:
        meta = pq.ParquetFile(path).metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        assert sizes == [100] * (records // 100), (path, sizes)
        stats = [[meta.row_group(g).column(c).statistics for c in (0, 1)]
                 for g in range(meta.num_row_groups)]
        assert [(p.min, p.max, o.min, o.max) for p, o in stats] == [
            (partition, partition, base + g * 100, base + g * 100 + 99)
            for g in range(len(sizes))]
    # an import compares records the log holds with the row groups that hold them
    again = {"partition": [0] * 200, "offset": list(range(250, 450)),
             "payload": [f"i-0-{o}" for o in range(250, 450)]}
    same = segments.import_segments(conn, root, "tweets_files", pa.table(again))
    assert (same.records, same.skipped) == (0, 200)
    again["payload"][333 - 250] = "other"
    with pytest.raises(ImportConflict, match="first: partition 0, offset 333\\)"):
        segments.import_segments(conn, root, "tweets_files", pa.table(again))
    # partition 3's segment rewritten as onceflow wrote it before: one row group
    old = index[-1][3]
    pq.write_table(pq.read_table(old), old, row_group_size=1 << 20)
    assert pq.ParquetFile(old).metadata.num_row_groups == 1

    def payload(p, o):
        if p in (0, 1) and o < 1000:
            return f"i-{p}-{o}"
        return f"n-{(o - 1000 if p in (0, 1) else o) * 4 + p}"

    ranges = [PartitionRange(0, 150, 250),  # inside row groups, across an edge
              PartitionRange(0, 300, 400),  # one whole row group, edge to edge
              PartitionRange(0, 999, 1001),  # the last record of a segment, the next's first
              PartitionRange(1, 500, 501),  # one record, at a row group's start
              PartitionRange(2, 199, 200),  # a segment's last record
              PartitionRange(3, 37, 161)]  # inside the old one-row-group segment
    expected = sorted((r.partition, o, payload(r.partition, o)) for r in ranges
                      for o in range(r.start, r.end))
    assert sorted(source.payloads(conn, ranges)) == expected
    frame = source.read(spark, dsn, ranges)
    assert sorted(tuple(row) for row in frame.collect()) == expected
    # at most the row groups that meet a range (p0: 1, 2, 3, 9 and the next segment's 0; p1:
    # 5; p2: 1; p3: the old segment whole), never the 2,400 rows the six files hold
    assert len(expected) <= _scanned_rows(frame) <= 5 * 100 + 100 + 100 + 200


def test_json_schema_segments_are_decoded_where_they_are_read(spark, conn, dsn, tmp_path):
    """File segments that declare their payloads' schema: the batch's read decodes them in
    the JVM (no from_json in the topology), corrupt payloads reach it as _corrupt_record,
    the spout refuses an oversized one, failed records replay decoded from the backflow, and
    the result equals the pure-Python recount; verify re-runs it equal."""

    import typed_tweets

    from onceflow.core.planner import PartitionRange
    from onceflow.ops.verify import rerun

    source = FileSegments(topic="typed_files", path=str(tmp_path / "seg"), partitions=2,
                          json_schema=typed_tweets.SCHEMA,
                          max_record_bytes=typed_tweets.MAX_RECORD_BYTES)
    pipeline = typed_tweets.pipeline("tweets_files", source)
    register(conn, pipeline, create_source=True)
    payloads = typed_tweets.payloads()
    # several segments per partition: the batches' ranges cross segment ends
    produce_segments(conn, source.root(), "typed_files", payloads, chunk_size=300)
    frame = source.read(spark, dsn, [PartitionRange(0, 0, 10)])
    assert "onceflow segments: 1 segment(s)" in frame._jdf.queryExecution().toString()
    assert frame.columns == ["partition", "offset", "url", "flaky", "_corrupt_record",
                             "_problem"]
    for n in range(4):  # flaky records fail once or twice, then count
        run_transaction(spark, dsn, conn, pipeline, f"run-{n}")
    rejected = dict(table(conn, "SELECT \"offset\", error FROM rejected_records "
                                "WHERE partition = 0"))
    assert rejected[5].startswith("oversized record (")  # payload 10: partition 0, offset 5
    assert rejected[15] == "malformed JSON"  # a wrongly typed field
    report = verify(conn, pipeline)
    assert report.ok, report.mismatches
    assert report.records + report.queued + report.dead == 1000
    replayed = table(conn, "SELECT sum(replayed) FROM transactions WHERE state = 'committed'")
    assert replayed[0][0] > 0  # flaky records came back from the backflow, decoded
    assert rerun(conn, dsn, pipeline, spark).ok


def _decoded_rows(spark, dsn, source, ranges, monkeypatch) -> list[tuple]:
    """The rows ``source`` reads for ``ranges`` in the JVM and in Python workers, checked
    equal, by offset."""
    out = []
    for jvm in ("1", "0"):
        monkeypatch.setenv("ONCEFLOW_JVM_READER", jvm)
        frame = source.read(spark, dsn, ranges)
        assert ("onceflow segments" in frame._jdf.queryExecution().toString()) == (jvm == "1")
        out.append(sorted(tuple(row) for row in frame.collect()))
    monkeypatch.delenv("ONCEFLOW_JVM_READER")
    assert out[0] == out[1]
    return out[0]


def test_the_jvm_and_python_segment_readers_decode_alike(spark, conn, dsn, tmp_path,
                                                         monkeypatch):
    """The decoding read of file segments gives, in the JVM and in Python workers, exactly
    the rows of the planned ranges (cut inside row groups and across segments, in an old
    one-row-group segment too), each payload decoded as json_records decodes a line: the
    rules' cases, an oversized payload and one with a NUL (refused by the spout, imported
    as they were exported)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_json_records import ALL, CASES

    from onceflow.core.planner import PartitionRange
    from onceflow.sources import segments

    monkeypatch.setattr(segments.write, "ROW_GROUP_ROWS", 7)
    root = tmp_path / "seg"
    source = FileSegments(topic="decoded", path=str(root), partitions=2, json_schema=ALL.ddl,
                          max_record_bytes=200)
    source.ensure(conn, create=True)
    cases = []  # (payload, its expected columns or None: corrupt)
    for line, want in CASES:
        try:
            if b"\n" not in line:
                cases.append((line.decode("utf-8"), want))
        except UnicodeDecodeError:  # a payload is text: bytes that are not UTF-8 never are
            pass
    payloads = [*(p for p, _ in cases), '{"s": "' + "x" * 300 + '"}', '{"s": "a\x00b"}', "",
                '{"i": 1}']
    n = len(payloads)
    segments.import_segments(conn, root, "decoded", pa.table({
        "partition": [0] * n + [1] * n, "offset": list(range(n)) * 2,
        "payload": payloads + payloads[::-1]}), chunk_size=n // 2)
    # partition 1's later segment rewritten as onceflow wrote segments before: one row group
    old = table(conn, "SELECT path FROM source_segments WHERE topic = 'decoded' "
                      "AND partition = 1 ORDER BY base_offset DESC LIMIT 1")[0][0]
    pq.write_table(pq.read_table(old), old, row_group_size=1 << 20)
    ranges = [PartitionRange(0, 0, n), PartitionRange(1, 3, n - 2)]
    rows = _decoded_rows(spark, dsn, source, ranges, monkeypatch)
    expected = []
    for r in ranges:
        lines = (payloads if r.partition == 0 else payloads[::-1])[r.start:r.end]
        columns, problems = ALL.decode([p.encode() for p in lines], 200)
        values = [columns[name].to_pylist() for name in [*ALL.names, "_corrupt_record"]]
        for i, offset in enumerate(range(r.start, r.end)):
            expected.append((r.partition, offset, *(v[i] for v in values),
                             problems[i].as_py()))
    assert rows == sorted(expected)
    # the cases' own verdicts hold (columns, _corrupt_record), and the refusals
    assert [row[-2] is None for row in rows[:len(cases)]] == \
        [want is not None for _, want in cases]
    assert rows[n - 4][-1].startswith("oversized record (") and "NUL" in rows[n - 3][-1]
    assert rows[n - 2][-2] == ""  # an empty payload is corrupt
    assert rows[n - 1][2:] == (None, None, None, None, 1, None, None, None, None, None, None)
    # an executor that does not see the segments root says so (the driver checks it first
    # where it reads the index, so the JVM reader is asked directly here)
    from onceflow.sources.jvm import SEGMENTS_READER

    spec = {"segments": [[str(tmp_path / "gone" / "decoded" / "p00000" / "0.parquet"), 0]],
            "wanted": [[0, 0, 1]], "columns": [["s", "string"]], "max_record_bytes": 200}
    with pytest.raises(Exception, match="FolderNotVisible: the folder '.*gone' is not visible"):
        spark.read.format(SEGMENTS_READER).option("spec", json.dumps(spec)).load().collect()
    # within the planned ranges only, across a segment's end
    half = n // 2
    assert [r[1] for r in _decoded_rows(spark, dsn, source, [PartitionRange(0, half - 2,
                                                                            half + 2)],
                                        monkeypatch)] == [half - 2, half - 1, half, half + 1]


def test_a_batch_is_searched_for_refusals_only_where_a_segment_may_hold_one(conn, tmp_path):
    """The writer records each segment's longest payload (none when one holds a NUL): a
    batch whose segments are all within max_record_bytes is not searched for records the
    spout refuses; a lower max_record_bytes, an imported NUL, or a segment written before
    (nothing recorded) makes it searched."""
    import dataclasses

    import pyarrow as pa

    from onceflow.core.planner import PartitionRange
    from onceflow.sources import segments

    root = tmp_path / "seg"
    source = FileSegments(topic="sized", path=str(root), partitions=2)
    source.ensure(conn, create=True)
    produce_segments(conn, root, "sized", ["é" * 10, "x" * 30, "y", "z"], chunk_size=2)
    segments.import_segments(conn, root, "sized", pa.table({
        "partition": [0, 1], "offset": [2, 2], "payload": ["ok", "a\x00b"]}))
    assert table(conn, """SELECT partition, base_offset, largest_bytes FROM source_segments
                          WHERE topic = 'sized' ORDER BY 1, 2""") == [
        (0, 0, 20), (0, 1, 1), (0, 2, 2), (1, 0, 30), (1, 1, 1), (1, 2, None)]

    def may_refuse(source, *ranges):
        with conn.cursor() as cur:
            return source.may_refuse(cur, [PartitionRange(*r) for r in ranges])

    assert not may_refuse(source, (0, 0, 3), (1, 0, 2))
    assert not may_refuse(source, (0, 0, 0), (1, 1, 1))  # empty ranges
    assert may_refuse(dataclasses.replace(source, max_record_bytes=25), (1, 0, 1))
    assert not may_refuse(dataclasses.replace(source, max_record_bytes=25), (0, 0, 3))
    assert may_refuse(source, (1, 1, 3))  # the imported NUL's segment
    with conn, conn.cursor() as cur:  # as a segment written before the column reads
        cur.execute("UPDATE source_segments SET largest_bytes = NULL "
                    "WHERE topic = 'sized' AND partition = 0 AND base_offset = 0")
    assert may_refuse(source, (0, 0, 1))
    conn.rollback()
