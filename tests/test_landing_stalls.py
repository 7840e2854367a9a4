"""Landed files a user gets wrong, each a stall that names the command that frees it: a file
removed after it was indexed, a Parquet file whose column has another type than declared,
and CSV that RFC 4180 allows (a quoted field holding a newline, an empty line). Each case is
run through the real phases (PostgreSQL, Spark), freed by the command status names, and its
committed counts checked against a count of the files the test wrote."""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_landing import clean, land

from helpers import run_transaction, table
from onceflow.core.errors import SourceChanged, is_permanent
from onceflow.core.planner import PartitionRange
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.ops.repair import repair
from onceflow.ops.status import pipeline_status, render
from onceflow.sources.landing import LandingFolder
from onceflow.spark.loop import run_batches


def _urls(lines: list[str]) -> Counter:
    return Counter(json.loads(line)["url"] for line in lines)


def _committed_urls(conn) -> Counter:
    return Counter(dict(table(conn, "SELECT key, value FROM url_counts")))


def _status(conn, pipeline) -> str:
    with conn.cursor() as cur:
        lines = render(pipeline_status(cur, pipeline.source, pipeline.name))
    conn.rollback()
    return "\n".join(lines)


@pytest.mark.parametrize("reader", ["jvm", "python"])
def test_a_removed_file_fails_in_one_line_and_status_points_to_repair(
        spark, conn, dsn, tmp_path, monkeypatch, reader):
    """A file removed after a batch committed part of one of its chunks: the next batch fails
    at once with one line naming the file (no JVM frames), status names `onceflow repair` for
    its txid, repair announces exactly the records it then records as a gap (the chunk's
    uncommitted part, not the whole chunk), and the pipeline then commits exactly what the
    files held up to the removal, and the file after it."""
    monkeypatch.setenv("ONCEFLOW_JVM_READER", "1" if reader == "jvm" else "0")
    folder = tmp_path / "gone"
    folder.mkdir()
    source = LandingFolder(topic=f"gone_{reader}", path=str(folder), chunk_bytes=4096)
    pipeline = get_pipeline("tweets", source=source, batch_size=150)
    register(conn, pipeline, create_source=True)
    first, second = clean(400, seed=21), clean(100, seed=22)
    a = land(folder, "a.jsonl", first, age_s=20)
    batch, result = run_transaction(spark, dsn, conn, pipeline, "run-1")
    assert result.status == "committed" and batch.records == 150
    [(chunk_first,)] = table(conn, "SELECT first_offset FROM landing_chunks WHERE "
                                   "first_offset <= 150 AND first_offset + records > 150")
    assert chunk_first < 150  # the fault: a chunk the pipeline committed part of
    land(folder, "b.jsonl", second, age_s=10)
    a.unlink()

    with pytest.raises(SourceChanged) as failed:
        run_batches(spark, dsn, pipeline)
    said = str(failed.value)
    assert said == (f"landed file '{a}' was removed before every batch reading it committed: "
                    "refused. `onceflow repair` says what changed and how to go on")
    assert is_permanent(failed.value)
    [(state, reason)] = table(conn, "SELECT t.state, a.reason FROM transactions t JOIN "
                                    "transaction_attempts a USING (pipeline, txid, attempt) "
                                    "WHERE t.txid = 2")
    assert state == "failed" and reason == said and "\n" not in reason

    status = _status(conn, pipeline)
    assert "-> onceflow repair --pipeline tweets (a landed file changed or was removed)" \
        in status
    assert "backfill" not in status

    report = repair(conn, pipeline)
    [found] = report.landed
    assert report.unresolved == 1 and found.problem == (
        f"landed file {a} (partition 0) changed: it was removed")
    assert found.choices[1] == (f"--skip-changed {a}: skip 250 record(s) of it no pipeline "
                                "committed (recorded as gaps: tweets [150, 400)) and stop "
                                "following it")
    done = repair(conn, pipeline, skip_changed=[a.name])
    assert done.landed[0].done.startswith("skipped: 250 record(s)")
    assert table(conn, "SELECT partition, from_offset, to_offset FROM offset_gaps") == [
        (0, 150, 400)]

    loop = run_batches(spark, dsn, pipeline)
    assert loop.committed[0] == 2
    assert table(conn, "SELECT state FROM transactions WHERE txid = 2") == [("committed",)]
    assert _committed_urls(conn) == _urls(first[:150]) + _urls(second)


