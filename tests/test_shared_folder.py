"""A source's folder must be the same folder on every machine that reads it
(docs/deployment.md): an Airflow worker or a Spark executor where it is missing fails the
batch saying so, naming the folder and the rule, not with a bare file-not-found. On one
machine, "missing on this machine" is the folder moved away after the batch was planned; a
file removed from a folder that is there is refused for repair (tests/test_landing.py)."""

from __future__ import annotations

import re

import pytest
from test_landing import land

from helpers import table
from onceflow.core.begin import begin
from onceflow.core.registration import register
from onceflow.core.registry import get_pipeline
from onceflow.sources.folders import FolderNotVisible
from onceflow.sources.landing import LandingFolder
from onceflow.sources.segments import FileSegments, produce_segments
from tweets_example.data import generate

RULE = (r"the folder '(?P<folder>[^']+)' is not visible here \(host [^)]+\): every Airflow "
        r"worker and Spark executor must see the same folder \(see docs/deployment.md\)")


@pytest.fixture
def landed(conn, tmp_path):
    folder = tmp_path / "landing"
    folder.mkdir()
    pipeline = get_pipeline("tweets", batch_size=500, source=LandingFolder(
        topic="shared_tweets", path=str(folder), partitions=2, chunk_bytes=4096))
    register(conn, pipeline, create_source=True)
    land(folder, "a.jsonl", list(generate(300, seed=31)))
    return pipeline, folder


def test_a_worker_without_the_landing_folder_cannot_begin(conn, landed):
    pipeline, folder = landed
    folder.rename(folder.with_name("elsewhere"))
    with pytest.raises(FolderNotVisible, match=RULE) as raised:
        begin(conn, pipeline, "run-1")
    assert re.search(RULE, str(raised.value))["folder"] == str(folder)
    assert str(raised.value).startswith(f"source.path={str(folder)!r}: ")


@pytest.mark.parametrize("reader", ["jvm", "python"])
def test_a_spark_executor_without_the_landing_folder_fails_the_batch(spark, conn, dsn, landed,
                                                                     monkeypatch, reader):
    """The executors' readers (onceflow's JVM reader, the Python one) check the folder when a
    file is not found: the batch fails naming the folder, nothing is staged."""
    from onceflow.sources.jvm import jvm_reader
    from onceflow.spark.processing import process_batch

    if reader == "python":
        monkeypatch.setenv("ONCEFLOW_JVM_READER", "off")
    assert jvm_reader(spark) == (reader == "jvm")
    pipeline, folder = landed
    batch = begin(conn, pipeline, "run-1")
    assert batch.records == 300
    folder.rename(folder.with_name("elsewhere"))
    with pytest.raises(Exception) as raised:  # noqa: B017 (Spark's wrapper of the executor's)
        process_batch(spark, dsn, pipeline, batch.attempt)
    found = re.search(RULE, str(raised.value))
    assert found and found["folder"] == str(folder), str(raised.value)[-2000:]
    assert "was removed" not in str(raised.value)
    assert table(conn, "SELECT count(*) FROM staged_groups") == [(0,)]


def test_a_worker_without_the_segments_root_fails_the_batch(spark, conn, dsn, tmp_path):
    from onceflow.spark.processing import process_batch

    root = tmp_path / "segments"
    pipeline = get_pipeline("tweets_files", batch_size=700, source=FileSegments(
        topic="tweets_files", path=str(root)))
    register(conn, pipeline, create_source=True)
    produce_segments(conn, root, "tweets_files", generate(300, seed=32), chunk_size=100)
    batch = begin(conn, pipeline, "run-1")
    root.rename(tmp_path / "elsewhere")
    with pytest.raises(FolderNotVisible, match=RULE) as raised:
        process_batch(spark, dsn, pipeline, batch.attempt)
    assert re.search(RULE, str(raised.value))["folder"] == str(root)
    # the failed records' payloads and verify read the files in Python: the same refusal
    with pytest.raises(FolderNotVisible, match=RULE):
        list(pipeline.source.payloads(conn, batch.ranges_of(0)))
    conn.rollback()
    assert table(conn, "SELECT count(*) FROM staged_groups") == [(0,)]
