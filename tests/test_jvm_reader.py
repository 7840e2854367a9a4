"""onceflow's JVM reader (onceflow/sources/jvm.py, ``onceflow.spark.JsonLinesSource``) reads a
folder's JSON lines into exactly the rows the Python reader gives: the same cut into lines,
the same offsets, the same decoding rules (the json_records tests' cases and generated lines,
mangled), the same refusals, the same replacement of bytes that are not UTF-8."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_json_records import ALL, CASES, lines

from onceflow.core.planner import PartitionRange
from onceflow.sources.jvm import jvm_conf, jvm_reader
from onceflow.sources.landing import LandingFolder

# Lines the cut and the UTF-8 replacement must agree on (each followed by LF unless it ends
# the file): CRs before and inside line ends, empty lines, broken and surrogate UTF-8.
ODD = [b"", b"\r", b"x\r\r", b'{"s": "\xed\xa0\x80"}', b"\xf0\x9f\x98", b"\xc3(", b"\xff\xfe",
       b'{"s": "caf\xc3\xa9", "i": 3}\r', b'{"s": "a"}\r\r', b" \t{\"i\": -1}\r",
       # overlong forms, past U+10FFFF, a whole 4-byte sequence, one cut at the line's end
       b"\xc0\x80", b"\xe0\x80\x80", b"\xf4\x90\x80\x80", b'{"s": "\xf0\x9f\x98\x80"}',
       b"x\xe2\x82"]


def write(folder, lines: list[bytes], end: bytes = b"") -> str:
    """A settled file of ``lines`` (LF after each, CRLF after every third) plus ``end``."""
    data = b"".join(line + (b"\r\n" if i % 3 == 2 else b"\n") for i, line in enumerate(lines))
    name = f"{uuid.uuid4().hex}.jsonl"
    (folder / name).write_bytes(data + end)
    when = time.time() - 5
    os.utime(folder / name, (when, when))
    return name


def both(spark, dsn, conn, source, name: str, cut=(0, 0)):
    """The rows of file ``name`` (less ``cut`` records at either end) read by the JVM reader
    and by the Python reader, by offset."""
    with conn, conn.cursor() as cur:
        source.positions(cur)  # indexes the new file
        cur.execute("SELECT partition, base_offset, records FROM landing_files "
                    "WHERE topic = %s AND path LIKE %s", (source.topic, f"%{name}"))
        partition, base, records = cur.fetchone()
    ranges = [PartitionRange(partition, base + cut[0], base + records - cut[1])]
    out = []
    for jvm in ("1", "0"):
        os.environ["ONCEFLOW_JVM_READER"] = jvm
        try:
            df = source.read(spark, dsn, ranges)
            assert ("onceflow JSON lines" in df._jdf.queryExecution().toString()) == \
                (jvm == "1")
            out.append([tuple(r) for r in df.orderBy("offset").collect()])
        finally:
            os.environ.pop("ONCEFLOW_JVM_READER")
    assert len(out[0]) == records - cut[0] - cut[1]
    return out


@pytest.fixture
def folders(conn, tmp_path):
    made = {}
    for kind, schema in (("decoded", ALL.ddl), ("payload", None)):
        folder = tmp_path / kind
        folder.mkdir()
        source = LandingFolder(topic=f"jvm_{kind}", path=str(folder), partitions=2,
                               chunk_bytes=512, settle_s=0.0, json_schema=schema,
                               max_record_bytes=200, unterminated_s=0.0)
        source.ensure(conn, create=True)
        made[kind] = (source, folder)
    return made


def test_the_test_session_has_the_jvm_reader(spark):
    assert jvm_reader(spark)


@pytest.mark.parametrize("kind", ["decoded", "payload"])
def test_the_rules_cases_and_odd_lines_read_alike(spark, conn, dsn, folders, kind):
    source, folder = folders[kind]
    cases = [line for line, _ in CASES if b"\n" not in line]
    big = b'{"s": "' + b"x" * 300 + b'"}'  # over max_record_bytes: refused, not decoded
    name = write(folder, [*cases, *ODD, big, b'{"s": "a\x00b"}', b'{"i": 1}'],
                 end=b'{"s": "last, no newline"}\r')
    jvm, python = both(spark, dsn, conn, source, name)
    assert jvm == python
    if kind == "decoded":  # the cases' own verdicts hold (columns, _corrupt_record)
        corrupt = len(ALL.columns) + 2
        assert [r[corrupt] is None for r in jvm[:len(cases)]] == \
            [want is not None for line, want in CASES if b"\n" not in line]
        assert jvm[-4][-1].startswith("oversized record") and "NUL" in jvm[-3][-1]


def test_ranges_that_start_and_end_inside_chunks_read_alike(spark, conn, dsn, folders):
    source, folder = folders["decoded"]
    name = write(folder, [b'{"i": %d, "s": "%s"}' % (i, b"y" * (i % 50)) for i in range(300)])
    jvm, python = both(spark, dsn, conn, source, name, cut=(7, 11))
    assert jvm == python and [r[1] for r in jvm][:2] == [7, 8]


# (JVM_EXAMPLES=200: a longer search; each example is two Spark reads)
@settings(max_examples=int(os.environ.get("JVM_EXAMPLES", "12")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=st.lists(lines(), min_size=1, max_size=120))
def test_generated_lines_read_alike(spark, conn, dsn, folders, batch):
    source, folder = folders["decoded"]
    name = write(folder, [line.replace(b"\n", b" ") for line in batch])
    jvm, python = both(spark, dsn, conn, source, name)
    assert jvm == python


@pytest.mark.parametrize("where", ["head", "middle", "tail"])
def test_bytes_changed_in_place_are_refused_by_both_readers(spark, conn, dsn, tmp_path,
                                                            monkeypatch, where):
    """A landed file edited in place, its size and modification time kept (``touch -r``):
    within its first 64 KiB, in its middle, within its last 64 KiB. The JVM reader, the
    Python reader and the Python payloads (verify, the backflow) each refuse the chunk whose
    bytes changed, naming the file and the chunk; the chunks before it still read."""
    folder = tmp_path / "edited"
    folder.mkdir()
    source = LandingFolder(topic="edited", path=str(folder), chunk_bytes=32 << 10,
                           settle_s=0.0)
    source.ensure(conn, create=True)
    data = b"".join(b'{"i": %d, "s": "%s"}\n' % (i, b"y" * 80) for i in range(4000))
    path = folder / "e.jsonl"
    path.write_bytes(data)
    when = time.time() - 5
    os.utime(path, (when, when))
    with conn, conn.cursor() as cur:
        source.positions(cur)
    at = data.index(b"y", {"head": 1000, "middle": len(data) // 2,
                           "tail": len(data) - 1000}[where])
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"z")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT byte_start, byte_end, first_offset, records FROM landing_chunks "
                    "WHERE byte_start <= %s AND byte_end > %s", (at, at))
        start, end, first, records = cur.fetchone()
    expected = re.escape(
        f"landed file '{path}' changed after it was indexed: bytes [{start}, {end}) (the "
        f"chunk of offsets [{first}, {first + records}) of partition 0) are not the bytes "
        "indexed (CRC-32 ") + "[0-9a-f]{8}, indexed [0-9a-f]{8}" + re.escape(
        "): refused. `onceflow repair` says what changed and how to go on")
    ranges = [PartitionRange(0, 0, 4000)]
    for jvm in ("1", "0"):
        monkeypatch.setenv("ONCEFLOW_JVM_READER", jvm)
        df = source.read(spark, dsn, ranges)
        assert ("onceflow JSON lines" in df._jdf.queryExecution().toString()) == (jvm == "1")
        with pytest.raises(Exception, match=expected):
            df.collect()
        if first:
            assert source.read(spark, dsn, [PartitionRange(0, 0, first)]).count() == first
    with pytest.raises(RuntimeError, match=expected):
        list(source.payloads(conn, ranges))
    conn.rollback()


def test_an_operators_own_jars_are_kept_beside_the_readers(monkeypatch):
    conf = jvm_conf({"spark.jars": "/opt/theirs.jar", "spark.executor.cores": "2"})
    jars = conf["spark.jars"].split(",")
    assert jars[0] == "/opt/theirs.jar" and len(jars) == 2 and Path(jars[1]).is_file()
    assert conf["spark.onceflow.jvmReader"] == "true" and conf["spark.executor.cores"] == "2"
    for off in ("0", "off", " False "):  # turned off: the conf as it was
        monkeypatch.setenv("ONCEFLOW_JVM_READER", off)
        assert jvm_conf({"spark.jars": "/opt/theirs.jar"}) == {"spark.jars": "/opt/theirs.jar"}


def test_an_on_off_setting_with_a_typo_is_refused_not_ignored(monkeypatch):
    from onceflow.core.errors import ConfigError

    monkeypatch.setenv("ONCEFLOW_JVM_READER", "of")
    with pytest.raises(ConfigError, match="ONCEFLOW_JVM_READER='of' is not an on/off value"):
        jvm_conf()


def test_a_processing_session_runs_without_dataframe_debugging(monkeypatch):
    """Static settings go to a Spark onceflow starts, never to a session of a running Connect
    server (which refuses to change them)."""
    from onceflow.spark.conf import processing_conf

    monkeypatch.setenv("ONCEFLOW_SHUFFLE_PARTITIONS", "6")
    conf = processing_conf()
    assert conf["spark.python.sql.dataFrameDebugging.enabled"] == "false"
    assert conf["spark.sql.adaptive.enabled"] == "false"
    assert conf["spark.sql.shuffle.partitions"] == "6"
    assert "spark.python.sql.dataFrameDebugging.enabled" not in processing_conf(static=False)


READ_UNDER_SPARK_SUBMIT = """
import json, sys
from onceflow.core.planner import PartitionRange
from onceflow.sources.landing import LandingFolder
from onceflow.sources.jvm import jvm_reader
from onceflow.spark.session import get_spark

