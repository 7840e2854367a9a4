"""The landing-folder source: files dropped into a folder, indexed in arrival order, read
exactly once; half-written, changed and removed files handled loudly."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from psycopg2 import sql

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


def clean(count: int, seed: int) -> list[str]:
    """Tweets the pipeline counts whole: none malformed, poisoned or flaky."""
    return list(generate(count, seed=seed, malformed_share=0, poison_share=0, flaky_share=0))


def settled(*paths: Path, age_s: float = 5.0) -> None:
    """Make files look untouched for ``age_s`` seconds (older than settle_s)."""
    for path in paths:
        when = time.time() - age_s
        os.utime(path, (when, when))


def counted(conn, state: str = "url_counts") -> tuple[Counter, int]:
    """What the pipeline committed: its URL counts (the table ``state``), and its committed
    records."""
    urls = Counter(dict(table(conn, sql.SQL("SELECT key, value FROM {}").format(
        sql.Identifier(state)))))
    records = table(conn, "SELECT coalesce(sum(records), 0) FROM transactions "
                          "WHERE state = 'committed'")[0][0]
    return urls, records


def outside_count(*paths: Path) -> tuple[Counter, int]:
    """The oracle, from the files themselves: the URL of every complete line, and how many."""
    lines = [line for path in paths for line in path.read_bytes().split(b"\n")[:-1]]
    return Counter(json.loads(line)["url"] for line in lines), len(lines)


def drain(spark, dsn, conn, pipeline, prefix: str, most: int = 8) -> list[int]:
    """Run transactions until one reads nothing new; their record counts."""
    out = []
    for n in range(most):
        batch, result = run_transaction(spark, dsn, conn, pipeline, f"{prefix}-{n}")
        assert result.status == "committed"
        out.append(batch.records)
        if not batch.records:
            return out
    raise AssertionError(f"still reading after {most} transactions: {out}")


def test_a_file_written_directly_is_read_whole_once_complete(spark, conn, dsn, landed):
    """A producer writes a file in place (no temporary name) and pauses mid-line: a batch
    reads its complete lines only; once the rest is written, the next batch reads the rest,
    from the torn line on. No record is refused, split or lost."""
    pipeline, folder = landed
    data = "".join(line + "\n" for line in clean(700, seed=5)).encode()
    cut = data.index(b"\n", len(data) // 2) + 40  # inside a line, past the middle
    path = folder / "direct.jsonl"
    path.write_bytes(data[:cut])
    settled(path)  # the producer paused longer than settle_s
    batch, _ = run_transaction(spark, dsn, conn, pipeline, "run-1")
    assert batch.records == data[:cut].count(b"\n")
    assert table(conn, "SELECT indexed_to FROM landing_files") == [(data.rindex(b"\n", 0, cut)
                                                                     + 1,)]
    with open(path, "ab") as f:
        f.write(data[cut:])
    settled(path)
    assert [batch.records, *drain(spark, dsn, conn, pipeline, "run-2")] == [
        data[:cut].count(b"\n"), data[cut:].count(b"\n"), 0]
    assert counted(conn) == outside_count(path)
    assert table(conn, "SELECT count(*) FROM rejected_records") == [(0,)]
    report = recount(conn, pipeline)
    assert report.ok and report.records == 700, report.mismatches


def test_a_file_that_grows_is_read_on_at_later_offsets(spark, conn, dsn, landed):
    """Appended lines are new records at the next offsets of the file's partition, after
    files that landed meanwhile; a file touched only (another modification time) is the same
    file: nothing new, nothing refused."""
    from onceflow.core.planner import PartitionRange

    pipeline, folder = landed  # two partitions: a and c go to 0, b to 1
    a = land(folder, "a.jsonl", clean(100, seed=1), age_s=30)
    b = land(folder, "b.jsonl", clean(100, seed=2), age_s=20)
    assert drain(spark, dsn, conn, pipeline, "first") == [200, 0]
    c = land(folder, "c.jsonl", clean(50, seed=3), age_s=10)
    more = clean(30, seed=4)
    with open(a, "a") as f:
        f.write("".join(line + "\n" for line in more))
    settled(a, age_s=5)  # a grew after c landed
    settled(b, age_s=7)  # b was touched
    assert drain(spark, dsn, conn, pipeline, "then") == [80, 0]
    assert table(conn, """SELECT c.first_offset, c.records FROM landing_chunks c
                          JOIN landing_files f USING (topic, file_no)
                          WHERE f.path = %s ORDER BY c.byte_start""", (str(a),))[-1] == (150, 30)
    assert table(conn, "SELECT path, records, changed FROM landing_files ORDER BY file_no") == [
        (str(a), 130, None), (str(b), 100, None), (str(c), 50, None)]
    assert [p for _, _, p in pipeline.source.payloads(conn, [PartitionRange(0, 150, 180)])] \
        == more
    assert counted(conn) == outside_count(a, b, c)


def test_files_that_grow_while_batches_run_are_counted_whole(spark, conn, dsn, tmp_path):
    """A producer thread appends to two log files in place (no temporary name), each round
    ending inside a line, while transactions commit; at the end the committed records are
    the files' lines, counted here, none refused. (GROWING_LINES, GROWING_BATCH,
    GROWING_ROUNDS: a larger run; it prints its figures.)"""
    import threading

    folder = tmp_path / "logs"
    folder.mkdir()
    source = LandingFolder(topic="growing", path=str(folder), partitions=2, chunk_bytes=8192,
                           settle_s=0.0)
    pipeline = get_pipeline("tweets", source=source,
                            batch_size=int(os.environ.get("GROWING_BATCH", "600")))
    register(conn, pipeline, create_source=True)
    total = int(os.environ.get("GROWING_LINES", "2000"))
    rounds = int(os.environ.get("GROWING_ROUNDS", "4"))
    lines = [(line + "\n").encode() for line in clean(total, seed=12)]
    logs = [folder / "0.log", folder / "1.log"]
    ahead = threading.Semaphore(1)  # the producer runs at most a round ahead of the batches
    failed: list[BaseException] = []

    def produce() -> None:
        try:
            handles = [open(path, "ab", buffering=0) for path in logs]  # noqa: SIM115
            held = [b"", b""]  # the rest of a line a round ended inside
            for r in range(rounds):
                ahead.acquire(timeout=600)
                share = lines[r * total // rounds:(r + 1) * total // rounds]
                for n, f in enumerate(handles):
                    mine = b"".join(share[n::2])
                    cut = len(mine) - len(share[n::2][-1]) // 2 if r < rounds - 1 else len(mine)
                    f.write(held[n] + mine[:cut])
                    held[n] = mine[cut:]
            for f in handles:
                f.close()
        except BaseException as error:  # noqa: BLE001 (the test thread re-raises it)
            failed.append(error)

    producer = threading.Thread(target=produce, name="producer")
    producer.start()
    during = []
    while producer.is_alive() or not during:
        batch, result = run_transaction(spark, dsn, conn, pipeline, f"during-{len(during)}")
        assert result.status == "committed"
        during.append(batch.records)
        ahead.release()
    producer.join()
    assert not failed, failed
    after = drain(spark, dsn, conn, pipeline, "after", most=2 + total // pipeline.batch_size)
    urls, _ = counted(conn)
    oracle, count = outside_count(*logs)
    print(f"GROWING: {count} lines written by the producer (counted in the files), "
          f"{sum(urls.values())} records committed, {len(during)} transactions while it "
          f"wrote ({sum(during)} records), {len(after)} after ({sum(after)})")
    assert count == total and urls == oracle and sum(urls.values()) == total
    assert sum(1 for n in during if n) >= 2  # batches committed while the files grew
    assert table(conn, "SELECT count(*) FROM rejected_records") == [(0,)]
    assert table(conn, "SELECT count(*) FROM landing_files WHERE changed IS NOT NULL") \
        == [(0,)]


def test_a_last_line_without_its_newline_waits_and_status_names_it(conn, tmp_path):
    """The bytes after a file's last newline are not read while they wait for it; status names
    the file once it has waited a minute; with ``unterminated_s`` the line is read as a
    record once its file has been unmodified that long."""
    import re

    from onceflow.core.planner import PartitionRange

    folder = tmp_path / "tails"
    folder.mkdir()
    source = LandingFolder(topic="tails", path=str(folder), settle_s=0.0)
    register(conn, get_pipeline("tweets", source=source), create_source=True)
    path = folder / "a.jsonl"
    path.write_bytes(b'{"n": 1}\n{"n": 2}\n{"n": 3')
    settled(path, age_s=120)
    with conn.cursor() as cur:
        assert source.positions(cur)[0].head == 2
        [(what, fix)] = source.notices(cur, "tweets")
    conn.commit()
    assert re.fullmatch(re.escape(f"landed file {path}: its last 7 bytes have no newline yet "
                                  "(unmodified for ") + r"12\ds\): they are not read", what)
    assert fix.startswith("if the file is complete, append a newline to it")
    later = dataclasses.replace(source, unterminated_s=60.0)
    with conn.cursor() as cur:
        assert later.positions(cur)[0].head == 3
        assert later.notices(cur, "tweets") == []
    conn.commit()
    assert [p for *_, p in later.payloads(conn, [PartitionRange(0, 0, 3)])] == [
        '{"n": 1}', '{"n": 2}', '{"n": 3']


def test_a_changed_file_is_held_back_until_it_is_as_indexed_again(conn, landed):
    """A file that shrank is marked changed and its unread records are not planned; written
    back as it was (another modification time), it is the indexed file again."""
    pipeline, folder = landed
    path = land(folder, "a.jsonl", clean(300, seed=6))
    data = path.read_bytes()
    assert begin(conn, pipeline, "run-1").records == 300  # a batch of 500 plans all of it
    source = pipeline.source
    path.write_bytes(data[:1000])  # truncated
    settled(path, age_s=3)
    with conn.cursor() as cur:
        source.positions(cur)
        assert source.held_back(cur, {0: 0}) == {0: 0}
        assert source.held_back(cur, {0: 300}) == {}  # read already: nothing held back
    conn.commit()
    assert table(conn, "SELECT changed FROM landing_files") == [
        (f"it shrank to 1000 bytes; {len(data)} bytes of it were indexed",)]
    path.write_bytes(data)
    settled(path, age_s=2)
    with conn.cursor() as cur:
        source.positions(cur)
        assert source.held_back(cur, {0: 0}) == {}
    conn.commit()
    assert table(conn, "SELECT changed, size FROM landing_files") == [(None, len(data))]


PIPES = """
from helpers import another
from onceflow.sources.landing import LandingFolder
from tweets_example.pipelines import TWEETS

