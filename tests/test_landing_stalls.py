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
from test_landing import clean, land

from helpers import run_transaction, table
from onceflow.core.errors import SourceChanged, is_permanent
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