spark = get_spark("jvm-reader-submit")
source = LandingFolder(topic="submitted", path=sys.argv[2], settle_s=0.0,
                       json_schema="s string, i int")
df = source.read(spark, sys.argv[1], [PartitionRange(0, 0, 3)])
print("RESULT " + json.dumps({
    "jvm": jvm_reader(spark),
    "planned": "onceflow JSON lines" in df._jdf.queryExecution().toString(),
    "rows": [list(r) for r in df.orderBy("offset").collect()]}))
"""


def test_spark_submit_with_the_process_tasks_conf_reads_in_the_jvm(conn, dsn, tmp_path):
    """What ProcessBatchOperator gives spark-submit (jvm_conf of its conf) brings the reader to
    a driver onceflow did not start itself."""
    folder = tmp_path / "submitted"
    folder.mkdir()
    source = LandingFolder(topic="submitted", path=str(folder), settle_s=0.0,
                           json_schema="s string, i int")
    source.ensure(conn, create=True)
    write(folder, [b'{"s": "a", "i": 1}', b"{oops", b'{"i": 3}'])
    with conn, conn.cursor() as cur:
        source.positions(cur)
    script = tmp_path / "read.py"
    script.write_text(READ_UNDER_SPARK_SUBMIT)
    conf = jvm_conf({"spark.ui.enabled": "false"})
    done = subprocess.run(
        [str(Path(sys.executable).with_name("spark-submit")), "--master", "local[1]",
         *[arg for k, v in conf.items() for arg in ("--conf", f"{k}={v}")],
         str(script), dsn, str(folder)],
        env={**os.environ, "PYSPARK_PYTHON": sys.executable}, capture_output=True, text=True,
        timeout=240)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["jvm"] and result["planned"]
    assert result["rows"] == [[0, 0, "a", 1, None, None], [0, 1, None, None, "{oops", None],
                              [0, 2, None, 3, None, None]]