def test_a_parquet_file_with_a_column_of_another_type_is_set_aside(spark, conn, dsn, tmp_path):
    """Declared ``n bigint``: a file whose n is a string, one whose n is a double (which
    Spark's Parquet reader refuses to read as bigint, so each would fail every try) are set
    aside at indexing naming the column, both types and the file, as a file with a missing
    column is; status and repair show them. A file whose n is int32 (which Spark widens) is
    read. The pipeline commits exactly the rows of the files it can read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "typed"
    folder.mkdir()
    source = LandingFolder(topic="pq_types", path=str(folder), format="parquet",
                           schema="url string, n bigint")
    pipeline = get_pipeline("tweets", source=source, batch_size=100)
    register(conn, pipeline, create_source=True)
    rows = {"good": (["https://a.example/1", "https://b.example/2"], pa.int64()),
            "as_string": (["https://c.example/3"], pa.string()),
            "as_double": (["https://d.example/4"], pa.float64()),
            "as_int32": (["https://e.example/5", "https://a.example/1"], pa.int32())}
    for age, (name, (urls, kind)) in enumerate(rows.items()):
        path = folder / f"{name}.parquet"
        values = [str(i) if kind == pa.string() else i for i in range(len(urls))]
        pq.write_table(pa.table({"url": urls, "n": pa.array(values, kind)}), path)
        when = time.time() - 20 + age
        os.utime(path, (when, when))
    # the fault: Spark's reader refuses such a file as declared (every try of a batch would)
    with pytest.raises(Exception, match="PARQUET_COLUMN_DATA_TYPE_MISMATCH"):
        spark.read.schema(source.schema).parquet(str(folder / "as_double.parquet")).collect()

    batch, result = run_transaction(spark, dsn, conn, pipeline, "run-1")
    assert result.status == "committed" and batch.records == 4
    assert run_transaction(spark, dsn, conn, pipeline, "run-2")[0].records == 0
    assert _committed_urls(conn) == Counter(rows["good"][0] + rows["as_int32"][0])
    string_why = ("column n is string in the file, declared bigint (Spark's Parquet reader "
                  "cannot read it as declared)")
    double_why = string_why.replace("is string", "is double")
    assert table(conn, "SELECT path, records, refused FROM landing_files ORDER BY file_no") == [
        (str(folder / "good.parquet"), 2, None),
        (str(folder / "as_string.parquet"), 0, string_why),
        (str(folder / "as_double.parquet"), 0, double_why),
        (str(folder / "as_int32.parquet"), 2, None)]
    status = " ".join(_status(conn, pipeline).split())
    assert (f"landed file {folder / 'as_string.parquet'} is set aside (it holds no record): "
            f"{string_why}") in status
    assert f"landed file {folder / 'as_double.parquet'} is set aside" in status
    assert "land a copy that matches source.schema under a new name" in status
    said = "\n".join(repair(conn, pipeline).lines())
    assert f"  - {folder / 'as_double.parquet'}: {double_why}" in said
    assert "set aside at indexing (nothing to repair" in said


def _payload_topology(pipeline=None):
    """Each record's payload counted as it is (url_counts), and every record (domain_counts
    under "records"): what the test then parses with Python's csv module."""
    from pyspark.sql import functions as F

    from onceflow import ANCHORS, SPOUT, Topology

    def bolt(records):
        return records.select(*ANCHORS, F.explode(F.array(
            F.struct(F.lit("payloads").alias("_stream"), F.col("payload").alias("key")),
            F.struct(F.lit("all").alias("_stream"), F.lit("records").alias("key")))
        ).alias("t")).select(*ANCHORS, "t.*")

    return (Topology("csv").bolt("keys", input=SPOUT, fn=bolt,
                                 outputs={"payloads": "key string", "all": "key string"})
            .count("payloads", "url_counts").count("all", "domain_counts"))


def _csv_rows(data: bytes) -> list[tuple[str, ...]]:
    """The oracle: Python's csv module over a file's bytes; an empty line is no row."""
    import csv
    import io

    return [tuple(row) for row in csv.reader(io.StringIO(data.decode(), newline="")) if row]