PIPE = another(TWEETS, "landed_tweets", batch_size=300, source=LandingFolder(
    topic="rewritten", path={folder!r}, chunk_bytes=4096))
"""


@pytest.mark.parametrize("how", ["accept", "skip"])
def test_a_rewritten_file_stops_nothing_but_itself_and_repair_moves_on(
        spark, conn, dsn, tmp_path, monkeypatch, capsys, how):
    """A landed file is rewritten after a batch read part of it: its first 400 lines as they
    were, 100 new ones after. The next batches read nothing more of its partition (the file
    behind it waits too), status names it and the command that fixes it, repair says what
    changed and exits 1 without a choice; --accept-changed reads the file as it is now,
    --skip-changed skips its unread rest (a recorded gap). The committed counts then match
    the files' lines, counted here."""
    from onceflow.cli import main
    from onceflow.core.registry import clear_cache, get_pipeline

    folder = tmp_path / "rewritten"
    folder.mkdir()
    (tmp_path / f"landed_pipes_{how}.py").write_text(PIPES.format(folder=str(folder)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ONCEFLOW_PIPELINES", f"landed_pipes_{how}:PIPE")
    clear_cache()
    pipeline = get_pipeline("landed_tweets")
    register(conn, pipeline, create_source=True)
    old = clean(600, seed=7)
    a = land(folder, "a.jsonl", old, age_s=30)
    batch, _ = run_transaction(spark, dsn, conn, pipeline, "run-1")
    assert batch.records == 300
    b = land(folder, "b.jsonl", clean(100, seed=8), age_s=20)  # behind a, in its partition
    a.write_text("".join(line + "\n" for line in old[:400] + clean(100, seed=9)))
    settled(a, age_s=10)
    assert drain(spark, dsn, conn, pipeline, "stuck") == [0]
    capsys.readouterr()
    cli = ["--pipelines", f"landed_pipes_{how}:PIPE"]
    assert main([*cli, "status", "--pipeline", "landed_tweets"]) == 1  # stalled
    said = " ".join(capsys.readouterr().out.split())  # (its long lines are wrapped)
    assert "STALLED until someone acts" in said
    assert f"landed file {a} changed after it was indexed: it shrank to" in said
    assert "-> onceflow repair --pipeline landed_tweets" in said
    assert main([*cli, "repair", "--pipeline", "landed_tweets"]) == 1
    said = capsys.readouterr().out
    assert f"landed file {a} (partition 0) changed: it shrank to" in said
    assert "the bytes of chunk" in said and "nothing done; choose one" in said
    assert f"--accept-changed {a}: index it again as it is now from byte" in said
    assert f"--skip-changed {a}: skip " in said
    assert main([*cli, "repair", "--pipeline", "landed_tweets", f"--{how}-changed", "a.jsonl"]
                ) == 0
    said = capsys.readouterr().out
    assert ("did: accepted as it is now" if how == "accept" else "did: skipped: ") in said
    assert main([*cli, "repair", "--pipeline", "landed_tweets"]) == 0  # done, once
    assert "nothing to repair" in capsys.readouterr().out
    drain(spark, dsn, conn, pipeline, "after")
    # (a batch's records count the void offsets it planned too)
    urls, _ = counted(conn, "landed_tweets_url_counts")
    if how == "accept":  # the files as they are now
        assert urls == outside_count(a, b)[0]
        assert table(conn, "SELECT count(*) FROM offset_gaps") == [(0,)]
    else:  # a up to the gap, then b
        [(start, end)] = table(conn, "SELECT from_offset, to_offset FROM offset_gaps")
        assert 300 < start <= 400 and end == 600
        kept = a.read_bytes().split(b"\n")[:start]
        assert urls == Counter(json.loads(line)["url"] for line in kept) + outside_count(b)[0]
        assert table(conn, "SELECT skipped IS NOT NULL FROM landing_files ORDER BY file_no") \
            == [(True,), (False,)]
    report = recount(conn, pipeline)
    assert report.ok, report.mismatches
    assert table(conn, "SELECT count(*) FROM rejected_records") == [(0,)]


def test_a_batch_over_bytes_edited_in_place_fails_and_repair_skips_them(spark, conn, dsn,
                                                                         landed):
    """A file edited in place after a batch planned it, its size and modification time kept:
    the batch fails naming the file and the chunk, status says to run repair, repair finds
    the chunk, cannot accept it (a batch holds it) and skips the file from there (a recorded
    gap); the failed transaction then commits without those records."""
    from onceflow.core.begin import mark_failed
    from onceflow.ops.repair import repair
    from onceflow.ops.status import pipeline_status, render
    from onceflow.spark.processing import process_batch

    pipeline, folder = landed  # a to partition 0, b to 1; batches of 500
    a = land(folder, "a.jsonl", clean(300, seed=10), age_s=20)
    b = land(folder, "b.jsonl", clean(300, seed=11), age_s=10)
    batch = begin(conn, pipeline, "run-1")
    assert batch.records == 500
    data = a.read_bytes()
    at = data.index(b'"user": "u', len(data) // 3) + 10  # a digit of a user, a third in
    before = a.stat()
    a.write_bytes(data[:at] + (b"7" if data[at:at + 1] != b"7" else b"8") + data[at + 1:])
    os.utime(a, ns=(before.st_atime_ns, before.st_mtime_ns))
    [(start, end, first, records)] = table(
        conn, "SELECT byte_start, byte_end, first_offset, records FROM landing_chunks "
              "WHERE file_no = 0 AND byte_start <= %s AND byte_end > %s", (at, at))
    with pytest.raises(Exception) as failed:
        process_batch(spark, dsn, pipeline, batch.attempt, 0)
    assert (f"landed file '{a}' changed after it was indexed: bytes [{start}, {end}) (the "
            f"chunk of offsets [{first}, {first + records}) of partition 0) are not the bytes "
            "indexed") in str(failed.value)
    mark_failed(conn, pipeline.name, batch.attempt, f"process failed: {failed.value!r}")
    with conn.cursor() as cur:
        lines = render(pipeline_status(cur, pipeline.source, pipeline.name))
    conn.rollback()
    assert ("    -> onceflow repair --pipeline tweets (a landed file changed or was removed)"
            in lines)
    report = repair(conn, pipeline)
    [found] = report.landed
    [(number, chunks)] = table(conn, "SELECT count(*) FILTER (WHERE byte_start <= %s), "
                                     "count(*) FROM landing_chunks WHERE file_no = 0", (start,))
    assert report.unresolved == 1 and found.problem == (
        f"landed file {a} (partition 0) changed: the bytes of chunk {number} of {chunks} "
        f"differ (bytes [{start}, {end}), offsets [{first}, {first + records}))")
    assert found.choices[0].startswith(f"--accept-changed {a}: not possible: pipeline(s) "
                                       "tweets planned or read its offsets")
    with pytest.raises(ConfigError, match="not possible: .* --skip-changed"):
        repair(conn, pipeline, accept_changed=[str(a)])
    assert repair(conn, pipeline, skip_changed=[str(a)]).unresolved == 0
    assert table(conn, "SELECT partition, from_offset, to_offset, policy FROM offset_gaps") \
        == [(0, first, 300, f"repair --skip-changed {a}")]
    assert drain(spark, dsn, conn, pipeline, "after") == [500, 100, 0]
    assert table(conn, "SELECT state FROM transactions WHERE txid = 1") == [("committed",)]
    kept = [json.loads(line)["url"] for line in a.read_bytes().split(b"\n")[:first]]
    assert counted(conn)[0] == Counter(kept) + outside_count(b)[0]
    assert recount(conn, pipeline).ok


def test_a_removed_file_fails_the_batch_that_reads_it(spark, conn, dsn, landed):
    from onceflow.spark.processing import process_batch

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


def test_a_parquet_file_edited_in_place_is_refused_naming_the_row_group(spark, conn, dsn,
                                                                         tmp_path):
    """A value of a Parquet file's second row group changed in place, its size, footer and
    modification time kept: the batch's read (checked on the driver before Spark's reader)
    and the Python payloads refuse that row group, naming it; the first still reads."""
    import re

    import pyarrow as pa
    import pyarrow.parquet as pq

    from onceflow.core.errors import SourceChanged
    from onceflow.core.planner import PartitionRange

    folder = tmp_path / "pq_edit"
    folder.mkdir()
    source = LandingFolder(topic="pq_edit", path=str(folder), format="parquet", settle_s=0.0)
    source.ensure(conn, create=True)
    path = folder / "t.parquet"
    pq.write_table(pa.table({"n": list(range(3000))}), path, row_group_size=1000,
                   compression="NONE", use_dictionary=False, write_statistics=False)
    settled(path)
    with conn, conn.cursor() as cur:
        assert source.positions(cur)[0].head == 3000
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    at = column.data_page_offset + column.total_compressed_size - 8  # a value's low byte
    data, before = bytearray(path.read_bytes()), path.stat()
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    expected = re.escape(f"landed file '{path}' changed after it was indexed: row group 1 "
                         "(offsets [1000, 2000) of partition 0) is not the one indexed")
    with pytest.raises(SourceChanged, match=expected):
        source.read(spark, dsn, [PartitionRange(0, 0, 3000)])
    with pytest.raises(RuntimeError, match=expected):
        list(source.payloads(conn, [PartitionRange(0, 1500, 1501)]))
    assert source.read(spark, dsn, [PartitionRange(0, 0, 1000)]).count() == 1000
    conn.rollback()


def test_a_parquet_file_replaced_before_it_was_read_is_accepted_whole(conn, tmp_path):
    """A Parquet file replaced under its name before any batch read it: marked changed at the
    next look; repair --accept-changed indexes the new file whole at new offsets (its old
    ones void), and its rows are read there."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from onceflow.core.planner import PartitionRange
    from onceflow.ops.repair import repair

    folder = tmp_path / "pq_replaced"
    folder.mkdir()
    source = LandingFolder(topic="pq_replaced", path=str(folder), format="parquet",
                           settle_s=0.0)
    pipeline = get_pipeline("tweets", source=source)
    register(conn, pipeline, create_source=True)
    path = folder / "t.parquet"
    pq.write_table(pa.table({"url": ["a", "b", "c"]}), path)
    settled(path, age_s=20)
    with conn.cursor() as cur:
        assert source.positions(cur)[0].head == 3
    conn.commit()
    pq.write_table(pa.table({"url": ["x", "y", "z", "w"]}), path, row_group_size=2)
    settled(path, age_s=10)
    [found] = repair(conn, pipeline).landed
    assert found.problem.startswith(f"landed file {path} (partition 0) changed: its size went "
                                    "from ") and found.done is None
    [done] = repair(conn, pipeline, accept_changed=["t.parquet"]).landed
    assert done.done == "accepted as it is now: indexed again, 4 record(s) at new offsets"
    with conn.cursor() as cur:
        assert source.positions(cur)[0].head == 7
    assert list(source.payloads(conn, [PartitionRange(0, 0, 7)])) == [
        (0, 3 + i, json.dumps({"url": url})) for i, url in enumerate("xyzw")]
    conn.rollback()
    assert repair(conn, pipeline).landed == []


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
    source = dataclasses.replace(pipeline.source, unterminated_s=0.0)  # the last line too
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


def test_a_landed_chunks_checksum_is_the_crc32_of_its_bytes(tmp_path):
    """A text file read in many blocks (the last one short): each chunk's checksum is
    zlib's CRC-32 of its bytes; a Parquet file's row groups: of their column chunks' bytes
    (where the footer says they lie), and the file's checksum that of its footer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from onceflow.sources.landing.scan import scan_parquet, scan_text
    from onceflow.sources.landing.storage import open_filesystem

    data = b"".join(b'{"n": %d, "pad": "%s"}\n' % (i, b"x" * (i % 97)) for i in range(5000))
    path = tmp_path / "a.jsonl"
    path.write_bytes(data)
    scan = scan_text(open_filesystem(str(path))[0], str(path), 0, len(data), 7001, header=False)
    assert scan.records == 5000 and scan.indexed_to == len(data) and len(scan.chunks) > 10
    assert [crc for *_, crc in scan.chunks] == [zlib.crc32(data[start:end])
                                                for _, start, end, *_ in scan.chunks]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"n": list(range(50_000)), "s": [str(i) for i in range(50_000)]}),
                   path, row_group_size=20_000)
    raw = path.read_bytes()
    scan = scan_parquet(open_filesystem(str(path))[0], str(path))
    meta = pq.ParquetFile(path).metadata
    footer = int.from_bytes(raw[-8:-4], "little") + 8
    assert scan.records == 50_000 and scan.checksum == f"{zlib.crc32(raw[-footer:]):08x}"
    for group, (first, number, _, rows, _, crc) in enumerate(scan.chunks):
        columns = [meta.row_group(group).column(i) for i in range(2)]
        start = min(c.dictionary_page_offset or c.data_page_offset for c in columns)
        end = max((c.dictionary_page_offset or c.data_page_offset) + c.total_compressed_size
                  for c in columns)
        assert (first, number, rows) == (group * 20_000, group, min(20_000, 50_000 - first))
        assert crc == zlib.crc32(raw[start:end])


