"""The landing-folder source: files dropped into a folder, indexed in arrival order, read
exactly once; half-written, changed and removed files handled loudly."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from helpers import run_transaction, table
from onceflow.core.begin import begin
from onceflow.core.errors import ConfigError
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.ops.verify import recount, rerun
from onceflow.sources.landing import LandingFolder
from tweets_example.data import generate


def land(folder: Path, name: str, payloads: list[str], *, age_s: float = 5.0) -> Path:
    """Write a file the documented way: a temporary name, then a rename into place; then make
    it look settled (older than settle_s)."""
    tmp = folder / f".{name}.tmp"
    tmp.write_text("".join(p + "\n" for p in payloads))
    path = folder / name
    tmp.rename(path)
    when = time.time() - age_s
    os.utime(path, (when, when))
    return path


@pytest.fixture
def landed(conn, tmp_path):
    folder = tmp_path / "landing"
    folder.mkdir()
    source = LandingFolder(topic="landed_tweets", path=str(folder), partitions=2,
                           chunk_bytes=4096)
    pipeline = get_pipeline("tweets", source=source, batch_size=500)
    register(conn, pipeline, create_source=True)
    return pipeline, folder


def test_files_are_read_in_arrival_order_exactly_once(spark, conn, dsn, landed):
    pipeline, folder = landed
    first = list(generate(600, seed=1))
    land(folder, "a.jsonl", first[:300], age_s=20)
    land(folder, "b.jsonl", first[300:], age_s=10)
    (folder / ".c.jsonl.tmp").write_text("not yet\n")  # a file being written: never read
    (folder / "_SUCCESS").write_text("")
    batch, result = run_transaction(spark, dsn, conn, pipeline, "run-1")
    assert result.status == "committed" and batch.records == 500
    files = table(conn, """SELECT file_no, partition, path, records, base_offset
                           FROM landing_files ORDER BY file_no""")
    assert [(n, p, Path(f).name, r, b) for n, p, f, r, b in files] == [
        (0, 0, "a.jsonl", 300, 0), (1, 1, "b.jsonl", 300, 0)]
    # a file lands while the pipeline runs, another is still settling (just written)
    more = list(generate(200, seed=2))
    land(folder, "c.jsonl", more[:100])
    land(folder, "d.jsonl", more[100:], age_s=-3600)  # written "just now": not settled
    batch, _ = run_transaction(spark, dsn, conn, pipeline, "run-2")
    assert batch.records == 200  # the rest of a and b, and c; not d yet
    os.utime(folder / "d.jsonl", (time.time() - 5, time.time() - 5))
    batch, _ = run_transaction(spark, dsn, conn, pipeline, "run-3")
    assert batch.records == 100
    report = recount(conn, pipeline)
    assert report.ok, report.mismatches
    assert report.records + report.queued + report.dead == 800
    assert rerun(conn, dsn, pipeline, spark).ok


@pytest.mark.parametrize("policy", ["earliest", "latest"])
def test_a_begin_indexes_what_its_batch_needs_and_leaves_the_rest(conn, tmp_path, policy):
    """A backlog of files: a begin indexes them in arrival order in steps of 1, 2, 4, ...
    files until its batch is full, and a later look (status, the next begins) the rest.
    A first batch whose start the head decides (start_policy latest) indexes them all."""
    folder = tmp_path / "backlog"
    folder.mkdir()
    source = LandingFolder(topic="backlog", path=str(folder), chunk_bytes=4096)
    pipeline = get_pipeline("tweets", source=source, batch_size=150, start_policy=policy)
    register(conn, pipeline, create_source=True)
    for i in range(5):
        land(folder, f"{i}.jsonl", list(generate(100, seed=i)), age_s=50 - i)

    def indexed():
        return table(conn, "SELECT path FROM landing_files ORDER BY file_no")

    batch = begin(conn, pipeline, "run-1")
    if policy == "latest":
        assert batch.records == 0 and len(indexed()) == 5
        return
    assert batch.records == 150
    assert [Path(p).name for p, in indexed()] == ["0.jsonl", "1.jsonl", "2.jsonl"]
    assert begin(conn, pipeline, "run-2").records == 150  # what was indexed sufficed
    assert len(indexed()) == 3
    with conn.cursor() as cur:  # what status, alerts and retention see: everything landed
        assert source.positions(cur)[0].head == 500
    conn.commit()
    assert [Path(p).name for p, in indexed()] == [f"{i}.jsonl" for i in range(5)]


def test_a_changed_file_is_refused_loudly(spark, conn, dsn, landed):
    pipeline, folder = landed
    path = land(folder, "a.jsonl", list(generate(100, seed=3)))
    run_transaction(spark, dsn, conn, pipeline, "run-1")
    with open(path, "a") as f:
        f.write(json.dumps({"url": "https://late.example/x"}) + "\n")
    os.utime(path, (time.time() - 5, time.time() - 5))
    with pytest.raises(ConfigError, match=r"a.jsonl' changed after it was indexed .* landed "
                                          r"files must never change"):
        begin(conn, pipeline, "run-2")


def test_a_removed_file_fails_the_batch_that_reads_it(spark, conn, dsn, landed):
    from spark_tasks.processing import process_batch

    pipeline, folder = landed
    path = land(folder, "a.jsonl", list(generate(100, seed=4)))
    batch = begin(conn, pipeline, "run-1")
    path.unlink()
    with pytest.raises(Exception, match="was removed before every batch reading it committed"):
        process_batch(spark, dsn, pipeline, batch.attempt)
    assert table(conn, "SELECT count(*) FROM staged_groups") == [(0,)]


def test_a_folder_that_does_not_exist_is_refused(conn, tmp_path):
    pipeline = get_pipeline("tweets", source=LandingFolder(
        topic="nowhere", path=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="source.path=.*: the folder .* is not visible here"):
        register(conn, pipeline, create_source=True)


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_parquet_file_of_another_schema_is_set_aside_or_stops(spark, conn, dsn, tmp_path,
                                                                policy):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "pq"
    folder.mkdir()
    source = LandingFolder(topic=f"pq_{policy}", path=str(folder), format="parquet",
                           schema="url string", on_mismatch=policy)
    pipeline = get_pipeline("tweets", source=source, batch_size=100)
    register(conn, pipeline, create_source=True)
    good, bad = folder / "good.parquet", folder / "bad.parquet"
    pq.write_table(pa.table({"url": ["https://a.example/1", "https://b.example/2"]}), good)
    pq.write_table(pa.table({"link": ["https://c.example/3"]}), bad)
    past = time.time() - 10
    os.utime(good, (past - 1, past - 1))
    os.utime(bad, (past, past))
    if policy == "stop":
        with pytest.raises(ConfigError, match=r"bad.parquet' does not match source.schema "
                                              r"\(missing column\(s\) \['url'\]\)"):
            begin(conn, pipeline, "run-1")
        return
    batch, result = run_transaction(spark, dsn, conn, pipeline, "run-1")
    assert result.status == "committed" and batch.records == 2
    assert dict(table(conn, "SELECT key, value FROM url_counts")) == {
        "https://a.example/1": 1, "https://b.example/2": 1}
    assert table(conn, "SELECT refused FROM landing_files WHERE path LIKE %s",
                 ("%bad.parquet",)) == [("missing column(s) ['url']",)]


def test_an_empty_batch_commits_nothing_and_moves_nothing(spark, conn, dsn, landed):
    pipeline, _ = landed
    batch, result = run_transaction(spark, dsn, conn, pipeline, "run-1")
    assert batch.records == 0 and result.status == "committed" and result.rows_applied == 0


def test_lines_are_cut_in_spark_as_python_cuts_them(spark, conn, dsn, landed):
    """The JVM cuts each chunk into records; the Python reader (used by verify and the
    backflow) must see the same records at the same offsets: CRLF, empty lines, bytes that
    are not UTF-8, a last line without a newline, chunks cut mid-file, a range that starts
    and ends inside chunks."""
    from onceflow.core.planner import PartitionRange

    pipeline, folder = landed
    lines = [f'{{"n": {i}, "pad": "{"x" * (i % 97)}"}}'.encode() for i in range(400)]
    lines[3] = b""
    lines[5] = b'{"n": 5, "bad": "\xff\xfe"}'
    lines[7] = b"\xc3"  # a truncated two-byte sequence
    data = b"".join(line + (b"\r\n" if i % 3 == 0 else b"\n") for i, line in enumerate(lines))
    path = folder / "mixed.jsonl"
    path.write_bytes(data + b'{"n": "last, no newline"}\r')
    os.utime(path, (time.time() - 5, time.time() - 5))
    source = pipeline.source
    with conn, conn.cursor() as cur:
        source.positions(cur)
        assert table(conn, "SELECT count(*) FROM landing_chunks")[0][0] > 3  # cut mid-file
    ranges = [PartitionRange(0, 2, 390)]
    read = [tuple(r) for r in source.read(spark, dsn, ranges).orderBy("offset").collect()]
    expected = [(0, o, line) for o, line in enumerate(
        data.decode("utf-8", errors="replace").replace("\r\n", "\n").split("\n"))][2:390]
    assert read == expected == list(source.payloads(conn, ranges))
    assert read[3][2] == '{"n": 5, "bad": "\ufffd\ufffd"}' and read[5][2] == "\ufffd"
    last = source.read(spark, dsn, [PartitionRange(0, 398, 401)]).orderBy("offset").collect()
    assert [r.payload for r in last] == [lines[398].decode(), lines[399].decode(),
                                         '{"n": "last, no newline"}']


def test_a_batch_of_clean_chunks_is_not_searched_for_refusals(conn, tmp_path):
    """The index marks the chunks whose records the spout cannot refuse; a batch of them only
    is not searched for refusals, unless max_record_bytes shrank since they were indexed."""
    import dataclasses

    from onceflow.core.planner import PartitionRange

    folder = tmp_path / "refusals"
    folder.mkdir()
    source = LandingFolder(topic="refusals", path=str(folder), chunk_bytes=32,
                           max_record_bytes=20)
    register(conn, get_pipeline("tweets", source=source), create_source=True)
    land(folder, "a.jsonl", ["short"] * 20)  # offsets 0-19
    land(folder, "b.jsonl", ["ok", "x" * 21, "ok"])  # 20-22: one chunk, a line over 20 bytes
    land(folder, "c.jsonl", ["ok", "nul\0", "ok"])  # 23-25: a NUL
    with conn.cursor() as cur:
        assert source.positions(cur)[0].head == 26
        assert not source.may_refuse(cur, [PartitionRange(0, 0, 20)])
        assert source.may_refuse(cur, [PartitionRange(0, 19, 21)])
        assert source.may_refuse(cur, [PartitionRange(0, 0, 10), PartitionRange(0, 25, 26)])
        assert not source.may_refuse(cur, [PartitionRange(0, 5, 5)])
        smaller = dataclasses.replace(source, max_record_bytes=10)
        assert smaller.may_refuse(cur, [PartitionRange(0, 0, 20)])
        larger = dataclasses.replace(source, max_record_bytes=30)
        assert not larger.may_refuse(cur, [PartitionRange(0, 0, 20)])
    conn.rollback()


def _clean_to(chunk: bytes, limit: int) -> int | None:
    """What the index must say of a chunk's bytes: ``limit`` when every line (its newline
    not counted, a CR counted) is at most ``limit`` bytes, no byte is NUL and all is UTF-8."""
    lines = chunk.split(b"\n")
    if chunk.endswith(b"\n"):
        lines.pop()
    try:
        chunk.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if b"\0" in chunk or any(len(line) > limit for line in lines):
        return None
    return limit


def _sampled_print(data: bytes) -> str:
    """What a file's fingerprint must be: SHA-256 of its size and first and last 64 KiB."""
    import hashlib

    sample = 64 << 10
    ends = data[:sample] + (data[-sample:] if len(data) > sample else b"")
    return hashlib.sha256(b"%d\n" % len(data) + ends).hexdigest()