@pytest.mark.parametrize("reader", ["jvm", "python"])
def test_csv_records_follow_rfc_4180(spark, conn, dsn, tmp_path, monkeypatch, reader):
    """A CSV file whose quoted fields hold newlines (LF and CRLF), commas and quotes, with
    empty lines: each record is one payload whole (a quoted newline does not cut it), an
    empty line is no record, chunks end at record ends only. A record still being written
    (its quoted field open) waits, and status says so; once written it is read. Every
    committed payload parses, with Python's csv module, into one row, and the rows are
    exactly the file's (the header left out)."""
    monkeypatch.setenv("ONCEFLOW_JVM_READER", "1" if reader == "jvm" else "0")
    folder = tmp_path / "csv"
    folder.mkdir()
    source = LandingFolder(topic=f"csv_{reader}", path=str(folder), format="csv",
                           csv_header=True, chunk_bytes=48)
    pipeline = get_pipeline("tweets", source=source, topology=_payload_topology,
                            batch_size=3)
    register(conn, pipeline, create_source=True)
    body = ('id,note\r\n1,plain\n\n2,"a quoted, comma"\r\n3,"multi\nline note"\n\r\n'
            '4,"say ""hi"""\n5,"crlf\r\ninside, and\nmore lines\nthan a chunk holds"\n'
            '6,x"y\n')
    path = folder / "notes.csv"
    path.write_bytes(body.encode() + b'7,"still being')
    settle = time.time() - 120
    os.utime(path, (settle, settle))

    assert run_batches(spark, dsn, pipeline).records == 6
    ranges = [PartitionRange(0, 0, 6)]
    read = source.read(spark, dsn, ranges)
    assert ("onceflow JSON lines" in read._jdf.queryExecution().toString()) == \
        (reader == "jvm")  # the reader the test means
    payloads = [r.payload for r in read.orderBy("offset").collect()]
    assert payloads == [p for _, _, p in source.payloads(conn, ranges)]
    assert payloads[2] == '3,"multi\nline note"' and payloads[4].startswith('5,"crlf\r\n')
    chunks = table(conn, "SELECT byte_start, byte_end, records FROM landing_chunks "
                         "ORDER BY byte_start")
    data = path.read_bytes()
    assert len(chunks) > 2 and chunks[-1][1] == len(body.encode())
    for start, end, records in chunks:  # each chunk: whole records, as the csv module says
        assert len(_csv_rows(data[start:end])) == records
    status = " ".join(_status(conn, pipeline).split())
    assert f"landed file {path}: its last 14 bytes hold no whole record yet" in status

    with path.open("ab") as f:
        f.write(b'\nwritten"\n\n8,last\n')
    os.utime(path, (settle + 10, settle + 10))
    run_batches(spark, dsn, pipeline, run_prefix="after")
    rows = _csv_rows(path.read_bytes())[1:]
    assert len(rows) == 8 and rows[2] == ("3", "multi\nline note")
    committed = _committed_urls(conn)
    assert Counter({_csv_rows(k.encode())[0]: n for k, n in committed.items()}) == \
        Counter(rows)
    assert all(len(_csv_rows(k.encode())) == 1 for k in committed)
    assert table(conn, "SELECT value FROM domain_counts") == [(8,)]
    assert table(conn, "SELECT count(*) FROM rejected_records") == [(0,)]


_FIELDS = st.one_of(
    st.sampled_from(["", "1", "abc", "x y", 'q"uote', "é"]),
    st.text(st.sampled_from('ab,\n"\r '), max_size=6).map(
        lambda t: '"' + t.replace('"', '""') + '"'))
_RECORDS = st.one_of(st.sampled_from(["", "\r"]),
                     st.lists(_FIELDS, min_size=1, max_size=4).map(",".join))


@settings(max_examples=300, deadline=None)
@given(records=st.lists(_RECORDS, max_size=12), crlf=st.lists(st.booleans(), max_size=12),
       last=st.one_of(st.just(""), _RECORDS), header=st.booleans(), tail=st.booleans(),
       chunk_bytes=st.sampled_from([1, 7, 30, 4096]), cut=st.integers(0, 200))
def test_the_index_cuts_csv_into_whole_records(tmp_path_factory, records, crlf, last, header,
                                               tail, chunk_bytes, cut):
    """CSV is cut into chunks at record ends only, each counting the records Python's csv
    module finds in its bytes (an empty line is none), each with the CRC-32 of its bytes;
    the readers' records are those; a file indexed when only part of it was written, then
    on from where that stopped, holds the same records."""
    import zlib

    from onceflow.sources.landing.scan import _csv_records, csv_array, scan_csv
    from onceflow.sources.landing.storage import open_filesystem

    ends = ["\r\n" if i < len(crlf) and crlf[i] and r != "\r" else "\n"
            for i, r in enumerate(records)]
    data = ("".join(r + e for r, e in zip(records, ends, strict=True)) + last).encode()
    path = tmp_path_factory.mktemp("csv") / "f.csv"
    path.write_bytes(data)
    filesystem = open_filesystem(str(path))[0]
    scan = scan_csv(filesystem, str(path), 0, len(data), chunk_bytes, header=header,
                     tail=tail)
    got = []
    for _, start, end, count, _, crc in scan.chunks:
        piece = data[start:end]
        assert crc == zlib.crc32(piece) and count == len(_csv_rows(piece)) > 0
        assert csv_array(piece).to_pylist() == [r.decode() for r in _csv_records(piece)]
        got += [_csv_rows(r)[0] for r in _csv_records(piece)]
    assert scan.records == len(got)
    want = _csv_rows(data[:scan.indexed_to])
    assert got == (want[1:] if header else want)
    early = scan_csv(filesystem, str(path), 0, min(cut, len(data)), chunk_bytes,
                      header=header)
    later = scan_csv(filesystem, str(path), early.indexed_to, len(data), chunk_bytes,
                      header=header and early.indexed_to == 0, tail=tail)
    assert early.records + later.records == scan.records