@settings(max_examples=400, deadline=None)
@given(lines=st.lists(st.one_of(  # mostly clean text, sometimes any bytes
    st.text("ab\r\u00e9\U0001f600", max_size=12).map(str.encode),
    st.binary(max_size=12).map(lambda b: b.replace(b"\n", b""))), max_size=30),
       last_newline=st.booleans(), header=st.booleans(), chunk_bytes=st.integers(1, 40),
       limit=st.integers(1, 14), tail=st.booleans(), cut=st.integers(0, 400))
@example(lines=[b"ab", b"caf\xc3", b"\xa9!", b"12345678"], last_newline=True, header=False,
         chunk_bytes=4, limit=8, tail=False, cut=7)  # a character cut by a block, then a line
@example(lines=[b"h", b"a\x00", b"abcdefghi"], last_newline=False, header=True, chunk_bytes=3,
         limit=8, tail=True, cut=1)  # a NUL, then a last line over the limit without a newline
@example(lines=[b"abc\r", b"abcdefg"], last_newline=True, header=False, chunk_bytes=40,
         limit=3, tail=False, cut=0)  # a CR counts
def test_the_index_cuts_a_file_into_whole_lines(tmp_path_factory, lines, last_newline, header,
                                                chunk_bytes, limit, tail, cut):
    """A file's chunks cover it from the first record (after the header) to its last newline
    (to its end with ``tail``), each cut after a newline (but a tail), each counting the
    records its bytes hold, each with the CRC-32 of its bytes, each marked clean (up to
    ``limit`` bytes a line, no NUL, UTF-8) exactly when it is. A file indexed when only its
    first ``cut`` bytes were written, then again from where that stopped, is cut the same."""
    from onceflow.sources.landing.scan import scan_text, split_lines
    from onceflow.sources.landing.storage import open_filesystem

    data = b"\n".join(lines) + (b"\n" if last_newline and lines else b"")
    path = tmp_path_factory.mktemp("index") / "f.jsonl"
    path.write_bytes(data)
    filesystem = open_filesystem(str(path))[0]
    scan = scan_text(filesystem, str(path), 0, len(data), chunk_bytes, header=header,
                      limit=limit, tail=tail)
    body = data.split(b"\n", 1)[1] if header and b"\n" in data else b"" if header else data
    first_byte = len(data) - len(body) if not header or b"\n" in data else 0
    whole = body if tail or body.endswith(b"\n") else body[:body.rfind(b"\n") + 1]
    assert scan.records == len(split_lines(whole))
    expected_first, expected_start = 0, first_byte
    for first, start, end, count, clean_to, crc in scan.chunks:
        assert (first, start) == (expected_first, expected_start)
        assert end > start and (data[end - 1:end] == b"\n" or tail and end == len(data))
        assert count == len(split_lines(data[start:end])) and crc == zlib.crc32(data[start:end])
        assert clean_to == _clean_to(data[start:end], limit), data[start:end]
        expected_first, expected_start = first + count, end
    assert (expected_first, expected_start) == (scan.records, first_byte + len(whole))
    assert scan.indexed_to == first_byte + len(whole)
    # written in two parts: the first look indexes up to its last newline, the second on
    cut = min(cut, len(data))
    early = scan_text(filesystem, str(path), 0, cut, chunk_bytes, header=header,
                       limit=limit)
    later = scan_text(filesystem, str(path), early.indexed_to, len(data), chunk_bytes,
                       header=header and early.indexed_to == 0, limit=limit, tail=tail)
    both = [(start, end) for _, start, end, *_ in early.chunks + later.chunks]
    assert early.records + later.records == scan.records
    assert b"".join(data[s:e] for s, e in both) == data[first_byte:first_byte + len(whole)]


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=60).map(lambda b: b.replace(b"a", b"\n").replace(b"b", b"\r")))
@example(data=b"x\r\r\n")  # a last line ending in CR, then CRLF: one CR goes
def test_decoded_lines_are_cut_as_payload_lines(data):
    """A decoding reader cuts the bytes into the same lines as the payload reader."""
    from onceflow.sources.landing.scan import line_bytes, split_lines

    assert [line.decode("utf-8", "replace") for line in line_bytes(data)] == split_lines(data)