def test_a_landed_files_fingerprint_is_its_size_and_ends(tmp_path):
    """A text file read in many blocks (the last one short) and a Parquet file read by row
    group get the same fingerprint as a plain hash of their size and ends; a file that
    differs only in its last byte, or only in its length, gets another."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from onceflow.sources.landing import _filesystem, _fingerprint

    lines = b"".join(b'{"n": %d, "pad": "%s"}\n' % (i, b"x" * (i % 97)) for i in range(5000))
    assert len(lines) > 3 * (64 << 10)
    prints = set()
    for name, data in (("a", lines), ("b", lines[:-2] + b"!\n"), ("c", lines + lines[-40:])):
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(data)
        got, records, _ = _fingerprint(_filesystem(str(path))[0], str(path), 7001, "jsonl",
                                       False)
        assert got == _sampled_print(data) and records == data.count(b"\n")
        prints.add(got)
    assert len(prints) == 3
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"n": list(range(50_000))}), path, row_group_size=20_000)
    got, rows, groups = _fingerprint(_filesystem(str(path))[0], str(path), 1 << 20, "parquet",
                                     False)
    assert got == _sampled_print(path.read_bytes()) and rows == 50_000 and len(groups) == 3


@settings(max_examples=400, deadline=None)
@given(lines=st.lists(st.one_of(  # mostly clean text, sometimes any bytes
    st.text("ab\r\u00e9\U0001f600", max_size=12).map(str.encode),
    st.binary(max_size=12).map(lambda b: b.replace(b"\n", b""))), max_size=30),
       last_newline=st.booleans(), header=st.booleans(), chunk_bytes=st.integers(1, 40),
       limit=st.integers(1, 14))
@example(lines=[b"ab", b"caf\xc3", b"\xa9!", b"12345678"], last_newline=True, header=False,
         chunk_bytes=4, limit=8)  # a character cut by a block, then a line at the limit
@example(lines=[b"h", b"a\x00", b"abcdefghi"], last_newline=False, header=True, chunk_bytes=3,
         limit=8)  # a NUL, then a last line over the limit without a newline
@example(lines=[b"abc\r", b"abcdefg"], last_newline=True, header=False, chunk_bytes=40,
         limit=3)  # a CR counts
def test_the_index_cuts_a_file_into_whole_lines(tmp_path_factory, lines, last_newline, header,
                                                chunk_bytes, limit):
    """A file's chunks cover it from the first record (after the header) to the end, each
    cut after a newline (but the last), each counting the records its bytes hold, each
    marked clean (up to ``limit`` bytes a line, no NUL, UTF-8) exactly when it is."""
    from onceflow.sources.landing import _filesystem, _fingerprint, _lines

    data = b"\n".join(lines) + (b"\n" if last_newline and lines else b"")
    path = tmp_path_factory.mktemp("index") / "f.jsonl"
    path.write_bytes(data)
    digest, records, chunks = _fingerprint(_filesystem(str(path))[0], str(path), chunk_bytes,
                                           "jsonl", header, limit)
    assert digest == _sampled_print(data)
    body = data.split(b"\n", 1)[1] if header and b"\n" in data else b"" if header else data
    first_byte = len(data) - len(body)
    assert records == len(_lines(body))
    expected_first, expected_start = 0, first_byte
    for first, start, end, count, clean_to in chunks:
        assert (first, start) == (expected_first, expected_start)
        assert end > start and (end == len(data) or data[end - 1:end] == b"\n")
        assert count == len(_lines(data[start:end]))
        assert clean_to == _clean_to(data[start:end], limit), data[start:end]
        expected_first, expected_start = first + count, end
    assert (expected_first, expected_start) == (records, len(data) if body else first_byte)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=60).map(lambda b: b.replace(b"a", b"\n").replace(b"b", b"\r")))
@example(data=b"x\r\r\n")  # a last line ending in CR, then CRLF: one CR goes
def test_decoded_lines_are_cut_as_payload_lines(data):
    """A decoding reader cuts the bytes into the same lines as the payload reader."""
    from onceflow.sources.landing import _line_bytes, _lines

    assert [line.decode("utf-8", "replace") for line in _line_bytes(data)] == _lines(data)


def test_json_schema_records_are_decoded_where_they_are_read(spark, conn, dsn, tmp_path):
    """A landing folder that declares its records' schema: the topology reads typed columns
    (no from_json), corrupt lines reach it as _corrupt_record, the spout refuses oversized
    lines, failed records replay decoded from the backflow, and the result equals the
    pure-Python recount; verify re-runs it equal. (On these tweets the decoder's rules and
    Spark's from_json, which the recount states, agree.)"""
    from tweets_example.topology import SCHEMA

    folder = tmp_path / "typed"
    folder.mkdir()
    source = LandingFolder(topic="typed_tweets", path=str(folder), partitions=2,
                           chunk_bytes=8192, json_schema=SCHEMA, max_record_bytes=4096)
    pipeline = get_pipeline("tweets", source=source, batch_size=700,
                            topology="tweets_example.topology:topology_typed")
    register(conn, pipeline, create_source=True)
    payloads = list(generate(1000, seed=11, malformed_share=0.05, poison_share=0.01,
                             flaky_share=0.03))
    payloads[10] = json.dumps({"url": "https://big.example/" + "x" * 5000})
    payloads[30] = json.dumps({"url": "https://typed.example/1", "flaky": "one"})
    land(folder, "a.jsonl", payloads[:600], age_s=20)
    land(folder, "b.jsonl", payloads[600:], age_s=10)
    for n in range(4):  # flaky records fail once or twice, then count
        run_transaction(spark, dsn, conn, pipeline, f"run-{n}")
    rejected = dict(table(conn, "SELECT \"offset\", error FROM rejected_records "
                                "WHERE partition = 0"))
    assert rejected[10].startswith("oversized record (")
    assert rejected[30] == "malformed JSON"  # a wrongly typed field
    report = recount(conn, pipeline)
    assert report.ok, report.mismatches
    assert report.records + report.queued + report.dead == 1000
    replayed = table(conn, "SELECT sum(replayed) FROM transactions WHERE state = 'committed'")
    assert replayed[0][0] > 0  # flaky records came back from the backflow, decoded
    assert rerun(conn, dsn, pipeline, spark).ok