def test_json_schema_records_are_decoded_where_they_are_read(spark, conn, dsn, tmp_path):
    """A landing folder that declares its records' schema: the topology reads typed columns
    (no from_json), corrupt lines reach it as _corrupt_record, the spout refuses oversized
    lines, failed records replay decoded from the backflow, and the result equals the
    pure-Python recount; verify re-runs it equal. (On these tweets the decoder's rules and
    Spark's from_json, which the recount states, agree.)"""
    import typed_tweets

    folder = tmp_path / "typed"
    folder.mkdir()
    source = LandingFolder(topic="typed_tweets", path=str(folder), partitions=2,
                           chunk_bytes=8192, json_schema=typed_tweets.SCHEMA,
                           max_record_bytes=typed_tweets.MAX_RECORD_BYTES)
    pipeline = typed_tweets.pipeline("tweets", source)
    register(conn, pipeline, create_source=True)
    payloads = typed_tweets.payloads()
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



def test_a_typed_parquet_source_reads_exactly_the_planned_rows_as_columns(spark, conn, dsn,
                                                                          tmp_path):
    """A typed Parquet landing folder (records carry the declared columns): ranges cut
    within row groups and across files give exactly their rows at the offsets the payload
    read gives, the same values, a column the file has but the schema lacks left out; a NaN
    (no JSON form) is the spout's problem; a replay decodes the payload into the same
    columns."""
    import math

    import pyarrow as pa
    import pyarrow.parquet as pq

    from onceflow.core.planner import PartitionRange
    from onceflow.spark.records import replayed_records

    folder = tmp_path / "pq_typed"
    folder.mkdir()
    typed = LandingFolder(topic="pq_typed", path=str(folder), format="parquet", typed=True,
                          schema="n long, name string, ok boolean, x double", settle_s=0.0)
    plain = dataclasses.replace(typed, typed=False)
    typed.ensure(conn, create=True)
    with pytest.raises(ConfigError, match=r"source.typed=True needs format='parquet' and a "):
        dataclasses.replace(typed, format="csv").validate()
    with pytest.raises(ConfigError, match=r"source.schema='d date' cannot be typed: column "
                                          r"'d' is date"):
        dataclasses.replace(typed, schema="d date").validate()

    def name(k):
        return None if k % 7 == 0 else f"r\u00e9{k}"

    for i, (start, count) in enumerate([(0, 2500), (10_000, 700)]):
        ns = range(start, start + count)
        path = folder / f"{i}.parquet"
        pq.write_table(pa.table({
            "n": list(ns), "name": [name(k) for k in ns], "ok": [k % 3 == 0 for k in ns],
            "x": [math.nan if k == 1000 else k / 2 for k in ns], "extra": ["x"] * count}),
            path, row_group_size=1000)
        os.utime(path, (time.time() - 10 + i, time.time() - 10 + i))
    with conn, conn.cursor() as cur:
        assert typed.positions(cur)[0].head == 3200
        assert typed.may_refuse(cur, [PartitionRange(0, 0, 3200)])  # a double column
    assert not dataclasses.replace(typed, schema="n long, name string").may_refuse(None, [])
    assert typed.read_ddl == ("partition int, offset long, `n` bigint, `name` string, `ok` "
                              "boolean, `x` double, _corrupt_record string, _problem string")
    # within row group 0, across groups 1-2 into the second file, and a single row there
    ranges = [PartitionRange(0, 5, 17), PartitionRange(0, 999, 2501),
              PartitionRange(0, 3199, 3200)]
    rows = sorted(tuple(r) for r in typed.read(spark, dsn, ranges).collect())
    wanted = [*range(5, 17), *range(999, 2501), 3199]
    assert [r[1] for r in rows] == wanted
    for part, offset, n, text, ok, x, corrupt, problem in rows:
        k = offset if offset < 2500 else 10_000 + offset - 2500
        assert (part, n, text, ok, corrupt) == (0, k, name(k), k % 3 == 0, None)
        if k == 1000:
            assert math.isnan(x) and problem.startswith("column x holds NaN or an infinity")
        else:
            assert (x, problem) == (k / 2, None)
    payloads = sorted(plain.read(spark, dsn, ranges).collect())
    assert [(p.partition, p.offset) for p in payloads] == [r[:2] for r in rows]
    assert [json.loads(p.payload)["n"] for p in payloads] == [r[2] for r in rows]
    back = [(0, o, p, 1) for _, o, p in typed.payloads(conn, [PartitionRange(0, 1001, 1004)])]
    conn.rollback()
    assert sorted(tuple(r)[:8] for r in replayed_records(spark, typed, back).collect()) == [
        r for r in rows if 1001 <= r[1] < 1004]


def test_parquet_batches_end_at_row_group_edges(conn, tmp_path):
    """Spark decodes a Parquet row group whole, so a batch that cut one would have two
    batches decode it. Over two partitions of one-group files, begin plans each group into
    one batch, and no partition sits out two batches in a row; smaller groups at a
    partition's head are planned as they come."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "pq_units"
    folder.mkdir()
    source = LandingFolder(topic="pq_units", path=str(folder), format="parquet", partitions=2,
                           settle_s=0.0)
    pipeline = get_pipeline("tweets", source=source, batch_size=1000, max_pending=6)
    register(conn, pipeline, create_source=True)

    def put(name, count, group, age):
        path = folder / name
        pq.write_table(pa.table({"n": list(range(count))}), path, row_group_size=group)
        os.utime(path, (time.time() - age, time.time() - age))

    for i in range(4):  # files 0 and 2 in partition 0, 1 and 3 in partition 1
        put(f"{i}.parquet", 1000, 1000, 50 - i)
    with conn.cursor() as cur:  # all indexed at once (as status does), not a file per begin
        assert {p: pos.head for p, pos in source.positions(cur).items()} == {0: 2000, 1: 2000}
    conn.commit()
    plans = [[(r.partition, r.start, r.end) for r, _ in begin(conn, pipeline, f"r{i}").ranges
              if r.size] for i in range(4)]
    assert plans == [[(0, 0, 1000)], [(1, 0, 1000)], [(0, 1000, 2000)], [(1, 1000, 2000)]]
    put("4.parquet", 900, 300, 5)  # partition 0: three groups, all it has left
    assert [(r.partition, r.start, r.end) for r, _ in begin(conn, pipeline, "r4").ranges
            if r.size] == [(0, 2000, 2900)]
    with conn.cursor() as cur:  # lines are read from any offset: a JSON lines folder has none
        assert dataclasses.replace(source, format="jsonl").whole_units(cur, [(0, 500)]) == {}
        assert source.whole_units(cur, [(0, 500), (1, 1999)]) == {0: (0, 1000),
                                                                   1: (1000, 2000)}
        assert source.whole_units(cur, [(0, 1000), (1, 2000)]) == {}  # at an edge: no cut
        assert source.whole_units(cur, [(0, 2100)]) == {0: (2000, 2300)}
    conn.rollback()
